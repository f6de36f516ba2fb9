package redisserver

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// CPUTime returns the CPU time, user plus system (used_cpu_user and
// used_cpu_sys of INFO cpu), that the server c talks to has used so far.
// Benchmarks take it before and after the timed part to report the
// server's share of the work.
func CPUTime(ctx context.Context, c *redis.Client) (time.Duration, error) {
	info, err := c.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, fmt.Errorf("redisserver: INFO cpu: %w", err)
	}
	var total float64
	for _, field := range []string{"used_cpu_user", "used_cpu_sys"} {
		v, ok := InfoField(info, field)
		if !ok {
			return 0, fmt.Errorf("redisserver: INFO cpu has no %s", field)
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, fmt.Errorf("redisserver: INFO cpu: %s: %w", field, err)
		}
		total += f
	}
	return time.Duration(total * float64(time.Second)), nil
}
