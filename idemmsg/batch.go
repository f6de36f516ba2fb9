package idemmsg

import (
	"context"
	"time"

	"github.com/idemkit/idem"
)

// DefaultFlushInterval is BatchOptions.FlushInterval's default.
const DefaultFlushInterval = 2 * time.Millisecond

// BatchOptions tunes HandleBatch.
type BatchOptions struct {
	// Concurrency is how many handlers of the batch run at once. Default
	// 1: one after another, in batch order.
	Concurrency int

	// InOrder keeps a partition's order, for brokers such as Kafka that
	// commit an offset rather than acknowledge each message: handlers run
	// one at a time, in batch order (Concurrency is ignored), and once a
	// delivery is decided InFlight or Released, or fails with a store error,
	// no later delivery's handler runs: the later ones are left
	// undecided (settle never sees them; their keys are released), for
	// the caller to retry from the one that stopped the batch. A later
	// delivery that needs no handler (Replayed, say) may still be
	// settled.
	InOrder bool

	// Handled, when set, is called once every handler of the batch has
	// returned and none will start, before the last groups are recorded
	// and settled: a consumer loop may then fetch, and start deciding, its
	// next batch (the adapters overlap their batches so).
	Handled func()

	// FlushInterval bounds how long a decided delivery waits for others
	// before its group is recorded and settled: a group is flushed when
	// every delivery of the batch is decided, or when its first delivery
	// has waited this long, whichever comes first, so a slow handler
	// never holds up the others. Default DefaultFlushInterval.
	FlushInterval time.Duration
}

// Settled is one decided delivery of a batch, as HandleBatch hands it to
// its settle function: the index of the delivery in the batch, and what
// Handle would have returned for it.
type Settled struct {
	Index  int
	Result Result
	Err    error
}

// HandleBatch decides a batch of deliveries, as fetched from the broker,
// with the same outcomes as Handle, for fewer store round trips: when the
// store implements idem.BatchStore, the keys are acquired in one step,
// and the results of finished handlers are recorded in groups, one step
// per group. fn(ctx, i) is the handler of dls[i]; the handlers run
// Concurrency at a time (one after another, in batch order, by default),
// as with Handle.
//
// settle is called with each group of decided deliveries, in index order
// within the group, once their outcomes are recorded: the adapter
// acknowledges them together (one ack round trip per group). The calls
// never overlap, and the next group is being decided (handlers run) while
// settle runs. A group is flushed when every delivery of the batch is
// decided, or after FlushInterval; Replayed, InFlight and the other
// outcomes that need no handler are in the first group.
//
// A key that appears more than once in dls is decided once first; its
// later deliveries are decided after that one is recorded, each as Handle
// would decide a delivery that came after it (Replayed, usually).
//
// With a store that does not implement idem.BatchStore, each delivery is
// decided by Handle (its own acquire and completion), Concurrency at a
// time, and only the settling is grouped.
//
// When ctx ends, deliveries whose handlers have not started are not
// decided (their keys are released, and settle never sees them: leave
// them for redelivery); running handlers get a cancelled context and
// their outcomes are still recorded and settled, as with Handle. If a
// handler panics, its key is released, the handlers not started are not
// run (their keys are released), the decided deliveries are recorded and
// settled, and the panic goes on once the others have returned. If settle
// returns an error, HandleBatch stops as a crashed consumer would: no
// further handler starts, nothing more is recorded or settled, the leases
// held are left to expire; it returns that error once the running
// handlers have returned.
func (d *Deduplicator) HandleBatch(ctx context.Context, dls []Delivery, opts BatchOptions,
	fn func(ctx context.Context, i int) error, settle func(group []Settled) error) error {
	if len(dls) == 0 || ctx.Err() != nil {
		return nil // nothing decided
	}
	if opts.FlushInterval <= 0 {
		opts.FlushInterval = DefaultFlushInterval
	}
	if opts.InOrder {
		opts.Concurrency = 1
	}
	_, batched := d.guard.Store().(idem.BatchStore)
	return newBatchRun(d, ctx, dls, opts, fn, settle, batched).run()
}
