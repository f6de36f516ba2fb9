#!/usr/bin/env bash
# Regenerates the fixtures beside this script with the vendors' own
# libraries (pinned here; bump them on purpose): npm packages into a
# temporary directory, then sign.mjs and shopify_sign.py. The output is
# deterministic: a run with the same versions changes nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
npm install --silent --no-audit --no-fund --prefix "$tmp" \
	stripe@23.1.0 @octokit/webhooks-methods@6.0.0 standardwebhooks@1.1.1
# sign.mjs runs from the directory that holds node_modules, so that its
# imports resolve there.
cp "$here/sign.mjs" "$tmp/"
node "$tmp/sign.mjs" "$here"
python3 "$here/shopify_sign.py" "$here"
