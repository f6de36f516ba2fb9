package dynamostore

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	"github.com/aws/smithy-go"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/idemkit/idem"
)

// API is the part of *dynamodb.Client the store uses.
type API interface {
	GetItem(ctx context.Context, in *dynamodb.GetItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.GetItemOutput, error)
	UpdateItem(ctx context.Context, in *dynamodb.UpdateItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.UpdateItemOutput, error)
	DeleteItem(ctx context.Context, in *dynamodb.DeleteItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.DeleteItemOutput, error)
}

var _ API = (*dynamodb.Client)(nil)

// Attribute names of an item.
const (
	KeyAttribute = "pk"  // partition key (string): Options.Namespace + the key in hex
	TTLAttribute = "ttl" // epoch seconds for DynamoDB TTL

	attrState   = "state"
	attrToken   = "token"
	attrFP      = "fp"
	attrLease   = "lease"
	attrExpires = "expires" // epoch milliseconds
	attrResp    = "resp"
)

// DefaultClockSkew is Options.ClockSkew when it is zero.
const DefaultClockSkew = time.Minute

// MinClockSkew and MaxClockSkew bound Options.ClockSkew when it is set.
const (
	MinClockSkew = time.Millisecond
	MaxClockSkew = 24 * time.Hour
)

// MaxNamespace is the longest Options.Namespace, in bytes (as
// mysqlstore's).
const MaxNamespace = 255

// Options configures a Store. Table is required; the zero value of every
// other field means its default.
type Options struct {
	// Table is the table: its name (3 to 255 letters, digits, '_', '-'
	// and '.') or its ARN (arn:aws:dynamodb:REGION:ACCOUNT:table/NAME,
	// in any AWS partition). Required.
	Table string
	// Namespace isolates stores sharing a table: each sees only the
	// records of its own namespace. It is prepended to every partition
	// key (the key in hex follows it), so items written by a store of the
	// same Namespace are its records. Valid UTF-8, at most MaxNamespace
	// bytes. Default "".
	Namespace string
	// Clock is the time source; time.Now when nil. See the package doc.
	Clock func() time.Time
	// ClockSkew is the largest difference between the clocks of the
	// instances sharing the table that fencing tokens survive a TTL
	// deletion with (see the package doc): between MinClockSkew and
	// MaxClockSkew. Default DefaultClockSkew.
	ClockSkew time.Duration
	// OnBodyOmitted, when set, is called for every response that Complete
	// stores without its body because the item would exceed DynamoDB's
	// 400 KB (see the package doc), with the encoded size that did not
	// fit. For metrics and logs; it must not block.
	OnBodyOmitted func(key idem.Key, size int)
}

// Store is an idem.Store on a DynamoDB table.
type Store struct {
	api     API
	table   *string
	pre     string
	clock   func() time.Time
	skew    time.Duration
	omitted func(idem.Key, int)
}

var (
	_ idem.Store      = (*Store)(nil)
	_ idem.Namespacer = (*Store)(nil)
)

// New returns a store on opts.Table through api (a *dynamodb.Client). It
// checks opts and makes no request: an error names the option and what
// it must be.
func New(api API, opts Options) (*Store, error) {
	if api == nil {
		return nil, errors.New("dynamostore: New: nil API (want a *dynamodb.Client)")
	}
	if err := checkTable(opts.Table); err != nil {
		return nil, err
	}
	switch {
	case !utf8.ValidString(opts.Namespace):
		return nil, fmt.Errorf("dynamostore: New: Options.Namespace %q is not valid UTF-8", opts.Namespace)
	case len(opts.Namespace) > MaxNamespace:
		return nil, fmt.Errorf("dynamostore: New: Options.Namespace is %d bytes, want at most %d", len(opts.Namespace), MaxNamespace)
	}
	switch {
	case opts.ClockSkew == 0:
		opts.ClockSkew = DefaultClockSkew
	case opts.ClockSkew < MinClockSkew || opts.ClockSkew > MaxClockSkew:
		return nil, fmt.Errorf("dynamostore: New: Options.ClockSkew %v, want 0 (the default, %v) or %v to %v",
			opts.ClockSkew, DefaultClockSkew, MinClockSkew, MaxClockSkew)
	}
	if opts.Clock == nil {
		opts.Clock = time.Now
	}
	return &Store{api: api, table: aws.String(opts.Table), pre: opts.Namespace, clock: opts.Clock, skew: opts.ClockSkew,
		omitted: opts.OnBodyOmitted}, nil
}

