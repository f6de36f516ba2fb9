//go:build unix

package crash

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/childproc"
)

// ---------------------------------------------------------------------------
// The fencing ledger: the system of record the handlers write their effect
// to, in the parent process.

// report is one phase report of a handler.
type report struct {
	Key     string
	Token   uint64
	Inc     int
	Phase   string
	Applied bool
	Cause   string
}

// execution is one run of the handler for a key: one lease, one token.
type execution struct {
	key      string
	token    uint64
	inc      int
	phases   []string
	effects  int    // writes the ledger accepted
	refused  int    // writes the ledger refused as stale
	killedAt string // the phase at which the test killed its process on purpose
	cause    string // the zombie's context cause, as reported
}

type ledger struct {
	srv *httptest.Server

	mu       sync.Mutex
	max      map[string]uint64                // key → highest token seen
	accepted map[string][]uint64              // key → tokens of accepted writes, in order
	execs    map[string]map[uint64]*execution // key → token → run
	stale    int                              // stale writes refused
	// hook is called (without the lock) for every phase report, before
	// the answer; it may kill or pause the reporting process.
	hook func(report)
}

func newLedger(t *testing.T) *ledger {
	l := &ledger{max: map[string]uint64{}, accepted: map[string][]uint64{}, execs: map[string]map[uint64]*execution{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /apply", l.serveApply)
	mux.HandleFunc("POST /phase", l.servePhase)
	l.srv = httptest.NewServer(mux)
	t.Cleanup(l.srv.Close)
	return l
}

func (l *ledger) setHook(h func(report)) {
	l.mu.Lock()
	l.hook = h
	l.mu.Unlock()
}

// exec returns the run of (key, token); the caller holds l.mu.
func (l *ledger) exec(key string, token uint64, inc int) *execution {
	m := l.execs[key]
	if m == nil {
		m = map[uint64]*execution{}
		l.execs[key] = m
	}
	e := m[token]
	if e == nil {
		e = &execution{key: key, token: token, inc: inc}
		m[token] = e
	}
	return e
}

func parseReport(r *http.Request) (report, error) {
	q := r.URL.Query()
	token, err1 := strconv.ParseUint(q.Get("token"), 10, 64)
	inc, err2 := strconv.Atoi(q.Get("inc"))
	if err := errors.Join(err1, err2); err != nil || q.Get("key") == "" {
		return report{}, fmt.Errorf("bad report %q: %v", r.URL.RawQuery, err)
	}
	return report{Key: q.Get("key"), Token: token, Inc: inc, Phase: q.Get("phase"),
		Applied: q.Get("applied") == "true", Cause: q.Get("cause")}, nil
}

// serveApply accepts a write whose token is at least the largest seen for
// its key, and refuses (409) an older one.
func (l *ledger) serveApply(w http.ResponseWriter, r *http.Request) {
	rep, err := parseReport(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if !l.apply(rep.Key, rep.Token, rep.Inc) {
		http.Error(w, "stale fencing token", http.StatusConflict)
	}
}

// apply is the fencing check: it accepts the write of (key, token) when
// token is at least the largest seen for key, and reports whether it did.
func (l *ledger) apply(key string, token uint64, inc int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.exec(key, token, inc)
	if token < l.max[key] {
		e.refused++
		l.stale++
		return false
	}
	l.max[key] = token
	l.accepted[key] = append(l.accepted[key], token)
	e.effects++
	return true
}

func (l *ledger) servePhase(w http.ResponseWriter, r *http.Request) {
	rep, err := parseReport(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	l.mu.Lock()
	e := l.exec(rep.Key, rep.Token, rep.Inc)
	e.phases = append(e.phases, rep.Phase)
	if rep.Cause != "" {
		e.cause = rep.Cause
	}
	hook := l.hook
	l.mu.Unlock()
	if hook != nil {
		hook(rep)
	}
}

// markKilled records that the test killed e's process at phase on purpose.
func (l *ledger) markKilled(key string, token uint64, inc int, phase string) {
	l.mu.Lock()
	l.exec(key, token, inc).killedAt = phase
	l.mu.Unlock()
}

// snapshot returns a copy of the runs of key, by token.
func (l *ledger) runs(key string) []execution {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []execution
	for _, e := range l.execs[key] {
		c := *e
		c.phases = slices.Clone(e.phases)
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b execution) int {
		switch {
		case a.token < b.token:
			return -1
		case a.token > b.token:
			return 1
		}
		return 0
	})
	return out
}

func (l *ledger) acceptedTokens(key string) []uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.accepted[key])
}

func (l *ledger) staleRefused() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.stale
}

