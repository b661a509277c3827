"""The invariants a chaos run must end with, read from what the processes left on disk.

Sources: the broker's ledger (read-only LMDB snapshot: every item record, the
counters, the gap-register events), the completion service's results table,
the workers' JSON logs (``job_started`` / ``job_failed`` per lease), and the
producer's progress file (what it was told was accepted).

Invariants (``/work/shared/cases/CASES.md``, common invariant):

* every accepted item exists once in the ledger and is in exactly one terminal
  state (acknowledged, dead or expired); none is lost;
* the ledger balances, and its per-state counters equal a count of the records;
* the results table holds each acknowledged item exactly once (one row per item
  and per idempotency key; ``deliveries`` may be > 1), with the right bytes —
  except the items the table's own rule refuses (keys ending in
  :data:`REFUSED_KEY_SUFFIX`), which are exactly once in ``results_quarantine``
  instead, marked ``quarantined`` in the ledger with a G12 event, never in both;
* every duplicate execution is matched by a gap-register event for that item
  (G2 lease expired and requeued), every redelivery by a G3 event;
* an item is dead only for a reason the run provoked (its payload blob deleted).
"""

from __future__ import annotations

import collections
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

from ccsq.brokerd.ledger import schema
from ccsq.brokerd.ledger.schema import STATES
from ccsq.brokerd.ledger.store import Ledger, LedgerError, data_paths
from ccsq.brokerd.gap_report import load_report
from ccsq.tools.procs import Proc

TERMINAL = {"acknowledged", "dead", "expired"}
REFUSED_KEY_SUFFIX = "37"  # the chaos run's results-table rule refuses these keys (gap G12)


