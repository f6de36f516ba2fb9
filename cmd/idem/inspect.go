package main

import (
	"cmp"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/internal/sidecar"
	"github.com/idemkit/idem/seal"
	"github.com/idemkit/idem/seal/awskms"
)

func init() {
	commands["inspect"] = command{
		summary: "show the record of one idempotency key",
		run:     runInspect,
	}
	commands["purge"] = command{
		summary: "delete the record of one idempotency key",
		run:     runPurge,
	}
}

// inspectBodyShown is how much of a stored body inspect prints.
const inspectBodyShown = 256

const inspectUsage = `usage: idem inspect --store STORE (--key K --route R [--tenant T] [--method M] | --stored-key S) [--blob URL] [--seal-keys FILE] [--json]

Shows the record of one key: its state, fencing token, the lease (in
flight) or retention (completed) left, its stored size and fingerprint,
and for a completed record the stored status, headers and the start of
the body, or where the body lives when it is in a blob store (with
--blob, also whether that blob is there with the size recorded). A
sealed record (the proxy's --seal-keys) shows its metadata and the id of
the key that sealed it, not its response, unless --seal-keys names the
ring to open it with; one that does not open with that ring says so and
exits with status 1. A missing (or expired) record prints "no record"
and exits with status 1.
`

const purgeUsage = `usage: idem purge --store STORE (--key K --route R [--tenant T] [--method M] | --stored-key S) [--blob URL] --yes [--json]

Deletes the record of one key, whatever its state: a completed key runs
its operation again on its next request, an in-flight one can be taken
by another caller at once, and the key's fencing-token history is lost.
A body kept in a blob store is deleted too, after the record, when
--blob names the store (else idem gc removes it later). Without --yes it
does nothing. A missing record prints "no record" and exits with status 1.
`

const inspectSelectUsage = `
Which record: --key with its scope (as idem.Scope{Tenant, Method, Route}.Key
derives it), or --stored-key, the 22-character form in idem's logs and in
the Redis key name idem:{…}. For idemhttp's middleware and the proxy, the
method is the HTTP method; the route is the ServeMux pattern that matched
(such as "POST /charges") in a middleware on a ServeMux, and for the proxy
its --config route's match, or else the path (a proxy without --config:
--route /charges). The tenant is empty when the request had no
Authorization header, client certificate or --tenant-cookie cookie;
otherwise it is a digest of it (--tenant-header's is hdr: and the raw
value): take the stored key from the proxy's log line (key=…) and use
--stored-key.

STORE (required) is the store the proxies use, one of these:
` + sharedStores + `.
Not memory: a memory store lives inside each proxy's process, and this
command runs in another. Nothing is created in the store: a PostgreSQL
or MySQL database without idem's table is an error.

flags:
`

// inspectString is a string flag that knows whether it was set, on the
// command line or from the environment.
type inspectString struct {
	v   string
	set bool
}

func (s *inspectString) String() string {
	if s == nil {
		return ""
	}
	return s.v
}

func (s *inspectString) Set(v string) error {
	s.v, s.set = v, true
	return nil
}

// inspectFlags are the flags inspect and purge share.
type inspectFlags struct {
	store, prefix, blob                   string
	sealKeys                              string // inspect only
	tenant, method, route, key, storedKey inspectString
	json                                  bool
	yes                                   bool // purge only
}

func newInspectFlags(name, usage string, stderr io.Writer) (*flag.FlagSet, *inspectFlags) {
	f := &inspectFlags{method: inspectString{v: http.MethodPost}}
	fs := flag.NewFlagSet("idem "+name, flag.ContinueOnError)
	fs.StringVar(&f.store, "store", "", "the store the proxies use (required): "+storeFlagHelpRead)
	fs.StringVar(&f.prefix, "prefix", "", `Redis key prefix (empty: redisstore's default, "idem:") or PostgreSQL namespace (empty: the default namespace)`)
	fs.Var(&f.tenant, "tenant", "the key's `tenant` (idemhttp's default: empty when the request had no Authorization header nor client certificate)")
	fs.Var(&f.method, "method", "the key's `method`, as sent (upper case for HTTP)")
	fs.Var(&f.route, "route", "the key's `route`: the ServeMux pattern such as \"POST /charges\", or the path")
	fs.Var(&f.key, "key", "the client's idempotency `key` (the Idempotency-Key header's value)")
	fs.Var(&f.storedKey, "stored-key", "the stored key, `S`: 22 base64url characters, as in logs and Redis key names")
	fs.BoolVar(&f.json, "json", false, "print JSON")
	fs.StringVar(&f.blob, "blob", "", "the blob store of large bodies, as the proxy's --blob: "+
		map[bool]string{true: "to delete the record's blob too", false: "to check that the record's blob is there"}[name == "purge"])
	if name == "purge" {
		fs.BoolVar(&f.yes, "yes", false, "really delete the record")
	} else {
		fs.StringVar(&f.sealKeys, "seal-keys", "", "the key ring `FILE` the proxies seal with (their --seal-keys): a sealed record's response is opened and shown; without it, a sealed record shows its metadata and key id only")
	}
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage, inspectSelectUsage)
		fs.PrintDefaults()
	}
	return fs, f
}

