package waiters

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// A holder's Wake hands its Result to every request waiting on the key,
// and only to those; For gives the response only for the same
// fingerprint.
func TestWakeHandsResult(t *testing.T) {
	var w Set
	key, _ := idem.Scope{}.Key("k")
	other, _ := idem.Scope{}.Key("other")
	res := &Result{Fingerprint: idem.Fingerprint{1}, Response: &idem.Response{Status: 201}}

	const n = 8
	var wg sync.WaitGroup
	got := make([]*Result, n)
	for i := range n {
		wg.Go(func() {
			live, r := w.Wait(context.Background(), key, time.Minute, time.Minute)
			if !live {
				t.Error("Wait: not live")
			}
			got[i] = r
		})
	}
	otherDone := make(chan *Result, 1)
	go func() {
		_, r := w.Wait(context.Background(), other, 200*time.Millisecond, 0)
		otherDone <- r
	}()
	for waiting(&w, key) < n || waiting(&w, other) < 1 {
		time.Sleep(time.Millisecond)
	}
	w.Wake(key, res)
	wg.Wait()
	for i, r := range got {
		if r != res {
			t.Errorf("waiter %d: got %v, want the holder's result", i, r)
		}
	}
	if r := <-otherDone; r != nil {
		t.Errorf("a waiter on another key got %v, want nil (it timed out)", r)
	}
	if resp := res.For(idem.Fingerprint{1}); resp != res.Response {
		t.Errorf("For(same fingerprint) = %v, want the response", resp)
	}
	if resp := res.For(idem.Fingerprint{2}); resp != nil {
		t.Errorf("For(another fingerprint) = %v, want nil: that request must ask the store (mismatch)", resp)
	}
	if resp := (*Result)(nil).For(idem.Fingerprint{1}); resp != nil {
		t.Errorf("nil Result: For = %v, want nil", resp)
	}

	// Woken without a result (released, not stored): nil, ask the store.
	done := make(chan *Result, 1)
	go func() { _, r := w.Wait(context.Background(), key, time.Minute, time.Minute); done <- r }()
	for waiting(&w, key) < 1 {
		time.Sleep(time.Millisecond)
	}
	w.Wake(key, nil)
	if r := <-done; r != nil {
		t.Errorf("woken without a result: got %v, want nil", r)
	}
}

// waiting returns how many requests wait on key.
func waiting(w *Set, key idem.Key) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if l := w.keys[key]; l != nil {
		return l.n
	}
	return 0
}

// A key held in this process is waited for until its holder's Wake, not
// for the polling pause; each Hold is ended by one Wake, and nothing stays
// behind once the last one is.
func TestHeldKeyWaitsForWake(t *testing.T) {
	var w Set
	key, _ := idem.Scope{}.Key("held")
	res := &Result{Fingerprint: idem.Fingerprint{1}, Response: &idem.Response{Status: 201}}
	w.Hold(key, idem.Fingerprint{})
	w.Hold(key, idem.Fingerprint{}) // a second holder (a takeover in this process)
	done := make(chan *Result, 1)
	go func() { _, r := w.Wait(context.Background(), key, time.Millisecond, time.Minute); done <- r }()
	for waiting(&w, key) < 1 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // far past the polling pause
	select {
	case r := <-done:
		t.Fatalf("Wait returned (%v) after the polling pause while the key is held", r)
	default:
	}
	w.Wake(key, res)
	if r := <-done; r != res {
		t.Fatalf("got %v, want the holder's result", r)
	}
	// One holder left: still held.
	go func() { _, r := w.Wait(context.Background(), key, time.Millisecond, time.Minute); done <- r }()
	for waiting(&w, key) < 1 {
		time.Sleep(time.Millisecond)
	}
	w.Wake(key, nil)
	if r := <-done; r != nil {
		t.Fatalf("got %v, want nil (released)", r)
	}
	// No holder: the polling pause applies.
	go func() { _, r := w.Wait(context.Background(), key, time.Millisecond, time.Minute); done <- r }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Wait on a key no longer held waited for a holder: a Hold outlived its Wake")
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.holds) != 0 || len(w.keys) != 0 {
		t.Errorf("left behind: %d holds, %d wait lists, want none", len(w.holds), len(w.keys))
	}
}

