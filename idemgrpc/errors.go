package idemgrpc

import (
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo detail that the
// interceptor attaches to its own error statuses; its Reason is one of the
// Reason constants. A handler's own errors never carry it.
const ErrorDomain = "idem.idemkit.github.com"

// Reasons of the interceptor's own error statuses (google.rpc.ErrorInfo).
// They are stable; the status messages are not.
const (
	ReasonKeyMissing       = "IDEMPOTENCY_KEY_MISSING"               // InvalidArgument: RequireKey, and no key
	ReasonKeyInvalid       = "IDEMPOTENCY_KEY_INVALID"               // InvalidArgument: malformed key, or more than one
	ReasonInFlight         = "IDEMPOTENCY_KEY_IN_FLIGHT"             // Aborted, with RetryInfo: another call holds the key
	ReasonMismatch         = "IDEMPOTENCY_KEY_REUSED"                // FailedPrecondition: the key was used with another request
	ReasonStoreUnavailable = "IDEMPOTENCY_STORE_UNAVAILABLE"         // Unavailable, with RetryInfo: the store failed; nothing ran
	ReasonResponseOmitted  = "IDEMPOTENT_RESPONSE_NOT_STORED"        // DataLoss: completed, but its response was too large to keep
	ReasonUnreplayable     = "IDEMPOTENT_RESPONSE_UNREADABLE"        // Internal: the stored response cannot be decoded
	ReasonUnsealable       = "IDEMPOTENT_RESPONSE_UNSEALABLE"        // DataLoss: completed, but its sealed response cannot be opened (Config.Seal); not run again
	ReasonNotFingerprinted = "IDEMPOTENCY_REQUEST_NOT_FINGERPRINTED" // Internal: the request could not be fingerprinted
	ReasonAnonymous        = "IDEMPOTENCY_CALLER_UNIDENTIFIED"       // Unauthenticated: RefuseAnonymous, and nothing identifies the caller
)

// ErrorReason returns the Reason of an error status the interceptor
// produced (in flight, mismatch, key missing, ...), or "" for any other
// error, a handler's included.
func ErrorReason(err error) string {
	st, ok := status.FromError(err)
	if !ok || st == nil {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == ErrorDomain {
			return info.GetReason()
		}
	}
	return ""
}

// RetryDelay returns the delay of the google.rpc.RetryInfo detail of an
// error status, if it has one.
func RetryDelay(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok || st == nil {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return max(ri.GetRetryDelay().AsDuration(), 0), true
		}
	}
	return 0, false
}

// errorStatus builds one of the interceptor's own errors; retry > 0 adds a
// RetryInfo.
func errorStatus(code codes.Code, reason, msg string, retry time.Duration) error {
	st := status.New(code, msg)
	info := &errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}
	var err error
	if retry > 0 {
		st, err = st.WithDetails(info, &errdetails.RetryInfo{RetryDelay: durationpb.New(retry)})
	} else {
		st, err = st.WithDetails(info)
	}
	if err != nil { // only for code OK, which is never used here
		return status.Error(code, msg)
	}
	return st.Err()
}
