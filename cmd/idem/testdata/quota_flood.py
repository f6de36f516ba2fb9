"""A flood against idem proxy's per-tenant quotas, with Python requests.

usage: quota_flood.py PROXY_URL MAX_KEYS BODY_BYTES

An attacker (Authorization: Bearer mallory) sends up to MAX_KEYS new keys,
each with a random body of BODY_BYTES that the upstream echoes, and stops
at the first answer that is not 201. Then a victim (Bearer alice) sends
three new keys of its own, each three times (a retry after a lost
answer). Prints one JSON object: what each side got.
"""
import hashlib
import json
import os
import sys

import requests

url, max_keys, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

attacker = requests.Session()
attacker.headers["Authorization"] = "Bearer mallory"
stored, stop = 0, None
for i in range(max_keys):
    body = json.dumps({"pad": os.urandom(size // 2).hex()})
    r = attacker.post(url + "/echo", data=body, headers={"Idempotency-Key": "flood-%d" % i,
                                                         "Content-Type": "application/json"})
    if r.status_code != 201:
        stop = {"status": r.status_code, "retry_after": r.headers.get("Retry-After"),
                "content_type": r.headers.get("Content-Type"), "problem": r.json().get("type") if r.content else None}
        break
    stored += 1

victim = requests.Session()
victim.headers["Authorization"] = "Bearer alice"
keys = []
for k in range(3):
    key = "victim-%d" % k
    body = json.dumps({"order": k, "pad": os.urandom(32 << 10).hex()})
    answers = []
    for _ in range(3):
        r = victim.post(url + "/echo", data=body, headers={"Idempotency-Key": key, "Content-Type": "application/json"})
        answers.append({"status": r.status_code, "replayed": r.headers.get("Idempotent-Replayed") == "true",
                        "body": hashlib.sha256(r.content).hexdigest() if r.status_code == 201 else r.text[:300]})
    keys.append({"key": key, "answers": answers})

print(json.dumps({"attacker_stored": stored, "attacker_stop": stop, "victim": keys}))
