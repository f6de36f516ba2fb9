package sidecar

import (
	"encoding/base64"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

func TestIsGRPC(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/grpc": true, "application/grpc+proto": true, "Application/GRPC+json": true, "application/grpc;charset=x": true,
		"application/grpc-web": false, "application/grpc-web+proto": false, "application/json": false, "": false, "application/grp": false,
	} {
		r := httptest.NewRequest("POST", "/pkg.Svc/M", nil)
		r.Header.Set("Content-Type", ct)
		if got := IsGRPC(r); got != want {
			t.Errorf("IsGRPC(%q): got %v, want %v", ct, got, want)
		}
	}
}

func TestEncodeGRPCMessage(t *testing.T) {
	if got, want := encodeGRPCMessage("a 100% é\n"), "a 100%25 %C3%A9%0A"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestWriteGRPCProblem: each of the middleware's answers is a
// trailers-only gRPC status with idemgrpc's code and reason.
func TestWriteGRPCProblem(t *testing.T) {
	for _, c := range []struct {
		p      idemhttp.Problem
		code   codes.Code
		reason string
	}{
		{idemhttp.Problem{Type: idemhttp.ProblemInFlight, Title: "Request in progress", Status: 409, RetryAfter: 1}, codes.Aborted, idemgrpc.ReasonInFlight},
		{idemhttp.Problem{Type: idemhttp.ProblemMismatch, Status: 422}, codes.FailedPrecondition, idemgrpc.ReasonMismatch},
		{idemhttp.Problem{Type: idemhttp.ProblemStoreUnavailable, Status: 503, RetryAfter: 1}, codes.Unavailable, idemgrpc.ReasonStoreUnavailable},
		{idemhttp.Problem{Type: idemhttp.ProblemKeyInvalid, Status: 400}, codes.InvalidArgument, idemgrpc.ReasonKeyInvalid},
		{idemhttp.Problem{Type: idemhttp.ProblemKeyMissing, Status: 400}, codes.InvalidArgument, idemgrpc.ReasonKeyMissing},
		{idemhttp.Problem{Type: idemhttp.ProblemAnonymous, Status: 401}, codes.Unauthenticated, idemgrpc.ReasonAnonymous},
		{idemhttp.Problem{Type: idemhttp.ProblemResponseNotKept, Status: 500}, codes.DataLoss, idemgrpc.ReasonResponseOmitted},
		{idemhttp.Problem{Type: idemhttp.ProblemResponseUnreadable, Status: 500}, codes.DataLoss, idemgrpc.ReasonUnsealable},
		{idemhttp.Problem{Type: idemhttp.ProblemBodyTooLarge, Status: 413}, codes.ResourceExhausted, ""},
		{idemhttp.Problem{Type: idemhttp.ProblemQuotaExceeded, Status: 429}, codes.ResourceExhausted, ""},
		{idemhttp.Problem{Type: "urn:idem:problem:bad-gateway", Status: 502}, codes.Unavailable, ""},
		{idemhttp.Problem{Type: "urn:idem:problem:upstream-timeout", Status: 504}, codes.DeadlineExceeded, ""},
	} {
		w := httptest.NewRecorder()
		WriteGRPCProblem(w, &c.p)
		h := w.Result().Header
		if w.Code != 200 || h.Get("Content-Type") != "application/grpc" || w.Body.Len() != 0 {
			t.Errorf("%s: got %d %v with %d body bytes, want a trailers-only 200 application/grpc", c.p.Type, w.Code, h, w.Body.Len())
		}
		if got, want := h.Get("Grpc-Status"), strconv.Itoa(int(c.code)); got != want {
			t.Errorf("%s: grpc-status %q, want %q", c.p.Type, got, want)
		}
		bin := h.Get("Grpc-Status-Details-Bin")
		if c.reason == "" && c.p.RetryAfter == 0 {
			if bin != "" {
				t.Errorf("%s: details %q, want none", c.p.Type, bin)
			}
			continue
		}
		raw, err := base64.RawStdEncoding.DecodeString(bin)
		var st spb.Status
		if err == nil {
			err = proto.Unmarshal(raw, &st)
		}
		if err != nil {
			t.Fatalf("%s: details %q: %v", c.p.Type, bin, err)
		}
		var reason string
		var retry bool
		for _, a := range st.Details {
			m, err := a.UnmarshalNew()
			if err != nil {
				t.Fatal(err)
			}
			switch d := m.(type) {
			case *errdetails.ErrorInfo:
				if d.Domain == idemgrpc.ErrorDomain {
					reason = d.Reason
				}
			case *errdetails.RetryInfo:
				retry = d.RetryDelay.AsDuration() > 0
			}
		}
		if reason != c.reason || retry != (c.p.RetryAfter > 0) || codes.Code(st.Code) != c.code {
			t.Errorf("%s: details code %d reason %q retry %v, want %d %q %v", c.p.Type, st.Code, reason, retry, c.code, c.reason, c.p.RetryAfter > 0)
		}
	}
}

// TestGRPCMiddleware: through GRPCMiddleware, a gRPC call's storage
// follows its grpc-status (trailer or trailers-only header), not the
// HTTP status; the upstream of a leased call gets no grpc-timeout; a
// mismatch is a gRPC status; other requests keep the HTTP answers.
func TestGRPCMiddleware(t *testing.T) {
	var runs atomic.Int64
	var timeouts atomic.Int64
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if r.Header.Get("Grpc-Timeout") != "" {
			timeouts.Add(1)
		}
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/grpc")
		st := strings.TrimPrefix(r.URL.Path, "/svc/")
		if strings.HasPrefix(st, "only") { // trailers-only
			w.Header().Set("Grpc-Status", strings.TrimPrefix(st, "only"))
			w.WriteHeader(200)
			return
		}
		w.WriteHeader(200)
		w.Write(body)
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", st)
	})
	mw, err := GRPCMiddleware(memstore.New(memstore.Options{}), idemhttp.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(mw(upstream))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	defer srv.Close()
	call := func(path, key, body string, grpc bool) *http.Response {
		t.Helper()
		req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Grpc-Timeout", "5S")
		if grpc {
			req.Header.Set("Content-Type", "application/grpc")
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	for _, c := range []struct {
		path   string
		stored bool
	}{{"/svc/0", true}, {"/svc/3", true}, {"/svc/14", false}, {"/svc/4", false}, {"/svc/only5", true}, {"/svc/only13", false}, {"/svc/x", false}} {
		before := runs.Load()
		call(c.path, "k"+c.path, "m", true)
		again := call(c.path, "k"+c.path, "m", true)
		if ran := runs.Load() - before; (ran == 1) != c.stored || ran == 0 {
			t.Errorf("%s: the upstream ran %d times, want stored %v", c.path, ran, c.stored)
		}
		if c.stored && again.Header.Get(idemhttp.HeaderReplayed) != "true" {
			t.Errorf("%s: second answer is no replay: %v", c.path, again.Header)
		}
	}
	if n := timeouts.Load(); n != 0 {
		t.Errorf("the upstream got grpc-timeout on %d leased calls, want none", n)
	}
	mismatch := call("/svc/0", "k/svc/0", "other", true)
	if got := mismatch.Header.Get("Grpc-Status"); mismatch.StatusCode != 200 || got != "9" {
		t.Errorf("mismatch: got %d grpc-status %q, want 200 and 9 (FailedPrecondition)", mismatch.StatusCode, got)
	}
	if plain := call("/svc/0", "k/svc/0", "other", false); plain.StatusCode != http.StatusUnprocessableEntity {
		// Another content type: a mismatch too, answered in HTTP.
		t.Errorf("HTTP mismatch: got %d, want 422", plain.StatusCode)
	}
	before := runs.Load()
	call("/svc/9", "unkeyed-grpc-timeout", "m", false) // not gRPC: stored on its HTTP 200
	call("/svc/9", "unkeyed-grpc-timeout", "m", false)
	if ran := runs.Load() - before; ran != 1 {
		t.Errorf("an HTTP call ran %d times, want 1 (stored on its status 200)", ran)
	}
}
