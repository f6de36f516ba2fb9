package redisstream

import "github.com/redis/go-redis/v9"

// crashBeforeAck sets c's crash hook: f is called before an entry is
// acknowledged (XACK, and the dead-letter XADD before it), and false
// simulates a crash there: nothing more is acknowledged and Run returns
// errCrashed at once, leaving its entries pending for a claim. Production
// code only checks the hook for nil; it is a field rather than a package
// variable because the tests run a crashing consumer beside healthy ones.
func (c *Consumer) crashBeforeAck(f func(msg redis.XMessage) bool) { c.beforeAck = f }
