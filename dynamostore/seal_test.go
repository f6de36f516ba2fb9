package dynamostore_test

import (
	"bytes"
	"context"
	"net/http"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/internal/sealtest"
)

// TestSealedAtRest: with Config.Seal, a scan of the table (what an
// operator with read access, an export or a backup sees) holds neither the
// card in the body nor the token in a header of a completed record, and
// the record replays; without it (the control) the scan holds both.
func TestSealedAtRest(t *testing.T) {
	const card, token = "4111 1111 1111 1111", "tok-for-dynamo-canary"
	for _, sealed := range []bool{true, false} {
		name := map[bool]string{true: "sealed", false: "clear"}[sealed]
		t.Run(name, func(t *testing.T) {
			ctx := t.Context()
			ns := newNamespace("seal-" + name)
			cfg := idem.Config{}
			if sealed {
				cfg.Seal = sealtest.Ring(t, "k1")
			}
			g, err := idem.New(mustNew(t, client, dynamostore.Options{Table: table, Namespace: ns}), cfg)
			if err != nil {
				t.Fatal(err)
			}
			runs := 0
			do := func() idem.Result {
				t.Helper()
				res, err := g.Do(ctx, idem.Key{9}, idem.Fingerprint{9}, func(context.Context) (*idem.Response, error) {
					runs++
					return &idem.Response{Status: 201, Header: http.Header{"X-Session-Token": {token}},
						Body: []byte(`{"card":"` + card + `"}`)}, nil
				})
				if err != nil {
					t.Fatal(err)
				}
				return res
			}
			do()
			if res := do(); runs != 1 || res.Response == nil || !bytes.Contains(res.Response.Body, []byte(card)) {
				t.Fatalf("replay: %d runs, response %+v", runs, res.Response)
			}
			dump := scanTable(ctx, t, ns)
			if len(dump) == 0 {
				t.Fatal("the scan found no item of the namespace")
			}
			for _, s := range []string{card, token} {
				if got := bytes.Contains(dump, []byte(s)); got == sealed {
					t.Errorf("%q in the table's items: %t, want %t", s, got, !sealed)
				}
			}
		})
	}
}

// scanTable returns the bytes of every attribute of the table's items
// whose key starts with ns, as a scan (or an export) shows them.
func scanTable(ctx context.Context, t *testing.T, ns string) []byte {
	t.Helper()
	var dump []byte
	p := dynamodb.NewScanPaginator(client, &dynamodb.ScanInput{TableName: &[]string{table}[0]})
	for p.HasMorePages() {
		out, err := p.NextPage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, item := range out.Items {
			mine := false
			var b []byte
			for _, v := range item {
				switch v := v.(type) {
				case *types.AttributeValueMemberS:
					mine = mine || bytes.HasPrefix([]byte(v.Value), []byte(ns))
					b = append(b, v.Value...)
				case *types.AttributeValueMemberB:
					b = append(b, v.Value...)
				case *types.AttributeValueMemberN:
					b = append(b, v.Value...)
				}
			}
			if mine {
				dump = append(dump, b...)
			}
		}
	}
	return dump
}
