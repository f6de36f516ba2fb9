package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/memstore"
)

// Short enough that retries, rebalances and polls happen within the
// test's bounds.
const (
	testLease  = 300 * time.Millisecond
	partitions = 3
	waitLimit  = 15 * time.Second
)

// env is one test's in-process Kafka cluster (kfake), topic, group,
// producer, deduplicator and ledger.
type env struct {
	t        *testing.T
	cfg      envConfig
	mu       sync.Mutex
	cluster  *kfake.Cluster // replaced by restart
	topic    string
	dead     string
	group    string
	producer *kgo.Client
	store    *memstore.Store // the Deduplicator's, unless envConfig.store
	dedup    *idemmsg.Deduplicator
	ledger   *ledger

	// With envConfig.faults: the cluster's data directory and port, and
	// the proxy every consumer's connection goes through.
	dataDir string
	port    int
	proxy   *msgtest.Proxy
}

// envConfig is what a test asks of its env.
type envConfig struct {
	maxFailures int
	// faults: the cluster persists to a directory (so that restart keeps
	// the records, the commits and the group) on a fixed port, and the
	// consumers' clients reach it only through a msgtest.Proxy.
	faults bool
	// lease is the Deduplicator's (0: testLease).
	lease time.Duration
	// store is the Deduplicator's (nil: a memstore).
	store idem.Store
	// sessionTimeout, when positive, is the consumers' group session
	// timeout (kgo.SessionTimeout).
	sessionTimeout time.Duration
}

func newEnv(t *testing.T, maxFailures int) *env {
	t.Helper()
	return newEnvWith(t, envConfig{maxFailures: maxFailures})
}

func newEnvWith(t *testing.T, cfg envConfig) *env {
	t.Helper()
	e := &env{t: t, cfg: cfg, topic: "orders", dead: "orders.dead", group: "billing",
		ledger: &ledger{Ledger: msgtest.NewLedger(), order: map[int32][]int64{}}}
	if cfg.faults {
		e.dataDir = t.TempDir()
	}
	cluster, err := e.newCluster()
	if err != nil {
		t.Fatal(err)
	}
	e.cluster = cluster
	addr := cluster.ListenAddrs()[0]
	if cfg.faults {
		_, port, _ := net.SplitHostPort(addr)
		e.port, _ = strconv.Atoi(port)
		e.proxy = msgtest.NewProxy(t, addr)
	}
	// The producer connects directly: a cut between the consumers and the
	// broker does not stop the test publishing.
	producer, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(producer.Close)
	e.producer = producer
	e.store = memstore.New(memstore.Options{})
	var store idem.Store = e.store
	if cfg.store != nil {
		store = cfg.store
	}
	lease := cfg.lease
	if lease == 0 {
		lease = testLease
	}
	e.dedup, err = idemmsg.New(store, idemmsg.Config{Namespace: e.topic + "/" + e.group, Lease: lease, MaxFailures: cfg.maxFailures})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// newCluster starts the env's cluster: a single broker with the topic and
// its dead-letter topic; with faults, on the env's data directory and
// port (once known), reloading what a previous cluster there persisted.
func (e *env) newCluster() (*kfake.Cluster, error) {
	opts := []kfake.Opt{kfake.NumBrokers(1), kfake.SeedTopics(partitions, e.topic), kfake.SeedTopics(1, e.dead),
		kfake.GroupMinSessionTimeout(100 * time.Millisecond)}
	if e.dataDir != "" {
		opts = append(opts, kfake.DataDir(e.dataDir))
	}
	if e.port != 0 {
		opts = append(opts, kfake.Ports(e.port))
	}
	cluster, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, err
	}
	e.t.Cleanup(cluster.Close)
	return cluster, nil
}

// kfake returns the current cluster.
func (e *env) kfake() *kfake.Cluster {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cluster
}

// restart closes the cluster, which closes every connection to it and
// persists its state, and starts a new one on the same port and data
// directory: a broker restart with its log, commits and group kept.
func (e *env) restart(t testing.TB) {
	t.Helper()
	e.kfake().Close()
	deadline := time.Now().Add(waitLimit)
	for {
		cluster, err := e.newCluster()
		if err == nil {
			e.mu.Lock()
			e.cluster = cluster
			e.mu.Unlock()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("restarting kfake on port %d: %v", e.port, err)
		}
		time.Sleep(50 * time.Millisecond) // the port is not free yet
	}
}

