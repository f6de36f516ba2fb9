// Signs the webhook fixtures of internal/webhook with each vendor's own
// library, so that the Go tests check idem's verification against what the
// senders really send, not against idem's own idea of the scheme.
//
// usage: node sign.mjs OUTDIR   (regen.sh installs the libraries and runs it)
//
// Writes OUTDIR/github.json, stripe.json and standard-webhooks.json: the
// secrets, the signing time (unix seconds) and deliveries (headers and raw
// body). Everything is fixed, so a run writes the same files again.
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import Stripe from "stripe";
import { sign as githubSign } from "@octokit/webhooks-methods";
import { Webhook } from "standardwebhooks";

const out = process.argv[2];
if (!out) {
  console.error("usage: node sign.mjs OUTDIR");
  process.exit(2);
}
// The version of a library as installed beside this script (regen.sh).
const here = dirname(fileURLToPath(import.meta.url));
const version = (name) =>
  JSON.parse(readFileSync(join(here, "node_modules", name, "package.json"))).version;
const write = (name, fixture) =>
  writeFileSync(join(out, name), JSON.stringify(fixture, null, 2) + "\n");

// 2026-12-02T02:00:00Z: the tests pass their own "now" near it or far from it.
const signedAt = 1796176800;

// GitHub: X-Hub-Signature-256 over the raw body; the delivery id is a header
// the signature does not cover.
{
  const secret = "idem-test github secret, current";
  const oldSecret = "idem-test github secret, previous";
  const forger = "not the github secret";
  const body = JSON.stringify({ zen: "Design for failure — café.", hook_id: 123456, hook: { type: "Repository" } });
  const delivery = async (s, id) => ({
    headers: {
      "User-Agent": "GitHub-Hookshot/044aadd",
      "Content-Type": "application/json",
      "X-GitHub-Event": "ping",
      "X-GitHub-Delivery": id,
      "X-Hub-Signature-256": await githubSign(s, body),
    },
    body,
  });
  const id = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
  write("github.json", {
    generator: `@octokit/webhooks-methods ${version("@octokit/webhooks-methods")} sign()`,
    secret, old_secret: oldSecret, forger_secret: forger, signed_at: signedAt,
    key: id,
    deliveries: {
      genuine: await delivery(secret, id),
      old_secret: await delivery(oldSecret, id),
      forged: await delivery(forger, id),
    },
  });
}

// Stripe: Stripe-Signature t=<unix>,v1=<hex> over "<t>.<body>", keyed by the
// event's id in the body. During a secret roll Stripe sends one v1 per
// secret: the two headers the library makes are joined the same way.
{
  const stripe = new Stripe("sk_test_idem_fixture_never_used");
  const secret = "whsec_idemTestStripeCurrent0123456789ab";
  const oldSecret = "whsec_idemTestStripePrevious0123456789a";
  const forger = "whsec_notTheStripeSecret0123456789abcdef";
  const event = { id: "evt_1QidemTestEvent000001", object: "event", type: "payment_intent.succeeded", created: signedAt - 2, data: { object: { id: "pi_3Qidem", amount: 2000, currency: "eur", description: "café" } } };
  const header = (payload, s, timestamp = signedAt) =>
    stripe.webhooks.generateTestHeaderString({ payload, secret: s, timestamp });
  const delivery = (payload, s) => ({
    headers: { "Content-Type": "application/json; charset=utf-8", "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)", "Stripe-Signature": header(payload, s) },
    body: payload,
  });
  const body = JSON.stringify(event, null, 2);
  const v1 = (h) => h.split(",").filter((kv) => kv.startsWith("v1="));
  const rolled = ["t=" + signedAt, ...v1(header(body, oldSecret)), ...v1(header(body, secret))].join(",");
  const { id, ...noId } = event;
  write("stripe.json", {
    generator: `stripe ${version("stripe")} webhooks.generateTestHeaderString()`,
    secret, old_secret: oldSecret, forger_secret: forger, signed_at: signedAt,
    key: event.id,
    deliveries: {
      genuine: delivery(body, secret),
      old_secret: delivery(body, oldSecret),
      forged: delivery(body, forger),
      rotation: { headers: { ...delivery(body, secret).headers, "Stripe-Signature": rolled }, body },
      no_id: delivery(JSON.stringify(noId), secret),
      id_number: delivery(JSON.stringify({ ...event, id: 42 }), secret),
      not_json: delivery("id=evt_1QidemTestEvent000001&type=payment_intent.succeeded", secret),
    },
  });
}

// Standard Webhooks (Svix): webhook-signature "v1,<base64>" over
// "<id>.<timestamp>.<body>" with the base64-decoded whsec_ secret; during a
// rotation the sender puts one signature per secret, space-separated.
{
  const whsec = (text) => "whsec_" + Buffer.from(text).toString("base64");
  const secret = whsec("idem-test standard-webhooks secret, current");
  const oldSecret = whsec("idem-test standard-webhooks secret, previous");
  const forger = whsec("not the standard-webhooks secret");
  const body = JSON.stringify({ type: "invoice.paid", timestamp: "2026-12-02T01:59:58Z", data: { id: "inv_idem1", amount: 990, note: "café" } });
  const id = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W";
  const sign = (s, msgId = id) => new Webhook(s).sign(msgId, new Date(signedAt * 1000), body);
  const delivery = (signature) => ({
    headers: {
      "Content-Type": "application/json",
      "webhook-id": id,
      "webhook-timestamp": String(signedAt),
      "webhook-signature": signature,
    },
    body,
  });
  write("standard-webhooks.json", {
    generator: `standardwebhooks ${version("standardwebhooks")} Webhook.sign()`,
    secret, old_secret: oldSecret, forger_secret: forger, signed_at: signedAt,
    key: id,
    deliveries: {
      genuine: delivery(sign(secret)),
      old_secret: delivery(sign(oldSecret)),
      forged: delivery(sign(forger)),
      rotation: delivery(`${sign(oldSecret)} ${sign(secret)}`),
      // Signed for another message id, sent under this one: the id is signed.
      other_id: delivery(sign(secret, "msg_someOtherMessage000000000")),
    },
  });
}
