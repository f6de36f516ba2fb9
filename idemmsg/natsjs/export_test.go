package natsjs

import "github.com/nats-io/nats.go/jetstream"

// crashBeforeAck sets c's crash hook: f is called before a message is
// settled (acked, naked, terminated or dead-lettered), and false
// simulates a crash there: nothing more is settled and Run returns
// errCrashed at once, leaving its messages for redelivery after AckWait.
// Production code only checks the hook for nil; it is a field rather than
// a package variable because the tests run a crashing consumer beside
// healthy ones.
func (c *Consumer) crashBeforeAck(f func(msg jetstream.Msg) bool) { c.beforeAck = f }
