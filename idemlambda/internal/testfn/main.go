// Command testfn is the Lambda function of idemlambda's tests: built with
// -tags lambda.norpc as "bootstrap" and run under the Lambda runtime
// interface emulator (aws-lambda-rie), it serves idemlambda.Wrap (the
// "api" mode) or idemlambda.WrapSQS (the "sqs" mode) over a redisstore on
// the private redis-server of the test (IDEMTEST_REDIS, host:port), or
// over a dynamostore on the test's dynalite (IDEMTEST_DYNAMODB,
// host:port, table "idem").
//
// The same Redis is the test's system of record: a run counts itself in
// runs:KEY and lists its fencing token in started:KEY before it works,
// and its write is fenced (sor:KEY keeps the largest token written and
// counts the writes it refused).
//
// The "apigw" and "apigwv2" modes serve API Gateway REST and HTTP API
// events with the defaults (the tenant from the request, its
// fingerprint); their handler counts its runs in runs:KEY and answers
// with session cookies and hop-by-hop headers in every spelling.
// IDEMTEST_REFUSE_ANONYMOUS=1 sets Config.RefuseAnonymous.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-lambda-go/lambda"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/idemlambda"
	"github.com/idemkit/idem/redisstore"
)

// Event is the "api" mode's event.
type Event struct {
	Key     string `json:"key"`
	Amount  int    `json:"amount"`
	SleepMS int    `json:"sleep_ms,omitempty"` // work time, not part of the payload
	Fail    bool   `json:"fail,omitempty"`
}

// Receipt is the "api" mode's result.
type Receipt struct {
	Key     string `json:"key"`
	Amount  int    `json:"amount"`
	Token   uint64 `json:"token"`
	Written bool   `json:"written"`
	PID     int    `json:"pid"`
	At      string `json:"at"` // differs on every run: a replay is byte-exact or not
}

// fenced writes token to the system of record unless a larger one was
// written before.
var fenced = redis.NewScript(`
local cur = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
if tonumber(ARGV[1]) < cur then
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  return 0
end
redis.call('HSET', KEYS[1], 'token', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'writes', 1)
return 1`)