var (
	tableName = regexp.MustCompile(`^[A-Za-z0-9_.-]{3,255}$`)
	tableARN  = regexp.MustCompile(`^arn:aws[a-z-]*:dynamodb:[a-z0-9-]+:[0-9]{12}:table/([^/]*)$`)
)

// checkTable checks Options.Table: a table name, or a table's ARN.
func checkTable(t string) error {
	const name = "3 to 255 letters, digits, '_', '-' or '.'"
	const arn = "arn:PARTITION:dynamodb:REGION:ACCOUNT:table/NAME, ACCOUNT 12 digits"
	switch {
	case t == "":
		return errors.New("dynamostore: New: Options.Table is required: a table name (" + name + ") or ARN (" + arn + ")")
	case strings.HasPrefix(t, "arn:"):
		m := tableARN.FindStringSubmatch(t)
		if m == nil {
			return fmt.Errorf("dynamostore: New: Options.Table %q is not a table ARN: want %s", t, arn)
		}
		if !tableName.MatchString(m[1]) {
			return fmt.Errorf("dynamostore: New: Options.Table %q: the table name %q in the ARN is not %s", t, m[1], name)
		}
	case !tableName.MatchString(t):
		return fmt.Errorf("dynamostore: New: Options.Table %q is not a table name (%s) nor an ARN (%s)", t, name, arn)
	}
	return nil
}

// Namespace implements idem.Namespacer: "dynamodb ", Options.Table (as
// given: a name and an ARN of one table differ), a space and
// Options.Namespace.
func (s *Store) Namespace() string { return "dynamodb " + *s.table + " " + s.pre }

var names = map[string]string{
	"#k": KeyAttribute, "#s": attrState, "#t": attrToken, "#f": attrFP, "#l": attrLease,
	"#e": attrExpires, "#x": TTLAttribute, "#r": attrResp,
}

func (s *Store) key(k idem.Key) map[string]types.AttributeValue {
	return map[string]types.AttributeValue{KeyAttribute: &types.AttributeValueMemberS{Value: s.pre + hex.EncodeToString(k[:])}}
}

func num(n int64) types.AttributeValue {
	return &types.AttributeValueMemberN{Value: strconv.FormatInt(n, 10)}
}

func bin(b []byte) types.AttributeValue { return &types.AttributeValueMemberB{Value: b} }

// end returns now+d in epoch milliseconds, saturating.
func end(nowMS int64, d time.Duration) int64 {
	ms := int64((d + time.Millisecond - 1) / time.Millisecond)
	if nowMS > 1<<62-ms {
		return 1 << 62
	}
	return nowMS + ms
}

// ttlFor is the TTL attribute for a record ending at expires (ms) that
// holds token: ClockSkew past both, in epoch seconds.
func (s *Store) ttlFor(expires int64, token uint64) types.AttributeValue {
	last := max(expires, int64(min(token, 1<<62))+1)
	return num(end(last, s.skew)/1000 + 1)
}

func storeErr(op string, key idem.Key, err error) error {
	return &idem.StoreError{Op: op, Key: key, Err: err}
}

func ctxErr(ctx context.Context, op string, key idem.Key) error {
	if err := ctx.Err(); err != nil {
		return storeErr(op, key, err)
	}
	return nil
}

// sendAttempts is how many times the store sends a request that got no
// whole answer (see unanswered; after whatever retries the client makes
// itself), when sending it again is safe: see "Lost answers" in the
// package doc.
const sendAttempts = 3