// ---------------------------------------------------------------------------
// Child server processes.

const (
	childStartTimeout = 20 * time.Second
	childReapTimeout  = 5 * time.Second
	restartDelay      = 30 * time.Millisecond
)

type child struct {
	inc  int
	slot int
	cmd  *exec.Cmd
	addr string
	done chan struct{} // closed once reaped
	logs *logBuf

	dead   bool // killed (or exited)
	paused bool // SIGSTOPped
}

// logBuf keeps a child's stderr, at most logCap bytes of it.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

const logCap = 1 << 20

func (b *logBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf.Len() < logCap {
		b.buf.Write(p[:min(len(p), logCap-b.buf.Len())])
	}
	return len(p), nil
}

func (b *logBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// cluster runs n child servers of one kind and restarts each one the test
// kills.
type cluster struct {
	t    *testing.T
	kind string
	env  []string

	mu       sync.Mutex
	slots    []*child // the live child of each slot; nil while it restarts
	byInc    map[int]*child
	all      []*child
	nextInc  int
	closing  bool
	restarts sync.WaitGroup
	kills    int
}

func startCluster(t *testing.T, kind, storeURL string, l *ledger, n int, lease, wait time.Duration) *cluster {
	t.Helper()
	c := &cluster{
		t: t, kind: kind, slots: make([]*child, n), byInc: map[int]*child{},
		env: []string{
			envChild + "=" + kind,
			envStoreURL + "=" + storeURL,
			envLedger + "=" + l.srv.URL,
			envLeaseMS + "=" + strconv.Itoa(int(lease.Milliseconds())),
			envWaitMS + "=" + strconv.Itoa(int(wait.Milliseconds())),
		},
	}
	t.Cleanup(c.close)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.start(i)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return c
}

// start launches a new incarnation in slot and waits until it listens.
func (c *cluster) start(slot int) error {
	c.mu.Lock()
	c.nextInc++
	inc := c.nextInc
	c.mu.Unlock()

	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer r.Close()
	ch := &child{inc: inc, slot: slot, done: make(chan struct{}), logs: &logBuf{}}
	ch.cmd = exec.Command(os.Args[0])
	ch.cmd.Env = append(append(os.Environ(), c.env...), envInc+"="+strconv.Itoa(inc))
	ch.cmd.Stdout = w
	ch.cmd.Stderr = ch.logs
	ch.cmd.SysProcAttr = childproc.SysProcAttr()
	err = ch.cmd.Start()
	w.Close()
	if err != nil {
		return fmt.Errorf("start child: %w", err)
	}
	go func() {
		ch.cmd.Wait()
		close(ch.done)
	}()
	c.mu.Lock()
	c.all = append(c.all, ch)
	c.byInc[inc] = ch
	c.mu.Unlock()

	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(r).ReadString('\n')
		line <- s
	}()
	select {
	case s := <-line:
		addr, ok := strings.CutPrefix(strings.TrimSpace(s), "LISTEN ")
		if !ok {
			c.kill(ch)
			return fmt.Errorf("child %d did not start (%q):\n%s", inc, s, ch.logs)
		}
		ch.addr = addr
	case <-time.After(childStartTimeout):
		c.kill(ch)
		return fmt.Errorf("child %d: no LISTEN line within %v:\n%s", inc, childStartTimeout, ch.logs)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closing {
		ch.dead = true
		ch.cmd.Process.Kill()
		return nil
	}
	c.slots[slot] = ch
	return nil
}

// kill SIGKILLs ch (resuming it first if paused) and waits, bounded, for
// it to be reaped.
func (c *cluster) kill(ch *child) {
	c.mu.Lock()
	ch.dead = true
	c.mu.Unlock()
	ch.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-ch.done:
	case <-time.After(childReapTimeout):
		c.t.Errorf("child %d not reaped %v after SIGKILL", ch.inc, childReapTimeout)
	}
}

// crash SIGKILLs incarnation inc, if it is still alive, and restarts its
// slot in the background. It reports whether it killed it.
func (c *cluster) crash(inc int) bool {
	c.mu.Lock()
	ch := c.byInc[inc]
	if ch == nil || ch.dead {
		c.mu.Unlock()
		return false
	}
	ch.dead = true
	c.kills++
	if c.slots[ch.slot] == ch {
		c.slots[ch.slot] = nil
	}
	restart := !c.closing
	if restart {
		c.restarts.Add(1)
	}
	c.mu.Unlock()
	c.kill(ch)
	if restart {
		go func() {
			defer c.restarts.Done()
			time.Sleep(restartDelay)
			if err := c.start(ch.slot); err != nil {
				c.t.Errorf("restart of slot %d: %v", ch.slot, err)
			}
		}()
	}
	return true
}

