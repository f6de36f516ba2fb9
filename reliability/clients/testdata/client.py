#!/usr/bin/python3
"""One logical POST with an Idempotency-Key, retried the way a Python
service usually does it: requests + urllib3's Retry, which resends the
request (POST allowed) after a read timeout, a reset connection or a 409,
429, 502, 503 or 504 answer, honouring Retry-After; and an application
loop around it for what urllib3 does not retry, a failure while reading
the body. Every attempt carries the same key and body.

usage: client.py URL KEY BODY READ_TIMEOUT_S ATTEMPTS

Prints one JSON line: the final status (0 when it ended in an error), body,
Idempotent-Replayed and Retry-After headers, and what each attempt saw (a
status, "timeout", "reset", "body timeout", ...), one entry per attempt.
"""
import json
import sys

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import MaxRetryError, ProtocolError, ReadTimeoutError
from urllib3.util.retry import Retry

seen = []  # one entry per attempt sent
state = {"last_recorded": False}  # urllib3 gave up on a response already in seen


def describe(error):
    text = str(error).lower()
    if isinstance(error, ReadTimeoutError) or "timed out" in text:
        return "timeout"
    if isinstance(error, ProtocolError) or "reset" in text or "broken" in text or "aborted" in text:
        return "reset"
    return type(error).__name__


class CountingRetry(Retry):
    """urllib3's Retry, recording what each retried attempt saw."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        seen.append(str(response.status) if response is not None and response.status else describe(error))
        try:
            return super().increment(method, url, response, error, _pool, _stacktrace)
        except MaxRetryError:
            # Out of retries on an answer: urllib3 returns it (raise_on_status
            # is off), and it is already recorded.
            state["last_recorded"] = response is not None
            raise


def main():
    url, key, body = sys.argv[1], sys.argv[2], sys.argv[3]
    read_timeout, attempts = float(sys.argv[4]), int(sys.argv[5])
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    out = {"status": 0, "body": "", "replayed": "", "retry_after": "", "seen": seen, "error": ""}
    session = requests.Session()
    while len(seen) < attempts:
        session.mount("http://", HTTPAdapter(max_retries=CountingRetry(
            total=attempts - len(seen) - 1,
            allowed_methods=frozenset({"POST"}),
            status_forcelist=(409, 429, 502, 503, 504),
            respect_retry_after_header=True,
            backoff_factor=0.05,
            raise_on_status=False,  # out of retries: return the last answer
        )))
        try:
            resp = session.post(url, data=body, headers=headers, timeout=(2, read_timeout))
        except requests.exceptions.RequestException as e:
            out.update(status=0, body="", error=f"{type(e).__name__}: {e}")
            cause = e.args[0] if e.args else None
            if isinstance(cause, MaxRetryError):
                break  # urllib3 gave up; its last attempt is in seen
            # The body failed after the headers came: urllib3 does not retry
            # that, the application sends the request again.
            seen.append("body " + describe(cause or e))
            continue
        if not state["last_recorded"]:
            seen.append(str(resp.status_code))
        out.update(status=resp.status_code, body=resp.text, error="",
                   replayed=resp.headers.get("Idempotent-Replayed", ""),
                   retry_after=resp.headers.get("Retry-After", ""))
        break
    print(json.dumps(out))


if __name__ == "__main__":
    main()