// JoinOrAsk lets the first request for a key ask the store and makes the
// copies of it (same fingerprint) wait for its Answer: a replay is handed
// to them; an acquired key makes them wait for the holder's Wake and get
// its result; nil sends them to the store. A request of another
// fingerprint neither waits nor asks for others.
func TestJoinOrAsk(t *testing.T) {
	var w Set
	key, _ := idem.Scope{}.Key("joined")
	fp, other := idem.Fingerprint{1}, idem.Fingerprint{2}
	res := &Result{Fingerprint: fp, Response: &idem.Response{Status: 201}}
	type joined struct {
		j    Joined
		live bool
		res  *Result
	}
	const copies = 5
	copiesOf := func() chan joined {
		done := make(chan joined, copies)
		for range copies {
			go func() {
				j, live, r := w.JoinOrAsk(context.Background(), key, fp, time.Minute)
				done <- joined{j, live, r}
			}()
		}
		for w.Waiting() < copies {
			time.Sleep(time.Millisecond)
		}
		return done
	}
	for _, c := range []struct {
		name     string
		res      *Result
		acquired bool
	}{{"replay", res, false}, {"nothing", nil, false}, {"acquired", res, true}} {
		if j, _, _ := w.JoinOrAsk(context.Background(), key, fp, time.Minute); j != Asking {
			t.Fatalf("%s: first request: %v, want Asking", c.name, j)
		}
		if j, _, _ := w.JoinOrAsk(context.Background(), key, other, time.Minute); j != Neither {
			t.Fatalf("%s: another fingerprint: %v, want Neither", c.name, j)
		}
		done := copiesOf()
		w.Answer(key, fp, c.res, c.acquired)
		if c.acquired {
			// Now they wait for the holder, which hands them its result.
			select {
			case j := <-done:
				t.Fatalf("acquired: a copy returned %+v before the holder's Wake", j)
			case <-time.After(50 * time.Millisecond):
			}
			// A request of another fingerprint does not wait for the
			// holder either: it goes to the store at once (a mismatch).
			if j, _, _ := w.JoinOrAsk(context.Background(), key, other, 10*time.Millisecond); j != Neither {
				t.Fatalf("acquired: another fingerprint while held: %v, want Neither", j)
			}
			w.Wake(key, res)
		}
		for range copies {
			if j := <-done; j.j != Waited || !j.live || j.res != c.res {
				t.Fatalf("%s: copy: got %+v, want Waited, live and %v", c.name, j, c.res)
			}
		}
	}

	// The wait ends when d passes or ctx ends, the ask unanswered.
	if j, _, _ := w.JoinOrAsk(context.Background(), key, fp, time.Minute); j != Asking {
		t.Fatalf("after the answers: %v, want Asking (nothing of the earlier asks left)", j)
	}
	if j, live, r := w.JoinOrAsk(context.Background(), key, fp, 10*time.Millisecond); j != Waited || !live || r != nil {
		t.Fatalf("past d: got %v, %v, %v; want Waited, live, no result", j, live, r)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if j, live, _ := w.JoinOrAsk(ctx, key, fp, time.Minute); j != Waited || live {
		t.Fatalf("cancelled context: got %v, live %v; want Waited, not live", j, live)
	}
	// An ask does not count as a hold: a poller's pause stays short.
	start := time.Now()
	w.Wait(context.Background(), key, 5*time.Millisecond, time.Minute)
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("Wait took %v while the key was only asked about: it waited as for a holder", took)
	}
	w.Answer(key, fp, nil, false)
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.holds) != 0 || len(w.keys) != 0 || len(w.asks) != 0 {
		t.Errorf("left behind: %d holds, %d wait lists, %d asks, want none", len(w.holds), len(w.keys), len(w.asks))
	}
}

// AnswerReplay hands the store's replay to the copies waiting for the
// asker, one Result for all of them, as Answer with that Result does; with
// no copy waiting it only ends the ask.
func TestAnswerReplay(t *testing.T) {
	var w Set
	key, _ := idem.Scope{}.Key("replayed")
	fp := idem.Fingerprint{1}
	resp := &idem.Response{Status: 201}
	if j, _, _ := w.JoinOrAsk(context.Background(), key, fp, time.Minute); j != Asking {
		t.Fatalf("first request: %v, want Asking", j)
	}
	const copies = 3
	done := make(chan *Result, copies)
	for range copies {
		go func() {
			j, live, r := w.JoinOrAsk(context.Background(), key, fp, time.Minute)
			if j != Waited || !live {
				t.Errorf("copy: %v, live %v; want Waited, live", j, live)
			}
			done <- r
		}()
	}
	for w.Waiting() < copies {
		time.Sleep(time.Millisecond)
	}
	w.AnswerReplay(key, fp, resp)
	first := <-done
	if first == nil || first.Fingerprint != fp || first.Response != resp {
		t.Fatalf("copy: got %+v, want the replay under fp", first)
	}
	for range copies - 1 {
		if r := <-done; r != first {
			t.Fatalf("copies got different Results: %p and %p", r, first)
		}
	}
	// No copy: the ask ends, nothing is left behind.
	if j, _, _ := w.JoinOrAsk(context.Background(), key, fp, time.Minute); j != Asking {
		t.Fatalf("after the answer: %v, want Asking", j)
	}
	w.AnswerReplay(key, fp, resp)
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.holds) != 0 || len(w.keys) != 0 || len(w.asks) != 0 {
		t.Errorf("left behind: %d holds, %d wait lists, %d asks, want none", len(w.holds), len(w.keys), len(w.asks))
	}
}

// Asking and answering, with no copy waiting, allocates nothing once the
// maps exist (issue 36).
func TestAskAllocs(t *testing.T) {
	var w Set
	key, _ := idem.Scope{}.Key("allocs")
	fp := idem.Fingerprint{1}
	resp := &idem.Response{Status: 201}
	w.JoinOrAsk(context.Background(), key, fp, time.Minute)
	w.Answer(key, fp, nil, true)
	w.Wake(key, nil)
	if n := testing.AllocsPerRun(100, func() {
		w.JoinOrAsk(context.Background(), key, fp, time.Minute)
		w.AnswerReplay(key, fp, resp)
		w.JoinOrAsk(context.Background(), key, fp, time.Minute)
		w.Answer(key, fp, nil, false)
		w.JoinOrAsk(context.Background(), key, fp, time.Minute)
		w.Answer(key, fp, nil, true)
		w.Wake(key, nil)
	}); n != 0 {
		t.Errorf("%v allocations per ask, want 0", n)
	}
}