// ledger is the system of record, and keeps the offsets it saw per
// partition, in the order it saw them.
type ledger struct {
	*msgtest.Ledger
	mu    sync.Mutex
	order map[int32][]int64
}

func (l *ledger) apply(ctx context.Context, key string, rec *kgo.Record) error {
	if err := l.Apply(ctx, key); err != nil {
		return err
	}
	l.record(rec)
	return nil
}

// record notes that rec's effect is done.
func (l *ledger) record(rec *kgo.Record) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.order[rec.Partition] = append(l.order[rec.Partition], rec.Offset)
}

// checkOrder wants the effects of each partition in offset order.
func (l *ledger) checkOrder(t testing.TB) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for p, offs := range l.order {
		for i := 1; i < len(offs); i++ {
			if offs[i] <= offs[i-1] {
				t.Errorf("partition %d: effects out of order: %v", p, offs)
				break
			}
		}
	}
}

// publish produces one record per key, the i-th to partition i%partitions,
// with the key in the Idempotency-Key header.
func (e *env) publish(keys ...string) {
	e.t.Helper()
	for i, k := range keys {
		e.publishTo(int32(i%partitions), k)
	}
}

func (e *env) publishTo(p int32, key string) {
	e.t.Helper()
	rec := &kgo.Record{Topic: e.topic, Partition: p, Value: []byte("value of " + key),
		Headers: []kgo.RecordHeader{{Key: DefaultKeyHeader, Value: []byte(key)}}}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	if err := e.producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
		e.t.Fatal(err)
	}
}

// client returns a new group member's client; closed when the test ends.
// With envConfig.faults it reaches the broker only through the env's
// proxy, the seed and every broker the metadata names alike.
func (e *env) client() *kgo.Client {
	e.t.Helper()
	opts := []kgo.Opt{
		kgo.SeedBrokers(e.kfake().ListenAddrs()...),
		kgo.ConsumerGroup(e.group), kgo.ConsumeTopics(e.topic), kgo.DisableAutoCommit(),
		kgo.FetchMaxWait(50 * time.Millisecond), kgo.HeartbeatInterval(100 * time.Millisecond),
	}
	if e.proxy != nil {
		var d net.Dialer
		opts = append(opts, kgo.Dialer(func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, e.proxy.Addr) // one broker, one proxy
		}))
	}
	if e.cfg.sessionTimeout > 0 {
		// A heartbeat is retried in place for up to its retry timeout
		// (by default the session timeout) before the member gives up
		// its partitions: longer, so that the coordinator, not the
		// client, ends a session whose heartbeats fail.
		opts = append(opts, kgo.SessionTimeout(e.cfg.sessionTimeout), kgo.RetryTimeout(30*time.Second))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(cl.Close)
	return cl
}

func (e *env) consumer(name string) *Consumer {
	return &Consumer{
		Client: e.client(), Dedup: e.dedup,
		Handler: func(ctx context.Context, rec *kgo.Record) error {
			return e.ledger.apply(ctx, headerValue(rec, DefaultKeyHeader), rec)
		},
		OnError: func(err error) { e.t.Logf("%s: %v", name, err) },
	}
}

func headerValue(rec *kgo.Record, name string) string {
	for _, h := range rec.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}

// settled reports whether the group's committed offset of every partition
// is the partition's end.
func (e *env) settled() bool {
	info := e.kfake().GroupInfo(e.group)
	if info == nil {
		return false
	}
	for _, p := range e.kfake().PartitionInfos(e.topic) {
		c, ok := info.Commits[e.topic][p.Partition]
		if p.HighWatermark > 0 && (!ok || c.Offset != p.HighWatermark) {
			return false
		}
	}
	return true
}

// checkLedger wants exactly one effect per distinct key, in order per
// partition, and every partition committed to its end.
func (e *env) checkLedger(keys []string) {
	e.t.Helper()
	e.ledger.WantOneEach(e.t, keys)
	e.ledger.checkOrder(e.t)
	if !e.settled() {
		e.t.Errorf("committed offsets %v, want the partitions' ends", e.cluster.GroupInfo(e.group).Commits)
	}
}

// keysWithDuplicates returns n keys over distinct values, each repeated;
// with publish, copies of a key land on different partitions.
func keysWithDuplicates(n, distinct int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("order-%d", i%distinct)
	}
	return keys
}

