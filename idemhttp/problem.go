package idemhttp

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Problem types: the stable `type` member of each problem+json answer
// (RFC 9457). Clients branch on these, not on titles or details.
const (
	ProblemKeyMissing       = "urn:idem:problem:key-missing"       // 400: the route requires an Idempotency-Key
	ProblemKeyInvalid       = "urn:idem:problem:key-invalid"       // 400: malformed or repeated Idempotency-Key
	ProblemBodyTooLarge     = "urn:idem:problem:body-too-large"    // 413: request body over Config.MaxBodySize
	ProblemInFlight         = "urn:idem:problem:in-flight"         // 409: the same key is being processed
	ProblemMismatch         = "urn:idem:problem:mismatch"          // 422: the key was used with a different request
	ProblemStoreUnavailable = "urn:idem:problem:store-unavailable" // 503: the idempotency store failed; nothing ran
	// 503: the idempotency store is full (idem.ErrStoreFull) and takes no
	// new key until records expire; nothing ran
	ProblemStoreFull = "urn:idem:problem:store-full"
	// 429: the client's tenant holds its Config.Quota (keys in flight,
	// records or bytes); the request did not run and nothing was claimed.
	// Retry-After says when some of it comes back.
	ProblemQuotaExceeded = "urn:idem:problem:quota-exceeded"
	// 503: the blob store (Config.Blobs) does not answer; the request did not run
	ProblemBlobStoreUnavailable = "urn:idem:problem:blob-store-unavailable"
	// 503: the request completed before, but its stored body cannot be read
	// from the blob store (missing, corrupt, or the store does not answer);
	// it is not run again
	ProblemStoredBodyUnavailable = "urn:idem:problem:stored-body-unavailable"
	// 500: the request completed before, but its response body was larger
	// than Config.MaxResponseSize and was not kept (no blob store, or the
	// blob store failed); it is not run again. The member status_executed
	// (Problem.StatusExecuted) and the header Idempotent-Original-Status
	// give the status it was executed with.
	ProblemResponseNotKept = "urn:idem:problem:response-not-kept"
	// 500: the request completed before, but its stored response is sealed
	// (Config.Seal) and cannot be opened: altered in the store, sealed
	// under a key id no longer in the ring, copied from another key, or
	// read without a Sealer (idem.ErrUnsealable); it is not run again, and
	// a retry gets this answer until the record expires
	ProblemResponseUnreadable = "urn:idem:problem:response-unreadable"
	// 401: the request carries an Idempotency-Key but nothing that
	// identifies its caller, and Config.RefuseAnonymous is set; nothing ran
	ProblemAnonymous = "urn:idem:problem:anonymous"
	// 401: the key source refused the request as not genuine
	// (ErrKeyUnverified: a webhook signature that does not verify, say);
	// nothing ran and nothing was claimed
	ProblemUnverified = "urn:idem:problem:unverified"
)

// Problem is an RFC 9457 problem details object.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// StatusExecuted is the status a request answered with
	// ProblemResponseNotKept was executed with (an extension member).
	StatusExecuted int `json:"status_executed,omitempty"`
	// RetryAfter, in seconds, is sent as the Retry-After header when
	// positive (409, 429 and 503).
	RetryAfter int `json:"-"`
}

// WriteProblem writes p as application/problem+json. It is the default
// Config.ErrorHandler.
func WriteProblem(w http.ResponseWriter, _ *http.Request, p *Problem) {
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	if p.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(p.RetryAfter))
	}
	w.WriteHeader(p.Status)
	json.NewEncoder(w).Encode(p)
}

var (
	problemKeyMissing = Problem{Type: ProblemKeyMissing, Title: "Idempotency-Key required", Status: http.StatusBadRequest,
		Detail: "This request must carry an Idempotency-Key header."}
	problemBodyTooLarge = Problem{Type: ProblemBodyTooLarge, Title: "Request body too large", Status: http.StatusRequestEntityTooLarge}
	problemInFlight     = Problem{Type: ProblemInFlight, Title: "Request in progress", Status: http.StatusConflict, RetryAfter: 1,
		Detail: "A request with this Idempotency-Key is being processed. Retry later with the same key to get its result."}
	problemMismatch = Problem{Type: ProblemMismatch, Title: "Idempotency-Key reused", Status: http.StatusUnprocessableEntity,
		Detail: "This Idempotency-Key was used with a different request (method, path, query, content type or body)."}
	problemMismatchCookies = Problem{Type: ProblemMismatch, Title: "Idempotency-Key reused", Status: http.StatusUnprocessableEntity,
		Detail: "This Idempotency-Key was used by another client (other cookies): its result is not yours to see."}
	problemStore = Problem{Type: ProblemStoreUnavailable, Title: "Idempotency store unavailable", Status: http.StatusServiceUnavailable, RetryAfter: 1,
		Detail: "The request was not processed. Retry later with the same key."}
	problemStoreFull = Problem{Type: ProblemStoreFull, Title: "Idempotency store full", Status: http.StatusServiceUnavailable, RetryAfter: 1,
		Detail: "The idempotency store holds all the records it may, and takes no new key until older ones expire. The request was not processed. Retry later with the same key."}
	problemQuotaExceeded = Problem{Type: ProblemQuotaExceeded, Title: "Idempotency quota exceeded", Status: http.StatusTooManyRequests}
	problemBlobStore     = Problem{Type: ProblemBlobStoreUnavailable, Title: "Blob store unavailable", Status: http.StatusServiceUnavailable, RetryAfter: 1,
		Detail: "The store for large responses does not answer. The request was not processed. Retry later with the same key."}
	problemAnonymous = Problem{Type: ProblemAnonymous, Title: "Caller not identified", Status: http.StatusUnauthorized,
		Detail: "Requests with an Idempotency-Key must identify their caller (an Authorization header, an API key, a client certificate or the configured tenant source), so that no caller is answered with another's result. The request was not processed."}
	problemNotKept    = Problem{Type: ProblemResponseNotKept, Title: "Response executed but not kept", Status: http.StatusInternalServerError}
	problemUnreadable = Problem{Type: ProblemResponseUnreadable, Title: "Response executed but unreadable", Status: http.StatusInternalServerError,
		Detail: "This request was executed and will not be executed again, but its stored response is sealed and cannot be opened " +
			"(it was altered in the store, or the key that sealed it is no longer configured). It cannot be replayed; " +
			"a retry with this key gets this answer until the record expires."}
	problemStoredBody = Problem{Type: ProblemStoredBodyUnavailable, Title: "Stored response unavailable", Status: http.StatusServiceUnavailable, RetryAfter: 1,
		Detail: "This request was processed before, but its stored response body cannot be read now. It was not processed again."}
)
