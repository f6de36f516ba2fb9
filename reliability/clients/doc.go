// Package clients drives idem the way real clients and infrastructure do
// (issue 12): Python requests with urllib3's Retry, Node's fetch, curl
// --retry, Go's http.Client and idemhttp.Transport, nginx and HAProxy
// resending a POST to a second `idem proxy`, and gRPC clients (grpc-go and
// Python's grpcio) with a service-config retry policy, each with its own
// retry logic. They time out during the work, drop the connection
// mid-body, meet a 5xx first, or storm one key with copies, against `idem
// proxy` (memory and a private Redis), the idemhttp middleware on a
// loopback server, and Caddy with idem's handler in front of
// reverse_proxy (idem-caddy, built from the caddyidem module; memory and
// Redis; nginx also resends to a second Caddy); HAProxy also meets an instance SIGKILLed mid-request,
// and the gRPC clients meet idemgrpc's server interceptor on Redis. Every
// scenario asserts, against a counting upstream (or handler), exactly one
// effect per key and that every client ends with the byte-identical 201
// (the replay marked Idempotent-Replayed; for gRPC, OK with the header
// idempotent-replayed) or a documented 409, 422 or 504, and reports a row
// with reltest.Report. The one exception is stated: an instance SIGKILLed
// after the upstream acted holds the key until its lease ends, and the
// retry after that runs the upstream again (idem's at-least-once limit
// for a crashed holder). The tests run scripts from testdata with
// /usr/bin/python3 (python3-requests, python3-grpcio), node (nodejs),
// curl, nginx (nginx-light) and haproxy (haproxy), each a private process
// on free loopback ports; the HAProxy crash cases read /proc (Linux).
package clients