// sendBackoff is the wait before the second attempt; it doubles, with
// jitter, before each later one.
const sendBackoff = 10 * time.Millisecond

// unanswered reports whether err is a request that got no whole answer,
// so that the server may or may not have applied it: its connection was
// refused, reset or closed before a response came (the SDK's
// *smithyhttp.RequestSendError), or while the response's body was read
// (a *smithy.DeserializationError of a body cut short: unexpected EOF, a
// reset, a broken pipe). An answer read whole (a failed condition, a
// throttling, validation or server error) is not one.
func unanswered(err error) bool {
	var rse *smithyhttp.RequestSendError
	if errors.As(err, &rse) {
		return true
	}
	var de *smithy.DeserializationError
	return errors.As(err, &de) && cutShort(de.Err)
}

// cutShort reports whether err is a connection's end: what reading a
// response whose connection was cut returns.
func cutShort(err error) bool {
	return errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed)
}

// unsent reports whether err is a request that never reached the server
// (its connection could not be made).
func unsent(err error) bool {
	var op *net.OpError
	return unanswered(err) && errors.As(err, &op) && op.Op == "dial"
}

// resend calls send until it returns an error that again(err) does not
// take for a lost answer, sendAttempts times at most, backing off in
// between, and stops when ctx ends.
func resend[T any](ctx context.Context, again func(error) bool, send func() (T, error)) (T, error) {
	wait := sendBackoff
	for i := 1; ; i++ {
		out, err := send()
		if err == nil || i >= sendAttempts || !again(err) || ctx.Err() != nil {
			return out, err
		}
		t := time.NewTimer(wait/2 + rand.N(wait/2))
		select {
		case <-ctx.Done():
			t.Stop()
			return out, err
		case <-t.C:
		}
		wait *= 2
	}
}

// getItem is a GetItem, sent again after a lost answer (a read).
func (s *Store) getItem(ctx context.Context, in *dynamodb.GetItemInput) (*dynamodb.GetItemOutput, error) {
	return resend(ctx, unanswered, func() (*dynamodb.GetItemOutput, error) { return s.api.GetItem(ctx, in) })
}

// updateItem is an UpdateItem, sent again after a lost answer: every
// UpdateItem of the store is a conditional write that, repeated after its
// first attempt applied, is recognised by the caller's own lease (see the
// package doc).
func (s *Store) updateItem(ctx context.Context, in *dynamodb.UpdateItemInput) (*dynamodb.UpdateItemOutput, error) {
	return resend(ctx, unanswered, func() (*dynamodb.UpdateItemOutput, error) { return s.api.UpdateItem(ctx, in) })
}

// item is a decoded item.
type item struct {
	state   idem.State
	token   uint64
	fp      idem.Fingerprint
	lease   idem.LeaseID
	expires int64
	resp    []byte
	size    int
}

var errCorrupt = idem.ErrCorrupt