// selected returns the key the flags name.
func (f *inspectFlags) selected() (idem.Key, error) {
	switch {
	case f.key.set && f.storedKey.set:
		return idem.Key{}, usageError{"--key and --stored-key both name the record: give one of them"}
	case f.storedKey.set:
		if f.tenant.set || f.method.set || f.route.set {
			return idem.Key{}, usageError{"--tenant, --method and --route go with --key; --stored-key is the whole key already"}
		}
		k, err := idem.ParseKey(f.storedKey.v)
		if err != nil {
			return idem.Key{}, usageError{"--stored-key: " + strings.TrimPrefix(err.Error(), "idem: ")}
		}
		return k, nil
	case f.key.set:
		if !f.route.set {
			return idem.Key{}, usageError{`--key needs --route, the route the key was used on (the ServeMux pattern such as "POST /charges", or the path)`}
		}
		k, err := idem.Scope{Tenant: f.tenant.v, Method: f.method.v, Route: f.route.v}.Key(f.key.v)
		if err != nil {
			return idem.Key{}, usageError{"--key: " + strings.TrimPrefix(err.Error(), "idem: ")}
		}
		return k, nil
	}
	return idem.Key{}, usageError{"which record? give --key K with --route R (and --tenant, --method), or --stored-key S"}
}

// open opens the store without creating anything in it (openStoreReading).
func (f *inspectFlags) open(ctx context.Context) (idem.Store, func(), error) {
	return openStoreReading(ctx, f.store, f.prefix, "it never holds a record")
}

// noRecord is the error of a key without a record: it names where inspect
// looked, the store with its database (sidecar.StoreForLog: /0 for
// Redis's default) and the prefix, since a wrong --store database,
// --prefix, --route, --tenant or --method is the usual cause; the
// database comes first, the likeliest mistake (redis://host/1 for the
// proxy's /0).
func (f *inspectFlags) noRecord(key idem.Key) error {
	prefix := strconv.Quote(f.prefix)
	if f.prefix == "" {
		prefix = "the default prefix"
	}
	store := storeForLog(f.store)
	if f.storedKey.set {
		return fmt.Errorf("no record for stored key %s under %s in %s\n"+
			"is %s the proxy's database (its start-up log's store=…) and --prefix its --prefix? (an expired or purged record is gone too)",
			key, prefix, store, storeDatabase(store))
	}
	return fmt.Errorf("no record for stored key %s (route %q, tenant %q, method %s) under %s in %s\n"+
		"is %s the proxy's database (its start-up log's store=…)? are --prefix and --route what the proxy uses (its --prefix; the path, or the --config match)? "+
		"the proxy logs each request's stored key (key=…): try --stored-key", key, f.route.v, f.tenant.v, f.method.v, prefix, store, storeDatabase(store))
}

// storeDatabase names the database of a store as StoreForLog writes it,
// for noRecord: "database /0 of redis://host:6379", or both of a tiered
// store's.
func storeDatabase(logged string) string {
	var dbs []string
	for _, u := range strings.Fields(logged) {
		scheme, rest, ok := strings.Cut(u, "://")
		host, db, hasDB := strings.Cut(rest, "/")
		if !ok || !hasDB {
			dbs = append(dbs, u)
			continue
		}
		dbs = append(dbs, fmt.Sprintf("database /%s of %s://%s", db, scheme, host))
	}
	return strings.Join(dbs, " and ")
}

