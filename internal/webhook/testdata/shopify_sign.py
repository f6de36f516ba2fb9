"""Signs the Shopify fixture of internal/webhook with Shopify's documented
recipe (shopify.dev, "Verify the webhook": base64 of the HMAC-SHA256 of the
raw body under the app's client secret), written here in Python as the docs
show it, so that the Go tests do not check idem against its own code.

usage: python3 shopify_sign.py OUTDIR   (regen.sh runs it)
"""
import base64
import hashlib
import hmac
import json
import os
import sys

SIGNED_AT = 1796176800  # 2026-12-02T02:00:00Z, as in sign.mjs (Shopify has no timestamp in the scheme)


def shopify_hmac(secret, data):
    digest = hmac.new(secret.encode("utf-8"), data, digestmod=hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: python3 shopify_sign.py OUTDIR")
    secret = "idem-test shopify client secret, current"
    old_secret = "idem-test shopify client secret, previous"
    forger = "not the shopify client secret"
    body = json.dumps({"id": 820982911946154508, "email": "jon@example.com", "note": "café",
                       "total_price": "19.90"}, ensure_ascii=False)
    webhook_id = "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043"

    def delivery(s):
        return {
            "headers": {
                "Content-Type": "application/json",
                "X-Shopify-Topic": "orders/create",
                "X-Shopify-Shop-Domain": "idem-test.myshopify.com",
                "X-Shopify-Webhook-Id": webhook_id,
                "X-Shopify-Hmac-Sha256": shopify_hmac(s, body.encode("utf-8")),
            },
            "body": body,
        }

    fixture = {
        "generator": "shopify_sign.py (Python hmac, hashlib, base64: Shopify's documented recipe)",
        "secret": secret, "old_secret": old_secret, "forger_secret": forger, "signed_at": SIGNED_AT,
        "key": webhook_id,
        "deliveries": {
            "genuine": delivery(secret),
            "old_secret": delivery(old_secret),
            "forged": delivery(forger),
        },
    }
    with open(os.path.join(sys.argv[1], "shopify.json"), "w", encoding="utf-8") as f:
        json.dump(fixture, f, indent=2, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