func decodeItem(av map[string]types.AttributeValue) (*item, error) {
	if len(av) == 0 {
		return nil, nil
	}
	it := new(item)
	n := func(name string) (int64, error) {
		v, ok := av[name].(*types.AttributeValueMemberN)
		if !ok {
			return 0, fmt.Errorf("%w: attribute %s missing or not a number", errCorrupt, name)
		}
		i, err := strconv.ParseInt(v.Value, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: attribute %s: %v", errCorrupt, name, err)
		}
		return i, nil
	}
	b := func(name string, dst []byte) error {
		v, ok := av[name]
		if !ok {
			return nil
		}
		bv, ok := v.(*types.AttributeValueMemberB)
		if !ok || len(bv.Value) != len(dst) {
			return fmt.Errorf("%w: attribute %s is not %d bytes", errCorrupt, name, len(dst))
		}
		copy(dst, bv.Value)
		return nil
	}
	st, err := n(attrState)
	if err != nil {
		return nil, err
	}
	if st < int64(idem.StateInFlight) || st > int64(idem.StateReleased) {
		return nil, fmt.Errorf("%w: state %d", errCorrupt, st)
	}
	it.state = idem.State(st)
	tok, err := n(attrToken)
	if err != nil {
		return nil, err
	}
	it.token = uint64(tok)
	if it.expires, err = n(attrExpires); err != nil {
		return nil, err
	}
	if err := b(attrFP, it.fp[:]); err != nil {
		return nil, err
	}
	if err := b(attrLease, it.lease[:]); err != nil {
		return nil, err
	}
	if v, ok := av[attrResp]; ok {
		bv, ok := v.(*types.AttributeValueMemberB)
		if !ok {
			return nil, fmt.Errorf("%w: attribute %s is not binary", errCorrupt, attrResp)
		}
		it.resp = bv.Value
	}
	if it.state == idem.StateCompleted && it.resp == nil {
		return nil, fmt.Errorf("%w: completed record without a response", errCorrupt)
	}
	it.size = fixedSize + len(it.resp)
	return it, nil
}

// fixedSize is the stored size of an item without its response, roughly.
const fixedSize = 100

func (it *item) live(nowMS int64) bool { return it != nil && it.expires > nowMS }

func (it *item) ttl(now time.Time) time.Duration { return time.UnixMilli(it.expires).Sub(now) }

func decodeResponse(enc []byte) (*idem.Response, error) {
	resp := new(idem.Response)
	if err := resp.UnmarshalBinary(enc); err != nil {
		return nil, fmt.Errorf("%w: %v", errCorrupt, err)
	}
	return resp, nil
}

// oldItem returns the item a failed condition saw: from the error
// (ReturnValuesOnConditionCheckFailure = ALL_OLD, DynamoDB) or, where the
// server does not return it (dynalite), read again. ok is false when err
// is not a failed condition.
func (s *Store) oldItem(ctx context.Context, key idem.Key, err error) (it *item, ok bool, _ error) {
	var ccf *types.ConditionalCheckFailedException
	if !errors.As(err, &ccf) {
		return nil, false, err
	}
	av := ccf.Item
	if av == nil {
		out, err := s.getItem(ctx, &dynamodb.GetItemInput{TableName: s.table, Key: s.key(key), ConsistentRead: aws.Bool(true)})
		if err != nil {
			return nil, true, err
		}
		av = out.Item
	}
	it, err = decodeItem(av)
	return it, true, err
}

// maxAttempts bounds Acquire's loop: a failed condition on an item that is
// free when read again (it expired or was released in between) is tried
// again.
const maxAttempts = 8

// Acquire implements idem.Store.
func (s *Store) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if err := ctxErr(ctx, "acquire", req.Key); err != nil {
		return idem.Acquisition{}, err
	}
	if err := req.Validate(); err != nil {
		return idem.Acquisition{}, err
	}
	for range maxAttempts {
		acq, retry, err := s.acquire(ctx, req)
		if err != nil {
			return idem.Acquisition{}, storeErr("acquire", req.Key, err)
		}
		if !retry {
			return acq, nil
		}
	}
	return idem.Acquisition{}, storeErr("acquire", req.Key, errors.New("dynamostore: the record changed under every attempt"))
}

