package redisserver

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

const (
	// doTimeout bounds one Do call: dial, write and read.
	doTimeout = 10 * time.Second
	// dialTimeout bounds connecting to a server.
	dialTimeout = 2 * time.Second
	// maxBulkLen is Redis's default proto-max-bulk-len.
	maxBulkLen = 512 << 20
)

// ErrNil is returned by Do when the reply is a nil bulk string or nil array,
// e.g. GET of a missing key.
var ErrNil = errors.New("redisserver: nil reply")

// ReplyError is an error reply from the server, such as
// "WRONGTYPE Operation against a key holding the wrong kind of value" or
// "MOVED 3999 127.0.0.1:7001". Its text is exactly the server's.
type ReplyError string

func (e ReplyError) Error() string { return string(e) }

// Do sends one command to the server on a new connection and returns the
// reply as text, all within 10s:
//   - simple strings, integers and bulk strings are returned as they are
//     (so INFO text keeps its "\r\n" line ends; see InfoField);
//   - arrays are rendered as their elements joined by "\n", nested arrays
//     flattened, nil elements as "" and error elements as their text;
//   - an error reply is returned as a ReplyError, a top-level nil as ErrNil.
//
// Because every call uses its own connection, connection state (SELECT,
// MULTI, CLIENT SETNAME, ...) does not carry over between calls.
func (s *Server) Do(args ...string) (string, error) {
	return do(s.Addr(), doTimeout, args...)
}

// do runs one command against addr, bounded by timeout.
func do(addr string, timeout time.Duration, args ...string) (string, error) {
	if len(args) == 0 {
		return "", errors.New("redisserver: Do needs a command")
	}
	conn, err := net.DialTimeout("tcp", addr, min(dialTimeout, timeout))
	if err != nil {
		return "", fmt.Errorf("redisserver: %s: %w", args[0], err)
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return "", fmt.Errorf("redisserver: %s: %w", args[0], err)
	}
	if _, err := conn.Write(encodeCommand(args)); err != nil {
		return "", fmt.Errorf("redisserver: %s: %w", args[0], err)
	}
	reply, err := readReply(bufio.NewReader(conn))
	var replyErr ReplyError
	if err != nil && !errors.Is(err, ErrNil) && !errors.As(err, &replyErr) {
		return "", fmt.Errorf("redisserver: %s: %w", args[0], err)
	}
	return reply, err
}

// encodeCommand encodes args as a RESP array of bulk strings.
func encodeCommand(args []string) []byte {
	b := fmt.Appendf(nil, "*%d\r\n", len(args))
	for _, arg := range args {
		b = fmt.Appendf(b, "$%d\r\n%s\r\n", len(arg), arg)
	}
	return b
}

// readReply reads one RESP2 reply and renders it as Do describes.
func readReply(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line, ok := strings.CutSuffix(line, "\r\n")
	if !ok || line == "" {
		return "", fmt.Errorf("malformed reply line %q", line)
	}
	kind, body := line[0], line[1:]
	switch kind {
	case '+':
		return body, nil
	case '-':
		return "", ReplyError(body)
	case ':':
		if _, err := strconv.ParseInt(body, 10, 64); err != nil {
			return "", fmt.Errorf("malformed integer reply %q", body)
		}
		return body, nil
	case '$':
		n, err := parseLen(body, maxBulkLen)
		if err != nil || n < 0 {
			return "", err
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		if string(buf[n:]) != "\r\n" {
			return "", errors.New("malformed bulk string: missing CRLF")
		}
		return string(buf[:n]), nil
	case '*':
		n, err := parseLen(body, maxBulkLen)
		if err != nil || n < 0 {
			return "", err
		}
		elems := make([]string, 0, min(n, 1024))
		for range n {
			elem, err := readReply(r)
			var replyErr ReplyError
			switch {
			case errors.As(err, &replyErr):
				elem = string(replyErr)
			case err != nil && !errors.Is(err, ErrNil):
				return "", err
			}
			elems = append(elems, elem)
		}
		return strings.Join(elems, "\n"), nil
	default:
		return "", fmt.Errorf("unknown reply type %q", kind)
	}
}

// parseLen parses the length of a bulk string or array. It returns -1 and
// ErrNil for a nil reply.
func parseLen(s string, limit int) (int, error) {
	n, err := strconv.Atoi(s)
	switch {
	case err != nil || n < -1 || n > limit:
		return 0, fmt.Errorf("malformed length %q", s)
	case n == -1:
		return -1, ErrNil
	}
	return n, nil
}

// InfoField returns the value of field in the text of an INFO or CLUSTER
// INFO reply, which consists of "field:value" lines, and whether it was
// present.
func InfoField(info, field string) (string, bool) {
	for line := range strings.Lines(info) {
		name, value, ok := strings.Cut(strings.TrimRight(line, "\r\n"), ":")
		if ok && name == field {
			return value, true
		}
	}
	return "", false
}
