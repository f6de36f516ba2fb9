package sidecar

// gRPC through the sidecar. A gRPC call is an HTTP/2 POST whose body is
// the request message (length-prefixed) and whose answer ends with
// trailers: idemhttp keys it as any POST (the message is in the
// fingerprint with the path, /pkg.Service/Method) and stores and replays
// its trailers. What differs is written here once, for idem proxy and
// Caddy alike:
//
//   - the middleware's own answers (in flight, mismatch, store down, ...)
//     are gRPC statuses, trailers-only, with the codes and reasons of
//     idemgrpc, since a gRPC client reads no problem+json;
//   - what is stored follows idemgrpc.DefaultShouldStore on the call's
//     grpc-status, not on the HTTP status, which is 200 for every answer;
//   - the client's grpc-timeout does not reach the upstream on a leased
//     call: its deadline must not cancel work that belongs to the key.
//
// A keyed call is read to the end of its request stream before the key is
// acquired, as any keyed request's body is: unary and server-streaming
// calls, and client-streaming calls that finish sending, run once per key
// with their whole request in the fingerprint and their whole answer
// stored. A bidirectional call that waits for answers before it ends its
// stream would wait for ever: streaming methods go on a route that covers
// no method, or are called without a key (docs/proxy.md, "gRPC").

import (
	"context"
	"encoding/base64"
	"net/http"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/idemhttp"
)

// IsGRPC reports whether r is a gRPC call: its Content-Type is
// application/grpc or application/grpc+<codec> (gRPC-Web, whose answers
// are framed otherwise, is not).
func IsGRPC(r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	if len(ct) < len("application/grpc") || !strings.EqualFold(ct[:len("application/grpc")], "application/grpc") {
		return false
	}
	rest := ct[len("application/grpc"):]
	return rest == "" || rest[0] == '+' || rest[0] == ';'
}

// GRPCMiddleware is idemhttp.NewMiddleware(store, cfg) with gRPC calls
// answered and stored as gRPC (see above): cfg's ErrorHandler and
// ShouldStore still decide for every other request, and for an answer to
// a gRPC call that carries no grpc-status (an upstream that is not gRPC;
// Caddy's own 502 when the upstream cannot be reached).
func GRPCMiddleware(store idem.Store, cfg idemhttp.Config) (func(http.Handler) http.Handler, error) {
	problem, shouldStore := cfg.ErrorHandler, cfg.ShouldStore
	if problem == nil {
		problem = idemhttp.WriteProblem
	}
	if shouldStore == nil {
		shouldStore = idemhttp.DefaultShouldStore
	}
	cfg.ErrorHandler = func(w http.ResponseWriter, r *http.Request, p *idemhttp.Problem) {
		if IsGRPC(r) {
			WriteGRPCProblem(w, p)
			return
		}
		problem(w, r, p)
	}
	cfg.ShouldStore = func(r *http.Request, st int) bool {
		if call, ok := r.Context().Value(grpcCallKey{}).(*grpcCall); ok && call.known {
			return idemgrpc.DefaultShouldStore(r.Context(), call.code)
		}
		return shouldStore(r, st)
	}
	mw, err := idemhttp.NewMiddleware(store, cfg)
	if err != nil {
		return nil, err
	}
	return func(next http.Handler) http.Handler {
		h := mw(grpcUpstream(next))
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if IsGRPC(r) {
				// The holder the upstream's grpc-status is put in for
				// ShouldStore, which sees the work's context: the
				// request's values.
				r = r.WithContext(context.WithValue(r.Context(), grpcCallKey{}, &grpcCall{}))
			}
			h.ServeHTTP(w, r)
		})
	}, nil
}

type grpcCallKey struct{}

// grpcCall is the grpc-status of a gRPC call's answer, once the upstream
// has given one. The upstream handler and ShouldStore run on the
// request's goroutine, one after the other.
type grpcCall struct {
	code  codes.Code
	known bool
}

// grpcUpstream runs next, the upstream, for the middleware: a leased gRPC
// call goes without its grpc-timeout, and the grpc-status of its answer
// is noted for ShouldStore.
func grpcUpstream(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		call, ok := r.Context().Value(grpcCallKey{}).(*grpcCall)
		if !ok {
			next.ServeHTTP(w, r)
			return
		}
		if _, leased := idem.LeaseFromContext(r.Context()); leased && r.Header.Get("Grpc-Timeout") != "" {
			// The client's deadline would make the upstream give up the
			// work that belongs to the key (Config.MaxExecution bounds it
			// instead). r is the middleware's copy; its header is the
			// client's request's.
			rc := *r
			rc.Header = r.Header.Clone()
			rc.Header.Del("Grpc-Timeout")
			r = &rc
		}
		next.ServeHTTP(w, r)
		call.code, call.known = grpcStatus(w.Header())
	})
}

