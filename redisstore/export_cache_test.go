package redisstore

import (
	"time"

	"github.com/idemkit/idem"
)

// HintLeft is how long s's replay cache will read key through the
// tracked cache (0: it runs the script).
func HintLeft(s *Store, key idem.Key) time.Duration { return s.cache.ttl(s.KeyName(key)) }

// OnHint makes f run each time s learns of a completion (its Complete, or
// an acquire script answering replay), before the replay cache notes it.
func OnHint(s *Store, f func()) { s.cache.hintHook = f }

// OnForget makes f run each time s forgets a record it deletes or
// overwrites (before and after the change: Delete, Fill).
func OnForget(s *Store, f func()) { s.cache.forgetHook = f }
