// Package dynamostore is an idem.Store on Amazon DynamoDB (aws-sdk-go-v2):
// one item per record, every transition one conditional write (UpdateItem
// with a ConditionExpression) and one round trip; Delete is one DeleteItem.
//
// # The table
//
// One table with a string partition key named "pk" (CreateTable makes it,
// on-demand). Turn on DynamoDB TTL on the attribute "ttl" (EnableTTL) so
// that records end up deleted; the store never relies on it: an item whose
// "expires" has passed is absent for every method, whether TTL has deleted
// it yet or not (TTL deletes within days, not at the second).
//
// # Options
//
// New checks its options and makes no request: Options.Table (a table
// name or ARN) is required; Options.Namespace, prepended to every
// partition key, lets several stores share a table; Options.ClockSkew and
// Options.Clock are the time rules below. A bad value is an error naming
// the option and what it must be.
//
// # A local endpoint
//
// Against DynamoDB Local, dynalite or LocalStack, the client needs four
// settings that AWS would otherwise supply: the endpoint
// (AWS_ENDPOINT_URL=http://localhost:8000 for config.LoadDefaultConfig,
// or BaseEndpoint in dynamodb.Options), a region (AWS_REGION or
// config.WithRegion; any one), static credentials (AWS_ACCESS_KEY_ID and
// AWS_SECRET_ACCESS_KEY, or config.WithCredentialsProvider; any ones), and
// AWS_EC2_METADATA_DISABLED=true. Without credentials every call fails
// with "no EC2 IMDS role found", after the SDK has tried the instance
// metadata address; the last setting makes that failure immediate.
// ExampleNew_localEndpoint runs so, against the tests' dynalite.
//
// # Time without a server clock
//
// DynamoDB has no clock a condition can read, so time is the caller's
// (Options.Clock): every write carries "now" in epoch milliseconds, and the
// condition compares it with the item's "expires" attribute. A lease is
// taken over when expires <= now on the taker's clock; Renew, Complete and
// Release succeed only while expires > now on the holder's clock. Instances
// whose clocks differ by d can therefore overlap by up to d: a taker whose
// clock runs d ahead takes a lease over d early. Leases are mutual
// exclusion only up to the clock skew between instances (NTP keeps it in
// milliseconds on EC2); what stays correct whatever the skew is the
// fencing token.
//
// # Fencing tokens
//
// The token is an atomic counter attribute of the item: Acquire sets
// token = if_not_exists(token, now) + 1 in the same conditional write, so
// every acquisition, takeover and release of a key gets a token larger
// than the one before, whatever the clocks say, as long as the item
// exists. An expired or released item is not deleted by the store: it
// keeps the counter. Only two things drop it: Delete (an operator's purge,
// allowed to drop the history) and DynamoDB TTL. The "ttl" attribute is
// therefore set Options.ClockSkew past both the record's end and the
// token read as a time in milliseconds, so that the next token, taken
// from a clock (within ClockSkew of the one that wrote the item), is
// larger. One item takes at most about 1,000 writes a second (a partition's
// limit), so tokens can run ahead of the clock only slowly; when an Acquire
// finds its token more than ClockSkew/2 ahead, it pushes "ttl" further with
// a second write.
//
// # Conditional-check failures
//
// When a condition fails (the key is in flight, completed, or the caller's
// lease is gone), the store needs the item to answer (InFlight with its
// RetryAfter, Replay with the response, a repeated Complete or Release).
// Writes ask for ReturnValuesOnConditionCheckFailure = ALL_OLD, which
// DynamoDB answers in the same round trip; a server that ignores it
// (dynalite, which the tests run on) gets one consistent GetItem more.
//
// # Lost answers
//
// A request that gets no whole answer is sent again by the store where
// that is safe: its connection was refused, reset or closed before a
// response came (the SDK's *smithyhttp.RequestSendError), or while the
// response's body was read (a *smithy.DeserializationError of a body cut
// short: unexpected EOF, a reset, a broken pipe). That is what a reused
// keep-alive connection gives when the server has closed it idle
// (DynamoDB's endpoints and Node.js's servers close idle connections), and
// the client's own retries are off or used up. Three attempts in all at
// most, the second after 5 to 10 ms, the third 10 to 20 ms later, while
// the context lasts. A read (GetItem) is always
// safe. So is every conditional write: repeated after its first attempt
// applied, it meets that write and is recognised by the caller's lease.
// Acquire finds the item in flight under its own LeaseID and returns
// that lease with its token; Complete and Release find the record
// completed or released with the lease's token and return nil; Renew's
// condition still holds, and it extends the lease again. One answer can
// differ: a Release whose first attempt applied, repeated after another
// caller acquired the released key, returns ErrLeaseLost (the key is
// released either way; idem.Store says the same of a caller's own
// repeat). Delete is sent again only when its connection could not be
// made: a repeat of a Delete that reached the server would find nothing
// and report false. A request the server answered whole (a failed
// condition, a throttling, validation or server error) is not sent again
// by the store; the client's own retries (RetryMaxAttempts, 3 by default;
// they retry throttling and lost answers) are safe for the same reasons.
// TestCutConnections puts a proxy between the store and dynalite that
// cuts connections mid-request (never applied), before the answer, inside
// its header and inside its body (applied), and after answers: every
// key's work runs once, and no request answered whole is sent again.
//
// # dynalite
//
// The tests run on dynalite 4.0.0 (the DynamoDB API on LevelDB, from npm;
// internal/dynamotest). Where it differs from DynamoDB: it ignores
// ReturnValuesOnConditionCheckFailure (hence the read after a failed
// condition, tested both ways), it has no UpdateTimeToLive and never
// deletes expired items (so the read path's own expiry check is what the
// suite sees), and it has no transactions.
//
// # Limits
//
// A DynamoDB item holds at most 400 KB (MaxItemSize). A response whose
// encoding (Response.AppendBinary: bodies compressed when that helps)
// does not fit is not refused after the work ran: Complete stores it
// without its body, BodyOmitted set, as idemhttp stores a body over its
// MaxResponseSize without a blob store. The key is completed and never
// run again; replays carry the status and headers with an empty body
// (idemhttp answers them ProblemResponseNotKept), and Options.OnBodyOmitted
// hears of it. To keep such bodies, use a blob store
// (idemhttp.Config.Blobs) with idemhttp.Config.MaxResponseSize under
// about 350 KB (its default is 1 MiB), so that larger bodies stream to
// the blob store and the record holds only their reference. A response
// whose headers alone do not fit fails Complete with a *idem.StoreError,
// and the lease stays held until it is released or ends.
//
// Store implements idem.BatchStore, for batched consumers: each key's
// transition is the single call's conditional write, different keys go
// out side by side (up to BatchParallelism at a time), and the requests
// for one key go one after the other in input order. DynamoDB has no
// batch write with a condition per item: BatchWriteItem takes no
// conditions, and TransactWriteItems fails every item when one condition
// fails (one key in flight would fail the whole batch) and costs twice
// the capacity. So a batch costs its keys' requests; it saves their
// waits. BENCHMARKS.md compares it with the single calls in a row.
package dynamostore
