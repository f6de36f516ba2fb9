package rabbitmq

import amqp "github.com/rabbitmq/amqp091-go"

// crashBeforeAck sets c's crash hook: f is called before a delivery is
// settled (acked, rejected or requeued), and false simulates a crash there: Run
// returns errCrashed at once, leaving its deliveries unacknowledged.
// Production code only checks the hook for nil; it is a field rather than
// a package variable because the tests run a crashing consumer beside
// healthy ones.
func (c *Consumer) crashBeforeAck(f func(d amqp.Delivery) bool) { c.beforeAck = f }

// watchTracker has f receive the ackTracker of c's Batch runs.
func (c *Consumer) watchTracker(f func(*ackTracker)) { c.onTracker = f }