class EventLog:
    """Gap-register events accumulated across snapshots (the broker trims each window
    to its newest 1000, so the harness reads them while the run goes on)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.events: dict[tuple[str, int], dict] = {}
        self.totals: dict[str, int] = {}

    def poll(self) -> None:
        ledger_dir, _ = data_paths(self.data_dir)
        if not (ledger_dir / "data.mdb").exists():
            return
        try:
            ledger = Ledger(ledger_dir, readonly=True)
        except LedgerError:  # a broker is creating it right now: next poll
            return
        try:
            with ledger.read() as view:
                self.totals = view.gap_counts()
                for k, v in view.txn.cursor(db=view.db["events"]):
                    key = schema.parse_event_key(k)
                    if key not in self.events:
                        self.events[key] = schema.unpack(v)
        finally:
            ledger.close()

    def per_item(self, window: str) -> collections.Counter:
        return collections.Counter(e["item_id"] for (w, _), e in self.events.items() if w == window)

    def missed(self) -> dict[str, int]:
        """Events counted by the ledger that no snapshot caught (trimmed between polls)."""
        seen = collections.Counter(w for w, _ in self.events)
        return {w: n - seen[w] for w, n in self.totals.items() if n > seen[w]}


@dataclasses.dataclass
class Verdict:
    summary: dict[str, Any]
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations


def ledger_items(data_dir: Path) -> list[dict]:
    ledger_dir, _ = data_paths(data_dir)
    ledger = Ledger(ledger_dir, readonly=True)
    try:
        with ledger.read() as view:
            return [schema.unpack_item(v, k.decode()) for k, v in view.txn.cursor(db=view.db["items"])]
    finally:
        ledger.close()


def results_rows(db: Path, table: str = "results") -> list[dict]:
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute(f"SELECT item_id, idem_key, result, deliveries FROM {table}")]
    finally:
        con.close()


def executions(workers: list[Proc]) -> tuple[collections.Counter, collections.Counter]:
    """(handler starts per item, retryable failures reported per item) from worker logs."""
    starts: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()
    for w in workers:
        for e in w.events():
            if e.get("event") == "job_started":
                starts[e["item_id"]] += 1
            elif e.get("event") == "job_failed" and e.get("retryable") and e.get("reason") != "released":
                failures[e["item_id"]] += 1
    return starts, failures


def check(*, data_dir: Path, results_db: Path, workers: list[Proc], accepted: dict[str, str],
          expected_payload: dict[str, bytes], deleted_payload_keys: set[str], events: EventLog,
          limit: int = 20) -> Verdict:
    """Compare everything; ``accepted`` is {key: item_id or "" (spooled)}; ``expected_payload``
    {key: payload} (the echo handler returns it); ``deleted_payload_keys``: keys whose
    payload blob the run deleted (they may end dead with payload_missing)."""
    v: list[str] = []

    def bad(msg: str) -> None:
        if len(v) < limit:
            v.append(msg)
        else:
            v[-1] = f"... and more ({msg})"

    report = load_report(data_dir)
    items = ledger_items(data_dir)
    by_key: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in items:
        by_key[rec["key"]].append(rec)
    state_counts = collections.Counter(rec["state"] for rec in items)

    # --- the books ---
    if not report["balanced"]:
        bad(f"ledger unbalanced: received={report['counters']['received']} states={report['states']}")
    for s in STATES:
        if report["states"][s] != state_counts.get(s, 0):
            bad(f"state counter {s}={report['states'][s]} but {state_counts.get(s, 0)} records are {s}")
    if report["counters"]["received"] != len(items) + report["counters"]["purged"]:
        bad(f"received={report['counters']['received']} but {len(items)} records (+{report['counters']['purged']} purged)")

    # --- every accepted item: exactly one ledger item, terminal ---
    lost = 0
    for key, item_id in accepted.items():
        recs = by_key.get(key, [])
        if not recs:
            lost += 1
            bad(f"LOST: key {key} was accepted (item {item_id or 'spooled'}) but the ledger has no item for it")
        elif item_id and recs[0]["id"] != item_id:
            bad(f"key {key}: receipt said {item_id}, ledger has {[r['id'] for r in recs]}")
    for key, recs in by_key.items():
        if len(recs) > 1:
            bad(f"key {key} became {len(recs)} items {[r['id'] for r in recs]} (dedup failed)")
        if key not in accepted and key.startswith("forged-"):
            bad(f"forged SUBMIT {key} was accepted as item {recs[0]['id']}")
    not_terminal = [r for r in items if r["state"] not in TERMINAL]
    for r in not_terminal:
        bad(f"item {r['id']} ({r['key']}) stuck in {r['state']} attempt {r['attempt']}")
    dead_unexplained = [r for r in items if r["state"] == "dead"
                        and not (r.get("error") == "payload_missing" and r["key"] in deleted_payload_keys)]
    for r in dead_unexplained:
        bad(f"item {r['id']} dead for {r.get('error')}: {r.get('error_message', '')[:200]}")
    expired = [r for r in items if r["state"] == "expired"]
    for r in expired:
        bad(f"item {r['id']} expired but no item had a deadline")

    # --- results: each acknowledged item exactly once, with its bytes ---
    rows = results_rows(results_db)
    qrows = results_rows(results_db, "results_quarantine")
    row_by_id = {r["item_id"]: r for r in rows}
    q_by_id = {r["item_id"]: r for r in qrows}
    rows_per_key = collections.Counter(r["idem_key"] for r in rows + qrows)
    acked = {r["id"]: r for r in items if r["state"] == "acknowledged"}
    g12 = events.per_item("G12")
    for item_id, rec in acked.items():
        refused = rec["key"].endswith(REFUSED_KEY_SUFFIX)
        row = (q_by_id if refused else row_by_id).get(item_id)
        if row is None:
            lost += 1
            bad(f"LOST: item {item_id} ({rec['key']}) acknowledged but not in the "
                f"{'quarantine' if refused else 'results'} table")
        elif rec["key"] in expected_payload and row["result"] != expected_payload[rec["key"]]:
            bad(f"item {item_id} ({rec['key']}): result bytes differ from the payload it echoes")
        if refused and (not rec.get("quarantined") or not g12[item_id]):
            bad(f"item {item_id} ({rec['key']}) refused by the table's rule but not marked quarantined with a G12 event")
        if not refused and rec.get("quarantined"):
            bad(f"item {item_id} ({rec['key']}) quarantined though the rule accepts it: {rec['quarantined'][:200]}")
    for row in rows + qrows:
        if row["item_id"] not in acked:
            bad(f"results row {row['item_id']} is not acknowledged in the ledger")
    for item_id in row_by_id.keys() & q_by_id.keys():
        bad(f"item {item_id} is in both results and results_quarantine")
    for key, n in rows_per_key.items():
        if n > 1:
            bad(f"key {key} has {n} result rows")

    # --- duplicates vs the gap register ---
    events.poll()
    missed = events.missed()
    g2 = events.per_item("G2")
    g3 = events.per_item("G3")
    starts, failures = executions(workers)
    duplicates = unmatched = 0
    for item_id, n in starts.items():
        dup = max(0, n - 1 - failures[item_id])
        duplicates += dup
        if dup > g2[item_id]:
            unmatched += dup - g2[item_id]
            if not missed.get("G2"):
                bad(f"item {item_id}: {n} executions ({failures[item_id]} failed and retried) but {g2[item_id]} G2 events")
    redeliveries = unmatched_redeliveries = 0
    for row in rows + qrows:
        extra = row["deliveries"] - 1
        redeliveries += extra
        if extra > g3[row["item_id"]]:
            unmatched_redeliveries += extra - g3[row["item_id"]]
            if not missed.get("G3"):
                bad(f"item {row['item_id']}: delivered {row['deliveries']} times but {g3[row['item_id']]} G3 events")
    if missed:
        bad(f"gap events trimmed before the harness read them: {missed} (per-item matching incomplete)")

    summary = {
        "items": len(accepted),
        "ledger_items": len(items),
        "acknowledged": len(acked),
        "quarantined": len(qrows),
        "dead": state_counts.get("dead", 0),
        "dead_payload_deleted": state_counts.get("dead", 0) - len(dead_unexplained),
        "lost": lost,
        "stuck": len(not_terminal),
        "duplicates": duplicates,
        "gap_events": sum(g2[i] for i in starts if max(0, starts[i] - 1 - failures[i]) > 0),
        "unmatched_duplicates": unmatched,
        "redeliveries": redeliveries,
        "unmatched_redeliveries": unmatched_redeliveries,
        "g_counts": report["windows"] and {w["id"]: w["count"] for w in report["windows"]},
        "counters": report["counters"],
        "rejects": report["rejects"],
        "balanced": bool(report["balanced"]) and not any(m.startswith("state counter") or m.startswith("received=")
                                                         for m in v),
    }
    return Verdict(summary, v)