// crashRandom kills a random live child; it reports the incarnation
// killed, or 0 if none was alive.
func (c *cluster) crashRandom() int {
	c.mu.Lock()
	var live []int
	for _, ch := range c.slots {
		if ch != nil && !ch.dead && !ch.paused {
			live = append(live, ch.inc)
		}
	}
	c.mu.Unlock()
	if len(live) == 0 {
		return 0
	}
	inc := live[rand.N(len(live))]
	if !c.crash(inc) {
		return 0
	}
	return inc
}

// pause and resume send SIGSTOP and SIGCONT to incarnation inc.
func (c *cluster) pause(inc int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.byInc[inc]
	if ch == nil || ch.dead {
		return fmt.Errorf("child %d is not running", inc)
	}
	ch.paused = true
	return ch.cmd.Process.Signal(syscall.SIGSTOP)
}

func (c *cluster) resume(inc int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.byInc[inc]
	if ch == nil || ch.dead {
		return fmt.Errorf("child %d is not running", inc)
	}
	ch.paused = false
	return ch.cmd.Process.Signal(syscall.SIGCONT)
}

// killed reports whether incarnation inc was killed.
func (c *cluster) killed(inc int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.byInc[inc]
	return ch != nil && ch.dead
}

// slotChild returns the live incarnation of slot (0 while restarting).
func (c *cluster) slotChild(slot int) (inc int, addr string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if ch := c.slots[slot]; ch != nil {
		return ch.inc, ch.addr
	}
	return 0, ""
}

// pick returns the address of a random live, running child.
func (c *cluster) pick() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var addrs []string
	for _, ch := range c.slots {
		if ch != nil && !ch.dead && !ch.paused {
			addrs = append(addrs, ch.addr)
		}
	}
	if len(addrs) == 0 {
		return ""
	}
	return addrs[rand.N(len(addrs))]
}

func (c *cluster) logs(inc int) string {
	c.mu.Lock()
	ch := c.byInc[inc]
	c.mu.Unlock()
	if ch == nil {
		return ""
	}
	return ch.logs.String()
}

func (c *cluster) killCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.kills
}

// close stops restarting, kills every child and checks their logs for
// data races.
func (c *cluster) close() {
	c.mu.Lock()
	c.closing = true
	c.mu.Unlock()
	c.restarts.Wait()
	c.mu.Lock()
	all := slices.Clone(c.all)
	c.mu.Unlock()
	for _, ch := range all {
		ch.cmd.Process.Signal(syscall.SIGKILL)
	}
	for _, ch := range all {
		select {
		case <-ch.done:
		case <-time.After(childReapTimeout):
			c.t.Errorf("child %d not reaped", ch.inc)
		}
		logs := ch.logs.String()
		if strings.Contains(logs, "DATA RACE") {
			c.t.Errorf("child %d reported a data race:\n%s", ch.inc, logs)
		}
		for line := range strings.Lines(logs) {
			if strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") {
				c.t.Logf("child %d: %s", ch.inc, strings.TrimSpace(line))
			}
		}
	}
}

// ---------------------------------------------------------------------------
// Clients.

// errStats counts what clients saw besides success, attempt by attempt.
type errStats struct {
	mu       sync.Mutex
	m        map[string]int
	attempts atomic.Int64
}

func (s *errStats) add(kind string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]int{}
	}
	s.m[kind]++
}

func (s *errStats) snapshot() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps(s.m)
}

