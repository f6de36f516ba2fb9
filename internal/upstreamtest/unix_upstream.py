# An HTTP/1.1 upstream on Python's standard library served on a unix
# socket (socketserver.UnixStreamServer), as gunicorn or uvicorn bound to
# a socket serve. Argument: the socket's path. It prints "ready" once it
# listens. Every request answers 201 with JSON: the Idempotency-Key, its
# executions so far, the path with its query and the Host it was sent,
# the body, and a random nonce (identical bytes prove a replay).
import http.server
import json
import os
import socketserver
import sys
import threading

lock = threading.Lock()
runs = {}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n)
        key = self.headers.get("Idempotency-Key", "")
        with lock:
            runs[key] = runs.get(key, 0) + 1
            run = runs[key]
        out = json.dumps({"key": key, "executions": run, "path": self.path, "host": self.headers.get("Host"),
                          "forwarded_host": self.headers.get("X-Forwarded-Host"),
                          "body": body.decode(), "nonce": os.urandom(8).hex()}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST

    def address_string(self):
        return "unix"  # a unix peer has no address

    def log_message(self, fmt, *args):
        pass


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)


srv = Server(sys.argv[1], Handler)
print("ready", flush=True)
srv.serve_forever()
