"""Signs one Shopify webhook delivery with Shopify's documented recipe
(shopify.dev, "Verify the webhook": base64 of the HMAC-SHA256 of the raw
body under the app's client secret, as internal/webhook/testdata/
shopify_sign.py writes it) and sends it with urllib, for the end-to-end
tests of idem proxy and of Caddy with idem's handler (internal/webhooktest
runs it). Shopify has no library of its own for signing.

usage: python3 shopify_send.py < SPEC

SPEC is send.mjs's JSON on stdin (never argv, which ps shows): url, body,
secrets (one), id (X-Shopify-Webhook-Id), sent_body (sent instead of body
when present: a body altered after signing) and headers. It prints
{"status", "headers" (lower-case names), "body"} as JSON on stdout; an
error prints its message alone on stderr (never the spec) and exits 1.
"""
import base64
import hashlib
import hmac
import json
import sys
import urllib.error
import urllib.request


def shopify_hmac(secret, data):
    digest = hmac.new(secret.encode("utf-8"), data, digestmod=hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def main():
    spec = json.load(sys.stdin)
    secrets = spec.get("secrets") or []
    if len(secrets) != 1:
        raise ValueError("shopify signs with one secret")
    body = spec["body"].encode("utf-8")
    headers = {
        "Content-Type": "application/json",
        "X-Shopify-Topic": "orders/create",
        "X-Shopify-Shop-Domain": "idem-test.myshopify.com",
        "X-Shopify-Api-Version": "2026-10",
        "X-Shopify-Webhook-Id": spec["id"],
        "X-Shopify-Hmac-Sha256": shopify_hmac(secrets[0], body),
    }
    headers.update(spec.get("headers") or {})
    sent = spec["sent_body"].encode("utf-8") if spec.get("sent_body") is not None else body
    req = urllib.request.Request(spec["url"], data=sent, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, hdrs, data = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        status, hdrs, data = e.code, e.headers, e.read()
    out = {}
    for name, value in hdrs.items():
        name = name.lower()
        out[name] = out[name] + ", " + value if name in out else value
    json.dump({"status": status, "headers": out, "body": data.decode("utf-8", "replace")}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the message only: never the spec, which holds the secret
        sys.stderr.write("shopify_send.py: %s\n" % e)
        sys.exit(1)
