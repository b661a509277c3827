"""Inline SVG charts for the console (nothing fetched, no script)."""

from __future__ import annotations

import html
import time
from typing import Any

from ccsq.brokerd import gap_report
from ccsq.brokerd.gap_report import CHART_COLOURS as COLOURS  # one palette with gap-report --html
from ccsq.brokerd.gap_report import CHART_COUNTERS

WINDOW_S = 3600.0


def rate_points(series: list[dict], counters: dict[str, int], now_ms: int,
                window_s: float = WINDOW_S) -> list[tuple[int, int, dict[str, float]]]:
    """Per interval between consecutive accounting samples (the ledger's series,
    oldest first, closed by the current ``counters`` at ``now_ms``), the rate of
    each of :data:`CHART_COUNTERS` in items/s, for intervals ending in the last
    ``window_s``. Returns [(start ts_ms, end ts_ms, {counter: items/s})], oldest first."""
    pts = [(d["ts_ms"], {c: d.get(c, 0) for c in CHART_COUNTERS}) for d in series]
    if not pts or now_ms - pts[-1][0] >= 1000:
        pts.append((now_ms, {c: counters.get(c, 0) for c in CHART_COUNTERS}))
    start = now_ms - window_s * 1000
    out = []
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t1 < start or t1 <= t0:
            continue
        dt = (t1 - t0) / 1000.0
        out.append((t0, t1, {c: max(0, v1[c] - v0[c]) / dt for c in CHART_COUNTERS}))
    return out


def hour_rates(series: list[dict], counters: dict[str, int], now_ms: int,
               window_s: float = WINDOW_S) -> tuple[dict[str, float | None], int | None]:
    """({counter: average items/s}, since ts_ms) for each chart counter over the last
    ``window_s``, measured from the newest sample at least that old (else the oldest
    sample); None per counter (and since) without history."""
    ref = None
    for d in series:
        if d["ts_ms"] <= now_ms - window_s * 1000 or ref is None:
            ref = d
    if ref is None or now_ms - ref["ts_ms"] < 1000:
        return {c: None for c in CHART_COUNTERS}, None
    dt = (now_ms - ref["ts_ms"]) / 1000.0
    return {c: round(max(0, counters.get(c, 0) - ref.get(c, 0)) / dt, 3) for c in CHART_COUNTERS}, ref["ts_ms"]


def rate_chart_svg(points: list[tuple[int, int, dict[str, float]]], now_ms: int, *, window_s: float = WINDOW_S,
                   width: int = 760, panel_h: int = 130) -> str:
    """The rates (:func:`rate_points`) over the last ``window_s`` (or since the oldest
    sample, if younger) as four small step charts in a 2 x 2 grid, one per counter,
    on one shared scale so they compare at a glance. Returns ``<svg>...</svg>``."""
    cols, gap_x, gap_y, left, title_h, axis_h = 2, 24, 14, 52, 18, 18
    cell_w = (width - gap_x * (cols - 1)) // cols
    pw = cell_w - left - 6
    ph = panel_h - title_h - axis_h
    rows = (len(CHART_COUNTERS) + cols - 1) // cols
    height = rows * panel_h + (rows - 1) * gap_y
    t0, t1 = now_ms - window_s * 1000, now_ms
    if points:  # a younger history fills the width (at least 10 s)
        t0 = max(t0, min(points[0][0], now_ms - 10_000))
    vmax = max([v for _, _, r in points for v in r.values()] + [0.0])
    vmax = vmax * 1.1 if vmax > 0 else 1.0
    fmt = "%H:%M" if t1 - t0 >= 600_000 else "%H:%M:%S"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="received, routed, completed and acknowledged per second, last hour" class="chart">'
    ]
    for i, c in enumerate(CHART_COUNTERS):
        ox = (i % cols) * (cell_w + gap_x) + left
        oy = (i // cols) * (panel_h + gap_y) + title_h

        def x(t: float, ox: int = ox) -> float:
            return ox + (t - t0) / (t1 - t0) * pw

        def y(v: float, oy: int = oy) -> float:
            return oy + ph - v / vmax * ph

        parts.append(f'<text x="{ox}" y="{oy - 5}" font-size="12" font-weight="600" fill="{COLOURS[c]}">{html.escape(c)} per second</text>')
        parts.append(f'<rect x="{ox}" y="{oy}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
        for frac in (0.0, 0.5, 1.0):
            v = vmax * frac
            parts.append(f'<line x1="{ox}" x2="{ox + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e6e6e6"/>')
            parts.append(f'<text x="{ox - 4}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">{_num(v)}</text>')
        for frac, anchor in ((0.0, "start"), (1.0, "end")):
            t = t0 + frac * (t1 - t0)
            label = time.strftime(fmt, time.localtime(t / 1000))
            parts.append(f'<text x="{x(t):.1f}" y="{oy + ph + 13}" font-size="10" text-anchor="{anchor}">{label}</text>')
        if not points:
            parts.append(f'<text x="{ox + pw / 2}" y="{oy + ph / 2 + 4}" font-size="11" text-anchor="middle" fill="#777">'
                         "no samples in the last hour</text>")
            continue
        # a step per interval: the rate was that average over the whole interval
        coords = " ".join(f"{x(max(a, t0)):.1f},{y(r[c]):.1f} {x(b):.1f},{y(r[c]):.1f}" for a, b, r in points)
        area = f"{x(max(points[0][0], t0)):.1f},{y(0):.1f} {coords} {x(points[-1][1]):.1f},{y(0):.1f}"
        parts.append(f'<polygon points="{area}" fill="{COLOURS[c]}" fill-opacity="0.12" stroke="none"/>')
        parts.append(f'<polyline data-counter="{c}" fill="none" stroke="{COLOURS[c]}" stroke-width="2" points="{coords}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _num(v: float) -> str:
    if v == 0:
        return "0"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 1:
        return f"{v:.1f}"
    return f"{v:.2f}"


def fmt_s(v: float | None) -> str:
    """A duration for people: '-', '12.0 s', '3.5 min', '1.2 h' (gap-report's format)."""
    return gap_report.fmt_s(v)


def fmt_ms(v: Any) -> str:
    """Wall-clock milliseconds as a local date and time ('' for 0/None)."""
    if not v:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v / 1000))
