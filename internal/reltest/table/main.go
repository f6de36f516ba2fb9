// Command table turns the rows that reltest.Report appends to
// IDEM_RELIABILITY_OUT (one JSON object per line) into the markdown table
// of RELIABILITY.md, sorted by scenario and store (rows of one scenario
// keep their order). Used by scripts/reliability.sh.
package main

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/idemkit/idem/internal/reltest"
)

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "table:", err)
		os.Exit(1)
	}
}

func run(in io.Reader, out io.Writer) error {
	var rows []reltest.Row
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for line := 1; sc.Scan(); line++ {
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		var r reltest.Row
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return fmt.Errorf("line %d: %w", line, err)
		}
		rows = append(rows, r)
	}
	if err := sc.Err(); err != nil {
		return err
	}
	slices.SortStableFunc(rows, func(a, b reltest.Row) int {
		return cmp.Or(strings.Compare(a.Scenario, b.Scenario), strings.Compare(a.Store, b.Store))
	})
	fmt.Fprintln(out, "| scenario | store | fault | requests | keys | duplicate effects | lost completions | stuck keys | errors seen by clients | notes |")
	fmt.Fprintln(out, "|---|---|---|---:|---:|---:|---:|---:|---|---|")
	for _, r := range rows {
		fmt.Fprintf(out, "| %s | %s | %s | %d | %d | %d | %d | %d | %s | %s |\n",
			cell(r.Scenario), cell(r.Store), cell(r.Fault), r.Requests, r.Keys, r.Duplicates, r.Lost, r.Stuck,
			cell(reltest.FormatErrors(r.ClientErrors)), cell(r.Notes))
	}
	return nil
}

// cell keeps a value inside its table cell.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}
