package sidecar

import (
	"strings"
	"testing"
)

// TestParseSize: a bare number is bytes (idem proxy v1.0's --max-body 10
// is ten bytes), a unit is one of sizeUnits as written; everything else
// is refused with SizeWant.
func TestParseSize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int64
		str  string // FormatSize
	}{
		{"1", 1, "1"}, {"10", 10, "10"}, {"0", 0, "0"}, {"1048576", 1 << 20, "1MiB"}, {" 1000 ", 1000, "1000"},
		{"10B", 10, "10"}, {"64KiB", 64 << 10, "64KiB"}, {"1 MiB", 1 << 20, "1MiB"}, {"3GiB", 3 << 30, "3GiB"},
		{"512KB", 512e3, "500KiB"}, {"10MB", 10e6, "10000000"}, {"2GB", 2e9, "1953125KiB"}, {"1536KiB", 1536 << 10, "1536KiB"},
	} {
		got, err := ParseSize(c.in)
		if err != nil || got != c.want || FormatSize(got) != c.str {
			t.Errorf("ParseSize(%q): got %d (formatted %q), %v; want %d (%q)", c.in, got, FormatSize(got), err, c.want, c.str)
		}
		if back, err := ParseSize(FormatSize(got)); err != nil || back != got { // the proxy's -h shows FormatSize
			t.Errorf("ParseSize(FormatSize(%d)) = %d, %v; want it back", got, back, err)
		}
	}
	for _, in := range []string{"", " ", "-1", "1.5MiB", "MiB", "B", "1TiB", "1mb", "1kib", "64K", "1M", "1 M B", "0x10",
		"9223372036854775807KiB", "4611686018427387905", "1e6"} {
		got, err := ParseSize(in)
		if err == nil || err.Error() != SizeWant {
			t.Errorf("ParseSize(%q): got %d, %v; want the error %q", in, got, err, SizeWant)
		}
	}
	if !strings.Contains(SizeWant, "number of bytes") || !strings.Contains(SizeWant, "KiB") {
		t.Errorf("SizeWant %q does not say that a bare number is bytes and which units there are", SizeWant)
	}
}
