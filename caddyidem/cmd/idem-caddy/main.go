// Command idem-caddy is Caddy with its standard modules and the
// idempotency handler (github.com/idemkit/idem/caddyidem): what
//
//	xcaddy build v2.11.9 --with github.com/idemkit/idem/caddyidem
//
// builds, pinned by this module's go.mod. It takes Caddy's commands and
// flags (idem-caddy run --config Caddyfile). The test suites build it.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/idemkit/idem/caddyidem"
)

func main() {
	caddycmd.Main()
}
