package mysqlstore

// SetAfterDraw makes s call f with each token Acquire draws, between the
// draw and the statement that inserts or takes the record over: tests
// interleave other calls there.
func SetAfterDraw(s *Store, f func(drawn int64)) { s.afterDraw = f }

// ParseURL is parseURL, Open's reading of its URL.
var ParseURL = parseURL
