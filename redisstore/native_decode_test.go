package redisstore

import (
	"context"
	"testing"

	"github.com/redis/rueidis"

	"github.com/idemkit/idem/internal/redisserver"
)

// TestRueidisValDecodes: the native path's decoding of rueidis replies
// gives each type its value, and a string reply (a record, a SET's OK)
// costs one allocation, its bytes: no failed conversion on the way (a
// string tried as an integer and as an array cost five more, and the
// fmt.Errorf of the array's error showed in consumer profiles).
func TestRueidisValDecodes(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	msg := func(cmd rueidis.Completed) rueidis.RedisMessage {
		t.Helper()
		m, err := c.Do(ctx, cmd).ToMessage()
		if err != nil && !rueidis.IsRedisNil(err) {
			t.Fatal(err)
		}
		return m
	}
	ok := msg(c.B().Arbitrary("SET").Keys("k").Args("record", "PX", "60000").Build())
	rec := msg(c.B().Get().Key("k").Build())
	pttl := msg(c.B().Pttl().Key("k").Build())
	now := msg(c.B().Time().Build())

	if v := rueidisVal(&ok); string(v.b) != "OK" || v.arr != nil || v.null || v.err != nil {
		t.Errorf("SET: got %+v, want OK", v)
	}
	if v := rueidisVal(&rec); string(v.b) != "record" || v.arr != nil {
		t.Errorf("GET: got %+v, want the bytes record", v)
	}
	if v := rueidisVal(&pttl); v.n <= 0 || v.n > 60000 || v.b != nil {
		t.Errorf("PTTL: got %+v, want 1 to 60000", v)
	}
	if v := rueidisVal(&now); len(v.arr) != 2 || len(v.arr[0].b) == 0 || len(v.arr[1].b) == 0 {
		t.Errorf("TIME: got %+v, want two strings", v)
	}
	for name, m := range map[string]*rueidis.RedisMessage{"SET's OK": &ok, "GET's record": &rec} {
		if n := testing.AllocsPerRun(100, func() { rueidisVal(m) }); n > 1 {
			t.Errorf("decoding %s: got %v allocations, want 1 (its bytes)", name, n)
		}
	}
	if n := testing.AllocsPerRun(100, func() { rueidisVal(&pttl) }); n != 0 {
		t.Errorf("decoding PTTL's integer: got %v allocations, want 0", n)
	}
}
