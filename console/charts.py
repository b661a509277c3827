"""Inline SVG charts for the console (nothing fetched, no script)."""

from __future__ import annotations

import html
import time
from typing import Any

from ccsq.brokerd.report import _CHART_COLOURS as COLOURS  # one palette with gap-report --html
from ccsq.brokerd.report import CHART_COUNTERS

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
                   width: int = 760, height: int = 240) -> str:
    """A line chart of the rates (:func:`rate_points`) over the last ``window_s``
    with the legend below the plot (it is never clipped). Returns ``<svg>...</svg>``."""
    left, right, top, legend_h, axis_h = 56, 14, 10, 26, 22
    pw, ph = width - left - right, height - top - axis_h - legend_h
    t0, t1 = now_ms - window_s * 1000, now_ms
    if points:  # a younger history fills the width (at least a minute)
        t0 = max(t0, min(points[0][0], now_ms - 60_000))
    vmax = max([v for _, _, r in points for v in r.values()] + [0.0])
    vmax = vmax * 1.1 if vmax > 0 else 1.0

    def x(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * pw

    def y(v: float) -> float:
        return top + ph - v / vmax * ph

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="received, routed, completed and acknowledged per second, last hour" class="chart">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#bbb"/>',
    ]
    for frac in (0.0, 0.5, 1.0):
        v = vmax * frac
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{left - 5}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{_num(v)}/s</text>')
    fmt = "%H:%M" if t1 - t0 >= 600_000 else "%H:%M:%S"
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        t = t0 + frac * (t1 - t0)
        label = time.strftime(fmt, time.localtime(t / 1000))
        parts.append(f'<text x="{x(t):.1f}" y="{top + ph + 15}" font-size="11" text-anchor="{anchor}">{label}</text>')
    if not points:
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" font-size="13" text-anchor="middle" fill="#777">'
                     "no accounting samples in the last hour</text>")
    for c in CHART_COUNTERS:
        # a step per interval: the rate was that average over the whole interval
        coords = " ".join(f"{x(max(a, t0)):.1f},{y(r[c]):.1f} {x(b):.1f},{y(r[c]):.1f}" for a, b, r in points)
        if coords:
            parts.append(f'<polyline data-counter="{c}" fill="none" stroke="{COLOURS[c]}" stroke-width="2" points="{coords}"/>')
    lx = left
    ly = height - 8
    for c in CHART_COUNTERS:
        parts.append(f'<rect x="{lx}" y="{ly - 9}" width="14" height="4" fill="{COLOURS[c]}"/>')
        parts.append(f'<text x="{lx + 18}" y="{ly - 3}" font-size="12">{html.escape(c)}</text>')
        lx += 18 + 8 * len(c) + 24
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
    """A duration for people: '-', '12.0 s', '3.5 min', '1.2 h'."""
    from ccsq.brokerd.report import _fmt_s

    return _fmt_s(v)


def fmt_ms(v: Any) -> str:
    """Wall-clock milliseconds as a local date and time ('' for 0/None)."""
    if not v:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v / 1000))
