.PHONY: test bench demo fmt reliability fuzz

# Every test, under -race, with private redis-servers (see scripts/test.sh).
test:
	./scripts/test.sh

# The reliability suites at full size (several minutes), and the table of
# RELIABILITY.md from what they report; a short version of each runs in test.
reliability:
	./scripts/reliability.sh

# Every fuzz target for 10 minutes each (the test command gives them 5 s).
fuzz:
	FUZZTIME=10m ./scripts/test.sh

# The store benchmarks recorded in BENCHMARKS.md.
bench:
	./scripts/bench.sh

# The main job on the embedded in-memory store: no Redis needed.
demo:
	go run ./cmd/idem demo

fmt:
	gofmt -w $$(git ls-files '*.go')