func (s *Store) acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, bool, error) {
	now := s.clock()
	nowMS := now.UnixMilli()
	exp := end(nowMS, req.TTL)
	out, err := s.updateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                s.table,
		Key:                      s.key(req.Key),
		ConditionExpression:      aws.String("attribute_not_exists(#k) OR #s = :rel OR #e <= :now"),
		UpdateExpression:         aws.String("SET #s = :fl, #t = if_not_exists(#t, :now) + :one, #f = :fp, #l = :lid, #e = :exp, #x = :x REMOVE #r"),
		ExpressionAttributeNames: names,
		ExpressionAttributeValues: map[string]types.AttributeValue{
			":rel": num(int64(idem.StateReleased)), ":fl": num(int64(idem.StateInFlight)),
			":now": num(nowMS), ":one": num(1), ":fp": bin(req.Fingerprint[:]), ":lid": bin(req.LeaseID[:]),
			":exp": num(exp), ":x": s.ttlFor(exp, uint64(nowMS)),
		},
		ReturnValues:                        types.ReturnValueUpdatedNew,
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	})
	if err == nil {
		tv, ok := out.Attributes[attrToken].(*types.AttributeValueMemberN)
		if !ok {
			return idem.Acquisition{}, false, errors.New("dynamostore: UpdateItem returned no token")
		}
		tok, err := strconv.ParseUint(tv.Value, 10, 64)
		if err != nil {
			return idem.Acquisition{}, false, fmt.Errorf("dynamostore: token %q: %w", tv.Value, err)
		}
		return s.acquired(ctx, req, nowMS, exp, tok, req.TTL)
	}
	it, ok, err := s.oldItem(ctx, req.Key, err)
	if err != nil || !ok {
		return idem.Acquisition{}, false, err
	}
	now = s.clock()
	nowMS = now.UnixMilli()
	switch {
	case !it.live(nowMS) || it.state == idem.StateReleased:
		return idem.Acquisition{}, true, nil
	case it.state == idem.StateInFlight && it.lease == req.LeaseID:
		// This Acquire again (the caller's, or the store's after a lost
		// answer): the lease its first write took.
		return s.acquired(ctx, req, nowMS, it.expires, it.token, it.ttl(now))
	case it.fp != req.Fingerprint:
		return idem.Acquisition{Outcome: idem.Mismatch}, false, nil
	case it.state == idem.StateInFlight:
		return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: it.ttl(now)}, false, nil
	}
	resp, err := decodeResponse(it.resp)
	if err != nil {
		return idem.Acquisition{}, false, err
	}
	return idem.Acquisition{Outcome: idem.Replay, Response: resp}, false, nil
}

// acquired answers an Acquire whose lease holds token tok and ends at exp
// (epoch ms), ttl from now.
func (s *Store) acquired(ctx context.Context, req idem.AcquireRequest, nowMS, exp int64, tok uint64, ttl time.Duration) (idem.Acquisition, bool, error) {
	if int64(tok) > nowMS+s.skew.Milliseconds()/2 {
		// The token runs ahead of the clock: keep the item until
		// the clock has passed it (see the package doc).
		if err := s.extendTTL(ctx, req.Key, req.LeaseID, exp, tok); err != nil {
			return idem.Acquisition{}, false, err
		}
	}
	l := idem.Lease{Key: req.Key, ID: req.LeaseID, Token: tok, TTL: ttl}
	return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, false, nil
}

func (s *Store) extendTTL(ctx context.Context, key idem.Key, id idem.LeaseID, exp int64, tok uint64) error {
	_, err := s.updateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                 s.table,
		Key:                       s.key(key),
		ConditionExpression:       aws.String("#l = :lid"),
		UpdateExpression:          aws.String("SET #x = :x"),
		ExpressionAttributeNames:  map[string]string{"#l": attrLease, "#x": TTLAttribute},
		ExpressionAttributeValues: map[string]types.AttributeValue{":lid": bin(id[:]), ":x": s.ttlFor(exp, tok)},
	})
	var ccf *types.ConditionalCheckFailedException
	if errors.As(err, &ccf) {
		return nil // the lease is gone already; its successor set the TTL
	}
	return err
}

// held is the condition of a write by the live lease l.
const held = "#s = :fl AND #l = :lid AND #e > :now"