// readDead returns the records of the dead-letter topic, waiting until
// there are want of them.
func (e *env) readDead(t testing.TB, want int) []*kgo.Record {
	t.Helper()
	if want == 0 {
		return nil
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.kfake().ListenAddrs()...), kgo.ConsumeTopics(e.dead),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	deadline := time.Now().Add(waitLimit)
	for len(recs) < want && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		f := cl.PollFetches(ctx)
		cancel()
		recs = append(recs, f.Records()...)
	}
	return recs
}

// TestPartitionOrder: one member delivers each partition's records in
// offset order (a retry repeats one) and applies their effects in that
// order; Run stops promptly. (The adapter suite checks the effects' order
// in every scenario, with its own handler.)
func TestPartitionOrder(t *testing.T) {
	e := newEnv(t, 0)
	keys := keysWithDuplicates(30, 10)
	e.publish(keys...)
	var delivered sync.Map
	c := e.consumer("c1")
	c.OnResult = func(rec *kgo.Record, res idemmsg.Result, err error) {
		if prev, ok := delivered.Swap(rec.Partition, rec.Offset); ok && prev.(int64) > rec.Offset {
			t.Errorf("partition %d: offset %d delivered after %d", rec.Partition, rec.Offset, prev)
		}
	}
	stop := e.start(c)
	waitFor(t, "all records committed", e.settled)
	t0 := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("Run: got %v, want nil after cancel", err)
	}
	if d := time.Since(t0); d > time.Second {
		t.Errorf("Run took %v to stop, want under 1s", d)
	}
	e.checkLedger(keys)
}

// TestRebalanceUnderLoad: two members share the partitions (and handle
// copies of a key at once), and a third joins midway, so that the group
// rebalances while records are handled; effects stay one per key and in
// partition order. (The adapter suite's two consumers start together.)
func TestRebalanceUnderLoad(t *testing.T) {
	e := newEnv(t, 0)
	keys := keysWithDuplicates(90, 30)
	var handled [3]atomic.Int32
	member := func(i int) *Consumer {
		c := e.consumer(fmt.Sprintf("c%d", i+1))
		h := c.Handler
		c.MaxPollRecords = 4
		c.Handler = func(ctx context.Context, rec *kgo.Record) error {
			time.Sleep(20 * time.Millisecond) // let the members interleave, and the third join
			handled[i].Add(1)
			return h(ctx, rec)
		}
		return c
	}
	e.start(member(0))
	e.start(member(1))
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	if _, err := e.cluster.WaitGroupStable(ctx, e.group, 2); err != nil {
		t.Fatalf("group of 2 not stable: %v", err)
	}
	e.publish(keys...)
	waitFor(t, "a third of the effects", func() bool { return len(e.ledger.Snapshot()) >= 10 })
	e.start(member(2))
	waitFor(t, "all records committed", e.settled)
	e.checkLedger(keys)
	if handled[0].Load() == 0 || handled[1].Load() == 0 {
		t.Errorf("effects per member: %d, %d, %d; want the first two to share them",
			handled[0].Load(), handled[1].Load(), handled[2].Load())
	}
	t.Logf("effects per member: %d, %d, %d", handled[0].Load(), handled[1].Load(), handled[2].Load())
}

// TestCrashCommitsNothingOfItsBatch: a member that crashes after the
// effect of its third record, before committing, committed none of the
// records of its batch (a partition's records are committed when its part
// of the batch is finished); the next member re-reads them all and answers
// each handled one Replayed. (The adapter suite's crashing consumer polls
// one record at a time.)
func TestCrashCommitsNothingOfItsBatch(t *testing.T) {
	e := newEnv(t, 0)
	keys := keysWithDuplicates(12, 12)
	e.publish(keys...)

	var handled atomic.Int32
	crashed := e.consumer("c1")
	crashed.crashBeforeCommit(func(*kgo.Record) bool { return handled.Add(1) < 3 })
	stop := e.start(crashed)
	waitFor(t, "c1 to crash", func() bool { return handled.Load() >= 3 })
	if err := stop(); !errors.Is(err, errCrashed) {
		t.Fatalf("crashed Run: got %v, want errCrashed", err)
	}
	crashed.Client.Close() // leaves the group
	// The partitions' goroutines run at once: another may finish a
	// handler while the crash happens.
	effects := len(e.ledger.Snapshot())
	if effects < 3 {
		t.Fatalf("before the restart the ledger holds %d keys, want at least 3", effects)
	}
	if info := e.cluster.GroupInfo(e.group); info != nil && len(info.Commits[e.topic]) != 0 {
		t.Fatalf("the crashed consumer committed %v", info.Commits)
	}

	var duplicates atomic.Int32
	c := e.consumer("c2")
	c.OnResult = func(rec *kgo.Record, res idemmsg.Result, err error) {
		if res.Outcome == idemmsg.Replayed {
			duplicates.Add(1)
		}
	}
	e.start(c)
	waitFor(t, "all records committed", e.settled)
	e.checkLedger(keys)
	if got := int(duplicates.Load()); got != effects {
		t.Errorf("got %d duplicates after the restart, want %d (every record handled before the crash)", got, effects)
	}
}