func runInspect(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, f := newInspectFlags("inspect", inspectUsage, stderr)
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	key, err := f.selected()
	if err != nil {
		return err
	}
	sealer, err := sidecar.NewSealer(ctx, sidecar.SealSettings{Keys: f.sealKeys}, flagName)
	if err != nil {
		return usageError{err.Error()}
	}
	var blobs *blobstore.Bucket
	if f.blob != "" { // its URL checked whether or not the record has a blob
		if blobs, err = openBlobs(ctx, f.blob); err != nil {
			return err
		}
		defer blobs.Close()
	}
	store, closeStore, err := f.open(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	rec, ok, err := store.Get(ctx, key)
	if err != nil {
		return err
	}
	var sealed *sealedInfo
	if ok && rec.Response.Sealed() {
		sealed = openSealed(sealer, f.sealKeys, key, &rec)
	}
	var blob *blobState
	if ok && rec.Response != nil && rec.Response.Blob != nil && blobs != nil {
		blob = lookBlob(ctx, blobs, rec.Response.Blob)
	}
	if !ok {
		if f.json {
			if err := inspectJSON(stdout, struct {
				StoredKey string `json:"stored_key"`
				Found     bool   `json:"found"`
			}{key.String(), false}); err != nil {
				return err
			}
		} else {
			fmt.Fprintln(stdout, "no record")
		}
		return f.noRecord(key)
	}
	if f.json {
		err = inspectJSON(stdout, newInspectRecord(key, rec, blob, sealed))
	} else {
		err = printRecord(stdout, key, rec, blob, sealed)
	}
	if err == nil && sealed != nil && sealed.openErr != nil {
		return sealed.openErr
	}
	return err
}

// sealedInfo is what inspect knows of a sealed record: the key id its
// envelope names, and, given --seal-keys, whether it opened.
type sealedInfo struct {
	keyID   string // "" when the envelope names none inspect can read
	opened  bool
	openErr error // with --seal-keys: why it did not open
}

// openSealed opens rec's sealed response with sealer, the ring of
// keysFile (nil without --seal-keys: only its key id is read), replacing rec.Response with the
// clear one when it opens.
func openSealed(sealer *sidecar.Sealer, keysFile string, key idem.Key, rec *idem.Record) *sealedInfo {
	raw, _ := rec.Response.AppendBinary(nil) // a sealed carrier's bytes, as stored
	info := &sealedInfo{}
	if sealer == nil {
		// Only the envelope's header is read: no key is needed.
		if id, ok := seal.KeyID(raw); ok {
			info.keyID = id
		} else {
			info.keyID, _ = awskms.KeyID(raw)
		}
		return info
	}
	info.keyID, _ = sealer.KeyID(raw)
	resp, err := idem.OpenResponse(sealer, key, rec.Fingerprint, rec.Response)
	if err != nil {
		var se *idem.SealError
		if errors.As(err, &se) && se.Err != nil {
			err = se.Err
		}
		info.openErr = fmt.Errorf("the sealed response of stored key %s (key id %s) does not open with --seal-keys %s: %v",
			key, cmp.Or(info.keyID, "unknown"), keysFile, err)
		return info
	}
	info.opened = true
	rec.Response = resp
	return info
}

// blobState is what inspect --blob found of a record's blob.
type blobState struct {
	Present bool   `json:"present"`
	Size    int64  `json:"size,omitempty"` // when present
	Error   string `json:"error,omitempty"`
}

// lookBlob looks for ref's blob in the --blob store.
func lookBlob(ctx context.Context, blobs *blobstore.Bucket, ref *idem.BlobRef) *blobState {
	r, size, err := blobs.Open(ctx, ref.Name)
	switch {
	case errors.Is(err, idem.ErrBlobNotFound):
		return &blobState{}
	case err != nil:
		return &blobState{Error: err.Error()}
	}
	r.Close()
	return &blobState{Present: true, Size: size}
}

func runPurge(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs, f := newInspectFlags("purge", purgeUsage, stderr)
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	key, err := f.selected()
	if err != nil {
		return err
	}
	if !f.yes {
		return usageError{fmt.Sprintf("not deleting the record of stored key %s without --yes: "+
			"deleting is for good (a completed operation runs again on its next request)", key)}
	}
	var blobs *blobstore.Bucket
	if f.blob != "" { // opened (and its URL checked) before the store, and anything is deleted
		if blobs, err = openBlobs(ctx, f.blob); err != nil {
			return err
		}
		defer blobs.Close()
	}
	store, closeStore, err := f.open(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	rec, had, err := store.Get(ctx, key) // to say what is deleted
	if err != nil {
		return err
	}
	deleted, err := store.Delete(ctx, key)
	if err != nil {
		return err
	}
	// The blob goes after the record: a record never points to a blob
	// that is gone.
	var blobName string
	blobDeleted := false
	if had && rec.Response != nil && rec.Response.Blob != nil {
		blobName = rec.Response.Blob.Name
		if blobs != nil {
			switch err := blobs.Delete(ctx, blobName); {
			case err == nil, errors.Is(err, idem.ErrBlobNotFound):
				blobDeleted = true
			default:
				return fmt.Errorf("record %s deleted, but not its blob %s (idem gc will): %w", key, blobName, err)
			}
		}
	}
	if !deleted {
		if f.json {
			if err := inspectJSON(stdout, struct {
				StoredKey string `json:"stored_key"`
				Deleted   bool   `json:"deleted"`
			}{key.String(), false}); err != nil {
				return err
			}
		} else {
			fmt.Fprintln(stdout, "no record")
		}
		return f.noRecord(key)
	}
	if f.json {
		out := struct {
			StoredKey   string `json:"stored_key"`
			Deleted     bool   `json:"deleted"`
			State       string `json:"state,omitempty"`
			Token       uint64 `json:"token,omitempty"`
			Blob        string `json:"blob,omitempty"`
			BlobDeleted bool   `json:"blob_deleted,omitempty"`
		}{StoredKey: key.String(), Deleted: true, Blob: blobName, BlobDeleted: blobDeleted}
		if had {
			out.State, out.Token = rec.State.String(), rec.Token
		}
		return inspectJSON(stdout, out)
	}
	if had {
		fmt.Fprintf(stdout, "purged %s (was %s, token %d)\n", key, rec.State, rec.Token)
	} else {
		fmt.Fprintf(stdout, "purged %s\n", key)
	}
	switch {
	case blobDeleted:
		fmt.Fprintf(stdout, "deleted its blob %s\n", blobName)
	case had && rec.Response.Sealed():
		fmt.Fprintln(stdout, "its response was sealed: a body it kept in a blob store stays there until idem gc")
	case blobName != "":
		fmt.Fprintf(stdout, "its body stays in the blob store as %s until idem gc (or give --blob to delete it now)\n", blobName)
	}
	return nil
}

// inspectRecord is a record as inspect --json prints it.
type inspectRecord struct {
	StoredKey   string           `json:"stored_key"`
	Found       bool             `json:"found"`
	State       string           `json:"state"`
	Token       uint64           `json:"token"`
	LeaseID     string           `json:"lease_id,omitempty"`    // in flight
	TTLMS       int64            `json:"ttl_ms"`                // until the record expires: lease left (in flight), retention left (completed)
	Fingerprint string           `json:"fingerprint,omitempty"` // hex; none when released
	Size        int              `json:"size,omitempty"`        // stored bytes, when the store knows
	Sealed      bool             `json:"sealed,omitempty"`      // the response is sealed at rest
	KeyID       string           `json:"key_id,omitempty"`      // the key that sealed it, as its envelope says
	Opened      bool             `json:"opened,omitempty"`      // sealed, and opened with --seal-keys: Response is its content
	OpenError   string           `json:"open_error,omitempty"`  // sealed, and did not open with --seal-keys
	Response    *inspectResponse `json:"response,omitempty"`    // completed (sealed: only when opened)
}

type inspectResponse struct {
	Status      int          `json:"status"`
	Header      http.Header  `json:"header"`
	BodySize    int          `json:"body_size"`
	Body        []byte       `json:"body_base64"`
	BodyOmitted bool         `json:"body_omitted,omitempty"` // larger than MaxResponseSize: not stored
	Blob        *inspectBlob `json:"blob,omitempty"`         // the body is in a blob store
}

// inspectBlob is where a body in a blob store lives.
type inspectBlob struct {
	Name   string     `json:"name"`
	Size   int64      `json:"size"`
	SHA256 string     `json:"sha256"`
	Found  *blobState `json:"found,omitempty"` // with --blob
}

func newInspectRecord(key idem.Key, rec idem.Record, blob *blobState, sealed *sealedInfo) inspectRecord {
	out := inspectRecord{StoredKey: key.String(), Found: true, State: rec.State.String(), Token: rec.Token,
		TTLMS: rec.TTL.Milliseconds(), Size: rec.Size}
	if sealed != nil {
		out.Sealed, out.KeyID, out.Opened = true, sealed.keyID, sealed.opened
		if sealed.openErr != nil {
			out.OpenError = sealed.openErr.Error()
		}
		if !sealed.opened {
			return out
		}
	}
	if rec.State != idem.StateReleased {
		out.Fingerprint = hex.EncodeToString(rec.Fingerprint[:])
	}
	if rec.State == idem.StateInFlight {
		out.LeaseID = rec.LeaseID.String()
	}
	if resp := rec.Response; resp != nil {
		out.Response = &inspectResponse{Status: resp.Status, Header: resp.Header, BodySize: len(resp.Body),
			Body: resp.Body, BodyOmitted: resp.BodyOmitted}
		if ref := resp.Blob; ref != nil {
			out.Response.BodySize = int(ref.Size)
			out.Response.Blob = &inspectBlob{Name: ref.Name, Size: ref.Size, SHA256: hex.EncodeToString(ref.SHA256[:]), Found: blob}
		}
		if out.Response.Header == nil {
			out.Response.Header = http.Header{}
		}
	}
	return out
}

func inspectJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// printRecord prints rec as "name: value" lines.
func printRecord(w io.Writer, key idem.Key, rec idem.Record, blob *blobState, sealed *sealedInfo) error {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	line := func(name, format string, args ...any) {
		fmt.Fprintf(tw, "%s:\t%s\n", name, fmt.Sprintf(format, args...))
	}
	line("stored key", "%s", key)
	line("state", "%s", rec.State)
	line("token", "%d", rec.Token)
	switch rec.State {
	case idem.StateInFlight:
		line("lease left", "%s", inspectDuration(rec.TTL))
		line("lease id", "%s", rec.LeaseID)
	case idem.StateCompleted:
		line("retention left", "%s", inspectDuration(rec.TTL))
	default:
		line("expires in", "%s", inspectDuration(rec.TTL))
	}
	if rec.State != idem.StateReleased { // a released record keeps only the token
		line("fingerprint", "%s", hex.EncodeToString(rec.Fingerprint[:]))
	}
	if rec.Size > 0 {
		line("size", "%d bytes stored", rec.Size)
	}
	if sealed != nil {
		id := cmp.Or(sealed.keyID, "unknown (not a key ring's envelope)")
		switch {
		case sealed.opened:
			line("sealed", "yes, key id %s (opened with --seal-keys)", id)
		case sealed.openErr != nil:
			line("sealed", "yes, key id %s: does NOT open with --seal-keys (see the error)", id)
			return tw.Flush()
		default:
			line("sealed", "yes, key id %s (its status, headers and body are encrypted; give --seal-keys FILE, the proxies' ring, to show them)", id)
			return tw.Flush()
		}
	}
	if resp := rec.Response; resp != nil {
		line("status", "%d %s", resp.Status, http.StatusText(resp.Status))
		names := make([]string, 0, len(resp.Header))
		for name := range resp.Header {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			for _, v := range resp.Header[name] {
				line("header", "%s: %s", inspectEscape(name, 200), inspectEscape(v, 200))
			}
		}
		switch {
		case resp.Blob != nil:
			line("body", "in the blob store: %s (%d bytes)", resp.Blob.Name, resp.Blob.Size)
			line("body sha256", "%s", hex.EncodeToString(resp.Blob.SHA256[:]))
			switch {
			case blob == nil:
			case blob.Error != "":
				line("blob", "could not be checked: %s", blob.Error)
			case !blob.Present:
				line("blob", "MISSING: a replay answers 503 until the record expires; to run the key again: %s", purgeHint(key))
			case blob.Size != resp.Blob.Size:
				line("blob", "present, but %d bytes (CORRUPT: a replay answers 503 until the record expires; to run the key again: %s)",
					blob.Size, purgeHint(key))
			default:
				line("blob", "present, %d bytes", blob.Size)
			}
		case resp.BodyOmitted:
			line("body", "(not stored: it was larger than the maximum response size)")
		case len(resp.Body) == 0:
			line("body", "(empty)")
		default:
			line("body", "%s (%d bytes)", inspectEscape(string(resp.Body), inspectBodyShown), len(resp.Body))
		}
	}
	return tw.Flush()
}

// purgeHint is the idem purge that deletes the record of key and its
// blob, for a record whose blob is missing or corrupt.
func purgeHint(key idem.Key) string {
	return "idem purge --stored-key " + key.String() + " --blob URL --yes, with the same --store and --prefix"
}

// inspectDuration rounds a time left for reading: to the second past a
// minute, else to the millisecond.
func inspectDuration(d time.Duration) string {
	if d >= time.Minute {
		d = d.Round(time.Second)
	} else {
		d = d.Round(time.Millisecond)
	}
	return d.String()
}

// inspectEscape makes stored bytes safe to print on a terminal: printable
// characters as they are, backslash, newline, tab and carriage return as
// Go escapes, anything else (control bytes, invalid UTF-8) as \xNN or
// \uNNNN. It stops after max bytes of s and then ends in "…".
func inspectEscape(s string, max int) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		if i >= max {
			b.WriteString("…")
			break
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case unicode.IsPrint(r):
			b.WriteRune(r)
		default:
			b.WriteString(strings.Trim(strconv.QuoteRuneToASCII(r), `'`))
		}
		i += size
	}
	return b.String()
}
