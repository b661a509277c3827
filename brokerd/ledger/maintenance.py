"""The ledger's background work and reader checks (docs/ledger.md).

Slices the broker runs in its turn's transaction (each bounded by ``limit`` entries,
so a turn stays short): :func:`expire_deadlines`, the purges (:func:`purge_acknowledged`,
:func:`purge_keys`, :func:`purge_events`; :func:`purge` runs the three under one
budget) and :func:`append_sample` (the accounting samples ``gap-report --html``
charts). :func:`reader_report` says who reads the ledger and what the oldest
snapshot costs (from the reader table and the commit history that
:meth:`LedgerTxn.note_history <ccsq.brokerd.ledger.rules.LedgerTxn.note_history>` keeps).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ccsq.brokerd import gaps
from ccsq.brokerd.ledger import schema
from ccsq.common.wire import protocol

if TYPE_CHECKING:
    from ccsq.brokerd.ledger.rules import LedgerTxn
    from ccsq.brokerd.ledger.store import Ledger
    from ccsq.brokerd.ledger.view import LedgerView

S = protocol.ItemState

#: Most kinds recorded per sample (their per-state counts, for per-queue drain rates).
SAMPLE_MAX_KINDS = 64


def expire_deadlines(txn: LedgerTxn, now_ms: int, limit: int) -> int:
    """Expire up to ``limit`` ready items whose deadline passed (G6); drop stale index
    entries (items no longer ready). Returns the number of index entries looked at."""
    seen = 0
    todo: list[bytes] = []
    for k, _ in txn.txn.cursor(db=txn.db["deadline"]):
        if seen >= limit or schema.parse_timed(k)[0] > now_ms:
            break
        todo.append(k)
        seen += 1
    for k in todo:
        txn.txn.delete(k, db=txn.db["deadline"])
        txn.changed = True
        rec = txn.get(schema.parse_timed(k)[1].decode())
        if rec is not None and rec["state"] == S.READY.value:
            txn.expire(rec, now_ms, "deadline passed while ready")
    return seen


def purge_acknowledged(txn: LedgerTxn, now_ms: int, limit: int) -> int:
    """Delete up to ``limit`` acknowledged items acknowledged more than ``retention_s``
    ago (record, payload, result; counter ``purged``). They stay counted in state
    ``acknowledged``, so the balance holds. Returns how many were purged."""
    cut = now_ms - int(txn.ledger.policy.retention_s * 1000)
    todo: list[bytes] = []
    for k, _ in txn.txn.cursor(db=txn.db["acked"]):
        if len(todo) >= limit or schema.parse_timed(k)[0] > cut:
            break
        todo.append(k)
    for k in todo:
        iid = schema.parse_timed(k)[1]
        txn.txn.delete(k, db=txn.db["acked"])
        for name in ("items", "payloads", "results"):
            txn.txn.delete(iid, db=txn.db[name])
        txn.forget(iid.decode())
        txn.bump("purged")
    return len(todo)


def purge_keys(txn: LedgerTxn, now_ms: int, limit: int) -> int:
    """Forget up to ``limit`` idempotency keys older than ``dedup_window_s`` (a key
    made again since keeps its new entry). ``keytime`` names each key by its entry in
    ``keys`` (a digest, or the raw key of an older version), so both forms go the same
    way. Returns how many index entries went."""
    kcut = now_ms - int(txn.ledger.policy.dedup_window_s * 1000)
    todo: list[bytes] = []
    for k, _ in txn.txn.cursor(db=txn.db["keytime"]):
        if len(todo) >= limit or schema.parse_timed(k)[0] >= kcut:
            break
        todo.append(k)
    for k in todo:
        created_ms, key = schema.parse_timed(k)
        txn.txn.delete(k, db=txn.db["keytime"])
        raw = txn.txn.get(key, db=txn.db["keys"])
        if raw is not None and schema.unpack(raw)[1] == created_ms:
            txn.txn.delete(key, db=txn.db["keys"])
        txn.changed = True
    return len(todo)


def purge_events(txn: LedgerTxn, limit: int) -> int:
    """Delete up to ``limit`` gap-register events beyond the newest
    :data:`gaps.EVENTS_KEPT_PER_WINDOW <ccsq.brokerd.gaps.EVENTS_KEPT_PER_WINDOW>` of
    each window (the window's count ``g:`` keeps them all). Returns how many went."""
    done = 0
    for w in gaps.WINDOWS:
        if done >= limit:
            break
        keep_from = txn.num(schema.gap_key(w.id)) - gaps.EVENTS_KEPT_PER_WINDOW
        if keep_from <= 0:
            continue
        prefix = schema.event_prefix(w.id)
        cur = txn.txn.cursor(db=txn.db["events"])
        todo: list[bytes] = []
        if cur.set_range(prefix):
            for k, _ in cur:
                if not k.startswith(prefix) or schema.parse_seq(k[len(prefix):]) > keep_from or done + len(todo) >= limit:
                    break
                todo.append(k)
        for k in todo:
            txn.txn.delete(k, db=txn.db["events"])
            txn.changed = True
            done += 1
    return done


def purge(txn: LedgerTxn, now_ms: int, limit: int) -> int:
    """The purge slice: :func:`purge_acknowledged`, then :func:`purge_keys`, then
    :func:`purge_events`, up to ``limit`` entries in all. Returns entries processed."""
    done = purge_acknowledged(txn, now_ms, limit)
    done += purge_keys(txn, now_ms, limit - done)
    return done + purge_events(txn, limit - done)


def append_sample(txn: LedgerTxn, now_ms: int, interval_s: float) -> bool:
    """Append ``{ts_ms, counters, states, kinds}`` to the sample ring (meta ``t:``,
    :data:`~ccsq.brokerd.ledger.schema.SAMPLES_KEPT` slots) when the last sample is
    ``interval_s`` old and the counters changed since. True if written."""
    n = txn.num(schema.SAMPLE_N)
    counters = txn.counters()
    if n:
        last = txn.sample(n)
        if last is not None and (now_ms - last["ts_ms"] < interval_s * 1000 or last["counters"] == counters):
            return False
    kinds = dict(list(txn.kind_states().items())[:SAMPLE_MAX_KINDS])
    n = txn.next_num(schema.SAMPLE_N)
    doc = {"ts_ms": now_ms, "counters": counters, "states": txn.states(), "kinds": kinds}
    txn.txn.put(schema.sample_key(n), schema.pack(doc), db=txn.db["meta"])
    return True



@dataclasses.dataclass(frozen=True)
class ReaderSlot:
    """One owned slot of the LMDB reader table: process id, thread (hex), and the
    transaction id of the snapshot it reads (None: it holds no snapshot now)."""

    pid: int
    thread: str
    txnid: int | None


def parse_readers(text: str) -> list[ReaderSlot]:
    """Parse ``Environment.readers()`` (``mdb_reader_list``): a header ``pid thread
    txnid`` then one line per owned slot; ``-`` for a slot without a snapshot;
    ``(no active readers)`` when empty."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        out.append(ReaderSlot(int(parts[0]), parts[1], None if parts[2] == "-" else int(parts[2])))
    return out


def reader_report(ledger: Ledger, view: LedgerView, now_ms: int, *, warn_age_s: float | None = None) -> dict[str, Any]:
    """Who reads the ledger and what the oldest snapshot costs, from the reader table
    and the commit history (read with ``view``; see docs/ledger.md, "Readers and disk use").

    Returns ``{max_readers, slots, snapshots, stale_cleared, last_txnid, file_bytes,
    live_bytes, free_bytes, oldest, readers, warn_age_s}``: ``slots`` owned reader slots,
    ``snapshots`` those holding a snapshot; ``file_bytes`` pages up to the file's high
    page, ``live_bytes`` pages of all trees, ``free_bytes`` the rest (reusable, or
    pinned by a reader); ``oldest`` None or ``{pid, thread, txnid, lag_txns, age_s,
    age_at_least, pinned_bytes, pinned_upper_bound, self}``: ``lag_txns`` commits
    made since its snapshot; ``age_s`` seconds since the first commit it does not see
    (0 when it lags by none: a snapshot of the newest commit pins nothing) -- from the
    history entry (one per second at most) of the first commit after its snapshot, so
    a lower bound within a second; ``age_at_least`` when that commit is older than the
    history (then the age of the oldest entry) or newer than its newest entry (then 0:
    less than a second, or a ledger no broker wrote history to); ``pinned_bytes`` non-live pages added
    since its snapshot (pages freed after it, which LMDB cannot reuse while it reads),
    or all non-live pages (``pinned_upper_bound``) when the history does not reach
    back. ``readers``: up to 20 slots, oldest snapshot first."""
    info = ledger.env.info()
    psize = ledger.env.stat()["psize"]
    slots = parse_readers(ledger.env.readers())
    snaps = sorted((r for r in slots if r.txnid is not None), key=lambda r: r.txnid or 0)
    file_pages = info["last_pgno"] + 1
    live_pages = ledger.used_bytes(view.txn) // psize
    free_pages = max(0, file_pages - live_pages)
    oldest: dict[str, Any] | None = None
    if snaps:
        r = snaps[0]
        tid = r.txnid or 0
        lag = max(0, info["last_txnid"] - tid)
        age_s, at_least, pinned, upper = 0.0, False, 0, False
        if lag:
            after = view.history_after(tid)
            before = view.history_at_or_before(tid)
            if after is not None:
                age_s = max(0.0, (now_ms - after[1][0]) / 1000.0)
                at_least = before is None
            else:  # its first unseen commit is newer than the newest entry (or there is no history)
                at_least = True
            if before is not None:
                _ts, then_pgno, then_live = before[1]
                pinned = max(0, free_pages - max(0, then_pgno + 1 - then_live))
            else:
                pinned, upper = free_pages, True
        oldest = {"pid": r.pid, "thread": r.thread, "txnid": tid, "lag_txns": lag, "age_s": round(age_s, 3),
                  "age_at_least": at_least, "pinned_bytes": pinned * psize, "pinned_upper_bound": upper,
                  "self": r.pid == os.getpid()}
    return {
        "max_readers": info["max_readers"],
        "slots": len(slots),
        "snapshots": len(snaps),
        "stale_cleared": ledger.stale_readers_cleared,
        "last_txnid": info["last_txnid"],
        "file_bytes": file_pages * psize,
        "live_bytes": live_pages * psize,
        "free_bytes": free_pages * psize,
        "oldest": oldest,
        "readers": [dataclasses.asdict(x) for x in (snaps + [r for r in slots if r.txnid is None])[:20]],
        "warn_age_s": warn_age_s,
    }