func main() {
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("IDEMTEST_REDIS"), ReadTimeout: time.Second, WriteTimeout: time.Second})
	var store idem.Store
	if ep := os.Getenv("IDEMTEST_DYNAMODB"); ep != "" {
		// The store on DynamoDB (the tests' dynalite, host:port), table
		// "idem"; Redis stays the system of record.
		ds, err := dynamostore.New(dynamodb.New(dynamodb.Options{
			Region:       "us-east-1",
			BaseEndpoint: aws.String("http://" + ep),
			Credentials:  credentials.NewStaticCredentialsProvider("idemtest", "idemtestsecret", ""),
		}), dynamostore.Options{Table: "idem"})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		store = ds
	} else {
		rs, err := redisstore.New(rdb, redisstore.Options{Timeout: time.Second})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		store = rs
	}
	var err error
	var lease time.Duration
	if s := os.Getenv("IDEMTEST_LEASE"); s != "" {
		if lease, err = time.ParseDuration(s); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	start := func(ctx context.Context, key string) (uint64, error) {
		tok, ok := idemlambda.FencingToken(ctx)
		if !ok {
			return 0, errors.New("no lease in the handler's context")
		}
		p := rdb.TxPipeline()
		p.Incr(ctx, "runs:"+key)
		p.RPush(ctx, "started:"+key, tok)
		_, err := p.Exec(ctx)
		return tok, err
	}
	refuse := os.Getenv("IDEMTEST_REFUSE_ANONYMOUS") == "1"
	switch os.Getenv("IDEMTEST_MODE") {
	case "apigw":
		// An API Gateway REST API function with the defaults: the tenant
		// from the request, the request fingerprinted. Its answer sets a
		// session cookie in every spelling a handler may write.
		cfg := idemlambda.Config[events.APIGatewayProxyRequest]{Key: idemlambda.APIGatewayKey, Lease: lease, RefuseAnonymous: refuse}
		h, err := idemlambda.Wrap(store, cfg, func(ctx context.Context, e events.APIGatewayProxyRequest) (events.APIGatewayProxyResponse, error) {
			key, _ := idemlambda.APIGatewayKey(e)
			n, err := rdb.Incr(ctx, "runs:"+key).Result()
			if err != nil {
				return events.APIGatewayProxyResponse{}, err
			}
			session := fmt.Sprintf("session=run%d", n)
			return events.APIGatewayProxyResponse{
				StatusCode: 201,
				Headers: map[string]string{
					"Content-Type": "application/json", "X-Run": strconv.FormatInt(n, 10),
					"set-cookie": session, "Connection": "keep-alive", "transfer-encoding": "chunked",
				},
				MultiValueHeaders: map[string][]string{
					"SET-COOKIE": {session + "-multi"}, "Set-Cookie": {session + "-canonical"},
					"x-multi": {"1", "2"}, "Keep-Alive": {"timeout=5"},
				},
				Body: fmt.Sprintf(`{"run":%d,"body":%q}`, n, e.Body),
			}, nil
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		lambda.Start(h)
	case "apigwv2":
		// The same over an HTTP API (payload 2.0): v2's Cookies too.
		cfg := idemlambda.Config[events.APIGatewayV2HTTPRequest]{Key: idemlambda.APIGatewayV2Key, Lease: lease, RefuseAnonymous: refuse}
		h, err := idemlambda.Wrap(store, cfg, func(ctx context.Context, e events.APIGatewayV2HTTPRequest) (events.APIGatewayV2HTTPResponse, error) {
			key, _ := idemlambda.APIGatewayV2Key(e)
			n, err := rdb.Incr(ctx, "runs:"+key).Result()
			if err != nil {
				return events.APIGatewayV2HTTPResponse{}, err
			}
			session := fmt.Sprintf("session=run%d", n)
			return events.APIGatewayV2HTTPResponse{
				StatusCode: 201,
				Headers: map[string]string{
					"content-type": "application/json", "x-run": strconv.FormatInt(n, 10),
					"set-cookie": session + "-header", "upgrade": "h2c",
				},
				Cookies: []string{session, "theme=dark"},
				Body:    fmt.Sprintf(`{"run":%d,"body":%q}`, n, e.Body),
			}, nil
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		lambda.Start(h)
	case "sqs":
		h, err := idemlambda.WrapSQS(store, idemlambda.SQSConfig{Lease: lease}, func(ctx context.Context, m events.SQSMessage) error {
			if _, err := start(ctx, m.MessageId); err != nil {
				return err
			}
			if m.Body == "fail" {
				return errors.New("record " + m.MessageId + " failed")
			}
			return nil
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		lambda.Start(h)
	default:
		wait := -time.Nanosecond // in flight: fail at once, unless IDEMTEST_WAIT says
		if s := os.Getenv("IDEMTEST_WAIT"); s != "" {
			wait, _ = time.ParseDuration(s)
		}
		cfg := idemlambda.Config[Event]{
			Key:     func(e Event) (string, error) { return e.Key, nil },
			Payload: func(e Event) any { return e.Amount },
			Wait:    wait,
			Lease:   lease,
		}
		h, err := idemlambda.Wrap(store, cfg, func(ctx context.Context, e Event) (Receipt, error) {
			tok, err := start(ctx, e.Key)
			if err != nil {
				return Receipt{}, err
			}
			// For the tests that act while the work runs, and not while
			// the function talks to Redis.
			fmt.Println("idemtest: working on " + e.Key)
			// The work: not cut short by the context, as a write already
			// on its way would not be.
			time.Sleep(time.Duration(e.SleepMS) * time.Millisecond)
			if e.Fail {
				return Receipt{}, errors.New("declined")
			}
			n, err := fenced.Run(context.WithoutCancel(ctx), rdb, []string{"sor:" + e.Key}, strconv.FormatUint(tok, 10)).Int()
			if err != nil {
				return Receipt{}, err
			}
			return Receipt{Key: e.Key, Amount: e.Amount, Token: tok, Written: n == 1, PID: os.Getpid(),
				At: time.Now().UTC().Format(time.RFC3339Nano)}, nil
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		lambda.Start(h)
	}
}
