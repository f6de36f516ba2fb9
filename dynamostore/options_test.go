package dynamostore_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
)

// TestNewOptions: New takes the table's name or ARN, a namespace of valid
// UTF-8 up to MaxNamespace bytes and a clock skew in range, and refuses
// anything else with an error that names the option and what it must be.
// It makes no request (the client here is never called).
func TestNewOptions(t *testing.T) {
	arn := "arn:aws:dynamodb:eu-west-1:123456789012:table/idem"
	for _, tt := range []struct {
		name string
		opts dynamostore.Options
		want []string // in the error; none: New succeeds
	}{
		{"name", dynamostore.Options{Table: "idem"}, nil},
		{"name of 255", dynamostore.Options{Table: strings.Repeat("a", 255)}, nil},
		{"name with every allowed character", dynamostore.Options{Table: "My_table-2.v1"}, nil},
		{"ARN", dynamostore.Options{Table: arn}, nil},
		{"ARN in another partition", dynamostore.Options{Table: "arn:aws-cn:dynamodb:cn-north-1:123456789012:table/idem"}, nil},
		{"namespace of MaxNamespace bytes", dynamostore.Options{Table: "idem", Namespace: strings.Repeat("é", dynamostore.MaxNamespace/2)}, nil},
		{"clock skew at its bounds", dynamostore.Options{Table: "idem", ClockSkew: dynamostore.MinClockSkew}, nil},
		{"clock skew at its upper bound", dynamostore.Options{Table: "idem", ClockSkew: dynamostore.MaxClockSkew}, nil},

		{"no table", dynamostore.Options{}, []string{"Options.Table is required", "3 to 255", "arn:"}},
		{"name too short", dynamostore.Options{Table: "ab"}, []string{`Options.Table "ab"`, "3 to 255"}},
		{"name too long", dynamostore.Options{Table: strings.Repeat("a", 256)}, []string{"Options.Table", "3 to 255"}},
		{"name with a space", dynamostore.Options{Table: "my table"}, []string{`Options.Table "my table"`, "letters, digits"}},
		{"ARN without an account", dynamostore.Options{Table: "arn:aws:dynamodb:eu-west-1::table/idem"}, []string{"is not a table ARN", "ACCOUNT 12 digits"}},
		{"ARN of an index", dynamostore.Options{Table: arn + "/index/by-date"}, []string{"is not a table ARN"}},
		{"ARN of another service", dynamostore.Options{Table: "arn:aws:s3:eu-west-1:123456789012:table/idem"}, []string{"is not a table ARN"}},
		{"ARN with a bad name", dynamostore.Options{Table: "arn:aws:dynamodb:eu-west-1:123456789012:table/a b"}, []string{`the table name "a b" in the ARN`}},
		{"namespace too long", dynamostore.Options{Table: "idem", Namespace: strings.Repeat("n", dynamostore.MaxNamespace+1)}, []string{"Options.Namespace is 256 bytes, want at most 255"}},
		{"namespace not UTF-8", dynamostore.Options{Table: "idem", Namespace: "orders\xff:"}, []string{"Options.Namespace", "not valid UTF-8"}},
		{"negative clock skew", dynamostore.Options{Table: "idem", ClockSkew: -time.Second}, []string{"Options.ClockSkew -1s", "1ms to 24h0m0s"}},
		{"clock skew under 1ms", dynamostore.Options{Table: "idem", ClockSkew: time.Microsecond}, []string{"Options.ClockSkew 1µs", "0 (the default, 1m0s)"}},
		{"clock skew over a day", dynamostore.Options{Table: "idem", ClockSkew: 25 * time.Hour}, []string{"Options.ClockSkew 25h0m0s"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, err := dynamostore.New(client, tt.opts)
			if tt.want == nil {
				if err != nil || s == nil {
					t.Fatalf("New: got %v, %v; want a store", s, err)
				}
				return
			}
			if err == nil || s != nil {
				t.Fatalf("New: got %v, nil error; want an error with %q", s, tt.want)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("New: error %q, want it to contain %q", err, w)
				}
			}
			if !strings.HasPrefix(err.Error(), "dynamostore: New: ") {
				t.Errorf("New: error %q, want it prefixed %q", err, "dynamostore: New: ")
			}
		})
	}
	if _, err := dynamostore.New(nil, dynamostore.Options{Table: "idem"}); err == nil || !strings.Contains(err.Error(), "nil API") {
		t.Errorf("New with a nil API: got %v, want an error naming the nil API", err)
	}
}

// TestNamespaceKeepsKeys: Options.Namespace is the partition keys' prefix
// (Options.Prefix before it was renamed), so the items stored under a
// namespace are the records of a store with the same namespace, and of
// no other.
func TestNamespaceKeepsKeys(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace("keys")
	a := mustNew(t, client, dynamostore.Options{Table: table, Namespace: ns})
	key := idem.Key{7}
	acq, err := a.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: %v, %v", acq.Outcome, err)
	}
	// The item's partition key, written out: the namespace, then the
	// key in hex (the format of the items stored before the rename).
	pk := ns + "07000000000000000000000000000000"
	out, err := client.GetItem(ctx, &dynamodb.GetItemInput{TableName: aws.String(table),
		Key: map[string]types.AttributeValue{dynamostore.KeyAttribute: &types.AttributeValueMemberS{Value: pk}}, ConsistentRead: aws.Bool(true)})
	if err != nil {
		t.Fatal(err)
	}
	if tok, ok := out.Item["token"].(*types.AttributeValueMemberN); !ok || tok.Value != strconv.FormatUint(acq.Lease.Token, 10) {
		t.Errorf("item %q: %v; want it there with the token %d", pk, out.Item, acq.Lease.Token)
	}
	if _, ok, err := mustNew(t, client, dynamostore.Options{Table: table, Namespace: ns + "x"}).Get(ctx, key); ok || err != nil {
		t.Errorf("Get by another namespace: %t, %v; want a miss", ok, err)
	}
	if got, want := a.Namespace(), "dynamodb "+table+" "+ns; got != want {
		t.Errorf("Namespace(): got %q, want %q", got, want)
	}
}
