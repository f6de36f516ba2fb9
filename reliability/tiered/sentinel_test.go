package tiered

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/tieredstore"
)

// TestSentinelFailover fails the Sentinel-managed Redis over under load,
// without WAIT. Completions written to the old primary between the
// promotion and its demotion are lost from Redis; on the plain Redis store
// their keys run again, on the tiered store they cannot commit again.
func TestSentinelFailover(t *testing.T) {
	kinds := []mode{tieredTx, redisPlain}
	if reltest.Long() {
		kinds = modes
	}
	for _, m := range kinds {
		t.Run(m.String(), func(t *testing.T) {
			set, err := redisserver.StartSentinelSet()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(set.Stop)
			h := newHarness(t, m, set.URL(), tieredstore.Options{RelayInterval: 200 * time.Millisecond, RelayDelay: 500 * time.Millisecond})
			start := time.Now()
			var took time.Duration
			tl := run(h, ms(500, 3000), ms(1000, 5000), func() {
				// SENTINEL FAILOVER; then, as in reliability/failover's
				// short run, the test demotes the old primary once every
				// sentinel names the new one (the sentinels do it ~8 s
				// later, in the long run).
				if err := set.Failover(!reltest.Long()); err != nil {
					t.Fatal(err)
				}
				took = time.Since(start)
			})
			if m == redisPlain {
				if tl.duplicates == 0 {
					t.Log("plain Redis: no duplicate effect after the failover (no completion landed on the old primary in the window)")
				}
			} else {
				assertTiered(t, tl)
			}
			h.report("Sentinel failover under load", "SENTINEL FAILOVER "+redisserver.SentinelMasterName+" without WAIT under load ("+strconv.Itoa(workers)+" workers)"+demotion(),
				tl, fmt.Sprintf("%s; fault took %v", tl.runs(m), took.Round(10*time.Millisecond)))
		})
	}
}

func demotion() string {
	if reltest.Long() {
		return "; the sentinel demotes the old primary ~8 s later"
	}
	return "; the test demotes the old primary once the sentinels name the new one"
}
