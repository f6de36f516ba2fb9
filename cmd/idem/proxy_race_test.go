//go:build race

package main

// The proxy binary the end-to-end tests run is built with -race too.
func init() { proxyRace = true }
