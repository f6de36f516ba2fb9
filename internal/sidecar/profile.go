package sidecar

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/idemkit/idem/idemhttp"
)

// ProfileErrorHandler is the idemhttp Config.ErrorHandler of the answer
// profile named profile (Settings.Profile): next (nil: idemhttp.WriteProblem)
// writes every problem, but for HTTP requests (not gRPC calls, IsGRPC)
// a mismatch (idemhttp.ProblemMismatch) and a key in flight
// (idemhttp.ProblemInFlight) are answered in the profile's shape, as
// application/json with Cache-Control: no-store, the problem's detail as
// the message, and Retry-After kept for the key in flight:
//
//	acp     409 {"type":"invalid_request","code":"idempotency_conflict","message":...}
//	        409 {"type":"invalid_request","code":"idempotency_in_flight","message":...}
//	stripe  400 {"error":{"type":"idempotency_error","message":...}}
//	        409 {"error":{"type":"idempotency_error","code":"idempotency_key_in_use","message":...}}
//
// "" and "ietf" are next itself (422 and 409 problem+json). Every other
// problem keeps its problem+json form in every profile: the 503s of a
// store, the 500s of a response not kept (urn:idem:problem:response-not-kept)
// or sealed and unreadable (urn:idem:problem:response-unreadable), whose
// type is what an operator's client branches on.
func ProfileErrorHandler(profile string, next func(http.ResponseWriter, *http.Request, *idemhttp.Problem)) func(http.ResponseWriter, *http.Request, *idemhttp.Problem) {
	if next == nil {
		next = idemhttp.WriteProblem
	}
	var write func(w http.ResponseWriter, p *idemhttp.Problem) bool
	switch profile {
	case "acp":
		write = writeACP
	case "stripe":
		write = writeStripe
	default:
		return next
	}
	return func(w http.ResponseWriter, r *http.Request, p *idemhttp.Problem) {
		if IsGRPC(r) || !write(w, p) {
			next(w, r, p)
		}
	}
}

// acpError is the Agentic Commerce Protocol's error object.
type acpError struct {
	Type    string `json:"type"`
	Code    string `json:"code"`
	Message string `json:"message"`
}

// writeACP writes p in the acp profile's shape, if it has one for it.
func writeACP(w http.ResponseWriter, p *idemhttp.Problem) bool {
	var code string
	switch p.Type {
	case idemhttp.ProblemMismatch:
		code = "idempotency_conflict"
	case idemhttp.ProblemInFlight:
		code = "idempotency_in_flight"
	default:
		return false
	}
	writeProfileJSON(w, p, http.StatusConflict, acpError{Type: "invalid_request", Code: code, Message: problemMessage(p)})
	return true
}

// stripeError is Stripe's error envelope.
type stripeError struct {
	Error struct {
		Type    string `json:"type"`
		Code    string `json:"code,omitempty"`
		Message string `json:"message"`
	} `json:"error"`
}

// writeStripe writes p in the stripe profile's shape, if it has one for
// it.
func writeStripe(w http.ResponseWriter, p *idemhttp.Problem) bool {
	var e stripeError
	e.Error.Type, e.Error.Message = "idempotency_error", problemMessage(p)
	status := http.StatusBadRequest
	switch p.Type {
	case idemhttp.ProblemMismatch:
	case idemhttp.ProblemInFlight:
		status, e.Error.Code = http.StatusConflict, "idempotency_key_in_use"
	default:
		return false
	}
	writeProfileJSON(w, p, status, e)
	return true
}

// problemMessage is p's detail, or its title when it has none.
func problemMessage(p *idemhttp.Problem) string {
	if p.Detail != "" {
		return p.Detail
	}
	return p.Title
}

func writeProfileJSON(w http.ResponseWriter, p *idemhttp.Problem, status int, body any) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	if p.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(p.RetryAfter))
	}
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body)
}