func maps(m map[string]int) map[string]int {
	out := make(map[string]int, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// classify names a transport error.
func classify(err error) string {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "conn refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "conn reset"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "EOF"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	return "net error"
}

// pickRT sends each attempt to a random live child and counts the outcome.
type pickRT struct {
	c     *cluster
	base  *http.Transport
	stats *errStats
}

func (p *pickRT) RoundTrip(req *http.Request) (*http.Response, error) {
	p.stats.attempts.Add(1)
	addr := p.c.pick()
	if addr == "" {
		if req.Body != nil {
			req.Body.Close()
		}
		p.stats.add("no live server")
		time.Sleep(20 * time.Millisecond)
		return nil, errors.New("no live server")
	}
	r := req.Clone(req.Context())
	r.URL.Host, r.Host = addr, addr
	resp, err := p.base.RoundTrip(r)
	switch {
	case err != nil:
		p.stats.add(classify(err))
	case resp.StatusCode != http.StatusOK:
		p.stats.add(strconv.Itoa(resp.StatusCode))
	}
	return resp, err
}

// clients send requests with idemhttp.Transport (same key and body on
// every retry) through pickRT.
type clients struct {
	c     *cluster
	stats *errStats
	hc    *http.Client
	base  *http.Transport
}

func newClients(t *testing.T, c *cluster) *clients {
	stats := &errStats{}
	base := &http.Transport{MaxIdleConnsPerHost: 16, ResponseHeaderTimeout: 15 * time.Second}
	t.Cleanup(base.CloseIdleConnections)
	tr := &idemhttp.Transport{
		Base:        &pickRT{c: c, base: base, stats: stats},
		MaxAttempts: 1000,
		MaxElapsed:  40 * time.Second,
		MinBackoff:  20 * time.Millisecond,
		MaxBackoff:  300 * time.Millisecond,
	}
	return &clients{c: c, stats: stats, hc: &http.Client{Transport: tr}, base: base}
}

// result is the final answer a client got for a key.
type result struct {
	body     []byte
	ans      answer
	replayed bool
}

// send sends key until it gets 200 or ctx ends.
func (cl *clients) send(ctx context.Context, key string) (result, error) {
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://child"+route, strings.NewReader(key))
		if err != nil {
			return result{}, err
		}
		req.Header.Set(idemhttp.HeaderKey, key)
		req.Header.Set("Content-Type", "text/plain")
		resp, err := cl.hc.Do(req)
		if err == nil {
			body, rerr := io.ReadAll(resp.Body)
			resp.Body.Close()
			if rerr == nil && resp.StatusCode == http.StatusOK {
				var a answer
				if err := json.Unmarshal(body, &a); err != nil {
					return result{}, fmt.Errorf("key %s: bad answer %q: %v", key, body, err)
				}
				return result{body: body, ans: a, replayed: resp.Header.Get(idemhttp.HeaderReplayed) == "true"}, nil
			}
			if rerr != nil {
				err = rerr
			} else {
				err = fmt.Errorf("status %s: %s", resp.Status, bytes.TrimSpace(body))
			}
		}
		if ctx.Err() != nil {
			return result{}, fmt.Errorf("key %s: no answer before the deadline; last: %v", key, err)
		}
		cl.stats.add("client retried after giving up")
		time.Sleep(50 * time.Millisecond)
	}
}

// sendOnce sends key once to a random live child, without retries.
func (cl *clients) sendOnce(ctx context.Context, key string) error {
	addr := cl.c.pick()
	if addr == "" {
		return errors.New("no live server")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+route, strings.NewReader(key))
	if err != nil {
		return err
	}
	req.Header.Set(idemhttp.HeaderKey, key)
	req.Header.Set("Content-Type", "text/plain")
	cl.stats.attempts.Add(1)
	resp, err := cl.base.RoundTrip(req)
	if err != nil {
		cl.stats.add(classify(err))
		return err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		cl.stats.add(strconv.Itoa(resp.StatusCode))
	}
	return nil
}

// run sends keys dup times at once each, workers keys at a time, and
// returns the answer of each key sent (the first 200 it got; the others
// must carry the same body). It sends at least min keys, and goes on with
// the rest only until more is closed.
func (cl *clients) run(t *testing.T, ctx context.Context, keys []string, minKeys int, more <-chan struct{}, dup, workers int) (answers map[string]result, fed int) {
	t.Helper()
	var (
		mu  sync.Mutex
		out = map[string]result{}
		wg  sync.WaitGroup
		ch  = make(chan string)
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for key := range ch {
				res := make([]result, dup)
				errs := make([]error, dup)
				var kwg sync.WaitGroup
				for i := range dup {
					kwg.Add(1)
					go func() {
						defer kwg.Done()
						res[i], errs[i] = cl.send(ctx, key)
					}()
				}
				kwg.Wait()
				mu.Lock()
				for i := range dup {
					if errs[i] != nil {
						t.Errorf("client: %v", errs[i])
						continue
					}
					if prev, ok := out[key]; ok && !bytes.Equal(prev.body, res[i].body) {
						t.Errorf("key %s: two clients got different answers: %s and %s", key, prev.body, res[i].body)
					}
					if _, ok := out[key]; !ok {
						out[key] = res[i]
					}
				}
				mu.Unlock()
			}
		}()
	}
feed:
	for i, k := range keys {
		if i >= minKeys {
			select {
			case <-more:
				break feed
			default:
			}
		}
		select {
		case ch <- k:
			fed++
		case <-ctx.Done():
			break feed
		}
	}
	close(ch)
	wg.Wait()
	return out, fed
}
