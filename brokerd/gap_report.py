"""Read-only accounting and gap report from a broker's data directory (``ccsq gap-report``).

Opens the ledger with ``readonly=True`` and LMDB's lock table, so it works
whether or not a broker is running. It never holds a snapshot for long (a reader
pins every page freed after its snapshot: docs/ledger.md): the accounting is read
in one short transaction (so the balance is of one commit), the history, deadlines
and events each in their own, and :func:`iter_blob_refs` pages through the
claim-check references with a fresh transaction per :data:`PAGE_ENTRIES`.
"""

from __future__ import annotations

import html
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ccsq.brokerd import gaps
from ccsq.brokerd.frame_intake import NOISE_PREFIX
from ccsq.brokerd.ledger.schema import COUNTERS, STATES
from ccsq.brokerd.ledger.store import Ledger, data_paths

RECENT_EVENTS = 10
PAGE_ENTRIES = 1000  # entries read per (fresh, short) read transaction when paging
RATE_WINDOW_S = 300.0  # the completion rate of a queue is measured over this much recent history
CHART_COUNTERS = ("received", "routed", "completed", "acknowledged")
SERIES_COUNTERS = ("received", "routed", "completed", "acknowledged", "retried", "dead", "expired")


def load_report(data_dir: str | Path, *, recent: int = RECENT_EVENTS) -> dict[str, Any]:
    """The accounting of the ledger under ``data_dir``.

    Returns a dict with: every flow counter at top level (``received``, ``routed``,
    ``completed``, ``acknowledged``, ``retried``, ``failed``, ``dead``, ``expired``,
    ``duplicate_submits``, ``fenced_completions``, ``redelivered``, ...); ``ready``
    and ``leased`` (current per-state counts); ``counters`` and ``states`` (dicts);
    ``balanced`` (bool: received == sum of per-state counts); ``dead_listed``
    (the dead letters ``ccsq dlq list`` lists: state ``dead`` less the purged ones,
    which stay counted there); ``epoch``;
    ``rejects`` ({reason: count}; refused frames and items); ``reconnect_noise`` ({code:
    count}: frames of sessions that had ended here, counted apart: not refusals); ``backlog`` ({kind: {state: count}});
    ``ledger`` (map size and use, bytes); ``windows``: a list of
    {id, name, where, why, repair, counter, count, recent: [events newest first]};
    ``queues``: per kind the backlog and drain forecast (see :func:`queue_forecast`);
    ``series``: the accounting samples, oldest first ({ts_ms, received, routed,
    completed, acknowledged, retried, dead, expired}); ``generated_ms``.
    Raises :class:`~ccsq.brokerd.ledger.LedgerError` if there is no ledger there.
    """
    ledger_dir, _lock = data_paths(Path(data_dir))
    ledger = Ledger(ledger_dir, readonly=True)
    now_ms = int(time.time() * 1000)
    try:
        with ledger.read() as view:  # the accounting: one commit's numbers, read at once
            kinds = view.kind_states()
            counters = view.counters()
            states = view.states()
            gap_counts = view.gap_counts()
            dead_listed = view.dead_listed()  # state dead counts purged dead items too (the balance holds)
            epoch, rejects = view.epoch(), view.rejects()
            noise = {k[len(NOISE_PREFIX):]: v for k, v in rejects.items() if k.startswith(NOISE_PREFIX)}
            rejects = {k: v for k, v in rejects.items() if not k.startswith(NOISE_PREFIX)}
            used = ledger.used_bytes(view.txn)
        with ledger.read() as view:
            samples = view.samples()
        with ledger.read() as view:
            deadlines = view.nearest_deadlines()
        with ledger.read() as view:
            windows = [
                {
                    "id": w.id,
                    "name": w.name,
                    "where": w.where,
                    "why": w.why,
                    "repair": w.repair,
                    "counter": w.counter,
                    "count": gap_counts[w.id],
                    "recent": view.recent_events(w.id, recent),
                }
                for w in gaps.WINDOWS
            ]
            report: dict[str, Any] = {
                # deprecated (kept for old readers): the flow counters and two states at top
                # level, where "completed" is a counter, not the state; read "counters" and "states"
                **counters,
                "ready": states["ready"],
                "leased": states["leased"],
                "deprecated_keys": sorted({*counters, "ready", "leased"}),
                "counters": counters,
                "states": states,
                "dead_listed": dead_listed,
                "balanced": counters["received"] == sum(states.values()),
                "epoch": epoch,
                "ledger_id": ledger.ledger_id,
                "rejects": rejects,
                "reconnect_noise": noise,
                "backlog": kinds,
                "ledger": {"map_size_bytes": ledger.map_size_bytes(), "used_bytes": used},
                "windows": windows,
                "queues": queue_forecast(kinds, samples, deadlines, now_ms),
                "series": [{"ts_ms": d["ts_ms"], **{c: d["counters"].get(c, 0) for c in SERIES_COUNTERS}} for d in samples],
                "generated_ms": now_ms,
            }
    finally:
        ledger.close()
    return report