// TestDeadLetterFields checks what the adapter suite does not: the
// failing record is retried in place (the record after it in its
// partition waits) with in-process attempts, Released twice then
// DeadLettered; the dead letter keeps the record's headers and value and
// gains where it came from and the error.
func TestDeadLetterFields(t *testing.T) {
	e := newEnv(t, 3)
	for _, k := range []string{"good-1", "poison", "good-2"} {
		e.publishTo(0, k)
	}
	var poisonRuns atomic.Int32
	var (
		mu       sync.Mutex
		attempts []int
	)
	c := e.consumer("c1")
	c.DeadLetterTopic = e.dead
	h := c.Handler
	c.Handler = func(ctx context.Context, rec *kgo.Record) error {
		if headerValue(rec, DefaultKeyHeader) == "poison" {
			return fmt.Errorf("cannot parse payload (run %d)", poisonRuns.Add(1))
		}
		return h(ctx, rec)
	}
	c.OnResult = func(rec *kgo.Record, res idemmsg.Result, err error) {
		if headerValue(rec, DefaultKeyHeader) == "poison" {
			mu.Lock()
			attempts = append(attempts, int(res.Outcome))
			mu.Unlock()
		}
	}
	e.start(c)
	waitFor(t, "all records committed", e.settled)
	e.checkLedger([]string{"good-1", "good-2"})
	if got := poisonRuns.Load(); got != 3 {
		t.Errorf("poison handler ran %d times, want 3 (MaxFailures)", got)
	}
	mu.Lock()
	if want := []int{int(idemmsg.Released), int(idemmsg.Released), int(idemmsg.DeadLettered)}; fmt.Sprint(attempts) != fmt.Sprint(want) {
		t.Errorf("poison outcomes: got %v, want %v", attempts, want)
	}
	mu.Unlock()
	dead := e.readDead(t, 1)
	if len(dead) != 1 {
		t.Fatalf("dead-letter topic: got %d records, want 1", len(dead))
	}
	d := dead[0]
	if headerValue(d, DefaultKeyHeader) != "poison" || string(d.Value) != "value of poison" ||
		headerValue(d, HeaderTopic) != e.topic || headerValue(d, HeaderPartition) != "0" ||
		headerValue(d, HeaderOffset) != "1" || headerValue(d, HeaderError) != "cannot parse payload (run 3)" {
		t.Errorf("dead letter: got headers %v, value %q", d.Headers, d.Value)
	}
}

func TestInvalidKeyDeadLettered(t *testing.T) {
	e := newEnv(t, 0)
	e.publishTo(0, "ok")
	e.publishTo(0, "") // an empty key header is invalid
	c := e.consumer("c1")
	c.DeadLetterTopic = e.dead
	c.OnError = func(error) {}
	e.start(c)
	waitFor(t, "all records committed", e.settled)
	e.checkLedger([]string{"ok"})
	dead := e.readDead(t, 1)
	if len(dead) != 1 || !strings.Contains(headerValue(dead[0], HeaderError), "invalid") {
		t.Fatalf("dead-letter topic: got %v, want one record with the key error", dead)
	}
}

