package idemhttp_test

import (
	"io"
	"log"
	"log/slog"
)

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

func quietStdLogger() *log.Logger { return log.New(io.Discard, "", 0) }