def _done(per_state: dict[str, int]) -> int:
    return per_state.get("completed", 0) + per_state.get("acknowledged", 0)


def queue_forecast(
    kinds: dict[str, dict[str, int]], samples: list[dict], deadlines: dict[str, int], now_ms: int
) -> list[dict[str, Any]]:
    """Per queue (kind): backlog, completion rate and whether it drains before its
    nearest deadline.

    ``kinds``: {kind: {state: count}} now; ``samples``: the ledger's accounting
    samples, oldest first; ``deadlines``: {kind: earliest deadline_ms of a ready or
    leased item}. The rate is the recent one: items that reached completed or acknowledged
    since the newest sample at least :data:`RATE_WINDOW_S` old (else the oldest sample),
    per second of at most the last RATE_WINDOW_S (the ledger samples only while counters
    change: after an idle hour the reference is an hour old, and dividing by that hour made
    a busy queue's rate the hour's average).
    Returns a list of {kind, ready, leased, backlog, completed_per_s (None: no
    history), drain_eta_s (None: never at this rate), nearest_deadline_ms,
    deadline_in_s, verdict: empty | on track | late | stalled | no deadline}
    (``ccsq gap-report`` turns "stalled" into "stalled: no worker serves kind 'X'" when
    the running broker has no worker for it).
    """
    ref = None
    for d in samples:
        if d["ts_ms"] <= now_ms - RATE_WINDOW_S * 1000 or ref is None:
            ref = d
    out = []
    for kind in sorted(kinds):
        st = kinds[kind]
        ready, leased = st.get("ready", 0), st.get("leased", 0)
        backlog = ready + leased
        rate = None
        if ref is not None and now_ms - ref["ts_ms"] >= 1000:
            then = _done(ref.get("kinds", {}).get(kind, {}))
            rate = max(0, _done(st) - then) / min((now_ms - ref["ts_ms"]) / 1000.0, RATE_WINDOW_S)
        eta = None if not rate else backlog / rate
        dl = deadlines.get(kind)
        left = None if dl is None else (dl - now_ms) / 1000.0
        if backlog == 0:
            verdict = "empty"
        elif not rate:
            verdict = "stalled"
        elif left is None:
            verdict = "no deadline"
        else:
            verdict = "on track" if eta is not None and eta <= left else "late"
        out.append(
            {
                "kind": kind,
                "ready": ready,
                "leased": leased,
                "backlog": backlog,
                "completed_per_s": None if rate is None else round(rate, 3),
                "drain_eta_s": None if eta is None else round(eta, 1),
                "nearest_deadline_ms": dl,
                "deadline_in_s": None if left is None else round(left, 1),
                "verdict": verdict,
            }
        )
    return out


def iter_blob_refs(data_dir: str | Path) -> Iterator[tuple[str, str, str]]:
    """``(item_id, state, sha256)`` for every claim-store reference in the ledger
    (payloads and results stored by reference; inline ones are skipped), for
    ``ccsq reconcile``. Safe while the broker runs: it pages through the tables with a
    fresh read transaction per :data:`PAGE_ENTRIES` entries and yields only between
    them, so a slow consumer (a claim-store listing) never holds a snapshot. A
    reference added during the scan behind the page being read is not seen, as with
    one snapshot taken at the start; reconcile's grace period covers both."""
    ledger_dir, _lock = data_paths(Path(data_dir))
    ledger = Ledger(ledger_dir, readonly=True)
    try:
        for name in ("payloads", "results"):
            after = b""
            while True:
                with ledger.read() as view:
                    refs, last = view.blob_refs_page(name, after, PAGE_ENTRIES)
                yield from refs
                if last is None:
                    break
                after = last
    finally:
        ledger.close()


