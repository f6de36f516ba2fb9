package idemhttp

import (
	"testing"
	"time"
)

func TestISODuration(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{24 * time.Hour, "PT24H"},
		{30 * time.Minute, "PT30M"},
		{90 * time.Minute, "PT1H30M"},
		{90 * time.Second, "PT1M30S"},
		{72 * time.Hour, "PT72H"},
		{time.Hour + time.Second, "PT1H1S"},
		{1500 * time.Millisecond, "PT1S"},
		{59*time.Second + 999*time.Millisecond, "PT59S"},
		{999 * time.Millisecond, "PT0S"},
		{time.Millisecond, "PT0S"},
	} {
		if got := isoDuration(c.d); got != c.want {
			t.Errorf("isoDuration(%v) = %q, want %q", c.d, got, c.want)
		}
	}
}
