# A tiny app for third-party servers on a unix socket: `asgi` for uvicorn
# (uvicorn --uds PATH sock_app:asgi), `wsgi` for gunicorn (gunicorn --bind
# unix:PATH sock_app:wsgi). One process (each server's default of one
# worker), so the count is the app's. A POST answers 201 with JSON: the
# server's name, the Idempotency-Key, its executions so far, the path, the
# Host, the body and a random nonce (identical bytes prove a replay). GET
# /runs?key=K answers 200 with the executions of K so far, as text.
import json
import os
import threading
import urllib.parse

lock = threading.Lock()
runs = {}


def answer(server, method, path, query, headers, body):
    """Returns (status, content type, body bytes) for one request."""
    if method == "GET" and path == "/runs":
        key = urllib.parse.parse_qs(query).get("key", [""])[0]
        with lock:
            return 200, "text/plain", str(runs.get(key, 0)).encode()
    key = headers.get("idempotency-key", "")
    with lock:
        runs[key] = runs.get(key, 0) + 1
        run = runs[key]
    out = json.dumps({"server": server, "key": key, "executions": run,
                      "path": path + ("?" + query if query else ""), "host": headers.get("host"),
                      "body": body.decode(), "nonce": os.urandom(8).hex()}).encode()
    return 201, "application/json", out


async def asgi(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
    status, ctype, out = answer("uvicorn", scope["method"], scope["path"], scope["query_string"].decode(), headers, body)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


def wsgi(environ, start_response):
    n = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(n) if n else b""
    headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
    status, ctype, out = answer("gunicorn", environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                environ.get("QUERY_STRING", ""), headers, body)
    start_response({200: "200 OK", 201: "201 Created"}[status],
                   [("Content-Type", ctype), ("Content-Length", str(len(out)))])
    return [out]