// grpcStatus is the grpc-status of an answer whose handler returned: a
// header of a trailers-only answer, a trailer the handler announced (its
// value is in the header map by now), or one set under http.TrailerPrefix.
// A value that is not a number is Unknown, as gRPC clients read it.
func grpcStatus(h http.Header) (codes.Code, bool) {
	for name, vs := range h {
		if len(vs) == 0 || !(strings.EqualFold(name, "Grpc-Status") || strings.EqualFold(name, http.TrailerPrefix+"Grpc-Status")) {
			continue
		}
		n, err := strconv.ParseUint(vs[0], 10, 32)
		if err != nil {
			return codes.Unknown, true
		}
		return codes.Code(n), true
	}
	return 0, false
}

// WriteProblem writes p for r: as a gRPC status for a gRPC call
// (WriteGRPCProblem), else as idemhttp.WriteProblem does. For the
// sidecar's own answers outside the middleware (the upstream's failures).
func WriteProblem(w http.ResponseWriter, r *http.Request, p *idemhttp.Problem) {
	if IsGRPC(r) {
		WriteGRPCProblem(w, p)
		return
	}
	idemhttp.WriteProblem(w, r, p)
}

// WriteGRPCProblem writes p as a gRPC status: HTTP 200 and trailers-only
// (grpc-status, grpc-message and grpc-status-details-bin in the header of
// an answer without a body), with the code idemgrpc gives the same
// condition, and its google.rpc.ErrorInfo reason (domain
// idemgrpc.ErrorDomain, so that idemgrpc.ErrorReason reads it) and
// RetryInfo where it has them.
func WriteGRPCProblem(w http.ResponseWriter, p *idemhttp.Problem) {
	code, reason := grpcCode(p)
	msg := p.Title
	if p.Detail != "" {
		msg += ": " + p.Detail
	}
	h := w.Header()
	h.Set("Content-Type", "application/grpc")
	h.Set("Grpc-Status", strconv.Itoa(int(code)))
	h.Set("Grpc-Message", encodeGRPCMessage(msg))
	var details []protoadapt.MessageV1
	if reason != "" {
		details = append(details, &errdetails.ErrorInfo{Reason: reason, Domain: idemgrpc.ErrorDomain})
	}
	if p.RetryAfter > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(p.RetryAfter) * time.Second)})
	}
	if st, err := status.New(code, msg).WithDetails(details...); err == nil && len(details) > 0 {
		if b, err := proto.Marshal(st.Proto()); err == nil {
			// gRPC's binary metadata: base64, padding optional (grpc-go
			// sends none).
			h.Set("Grpc-Status-Details-Bin", base64.RawStdEncoding.EncodeToString(b))
		}
	}
	w.WriteHeader(http.StatusOK)
}

// grpcCode is the gRPC code and idemgrpc reason of one of the middleware's
// problems: idemgrpc's for the conditions it has, else the code gRPC
// gives the HTTP status (the gRPC spec's table; 504, the proxy's
// --max-execution, is DeadlineExceeded).
func grpcCode(p *idemhttp.Problem) (codes.Code, string) {
	switch p.Type {
	case idemhttp.ProblemKeyMissing:
		return codes.InvalidArgument, idemgrpc.ReasonKeyMissing
	case idemhttp.ProblemKeyInvalid:
		return codes.InvalidArgument, idemgrpc.ReasonKeyInvalid
	case idemhttp.ProblemInFlight:
		return codes.Aborted, idemgrpc.ReasonInFlight
	case idemhttp.ProblemMismatch:
		return codes.FailedPrecondition, idemgrpc.ReasonMismatch
	case idemhttp.ProblemStoreUnavailable, idemhttp.ProblemStoreFull, idemhttp.ProblemBlobStoreUnavailable, idemhttp.ProblemStoredBodyUnavailable:
		return codes.Unavailable, idemgrpc.ReasonStoreUnavailable
	case idemhttp.ProblemResponseNotKept:
		return codes.DataLoss, idemgrpc.ReasonResponseOmitted
	case idemhttp.ProblemResponseUnreadable:
		return codes.DataLoss, idemgrpc.ReasonUnsealable
	case idemhttp.ProblemAnonymous:
		return codes.Unauthenticated, idemgrpc.ReasonAnonymous
	case idemhttp.ProblemBodyTooLarge, idemhttp.ProblemQuotaExceeded:
		return codes.ResourceExhausted, ""
	}
	switch p.Status {
	case http.StatusBadRequest:
		return codes.Internal, ""
	case http.StatusUnauthorized:
		return codes.Unauthenticated, ""
	case http.StatusForbidden:
		return codes.PermissionDenied, ""
	case http.StatusNotFound:
		return codes.Unimplemented, ""
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable:
		return codes.Unavailable, ""
	case http.StatusGatewayTimeout:
		return codes.DeadlineExceeded, ""
	}
	return codes.Unknown, ""
}

// encodeGRPCMessage percent-encodes msg as the gRPC spec asks of
// grpc-message: every byte outside printable ASCII, and %.
func encodeGRPCMessage(msg string) string {
	var b strings.Builder
	for i := 0; i < len(msg); i++ {
		c := msg[i]
		if c >= 0x20 && c <= 0x7e && c != '%' {
			b.WriteByte(c)
			continue
		}
		b.WriteString("%" + strings.ToUpper(strconv.FormatUint(uint64(c)>>4, 16)) + strings.ToUpper(strconv.FormatUint(uint64(c)&15, 16)))
	}
	return b.String()
}
