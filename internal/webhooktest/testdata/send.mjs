// Signs one webhook delivery with its sender's own library and sends it,
// so that the end-to-end tests of idem proxy and of Caddy with idem's
// handler check idem against what GitHub, Stripe and Standard Webhooks
// senders really send (internal/webhooktest runs it).
//
// usage: node send.mjs < SPEC   (node_modules beside this script holds
// stripe, @octokit/webhooks-methods and standardwebhooks)
//
// SPEC is JSON on stdin (never argv, which ps shows: it holds secrets):
//
//	{"preset": "github" | "stripe" | "standard-webhooks",
//	 "url": "http://...", "body": "<the signed body>",
//	 "secrets": ["..."],  // one signature each, as the library makes them
//	                      // (several: a sender rolling its secret)
//	 "id": "...",         // X-GitHub-Delivery or webhook-id (stripe's is
//	                      // the body's "id")
//	 "timestamp": 0,      // unix seconds signed (0: now)
//	 "sent_body": "...",  // sent instead of body when present: a body
//	                      // altered after signing
//	 "headers": {}}       // more headers
//
// It POSTs with Node's fetch and prints {"status", "headers" (lower-case
// names), "body"} as JSON on stdout. An error prints its message alone on
// stderr (never the spec) and exits 1.
// Each library is imported when its preset is asked for: stripe's takes
// most of a run's start-up.

async function readStdin() {
  const chunks = [];
  for await (const c of process.stdin) chunks.push(c);
  return Buffer.concat(chunks).toString("utf8");
}

async function signed(spec) {
  const { preset, body, secrets, id } = spec;
  const ts = spec.timestamp || Math.floor(Date.now() / 1000);
  if (!Array.isArray(secrets) || secrets.length === 0) throw new Error("no secrets in the spec");
  switch (preset) {
    case "github": {
      if (secrets.length !== 1) throw new Error("github signs with one secret");
      const { sign: githubSign } = await import("@octokit/webhooks-methods");
      return {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/044aadd",
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": id,
        "X-Hub-Signature-256": await githubSign(secrets[0], body),
      };
    }
    case "stripe": {
      // During a roll Stripe sends one v1 per secret, after one t=.
      const { default: Stripe } = await import("stripe");
      const stripe = new Stripe("sk_test_idem_never_used");
      const v1 = secrets.flatMap((secret) =>
        stripe.webhooks
          .generateTestHeaderString({ payload: body, secret, timestamp: ts })
          .split(",")
          .filter((kv) => kv.startsWith("v1=")),
      );
      return {
        "Content-Type": "application/json; charset=utf-8",
        "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
        "Stripe-Signature": ["t=" + ts, ...v1].join(","),
      };
    }
    case "standard-webhooks": {
      // During a rotation the sender puts one signature per secret,
      // space-separated.
      const { Webhook } = await import("standardwebhooks");
      const sigs = secrets.map((s) => new Webhook(s).sign(id, new Date(ts * 1000), body));
      return {
        "Content-Type": "application/json",
        "webhook-id": id,
        "webhook-timestamp": String(ts),
        "webhook-signature": sigs.join(" "),
      };
    }
    default:
      throw new Error(`preset ${JSON.stringify(preset)}: want github, stripe or standard-webhooks (shopify: shopify_send.py)`);
  }
}

try {
  const spec = JSON.parse(await readStdin());
  const headers = { ...(await signed(spec)), ...(spec.headers || {}) };
  const sent = spec.sent_body ?? spec.body;
  const res = await fetch(spec.url, { method: "POST", headers, body: sent });
  const out = { status: res.status, headers: Object.fromEntries(res.headers.entries()), body: await res.text() };
  process.stdout.write(JSON.stringify(out) + "\n");
} catch (err) {
  process.stderr.write(`send.mjs: ${err && err.message}\n`);
  process.exit(1);
}
