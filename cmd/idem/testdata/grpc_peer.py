"""A gRPC peer in Python (grpcio) for cmd/idem's gRPC tests, without
generated stubs: generic handlers and multi-callables on raw bytes.

  grpc_peer.py server         serves idem.Test on a free loopback port
                              (h2c), prints {"listen": PORT}, then one
                              JSON line per execution of Do.
  grpc_peer.py client ADDR C  makes the call C (JSON: method, key, msg,
                              timeout in seconds) and prints its result.

idem.Test/Do, unary: a message "hold:G" waits until Open is called with
"G"; "status:N" fails with code N; any other message is answered
"reply:MSG:RUN" (RUN counts the executions of the key), with header
metadata x-server and trailing metadata x-run and x-deadline (whether the
call had a deadline). Watch (server streaming)
answers 3 messages; Chat (bidi) answers each message as it comes.
"""
import base64
import json
import sys
import threading
from concurrent import futures

import grpc

runs = {}
gates = {}
lock = threading.Lock()


def gate(name):
    with lock:
        return gates.setdefault(name, threading.Event())


def do(request, context):
    msg = request.decode()
    key = dict(context.invocation_metadata()).get("idempotency-key", "")
    with lock:
        runs[key] = runs.get(key, 0) + 1
        n = runs[key]
    print(json.dumps({"key": key, "msg": msg}), flush=True)
    context.send_initial_metadata([("x-server", "python")])
    # grpcio gives a call without a deadline an infinite one (not None).
    left = context.time_remaining()
    deadline = "yes" if left is not None and left < 1e9 else "no"
    context.set_trailing_metadata([("x-run", str(n)), ("x-deadline", deadline)])
    if msg.startswith("hold:"):
        gate(msg[5:]).wait()
    if msg.startswith("status:"):
        codes = {c.value[0]: c for c in grpc.StatusCode}
        context.abort(codes[int(msg[7:])], "failed " + msg)
    return ("reply:%s:%d" % (msg, n)).encode()


def open_gate(request, context):
    gate(request.decode()).set()
    return b"opened"


def watch(request, context):
    for i in range(3):
        yield ("%s:%d" % (request.decode(), i)).encode()


def chat(requests, context):
    for r in requests:
        yield b"chat:" + r


def serve():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("idem.Test", {
        "Do": grpc.unary_unary_rpc_method_handler(do),
        "Open": grpc.unary_unary_rpc_method_handler(open_gate),
        "Watch": grpc.unary_stream_rpc_method_handler(watch),
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"listen": port}), flush=True)
    server.wait_for_termination()


def client(addr, spec):
    c = json.loads(spec)
    channel = grpc.insecure_channel(addr)
    md = [("idempotency-key", c["key"])] if c.get("key") else []
    out = {}
    try:
        if c["method"].endswith("/Watch"):
            call = channel.unary_stream(c["method"])(c["msg"].encode(), metadata=md, timeout=c.get("timeout") or None)
            out["msgs"] = [base64.b64encode(m).decode() for m in call]
        else:
            resp, call = channel.unary_unary(c["method"]).with_call(c["msg"].encode(), metadata=md, timeout=c.get("timeout") or None)
            out["msgs"] = [base64.b64encode(resp).decode()]
        out["code"] = 0
    except grpc.RpcError as e:
        call = e
        out["code"] = e.code().value[0]
        out["message"] = e.details()
    out["header"] = {k: v for k, v in (call.initial_metadata() or [])}
    out["trailer"] = {k: v for k, v in (call.trailing_metadata() or []) if not k.endswith("-bin")}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve()
    else:
        client(sys.argv[2], sys.argv[3])
