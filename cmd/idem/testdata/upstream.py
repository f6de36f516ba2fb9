# A keep-alive HTTP/1.1 upstream on Python's standard library, as many
# small services are written: it reads a request body by its
# Content-Length only (http.server does not read chunked bodies). It
# prints {"listen": PORT} once, then one JSON line per execution on
# stdout; what http.server reports as an error (a malformed request)
# goes to stderr. Used by cmd/idem's upstream framing tests.
import hashlib
import http.server
import json
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
            print(json.dumps({"key": key, "run": run, "len": len(body)}), flush=True)
        out = json.dumps({"key": key, "run": run, "len": len(body),
                          "sha256": hashlib.sha256(body).hexdigest()}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_PATCH = do_POST

    def log_request(self, code="-", size="-"):
        pass

    def log_error(self, fmt, *args):
        sys.stderr.write("upstream error: " + (fmt % args) + "\n")
        sys.stderr.flush()


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(json.dumps({"listen": server.server_address[1]}), flush=True)
server.serve_forever()