def render_text(report: dict[str, Any], *, width: int = 120, verbose: bool = False) -> str:
    """A human table: flow counters beside per-state counts, the balance, then each
    window (with where/why/repair when ``verbose``; docs/gap-register.md has them too)."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    acct = Table(title=f"ccsq ledger {report.get('ledger_id', '')} (epoch {report.get('epoch', 0)})")
    acct.add_column("flow counter")
    acct.add_column("count", justify="right")
    acct.add_column("state now")
    acct.add_column("items", justify="right")
    flows = list(COUNTERS)
    rows = max(len(flows), len(STATES) + 2)
    state_rows = [(_state_label(s, report), str(report["states"][s])) for s in STATES]
    state_rows.append(("sum", str(sum(report["states"].values()))))
    state_rows.append(("received", str(report["counters"]["received"])))
    for i in range(rows):
        f = (flows[i], str(report["counters"][flows[i]])) if i < len(flows) else ("", "")
        s = state_rows[i] if i < len(state_rows) else ("", "")
        acct.add_row(f[0], f[1], s[0], s[1])
    console.print(acct)
    verdict = "BALANCED" if report["balanced"] else "UNBALANCED"
    console.print(f"received = ready + leased + completed + acknowledged + dead + expired: {verdict}")
    if report.get("rejects"):
        console.print("rejected frames: " + ", ".join(f"{k}={v}" for k, v in sorted(report["rejects"].items())))
    if report.get("reconnect_noise"):
        console.print("reconnect noise (frames of sessions that had ended; peers reconnected): "
                      + ", ".join(f"{k}={v}" for k, v in sorted(report["reconnect_noise"].items())))
    wt = Table(title="gap register")
    wt.add_column("id")
    wt.add_column("window")
    wt.add_column("count", justify="right")
    if verbose:
        wt.add_column("where / why / repair")
    wt.add_column("recent events")
    for w in report["windows"]:
        recent = "\n".join(f"{e['item_id']}: {e['detail']}" for e in w["recent"][:3])
        detail = [f"{w['where']}\nwhy: {w['why']}\nrepair: {w['repair']}"] if verbose else []
        wt.add_row(w["id"], w["name"], str(w["count"]), *detail, recent)
    console.print(wt)
    if report.get("queues"):
        qt = Table(title="queues: backlog and drain forecast")
        for col in ("kind", "ready", "leased", "done/s", "drain in", "nearest deadline in", "verdict"):
            qt.add_column(col, justify="left" if col in ("kind", "verdict") else "right")
        for q in report["queues"]:
            qt.add_row(
                q["kind"], str(q["ready"]), str(q["leased"]), _fmt_rate(q["completed_per_s"]),
                fmt_s(q["drain_eta_s"]), fmt_s(q["deadline_in_s"]), q["verdict"],
            )
        console.print(qt)
    return buf.getvalue()


def _state_label(state: str, report: dict[str, Any]) -> str:
    """A state's row label; ``dead`` says how many are dead letters and how many purged
    (purged dead items stay counted in state dead; ``dlq list`` shows only the others)."""
    listed = report.get("dead_listed")
    if state != "dead" or listed is None or listed == report["states"]["dead"]:
        return state
    return f"dead ({listed} dead letters + {report['states']['dead'] - listed} purged)"


def fmt_s(v: float | None) -> str:
    """A duration in seconds for people: '-' (None), '12.0 s', '3.5 min', '1.2 h' (the console's too)."""
    if v is None:
        return "-"
    if abs(v) >= 3600:
        return f"{v / 3600:.1f} h"
    if abs(v) >= 60:
        return f"{v / 60:.1f} min"
    return f"{v:.1f} s"


def _fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


# --- HTML (self-contained: inline SVG and CSS, nothing fetched) ---------------------
_LEGEND_CHAR_PX = 7.5  # a generous width per character of a 12 px sans-serif font
#: One colour per charted counter, shared by ``gap-report --html`` and the console's charts.
CHART_COLOURS = {"received": "#1f77b4", "routed": "#ff7f0e", "completed": "#2ca02c", "acknowledged": "#9467bd"}
_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;vertical-align:top}td.n{text-align:right;font-variant-numeric:tabular-nums}"
    ".ok{color:#2ca02c}.bad{color:#d62728;font-weight:bold}small{color:#666}"
    "code{font-family:ui-monospace,monospace;font-size:.9em;background:#f3f3f3;padding:0 .2em;border-radius:3px}"
)


