// Package perkey runs a batch's entries the way idem.BatchStore's
// contract orders them when a store has no batch call of its own: the
// entries of one key one after the other in batch order, different keys
// side by side.
package perkey

import "sync"

// Run calls call(j) for every j in [0, n): the entries whose key(j) is
// the same one after the other in order of j, different keys side by
// side, at most limit keys at a time. It returns when every call has.
// call may run on several goroutines at once.
func Run[K comparable](n int, key func(j int) K, limit int, call func(j int)) {
	if n == 1 {
		call(0)
		return
	}
	byKey := make(map[K][]int, n)
	order := make([]K, 0, n)
	for j := range n {
		k := key(j)
		if _, ok := byKey[k]; !ok {
			order = append(order, k)
		}
		byKey[k] = append(byKey[k], j)
	}
	sem := make(chan struct{}, max(limit, 1))
	var wg sync.WaitGroup
	for _, k := range order {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			for _, j := range byKey[k] {
				call(j)
			}
		})
	}
	wg.Wait()
}
