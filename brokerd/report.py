"""Read-only accounting and gap report from a broker's data directory (``ccsq gap-report``).

Opens the ledger with ``readonly=True`` and LMDB's lock table, so it works
whether or not a broker is running (it reads one consistent snapshot).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ccsq.brokerd import gaps
from ccsq.brokerd.ledger import COUNTERS, STATES, Ledger, data_paths

RECENT_EVENTS = 10


def load_report(data_dir: str | Path, *, recent: int = RECENT_EVENTS) -> dict[str, Any]:
    """The accounting of the ledger under ``data_dir``.

    Returns a dict with: every flow counter at top level (``received``, ``routed``,
    ``completed``, ``acknowledged``, ``retried``, ``failed``, ``dead``, ``expired``,
    ``duplicate_submits``, ``fenced_completions``, ``redelivered``, ...); ``ready``
    and ``leased`` (current per-state counts); ``counters`` and ``states`` (dicts);
    ``balanced`` (bool: received == sum of per-state counts); ``epoch``;
    ``rejects`` ({reason: count}); ``backlog`` ({kind: {state: count}});
    ``ledger`` (map size and use, bytes); ``windows``: a list of
    {id, name, where, why, repair, counter, count, recent: [events newest first]}.
    Raises :class:`~ccsq.brokerd.ledger.LedgerError` if there is no ledger there.
    """
    ledger_dir, _lock = data_paths(Path(data_dir))
    ledger = Ledger(ledger_dir, readonly=True)
    try:
        with ledger.read() as view:
            counters = view.counters()
            states = view.states()
            gap_counts = view.gap_counts()
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
                **counters,
                "ready": states["ready"],
                "leased": states["leased"],
                "counters": counters,
                "states": states,
                "balanced": counters["received"] == sum(states.values()),
                "epoch": view.epoch(),
                "ledger_id": ledger.ledger_id,
                "rejects": view.rejects(),
                "backlog": view.kind_states(),
                "ledger": {"map_size_bytes": ledger.map_size_bytes(), "used_bytes": ledger.used_bytes()},
                "windows": windows,
            }
    finally:
        ledger.close()
    return report


def iter_blob_refs(data_dir: str | Path) -> Iterator[tuple[str, str, str]]:
    """``(item_id, state, sha256)`` for every claim-store reference in the ledger
    (payloads and results stored by reference; inline ones are skipped), for
    ``ccsq reconcile``. One read snapshot; safe while the broker runs."""
    ledger_dir, _lock = data_paths(Path(data_dir))
    ledger = Ledger(ledger_dir, readonly=True)
    try:
        with ledger.read() as view:
            yield from view.blob_refs()
    finally:
        ledger.close()


def render_text(report: dict[str, Any], *, width: int = 120) -> str:
    """A human table: flow counters beside per-state counts, the balance, then each window."""
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
    state_rows = [(s, str(report["states"][s])) for s in STATES]
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
    wt = Table(title="gap register")
    wt.add_column("id")
    wt.add_column("window")
    wt.add_column("count", justify="right")
    wt.add_column("where / why / repair")
    wt.add_column("recent events")
    for w in report["windows"]:
        recent = "\n".join(f"{e['item_id']}: {e['detail']}" for e in w["recent"][:3])
        wt.add_row(w["id"], w["name"], str(w["count"]), f"{w['where']}\nwhy: {w['why']}\nrepair: {w['repair']}", recent)
    console.print(wt)
    return buf.getvalue()