func TestDefaultKeyIsOffset(t *testing.T) {
	e := newEnv(t, 0)
	for range 2 { // two records without a key header, same value: both processed
		rec := &kgo.Record{Topic: e.topic, Partition: 0, Value: []byte("same")}
		if err := e.producer.ProduceSync(context.Background(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	c := e.consumer("c1")
	c.Handler = func(ctx context.Context, rec *kgo.Record) error {
		return e.ledger.apply(ctx, fmt.Sprintf("%s/%d/%d", rec.Topic, rec.Partition, rec.Offset), rec)
	}
	e.start(c)
	waitFor(t, "all records committed", e.settled)
	e.checkLedger([]string{e.topic + "/0/0", e.topic + "/0/1"})
}

func TestInFlightRetried(t *testing.T) {
	e := newEnv(t, 0)
	// Another holder takes the key's lease: the consumer gets InFlight and
	// retries in place, commits nothing past it, and once the holder
	// completes, answers Replayed without running the handler.
	g, err := idem.New(e.store, idem.Config{Lease: testLease})
	if err != nil {
		t.Fatal(err)
	}
	key, err := e.dedup.Key("busy")
	if err != nil {
		t.Fatal(err)
	}
	att, acq, err := g.Begin(context.Background(), key, idem.Fingerprint{})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Begin: got %v, %v", acq.Outcome, err)
	}
	e.publishTo(0, "busy")
	var inFlight, duplicate atomic.Int32
	c := e.consumer("c1")
	c.OnResult = func(rec *kgo.Record, res idemmsg.Result, err error) {
		switch res.Outcome {
		case idemmsg.InFlight:
			inFlight.Add(1)
		case idemmsg.Replayed:
			duplicate.Add(1)
		}
	}
	e.start(c)
	waitFor(t, "two InFlight answers", func() bool { return inFlight.Load() >= 2 })
	if e.settled() {
		t.Fatal("committed past a record that is in flight")
	}
	if err := att.Complete(context.Background(), &idem.Response{Status: idemmsg.StatusExecuted}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "all records committed", e.settled)
	if duplicate.Load() != 1 || len(e.ledger.Snapshot()) != 0 {
		t.Errorf("got %d duplicates and effects %v, want 1 duplicate and no effect", duplicate.Load(), e.ledger.Snapshot())
	}
}

func TestRunValidates(t *testing.T) {
	e := newEnv(t, 0)
	for name, mutate := range map[string]func(c *Consumer){
		"no client":  func(c *Consumer) { c.Client = nil },
		"no dedup":   func(c *Consumer) { c.Dedup = nil },
		"no handler": func(c *Consumer) { c.Handler = nil },
		"negative":   func(c *Consumer) { c.MaxPollRecords = -1 },
	} {
		c := e.consumer("c1")
		mutate(c)
		if err := c.Run(context.Background()); err == nil {
			t.Errorf("%s: got nil error", name)
		}
	}
}

func TestBackoff(t *testing.T) {
	for n, want := range map[int]time.Duration{0: 100 * time.Millisecond, 1: 100 * time.Millisecond, 3: 300 * time.Millisecond, 50: 5 * time.Second, 1000: 5 * time.Second} {
		if got := backoff(n); got != want {
			t.Errorf("backoff(%d): got %v, want %v", n, got, want)
		}
	}
}

func TestHandlerPanicPassedOn(t *testing.T) {
	e := newEnv(t, 0)
	e.publishTo(0, "ok")
	e.publishTo(0, "boom")
	c := e.consumer("c1")
	h := c.Handler
	c.Handler = func(ctx context.Context, rec *kgo.Record) error {
		if headerValue(rec, DefaultKeyHeader) == "boom" {
			panic("boom")
		}
		return h(ctx, rec)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	got := func() (v any) {
		defer func() { v = recover() }()
		c.Run(ctx)
		return nil
	}()
	if got != "boom" {
		t.Fatalf("Run: got panic %v, want boom", got)
	}
	// The record before the panic is done and committed; the key of the
	// panicking one is released, for the next member to take.
	if c, ok := e.cluster.GroupInfo(e.group).Commits[e.topic][0]; !ok || c.Offset != 1 {
		t.Errorf("committed %v, want offset 1 on partition 0", e.cluster.GroupInfo(e.group).Commits)
	}
	c2 := e.consumer("c2")
	c.Client.Close()
	e.start(c2)
	waitFor(t, "all records committed", e.settled)
	e.checkLedger([]string{"ok", "boom"})
}

// start runs c until the test ends, and returns a function that stops it
// and returns Run's error.
func (e *env) start(c *Consumer) (stop func() error) {
	return msgtest.Start(e.t, "consumer", waitLimit, c.Run, nil)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	msgtest.WaitFor(t, what, waitLimit, cond)
}

// TestFailedCommitRetried: the commit of a partition's last records fails
// once (a broker error, as while the connection is cut); with nothing
// more to poll on that partition, Run retries it, so the group's offset
// reaches the end rather than staying behind until the next rebalance.
func TestFailedCommitRetried(t *testing.T) {
	e := newEnv(t, 0)
	e.publishTo(0, "a")
	e.publishTo(0, "b")
	faulted := e.kfake().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Topic: e.topic, Count: 1, Err: kerr.UnknownServerError})
	var errs atomic.Int32
	c := e.consumer("c1")
	c.OnError = func(err error) { errs.Add(1); t.Logf("c1: %v", err) }
	e.start(c)
	waitFor(t, "the failed commit", func() bool { return faulted.Hits() == 1 && errs.Load() > 0 })
	waitFor(t, "all records committed", e.settled)
	e.checkLedger([]string{"a", "b"})
}

// TestNoCommitAfterThePartitionMoved: a member removed from the group
// while it works on a record (here: while OnResult runs) rejoins, and the
// partition's new owner commits past later records meanwhile; the first
// member's commit of its record, late, must not move the group's offset
// back (franz-go commits with the client's current generation, which the
// broker accepts for any partition).
func TestNoCommitAfterThePartitionMoved(t *testing.T) {
	e := newEnv(t, 0)
	e.publishTo(0, "a")
	e.publishTo(0, "b")
	blocked, release := make(chan struct{}), make(chan struct{})
	c1 := e.consumer("c1")
	c1.OnResult = func(rec *kgo.Record, res idemmsg.Result, err error) {
		if headerValue(rec, DefaultKeyHeader) == "b" {
			close(blocked)
			<-release // "b" is recorded, its commit not made
		}
	}
	stop1 := e.start(c1)
	<-blocked
	// The coordinator removes c1 (as after its session timeout).
	member, _ := c1.Client.GroupMetadata()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	leave := kmsg.NewPtrLeaveGroupRequest()
	leave.Group = e.group
	leave.Members = []kmsg.LeaveGroupRequestMember{{MemberID: member}}
	if _, err := leave.RequestWith(ctx, e.producer); err != nil {
		t.Fatal(err)
	}
	e.publishTo(0, "c")
	e.start(e.consumer("c2"))
	waitFor(t, "c2 to commit every record", e.settled)
	waitFor(t, "c1 to rejoin", func() bool { m, _ := c1.Client.GroupMetadata(); return m != "" && m != member })
	close(release)
	time.Sleep(500 * time.Millisecond) // c1's commit, if it makes one
	if err := stop1(); err != nil {
		t.Fatal(err)
	}
	e.checkLedger([]string{"a", "b", "c"})
}

// TestBatchDecidesEachRecordOnce: with Batch, a record InFlight stops its
// batch, and HandleBatch may still settle a later record that needs no
// handler (here Replayed); retrying from the stopped record must not
// decide that later one again (each retry reported it Replayed once more,
// and a dead-lettered one would be produced to the dead-letter topic
// again).
func TestBatchDecidesEachRecordOnce(t *testing.T) {
	e := newEnv(t, 0)
	g, err := idem.New(e.store, idem.Config{Lease: testLease})
	if err != nil {
		t.Fatal(err)
	}
	begin := func(msgKey string) *idem.Attempt {
		key, err := e.dedup.Key(msgKey)
		if err != nil {
			t.Fatal(err)
		}
		att, acq, err := g.Begin(context.Background(), key, idem.Fingerprint{})
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("Begin %s: got %v, %v", msgKey, acq.Outcome, err)
		}
		return att
	}
	if err := begin("done").Complete(context.Background(), &idem.Response{Status: idemmsg.StatusExecuted}); err != nil {
		t.Fatal(err)
	}
	busy := begin("busy") // another holder: InFlight until it completes
	e.publishTo(0, "busy")
	e.publishTo(0, "done")
	var inFlight atomic.Int32
	var mu sync.Mutex
	decisions := map[string][]idemmsg.Outcome{}
	c := e.consumer("c1")
	c.Batch = true
	c.OnResult = func(rec *kgo.Record, res idemmsg.Result, err error) {
		if res.Outcome == idemmsg.InFlight {
			inFlight.Add(1)
		}
		mu.Lock()
		k := headerValue(rec, DefaultKeyHeader)
		decisions[k] = append(decisions[k], res.Outcome)
		mu.Unlock()
	}
	e.start(c)
	waitFor(t, "three InFlight answers", func() bool { return inFlight.Load() >= 3 })
	if err := busy.Complete(context.Background(), &idem.Response{Status: idemmsg.StatusExecuted}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "all records committed", e.settled)
	mu.Lock()
	defer mu.Unlock()
	if got := decisions["done"]; len(got) != 1 || got[0] != idemmsg.Replayed {
		t.Errorf("decisions of the record after the InFlight one: got %v, want one Replayed", got)
	}
}
