package sidecar

import (
	"errors"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/webhook"
)

// keySource is the idemhttp.KeySource of a route with settings s: the
// Idempotency-Key header when neither Key nor Webhook is set; KeySpec(Key);
// or, with Webhook, a source that reads the body and verifies each
// request's signature with the preset (internal/webhook) before it names
// the preset's key. A request whose signature does not verify is refused
// 401 (idemhttp.ErrKeyUnverified, the verifier's message as the detail:
// it holds no secret) and counted in m's idem_webhook_unverified_total
// (m may be nil: not counted); a genuine delivery that names no key is
// answered as a request without a key (idem.ErrMissingKey).
//
// The webhook secrets are read here, from WebhookSecretFile or
// WebhookSecretEnv, each time it is called (the front ends call it
// through Middleware when a route's middleware is made: at start and on
// each reload, so that secrets rotate without a restart). An error names
// the file or variable and the line of a bad secret, never a secret. It
// expects settings that Validate accepts.
// now is the clock the signed timestamps are checked against (tests
// pass the fixtures' signing time).
func (s Settings) keySource(m *Metrics, now func() time.Time) (idemhttp.KeySource, error) {
	switch {
	case s.Webhook != "":
		return s.webhookKeySource(m, now)
	case s.Key != "":
		return KeySpec(s.Key)
	}
	return idemhttp.KeySource{}, nil
}

func (s Settings) webhookKeySource(m *Metrics, now func() time.Time) (idemhttp.KeySource, error) {
	p, err := webhook.Lookup(s.Webhook)
	if err != nil {
		return idemhttp.KeySource{}, err
	}
	if s.WebhookTolerance != 0 {
		p.Tolerance = s.WebhookTolerance
	}
	var secrets webhook.Secrets
	if s.WebhookSecretFile != "" {
		secrets, err = webhook.SecretsFromFile(s.WebhookSecretFile)
	} else {
		secrets, err = webhook.SecretsFromEnv(s.WebhookSecretEnv)
	}
	if err != nil {
		return idemhttp.KeySource{}, err
	}
	v, err := webhook.NewVerifier(p, secrets)
	if err != nil {
		return idemhttp.KeySource{}, err
	}
	var unverified prometheus.Counter
	if m != nil {
		unverified = m.WebhookUnverified.WithLabelValues(p.Name()) // the series, at zero from now on
	}
	return idemhttp.KeySource{NeedsBody: true, Key: func(r *http.Request, body []byte) (string, error) {
		key, err := v.Verify(r.Header, body, now())
		switch {
		case errors.Is(err, webhook.ErrUnverified):
			if unverified != nil {
				unverified.Inc()
			}
			return "", keyError{idemhttp.ErrKeyUnverified, err}
		case errors.Is(err, webhook.ErrNoKey):
			return "", keyError{idem.ErrMissingKey, err}
		}
		// nil, or (Verify promises none) another error: an invalid key.
		return key, err
	}}, nil
}

// keyError is a webhook verifier's error err (its message the problem's
// detail) that also wraps the sentinel that picks idemhttp's answer.
type keyError struct{ sentinel, err error }

func (e keyError) Error() string   { return e.err.Error() }
func (e keyError) Unwrap() []error { return []error{e.sentinel, e.err} }
