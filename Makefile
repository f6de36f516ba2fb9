.PHONY: test bench demo fmt

# Every test, under -race, with private redis-servers (see scripts/test.sh).
test:
	./scripts/test.sh

# The store benchmarks recorded in BENCHMARKS.md.
bench:
	./scripts/bench.sh

# The main job on the embedded in-memory store: no Redis needed.
demo:
	go run ./cmd/idem demo

fmt:
	gofmt -w $$(git ls-files '*.go')
