package sqstest

import (
	"context"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
)

// TestBehaviour checks what the adapter relies on, and what the package
// documentation says of fauxqs: receive counts, visibility changes, stale
// receipt handles, FIFO groups and deduplication, and a restart with a
// data directory.
func TestBehaviour(t *testing.T) {
	s, err := Start(Options{Persist: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	ctx := context.Background()
	c := s.Client()
	q, err := s.CreateQueue(ctx, "std", map[string]string{"VisibilityTimeout": "30"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: &q, MessageBody: aws.String("a")}); err != nil {
		t.Fatal(err)
	}
	recv := func(q string, vis int32) []types.Message {
		t.Helper()
		out, err := c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: &q, MaxNumberOfMessages: 10, VisibilityTimeout: vis,
			MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameApproximateReceiveCount}})
		if err != nil {
			t.Fatal(err)
		}
		return out.Messages
	}
	m := recv(q, 30)
	if len(m) != 1 || m[0].Attributes["ApproximateReceiveCount"] != "1" {
		t.Fatalf("first receive: %+v", m)
	}
	old := m[0].ReceiptHandle
	// (0 would lose the message with a data directory: see the package
	// documentation.)
	if _, err := c.ChangeMessageVisibility(ctx, &sqs.ChangeMessageVisibilityInput{QueueUrl: &q, ReceiptHandle: old, VisibilityTimeout: 1}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	m = recv(q, 1)
	if len(m) != 1 || m[0].Attributes["ApproximateReceiveCount"] != "2" {
		t.Fatalf("second receive: %+v", m)
	}
	// A stale receipt handle: visibility change refused, delete silent.
	if _, err := c.ChangeMessageVisibility(ctx, &sqs.ChangeMessageVisibilityInput{QueueUrl: &q, ReceiptHandle: old, VisibilityTimeout: 5}); err == nil {
		t.Error("visibility change with a stale receipt handle succeeded")
	}
	if _, err := c.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: &q, ReceiptHandle: old}); err != nil {
		t.Errorf("delete with a stale receipt handle: %v", err)
	}
	time.Sleep(1100 * time.Millisecond)
	m = recv(q, 30)
	if len(m) != 1 || m[0].Attributes["ApproximateReceiveCount"] != "3" {
		t.Fatalf("third receive (after the visibility ended; the stale delete deleted nothing): %+v", m)
	}
	// A restart keeps the in-flight message and its receipt handle.
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: &q, ReceiptHandle: m[0].ReceiptHandle}); err != nil {
		t.Fatal(err)
	}
	attrs, err := c.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: &q, AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameAll}})
	if err != nil {
		t.Fatal(err)
	}
	if a := attrs.Attributes; a["ApproximateNumberOfMessages"] != "0" || a["ApproximateNumberOfMessagesNotVisible"] != "0" {
		t.Errorf("after delete across a restart: %v", a)
	}

	// FIFO: one message per group per receive, the group locked while one
	// is in flight; a repeated MessageDeduplicationId is dropped.
	f, err := s.CreateQueue(ctx, "f.fifo", nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, g := range []string{"g1", "g1", "g2", "g1"} {
		id := string(rune('a' + i))
		for range 2 {
			if _, err := c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: &f, MessageBody: aws.String(g + id),
				MessageGroupId: aws.String(g), MessageDeduplicationId: aws.String(id)}); err != nil {
				t.Fatal(err)
			}
		}
	}
	m = recv(f, 30)
	if len(m) != 2 || *m[0].Body != "g1a" || *m[1].Body != "g2c" {
		t.Fatalf("FIFO receive: got %d messages", len(m))
	}
	if again := recv(f, 30); len(again) != 0 {
		t.Fatalf("FIFO receive while both groups are locked: got %d messages", len(again))
	}
}
