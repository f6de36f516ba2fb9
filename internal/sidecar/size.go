package sidecar

import (
	"errors"
	"strconv"
	"strings"
)

// SizeWant says what a size setting takes, for its error: the same words
// for idem proxy's flags and --config file and for Caddy's subdirectives.
const SizeWant = "want a size: a number of bytes (1048576), or one with a unit, " +
	"B, KiB, MiB, GiB (of 1024) or KB, MB, GB (of 1000), such as 64KiB or 1MiB"

// sizeUnits are the units ParseSize takes, written as they must be
// (case matters: mb would be millibits). FormatSize uses the first three.
var sizeUnits = []struct {
	suffix string
	n      int64
}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"B", 1}}

// ParseSize reads a size in bytes, the rule of every size setting of idem
// proxy and Caddy (--max-body, max_body, memory_limit, quota_bytes, ...):
// a whole number is a number of bytes (as idem proxy v1.0 took it:
// "--max-body 10" is ten bytes), and a whole number with a unit of
// sizeUnits (a space between them allowed) is that many units. Anything
// else, a fraction, a negative number or more than 2^62 bytes is an error
// that says SizeWant.
func ParseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range sizeUnits {
		if num, ok := strings.CutSuffix(s, u.suffix); ok {
			s, mult = strings.TrimSpace(num), u.n
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return 0, errors.New(SizeWant)
	}
	return n * mult, nil
}

// FormatSize writes n in the largest binary unit that divides it (1MiB,
// 64KiB), else as a number of bytes; ParseSize reads it back.
func FormatSize(n int64) string {
	for i := 2; i >= 0; i-- { // GiB, MiB, KiB
		if u := sizeUnits[i]; n >= u.n && n%u.n == 0 {
			return strconv.FormatInt(n/u.n, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}
