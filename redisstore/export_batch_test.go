package redisstore

// KeySlot is keySlot, for the tests of package redisstore_test.
var KeySlot = keySlot
