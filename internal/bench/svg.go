package bench

import (
	"encoding/xml"
	"fmt"
	"math"
	"strings"
)

// implColors gives every implementation one color in every panel.
var implColors = map[string]string{
	"none":         "#9e9e9e",
	"naive":        "#d62728",
	"watch":        "#ff7f0e",
	"lua":          "#1f77b4",
	"idem-rueidis": "#2ca02c",
	"idem-goredis": "#17becf",
	"idem-wait":    "#9467bd",
	"idem-409":     "#8c564b",
	"idem-sealed":  "#e377c2",
	"idem-v1off":   "#7f7f7f",
}

// colorOf is impl's color: its Impl's, else the built-in one, else gray.
func colorOf(meta Meta, impl string) string {
	for _, im := range meta.Impls {
		if im.Name == impl && im.Color != "" {
			return im.Color
		}
	}
	if c, ok := implColors[impl]; ok {
		return c
	}
	return "#7f7f7f"
}

func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s))
	return b.String()
}

// niceMax rounds v up to 1, 2 or 5 times a power of ten.
func niceMax(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

// renderSVG draws, per scenario, throughput bars (left) and latency
// percentiles (right: p99 light, p95 medium, p50 dark, one bar each per
// implementation), each panel on its own scale, with the values written
// beside the bars and duplicate executions flagged in red.
func RenderSVG(rs []Result, meta Meta) string {
	const (
		width    = 1000
		margin   = 16
		labelW   = 100
		barW     = 220
		panelW   = (width - 2*margin) / 2
		rowH     = 22
		barH     = 15
		headH    = 50
		blockGap = 18
	)
	type block struct {
		sc   Scenario
		rows []Result
	}
	var blocks []block
	for _, sc := range meta.Scenarios {
		b := block{sc: sc}
		for _, r := range rs {
			if r.Scenario == sc.Name {
				b.rows = append(b.rows, r)
			}
		}
		if len(b.rows) > 0 {
			blocks = append(blocks, b)
		}
	}
	height := 78
	for _, b := range blocks {
		height += headH + len(b.rows)*rowH + blockGap
	}
	height += 20

	var s strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&s, format, a...) }
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica, Arial, sans-serif" font-size="12">`+"\n", width, height, width, height)
	p(`<rect width="100%%" height="100%%" fill="#ffffff"/>` + "\n")
	mode := "closed loop"
	if meta.Rate > 0 {
		mode = fmt.Sprintf("open loop at %s req/s", thousands(int64(meta.Rate)))
	}
	size := ""
	if meta.Quick {
		size = ", --quick"
	}
	title := "idem bench: the same handler behind naive, WATCH, Lua and idem on one Redis"
	if len(peerNames(meta.Impls)) > 0 {
		title = "idem bench: the same handler behind naive, WATCH, Lua, idem and its peers on one Redis"
	}
	if meta.Instances > 1 {
		size += fmt.Sprintf(", %d instances each", meta.Instances)
	}
	p(`<text x="%d" y="24" font-size="17" font-weight="bold">%s</text>`+"\n", margin, esc(title))
	p(`<text x="%d" y="42" fill="#555">%s · %s · GOMAXPROCS %d · %s%s · each panel has its own scale</text>`+"\n",
		margin, esc(meta.Date), esc(meta.Redis), meta.Procs, esc(mode), esc(size))
	// Legend for the latency panels.
	lx := margin + panelW + labelW
	p(`<text x="%d" y="62" fill="#555">latency, first send → final answer:</text>`+"\n", lx)
	lx += 215
	for i, l := range []struct{ name, op string }{{"p50", "1"}, {"p95", "0.55"}, {"p99", "0.25"}} {
		x := lx + i*55
		p(`<rect x="%d" y="52" width="14" height="12" fill="#444" fill-opacity="%s"/><text x="%d" y="62">%s</text>`+"\n", x, l.op, x+18, l.name)
	}
	p(`<text x="%d" y="62" fill="#555">throughput, logical requests per second</text>`+"\n", margin+labelW)

	y := 78
	for _, b := range blocks {
		p(`<text x="%d" y="%d" font-size="13.5" font-weight="bold">(%s) %s</text>`+"\n", margin, y+14, esc(b.sc.Name), esc(b.sc.Title))
		var maxRPS, maxLat float64
		for _, r := range b.rows {
			maxRPS = max(maxRPS, r.RPS)
			maxLat = max(maxLat, r.P99ms)
		}
		maxRPS, maxLat = niceMax(maxRPS), niceMax(maxLat)
		top := y + headH - 14
		// Gridlines and scale labels at 0, half and full scale.
		for _, panel := range []struct {
			x0   int
			full float64
			unit string
		}{{margin + labelW, maxRPS, " req/s"}, {margin + panelW + labelW, maxLat, " ms"}} {
			for _, f := range []float64{0, 0.5, 1} {
				gx := float64(panel.x0) + f*barW
				p(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", gx, top-4, gx, top+len(b.rows)*rowH)
				label := thousands(int64(f * panel.full))
				if panel.unit == " ms" && panel.full < 10 {
					label = fmt.Sprintf("%g", f*panel.full)
				}
				p(`<text x="%.1f" y="%d" text-anchor="middle" font-size="10" fill="#888">%s%s</text>`+"\n", gx, top-7, label, esc(map[bool]string{true: panel.unit}[f == 1]))
			}
		}
		for i, r := range b.rows {
			ry := top + i*rowH
			color := colorOf(meta, r.Impl)
			// Throughput.
			x0 := margin + labelW
			p(`<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", x0-6, ry+12, esc(r.Impl))
			w := barW * r.RPS / maxRPS
			p(`<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", x0, ry, w, barH, color)
			p(`<text x="%.1f" y="%d">%s`, float64(x0)+w+5, ry+12, thousands(int64(math.Round(r.RPS))))
			if r.Duplicates > 0 {
				p(` <tspan fill="#d62728" font-weight="bold">· %s duplicates</tspan>`, thousands(int64(r.Duplicates)))
			}
			p("</text>\n")
			// Latency: p99, p95, p50 drawn over each other.
			x1 := margin + panelW + labelW
			p(`<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", x1-6, ry+12, esc(r.Impl))
			for _, q := range []struct {
				v  float64
				op string
			}{{r.P99ms, "0.25"}, {r.P95ms, "0.55"}, {r.P50ms, "1"}} {
				p(`<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s" fill-opacity="%s"/>`+"\n", x1, ry, barW*math.Min(q.v/maxLat, 1), barH, color, q.op)
			}
			p(`<text x="%.1f" y="%d">%s · %s · %s</text>`+"\n", float64(x1)+barW*math.Min(r.P99ms/maxLat, 1)+5, ry+12,
				fmtMs(r.P50ms), fmtMs(r.P95ms), fmtMs(r.P99ms))
		}
		y += headH + len(b.rows)*rowH + blockGap
	}
	p(`<text x="%d" y="%d" font-size="10.5" fill="#666">Bars: logical requests (a 409 retried until the final answer counts once). Numbers beside latency bars: p50 · p95 · p99 in ms. Red: duplicate handler executions.</text>`+"\n", margin, height-10)
	p("</svg>\n")
	return s.String()
}
