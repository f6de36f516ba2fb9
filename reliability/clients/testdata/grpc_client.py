#!/usr/bin/python3
"""One logical unary gRPC call with an idempotency key, made the way a
Python service usually makes it with grpcio: a channel whose service
config (the grpc.service_config channel option) gives the method a retry
policy, which resends UNAVAILABLE and ABORTED within one call, a timeout=
per call, and an application loop around it that calls again with the
same idempotency-key metadata after DEADLINE_EXCEEDED (or an ABORTED or
UNAVAILABLE the policy gave up on), after 0.1 s doubling up to 1 s. A
CANCELLED that comes once the call's timeout has passed is the deadline
too: grpc-go's server resets the stream (RST_STREAM CANCEL) when the
deadline it was sent passes, and on a loaded machine that reset can reach
grpcio before its own timer fires.

No generated code: channel.unary_unary with the serializers of
google.protobuf.StringValue, a well-known type that python3-protobuf
ships.

usage: grpc_client.py TARGET METHOD KEY VALUE TIMEOUT_S CALLS SERVICE_CONFIG_JSON

Prints one JSON line: the final code's name ("OK", "DEADLINE_EXCEEDED",
...), the reply, the idempotent-replayed header metadata, and the code of
each call of the loop.
"""
import json
import sys
import time

import grpc
from google.protobuf import wrappers_pb2

RETRY = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)


def main():
    target, method, key, value = sys.argv[1:5]
    timeout, calls, service_config = float(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    out = {"status": "", "value": "", "replayed": "", "seen": [], "error": ""}
    options = [("grpc.enable_retries", 1), ("grpc.service_config", service_config)]
    with grpc.insecure_channel(target, options=options) as channel:
        charge = channel.unary_unary(
            method,
            request_serializer=wrappers_pb2.StringValue.SerializeToString,
            response_deserializer=wrappers_pb2.StringValue.FromString,
        )
        request = wrappers_pb2.StringValue(value=value)
        backoff = 0.1
        for _ in range(calls):
            began = time.monotonic()
            try:
                reply, call = charge.with_call(request, timeout=timeout, metadata=(("idempotency-key", key),))
            except grpc.RpcError as error:
                code = error.code()
                out["seen"].append(code.name)
                out["status"], out["error"] = code.name, error.details() or ""
                deadline = code == grpc.StatusCode.CANCELLED and time.monotonic() - began >= 0.9 * timeout
                if code not in RETRY and not deadline:
                    break
                time.sleep(backoff)
                backoff = min(2 * backoff, 1.0)
                continue
            out["seen"].append("OK")
            out["status"], out["error"], out["value"] = "OK", "", reply.value
            out["replayed"] = ",".join(v for k, v in call.initial_metadata() if k == "idempotent-replayed")
            break
    print(json.dumps(out))


if __name__ == "__main__":
    main()