// Renew implements idem.Store.
func (s *Store) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	if err := ctxErr(ctx, "renew", l.Key); err != nil {
		return err
	}
	if ttl < time.Millisecond {
		return fmt.Errorf("dynamostore: renew: lease TTL %v is shorter than 1ms", ttl)
	}
	nowMS := s.clock().UnixMilli()
	exp := end(nowMS, ttl)
	_, err := s.updateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                s.table,
		Key:                      s.key(l.Key),
		ConditionExpression:      aws.String(held),
		UpdateExpression:         aws.String("SET #e = :exp, #x = :x"),
		ExpressionAttributeNames: pick("#s", "#l", "#e", "#x"),
		ExpressionAttributeValues: map[string]types.AttributeValue{
			":fl": num(int64(idem.StateInFlight)), ":lid": bin(l.ID[:]), ":now": num(nowMS),
			":exp": num(exp), ":x": s.ttlFor(exp, l.Token),
		},
	})
	var ccf *types.ConditionalCheckFailedException
	switch {
	case err == nil:
		return nil
	case errors.As(err, &ccf):
		return idem.ErrLeaseLost
	}
	return storeErr("renew", l.Key, err)
}

// pick returns the expression attribute names of placeholders ph (a
// request may not name attributes its expressions do not use).
func pick(ph ...string) map[string]string {
	m := make(map[string]string, len(ph))
	for _, p := range ph {
		m[p] = names[p]
	}
	return m
}

// Complete implements idem.Store.
func (s *Store) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	if err := ctxErr(ctx, "complete", l.Key); err != nil {
		return err
	}
	if retention < time.Millisecond {
		return fmt.Errorf("dynamostore: complete: retention %v is shorter than 1ms", retention)
	}
	enc, err := s.encode(l.Key, resp)
	if err != nil {
		return storeErr("complete", l.Key, err)
	}
	nowMS := s.clock().UnixMilli()
	exp := end(nowMS, retention)
	_, err = s.updateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                s.table,
		Key:                      s.key(l.Key),
		ConditionExpression:      aws.String(held),
		UpdateExpression:         aws.String("SET #s = :done, #r = :r, #e = :exp, #x = :x REMOVE #l"),
		ExpressionAttributeNames: pick("#s", "#l", "#e", "#x", "#r"),
		ExpressionAttributeValues: map[string]types.AttributeValue{
			":fl": num(int64(idem.StateInFlight)), ":lid": bin(l.ID[:]), ":now": num(nowMS),
			":done": num(int64(idem.StateCompleted)), ":r": bin(enc), ":exp": num(exp), ":x": s.ttlFor(exp, l.Token),
		},
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	})
	return s.settle(ctx, "complete", l, idem.StateCompleted, err)
}

// MaxItemSize is DynamoDB's limit on an item: attribute names and values
// together.
const MaxItemSize = 400 << 10

// itemOverhead bounds what a completed item holds besides the key's
// prefix and the encoded response: attribute names, the key in hex, the
// numbers and the fingerprint.
const itemOverhead = 256

// encode encodes resp for Complete. When the item would not fit in
// MaxItemSize, it encodes resp without its body, BodyOmitted set (the
// record is completed, the work is not run again, and its replays carry
// the status and headers with an empty body), and calls OnBodyOmitted.
func (s *Store) encode(key idem.Key, resp *idem.Response) ([]byte, error) {
	enc, err := resp.AppendBinary(nil)
	if err != nil {
		return nil, err
	}
	room := MaxItemSize - itemOverhead - len(s.pre)
	if len(enc) <= room || resp.Blob != nil || len(resp.Body) == 0 {
		return enc, nil
	}
	size := len(enc)
	cut := *resp
	cut.Body, cut.BodyOmitted = nil, true
	if enc, err = cut.AppendBinary(nil); err != nil {
		return nil, err
	}
	if s.omitted != nil {
		s.omitted(key, size)
	}
	return enc, nil
}

