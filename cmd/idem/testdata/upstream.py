# A keep-alive HTTP/1.1 upstream on Python's standard library, as many
# small services are written: it reads a request body by its
# Content-Length only (http.server does not read chunked bodies). It
# prints {"listen": PORT} once, then one JSON line per execution on
# stdout; what http.server reports as an error (a malformed request)
# goes to stderr. A POST or PATCH answers 201 with JSON: the key, its
# executions so far, the body's length and SHA-256, a random nonce (so
# that identical bytes prove a replay) and X-Pad: N bytes of padding.
# GET /?key=K answers {"executions": N}. Used by cmd/idem's upstream
# framing tests and the operator's suite.
import hashlib
import http.server
import json
import os
import sys
import threading
import urllib.parse

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
            print(json.dumps({"key": key, "run": run, "len": len(body)}), flush=True)
        self.answer(201, {"key": key, "executions": run, "len": len(body),
                          "sha256": hashlib.sha256(body).hexdigest(), "nonce": os.urandom(8).hex(),
                          "pad": "x" * int(self.headers.get("X-Pad") or 0)})

    do_PATCH = do_POST

    def do_GET(self):
        key = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).get("key", [""])[0]
        with lock:
            n = runs.get(key, 0)
        self.answer(200, {"executions": n})

    def answer(self, status, doc):
        out = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_request(self, code="-", size="-"):
        pass

    def log_error(self, fmt, *args):
        sys.stderr.write("upstream error: " + (fmt % args) + "\n")
        sys.stderr.flush()


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(json.dumps({"listen": server.server_address[1]}), flush=True)
server.serve_forever()
