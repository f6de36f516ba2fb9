// Package sqs consumes an Amazon SQS queue with an idemmsg.Deduplicator.
package sqs