// settle answers a Complete or Release whose write returned err: a failed
// condition is a repeat (nil) when the record is live, in state, and
// carries l's token; otherwise ErrLeaseLost.
func (s *Store) settle(ctx context.Context, op string, l idem.Lease, state idem.State, err error) error {
	if err == nil {
		return nil
	}
	it, ok, err := s.oldItem(ctx, l.Key, err)
	switch {
	case !ok:
		return storeErr(op, l.Key, err)
	case errors.Is(err, errCorrupt):
		return idem.ErrLeaseLost
	case err != nil:
		return storeErr(op, l.Key, err)
	case it.live(s.clock().UnixMilli()) && it.state == state && it.token == l.Token:
		return nil // the same call again, after a lost reply
	}
	return idem.ErrLeaseLost
}

// Release implements idem.Store.
func (s *Store) Release(ctx context.Context, l idem.Lease) error {
	if err := ctxErr(ctx, "release", l.Key); err != nil {
		return err
	}
	nowMS := s.clock().UnixMilli()
	exp := end(nowMS, max(l.TTL, time.Millisecond))
	_, err := s.updateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                s.table,
		Key:                      s.key(l.Key),
		ConditionExpression:      aws.String(held),
		UpdateExpression:         aws.String("SET #s = :rel, #e = :exp, #x = :x REMOVE #l, #f, #r"),
		ExpressionAttributeNames: pick("#s", "#l", "#e", "#x", "#f", "#r"),
		ExpressionAttributeValues: map[string]types.AttributeValue{
			":fl": num(int64(idem.StateInFlight)), ":lid": bin(l.ID[:]), ":now": num(nowMS),
			":rel": num(int64(idem.StateReleased)), ":exp": num(exp), ":x": s.ttlFor(exp, l.Token),
		},
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	})
	return s.settle(ctx, "release", l, idem.StateReleased, err)
}

// Get implements idem.Store. An item whose record has expired is a miss,
// whether DynamoDB TTL has deleted it yet or not.
func (s *Store) Get(ctx context.Context, key idem.Key) (idem.Record, bool, error) {
	if err := ctxErr(ctx, "get", key); err != nil {
		return idem.Record{}, false, err
	}
	out, err := s.getItem(ctx, &dynamodb.GetItemInput{TableName: s.table, Key: s.key(key), ConsistentRead: aws.Bool(true)})
	if err != nil {
		return idem.Record{}, false, storeErr("get", key, err)
	}
	it, err := decodeItem(out.Item)
	if err != nil {
		return idem.Record{}, false, storeErr("get", key, err)
	}
	now := s.clock()
	if !it.live(now.UnixMilli()) {
		return idem.Record{}, false, nil
	}
	rec := idem.Record{State: it.state, Token: it.token, TTL: it.ttl(now), Size: it.size}
	if it.state != idem.StateReleased {
		rec.Fingerprint = it.fp
	}
	switch it.state {
	case idem.StateInFlight:
		rec.LeaseID = it.lease
	case idem.StateCompleted:
		if rec.Response, err = decodeResponse(it.resp); err != nil {
			return idem.Record{}, false, storeErr("get", key, err)
		}
	}
	return rec, true, nil
}

// Delete implements idem.Store. It deletes the item, and reports whether
// it held a live record.
func (s *Store) Delete(ctx context.Context, key idem.Key) (bool, error) {
	if err := ctxErr(ctx, "delete", key); err != nil {
		return false, err
	}
	// Sent again only when it never reached the server: a repeat of a
	// Delete that did would find nothing, and report false.
	out, err := resend(ctx, unsent, func() (*dynamodb.DeleteItemOutput, error) {
		return s.api.DeleteItem(ctx, &dynamodb.DeleteItemInput{TableName: s.table, Key: s.key(key), ReturnValues: types.ReturnValueAllOld})
	})
	if err != nil {
		return false, storeErr("delete", key, err)
	}
	if len(out.Attributes) == 0 {
		return false, nil
	}
	v, ok := out.Attributes[attrExpires].(*types.AttributeValueMemberN)
	if !ok {
		return true, nil // a corrupt item was there
	}
	exp, err := strconv.ParseInt(v.Value, 10, 64)
	return err != nil || exp > s.clock().UnixMilli(), nil
}