def inline_code_html(text: str) -> str:
    """``text`` HTML-escaped, with Markdown inline code (`like this`) as ``<code>``
    (the gap-register texts are shared with docs/gap-register.md)."""
    parts = str(text).split("`")
    if len(parts) % 2 == 0:  # an unmatched backtick: leave it literal
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return "".join(f"<code>{html.escape(x)}</code>" if i % 2 else html.escape(x) for i, x in enumerate(parts))


def render_chart_svg(series: list[dict], *, now_ms: int, counters: dict[str, int], width: int = 760, height: int = 260) -> str:
    """An inline SVG step chart of :data:`CHART_COUNTERS` over time. ``series`` are
    the report's samples (oldest first); the current ``counters`` at ``now_ms``
    close each line. Returns ``<svg ...>...</svg>`` (no external resources)."""
    pts = [(d["ts_ms"], {c: d.get(c, 0) for c in CHART_COUNTERS}) for d in series]
    pts.append((now_ms, {c: counters.get(c, 0) for c in CHART_COUNTERS}))
    t0, t1 = pts[0][0], max(pts[-1][0], pts[0][0] + 1000)
    vmax = max(1, max(max(v.values()) for _, v in pts))
    # the legend sits under the time axis, in as many rows as its labels need (never clipped)
    labels = [f"{c} {pts[-1][1][c]}" for c in CHART_COUNTERS]
    left, right, top = 60, 14, 12
    rows: list[list[tuple[str, str, float]]] = [[]]
    lx = float(left)
    for c, label in zip(CHART_COUNTERS, labels):
        w = 22 + _LEGEND_CHAR_PX * len(label) + 22
        if rows[-1] and lx + w > width - right:
            rows.append([])
            lx = float(left)
        rows[-1].append((c, label, lx))
        lx += w
    bottom = 30 + 18 * len(rows)
    height += 18 * (len(rows) - 1)
    pw, ph = width - left - right, height - top - bottom

    def x(t: int) -> float:
        return left + (t - t0) / (t1 - t0) * pw

    def y(v: int) -> float:
        return top + ph - v / vmax * ph

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="accounting over time">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#999"/>',
    ]
    for frac in (0.0, 0.5, 1.0):
        mark = int(round(vmax * frac))
        parts.append(f'<text x="{left - 6}" y="{y(mark) + 4:.1f}" font-size="11" text-anchor="end">{mark}</text>')
    for t, anchor in ((t0, "start"), (t1, "end")):
        label = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t / 1000))
        parts.append(f'<text x="{x(t):.1f}" y="{top + ph + 16}" font-size="11" text-anchor="{anchor}">{label}</text>')
    for c, stroke in zip(CHART_COUNTERS, (9.0, 6.5, 4.0, 1.5)):  # widest first: equal lines still show every colour
        coords: list[str] = []
        prev = None
        for t, v in pts:
            if prev is not None:
                coords.append(f"{x(t):.1f},{y(prev):.1f}")
            coords.append(f"{x(t):.1f},{y(v[c]):.1f}")
            prev = v[c]
        colour = CHART_COLOURS[c]
        parts.append(
            f'<polyline data-counter="{c}" fill="none" stroke="{colour}" stroke-width="{stroke}" points="{" ".join(coords)}"/>'
        )
    for r, row in enumerate(rows):
        ly = top + ph + 36 + 18 * r
        for c, label, lx in row:
            colour = CHART_COLOURS[c]
            parts.append(f'<line x1="{lx:.1f}" y1="{ly - 4}" x2="{lx + 18:.1f}" y2="{ly - 4}" stroke="{colour}" stroke-width="3"/>')
            parts.append(f'<text x="{lx + 22:.1f}" y="{ly}" font-size="12" data-legend="{c}">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(report: dict[str, Any]) -> str:
    """A self-contained HTML page: the accounting side by side, the balance, a chart
    of received/routed/completed/acknowledged over time (inline SVG), the queues
    with their drain forecast, and each gap-register window with its recent events.
    Works offline (no scripts, fonts or styles fetched)."""
    e = html.escape
    now_ms = report.get("generated_ms") or int(time.time() * 1000)
    counters, states = report["counters"], report["states"]
    balanced = report["balanced"]
    out = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>ccsq gap report {e(str(report.get('ledger_id', '')))}</title><style>{_CSS}</style></head><body>",
        f"<h1>ccsq gap report <small>ledger {e(str(report.get('ledger_id', '')))}, epoch {report.get('epoch', 0)}, "
        f"{e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now_ms / 1000)))}</small></h1>",
        f"<p id='balance' class='{'ok' if balanced else 'bad'}'>received = ready + leased + completed + acknowledged + dead + expired: "
        f"{counters['received']} = {' + '.join(str(states[s]) for s in STATES)} = {sum(states.values())}: "
        f"{'BALANCED' if balanced else 'UNBALANCED'}</p>",
        "<h2>Accounting</h2><table id='accounting'><tr><th>flow counter</th><th>count</th><th>state now</th><th>items</th></tr>",
    ]
    flows = list(COUNTERS)
    state_rows = [(s, _state_label(s, report), states[s]) for s in STATES] + [("sum", "sum", sum(states.values()))]
    for i in range(max(len(flows), len(state_rows))):
        f = (flows[i], counters[flows[i]]) if i < len(flows) else ("", "")
        st = state_rows[i] if i < len(state_rows) else ("", "", "")
        out.append(
            f"<tr><td>{e(f[0])}</td><td class='n' data-counter='{e(f[0])}'>{f[1]}</td>"
            f"<td>{e(st[1])}</td><td class='n' data-state='{e(st[0])}'>{st[2]}</td></tr>"
        )
    out.append("</table>")
    out.append(f"<h2>Over time</h2><p><small>{len(report.get('series', []))} samples kept in the ledger</small></p>")
    out.append(render_chart_svg(report.get("series", []), now_ms=now_ms, counters=counters))
    out.append("<h2>Queues</h2><table id='queues'><tr><th>kind</th><th>ready</th><th>leased</th><th>done/s</th>"
               "<th>drain in</th><th>nearest deadline in</th><th>verdict</th></tr>")
    for q in report.get("queues", []):
        out.append(
            f"<tr><td>{e(q['kind'])}</td><td class='n'>{q['ready']}</td><td class='n'>{q['leased']}</td>"
            f"<td class='n'>{_fmt_rate(q['completed_per_s'])}</td><td class='n'>{fmt_s(q['drain_eta_s'])}</td>"
            f"<td class='n'>{fmt_s(q['deadline_in_s'])}</td><td class='{'bad' if q['verdict'].startswith(('late', 'stalled')) else 'ok'}'>"
            f"{e(q['verdict'])}</td></tr>"
        )
    out.append("</table><h2>Gap register</h2><table id='windows'><tr><th>id</th><th>window</th><th>count</th>"
               "<th>where / why / repair</th><th>recent events</th></tr>")
    for w in report["windows"]:
        recent = "<br>".join(
            f"{e(time.strftime('%H:%M:%S', time.localtime(ev['ts'])))} {e(ev['item_id'])}: {e(ev['detail'])}" for ev in w["recent"][:5]
        )
        out.append(
            f"<tr id='{e(w['id'])}'><td>{e(w['id'])}</td><td>{e(w['name'])}</td><td class='n'>{w['count']}</td>"
            f"<td>{inline_code_html(w['where'])}<br><b>why</b> {inline_code_html(w['why'])}<br><b>repair</b> "
            f"{inline_code_html(w['repair'])}</td><td>{recent}</td></tr>"
        )
    out.append("</table>")
    if report.get("rejects"):
        out.append("<h2>Rejected frames</h2><p>" + ", ".join(f"{e(k)}={v}" for k, v in sorted(report["rejects"].items())) + "</p>")
    out.append("</body></html>")
    return "\n".join(out)
