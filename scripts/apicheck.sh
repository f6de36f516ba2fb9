#!/usr/bin/env bash
# API compatibility check: the public API of the module github.com/idemkit/idem
# (every package outside internal/) must stay compatible with the last
# release's, whose export data is api/<tag>.export (the newest by version).
# It runs in scripts/test.sh. A removed or changed exported name, a method
# added to an exported interface and the like fail it; additions pass.
#
# Usage: scripts/apicheck.sh               compare the working tree with the last release
#        scripts/apicheck.sh --write TAG   write api/TAG.export from the working tree
#                                          (at a release, in the commit that TAG names)
#
# It uses apidiff from golang.org/x/exp, pinned below, installed with
# go install into $(go env GOPATH)/bin when it is missing (about 20 seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
module=github.com/idemkit/idem
version=v0.0.0-20261113113407-e3970619a1a4
gobin="$(go env GOPATH | cut -d: -f1)/bin"
apidiff="$gobin/apidiff-$version"
if [ ! -x "$apidiff" ]; then
	echo "apicheck: installing apidiff (golang.org/x/exp@$version, go install)" >&2
	tmp=$(mktemp -d)
	GOBIN="$tmp" GOFLAGS= go install "golang.org/x/exp/cmd/apidiff@$version"
	mkdir -p "$gobin"
	mv "$tmp/apidiff" "$apidiff"
	rm -rf "$tmp"
fi

if [ "${1:-}" = --write ]; then
	tag=${2:?"usage: scripts/apicheck.sh --write TAG (e.g. v1.0.0)"}
	[[ "$tag" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "apicheck: $tag is not a release tag vMAJOR.MINOR.PATCH" >&2; exit 2; }
	mkdir -p api
	"$apidiff" -m -w "api/$tag.export" "$module" 2> >(grep -v '^Ignoring internal package' >&2)
	echo "apicheck: wrote api/$tag.export"
	exit 0
fi

base=$(ls api/v*.export 2>/dev/null | sort -V | tail -n 1)
if [ -z "$base" ]; then
	echo "apicheck: no api/v*.export: write one at a release with scripts/apicheck.sh --write vX.Y.Z" >&2
	exit 1
fi
out=$("$apidiff" -m -incompatible "$base" "$module" 2> >(grep -v '^Ignoring internal package' >&2))
if [ -n "$out" ]; then
	echo "apicheck: the public API is incompatible with $(basename "$base" .export):" >&2
	echo "$out" >&2
	echo "apicheck: keep the old names (deprecate them instead), or, for a new major version, see CONTRIBUTING.md" >&2
	exit 1
fi
echo "apicheck: public API compatible with $(basename "$base" .export)"
