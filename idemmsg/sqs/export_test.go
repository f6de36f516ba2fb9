package sqs

import "github.com/aws/aws-sdk-go-v2/service/sqs/types"

// crashBeforeAck sets c's crash hook: f is called before a message is
// acknowledged (deleted, and sent to the dead-letter queue before that),
// and false simulates a crash there: nothing more is settled, no
// visibility is extended or handed back, and Run returns errCrashed at
// once, leaving its messages to come back after their visibility.
func (c *Consumer) crashBeforeAck(f func(msg types.Message) bool) { c.beforeAck = f }
