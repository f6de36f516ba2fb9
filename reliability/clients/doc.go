// Package clients drives idem the way real clients and infrastructure do
// (issue 12): Python requests with urllib3's Retry, Node's fetch, curl
// --retry, Go's http.Client and idemhttp.Transport, and nginx resending a
// POST to a second `idem proxy`, each with its own retry logic. They time
// out during the work, drop the connection mid-body, meet a 5xx first, or
// storm one key with copies, against `idem proxy` (memory and a private
// Redis) and the idemhttp middleware on a loopback server. Every scenario
// asserts, against a counting upstream, exactly one effect per key and that
// every client ends with the byte-identical 201 (the replay marked
// Idempotent-Replayed) or a documented 409 or 422, and reports a row with
// reltest.Report. The tests run scripts from testdata with /usr/bin/python3
// (python3-requests), node (nodejs), curl and nginx (nginx-light).
package clients
