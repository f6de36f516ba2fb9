// One logical POST with an Idempotency-Key, retried the way a Node service
// usually does it with the built-in fetch: each attempt is bounded by
// AbortSignal.timeout (which covers the body too), and a timeout, a network
// error or a 409, 429, 502, 503 or 504 answer is retried with the same key
// and body, after Retry-After when the answer has one, else a short backoff.
//
// usage: node client.mjs URL KEY BODY TIMEOUT_MS ATTEMPTS
//
// Prints one JSON line: the final status (0 when it ended in an error),
// body, Idempotent-Replayed and Retry-After headers, and what each attempt
// saw (a status, "timeout", "reset", ...), one entry per attempt.
const [url, key, body, timeoutArg, attemptsArg] = process.argv.slice(2);
const timeoutMs = Number(timeoutArg);
const attempts = Number(attemptsArg);
const retryable = new Set([409, 429, 502, 503, 504]);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const seen = [];
let out = { status: 0, body: "", replayed: "", retry_after: "", seen, error: "" };
for (let attempt = 1; attempt <= attempts; attempt++) {
  let wait = 50 * 2 ** (attempt - 1);
  let headers = false; // the answer's headers came: a failure is in the body
  try {
    const res = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", "Idempotency-Key": key },
      body,
      signal: AbortSignal.timeout(timeoutMs),
    });
    headers = true;
    const text = await res.text(); // the timeout covers the body as well
    seen.push(String(res.status));
    out = {
      status: res.status,
      body: text,
      replayed: res.headers.get("idempotent-replayed") ?? "",
      retry_after: res.headers.get("retry-after") ?? "",
      seen,
      error: "",
    };
    if (!retryable.has(res.status)) break;
    const after = Number(out.retry_after);
    if (out.retry_after !== "" && Number.isFinite(after)) wait = after * 1000;
  } catch (e) {
    const name = e?.name === "TimeoutError" ? "timeout" : /reset|socket|closed|terminated/i.test(String(e?.cause ?? e)) ? "reset" : String(e?.name);
    seen.push((headers ? "body " : "") + name);
    out = { status: 0, body: "", replayed: "", retry_after: "", seen, error: `${e?.name}: ${e?.message} ${e?.cause ?? ""}` };
  }
  if (attempt < attempts) await sleep(wait);
}
console.log(JSON.stringify(out));
process.exit(0); // do not wait for idle keep-alive sockets
