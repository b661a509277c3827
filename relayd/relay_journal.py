"""The relay's local journal: what it leased upstream and submitted downstream.

One SQLite file (``<journal_dir>/relay.sqlite3``, WAL, ``synchronous=FULL``: every
write is fsynced before the call returns), like the worker's journal, with one row
per upstream lease, keyed by ``(link, up_item, token)``::

    state      meaning                                              written when
    leased     DISPATCHed to us upstream, not yet confirmed down    DISPATCH arrives
    submitted  the downstream confirmed the SUBMIT (down_item)      SUBMIT_ACK arrives
    resulted   the downstream's result (and proof) is here; the     RESULT arrives, before
               upstream has not confirmed the COMPLETE              COMPLETE is sent
    returned   the upstream confirmed (outcome); downstream ACK     COMPLETE_ACK arrives
               not confirmed
    failing    a FAIL upstream is decided, not confirmed            a refusal downstream

A row is deleted when the downstream confirms its ACK (``returned`` rows), the
upstream confirms its FAIL, or the upstream released a lease that was never
submitted. ``lost = 1`` marks a lease the upstream no longer lists as ours (a relay
restart after the lease expired): the row carries on, and its result is still
reported under the old token (the upstream fences it, G4, or accepts it late, G8).

Per link counters live in the same transaction as the rows they count, so the
federation report (:mod:`ccsq.relayd.federation_report`) balances after any crash::

    leased == in_flight (rows) + ended_acked + ended_failed + ended_released

Table ``link_status`` holds one row per broken link (a swarm refused it: cause, reason,
fix, since when), kept until the cause is seen fixed; the federation report shows it.

The journal is single-writer (``flock`` on ``<journal_dir>/LOCK``; a second relay
on the same directory gets :class:`~ccsq.workerd.worker_journal.JournalLocked`).
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

from ccsq.common.wire import protocol
from ccsq.common.wire.errors import JournalCorrupt, JournalLocked  # noqa: F401 (JournalLocked: raised by open)
from ccsq.common.storage.sqlite_journal import open_locked_sqlite

Key = tuple[str, int]  # (up_item, token)

LEASED, SUBMITTED, RESULTED, RETURNED, FAILING = "leased", "submitted", "resulted", "returned", "failing"

#: Counters kept per link (the federation report shows them all).
COUNTERS = (
    "leased",  # upstream leases taken (rows created)
    "submitted",  # rows confirmed by the downstream's SUBMIT_ACK
    "dedup_hits",  # ... of which the downstream already had the item (resubmission after a crash)
    "completed",  # results received from the downstream
    "returned",  # results the upstream accepted
    "fenced",  # results the upstream fenced (its lease had moved on: G4)
    "duplicate",  # results the upstream already had (duplicate/unknown)
    "proof_rejected",  # results the upstream refused (proof did not verify)
    "forged_rejected",  # items the downstream refused with ORIGIN_REJECTED
    "refused",  # items the downstream refused otherwise (FAIL upstream)
    "failed_down",  # items that ended dead/expired downstream (FAIL upstream)
    "released",  # upstream leases released before they were submitted (dropped)
    "ended_acked",
    "ended_failed",
    "ended_released",
    "orphan_results",  # results for which no row existed (acknowledged at once)
    "blobs_copied",
    "lost_leases",  # rows whose upstream lease was found lost (released at a reconnect while past leased)
    "accepted_late",  # ... whose result the upstream still accepted (no new lease had taken it: G8)
    "partition_released",  # submitted rows given back upstream after downstream_hold_max_s of partition
    "cancelled_down",  # ... whose downstream copy was then cancelled before it started (dead there: cancelled)
)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS relayed (
        link       TEXT    NOT NULL,
        up_item    TEXT    NOT NULL,
        token      INTEGER NOT NULL,
        kind       TEXT    NOT NULL,
        state      TEXT    NOT NULL,
        task       BLOB    NOT NULL,
        down_item  TEXT    NOT NULL DEFAULT '',
        report     BLOB,
        outcome    TEXT    NOT NULL DEFAULT '',
        lost       INTEGER NOT NULL DEFAULT 0,
        copied     TEXT    NOT NULL DEFAULT '',
        updated_ts REAL    NOT NULL,
        PRIMARY KEY (link, up_item, token)
    )""",
    """CREATE TABLE IF NOT EXISTS counters (
        link TEXT NOT NULL, name TEXT NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (link, name)
    )""",
    # one row per broken link (a swarm refused it): kept until the cause is seen fixed
    """CREATE TABLE IF NOT EXISTS link_status (
        link TEXT PRIMARY KEY, cause TEXT NOT NULL, reason TEXT NOT NULL, fix TEXT NOT NULL, since_ts REAL NOT NULL
    )""",
)


def _pack_body(msg: protocol.Message) -> bytes:
    return msgpack.packb(protocol.encode_body(msg), use_bin_type=True)


def _one(msg_type: protocol.MsgType, raw: bytes, attr: str):
    msg = protocol.decode_body(msg_type, msgpack.unpackb(raw, raw=False))
    items = getattr(msg, attr)
    if len(items) != 1:
        raise ValueError(f"row holds {len(items)} records")
    return items[0]


@dataclasses.dataclass
class Row:
    link: str
    up_item: str
    token: int
    kind: str
    state: str
    task: protocol.Task
    down_item: str = ""
    report: protocol.TaskResult | protocol.TaskFailure | None = None
    outcome: str = ""
    lost: bool = False
    copied: str = ""  # sha256 of a payload blob the relay copied into the downstream store

    @property
    def key(self) -> Key:
        return (self.up_item, self.token)


class RelayJournal:
    """The journal of one relay (see module doc). Every write is one fsynced transaction."""

    def __init__(self, path: Path, db: sqlite3.Connection, lock_fd: int | None) -> None:
        self.path = path
        self._db = db
        self._lock_fd = lock_fd
        #: called with the seconds of each committed transaction (the relay's metrics; None = off)
        self.observe_commit: Callable[[float], object] | None = None

    @classmethod
    def open(cls, journal_dir: str | Path) -> RelayJournal:
        path, db, lock_fd = open_locked_sqlite(
            journal_dir, "relay.sqlite3", _SCHEMA, f"relay journal {Path(journal_dir)} is in use by another ccsq-relayd"
        )
        return cls(path, db, lock_fd)

    @classmethod
    def open_readonly(cls, journal_dir: str | Path) -> RelayJournal:
        """For reports: no lock, read-only (safe while the relay runs)."""
        path = Path(journal_dir) / "relay.sqlite3"
        if not path.exists():
            raise FileNotFoundError(f"no relay journal at {path}")
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        return cls(path, db, None)

    def close(self) -> None:
        self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)

    # --- writes ---
    def _tx(self):
        journal = self

        class _Tx:
            def __enter__(self_inner):
                self_inner.t0 = time.perf_counter()
                journal._db.execute("BEGIN IMMEDIATE")
                return journal._db

            def __exit__(self_inner, exc_type, exc, tb):
                journal._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
                if exc_type is None and journal.observe_commit is not None:
                    journal.observe_commit(time.perf_counter() - self_inner.t0)

        return _Tx()

    @staticmethod
    def _bump(db: sqlite3.Connection, link: str, name: str, n: int = 1) -> None:
        if n:
            db.execute("INSERT INTO counters VALUES (?, ?, ?) ON CONFLICT (link, name) DO UPDATE SET n = n + excluded.n",
                       (link, name, n))

    def insert_leased(self, link: str, tasks: list[protocol.Task]) -> list[protocol.Task]:
        """Record new upstream leases; returns those that were new (a resent DISPATCH is not)."""
        now = time.time()
        new = []
        with self._tx() as db:
            for t in tasks:
                cur = db.execute("INSERT OR IGNORE INTO relayed (link, up_item, token, kind, state, task, updated_ts) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (link, t.item_id, t.token, t.kind, LEASED, _pack_body(protocol.Dispatch([t])), now))
                if cur.rowcount:
                    new.append(t)
            self._bump(db, link, "leased", len(new))
        return new

    def set_copied(self, link: str, keys: list[Key], sha256: str) -> None:
        with self._tx() as db:
            db.executemany("UPDATE relayed SET copied = ? WHERE link = ? AND up_item = ? AND token = ?",
                           [(sha256, link, i, t) for i, t in keys])

    def mark_submitted(self, link: str, up_item: str, down_item: str, duplicate: bool) -> int:
        """Rows of ``up_item`` still ``leased`` become ``submitted``; returns how many."""
        with self._tx() as db:
            cur = db.execute("UPDATE relayed SET state = ?, down_item = ?, updated_ts = ? "
                             "WHERE link = ? AND up_item = ? AND state = ?",
                             (SUBMITTED, down_item, time.time(), link, up_item, LEASED))
            self._bump(db, link, "submitted", cur.rowcount)
            self._bump(db, link, "dedup_hits", cur.rowcount if duplicate else 0)
            return cur.rowcount

    def store_results(self, link: str, results: list[tuple[protocol.TaskResult, str]]) -> None:
        """``(report, down_item)``: the downstream's result for a row (before COMPLETE is sent)."""
        now = time.time()
        with self._tx() as db:
            n = 0
            for r, down_item in results:
                cur = db.execute("UPDATE relayed SET state = ?, report = ?, down_item = ?, updated_ts = ? "
                                 "WHERE link = ? AND up_item = ? AND token = ? AND state IN (?, ?)",
                                 (RESULTED, _pack_body(protocol.Complete([r])), down_item, now, link, r.item_id, r.token,
                                  LEASED, SUBMITTED))
                n += cur.rowcount
            self._bump(db, link, "completed", n)

    def mark_failing(self, link: str, failures: list[protocol.TaskFailure], counter: str) -> None:
        with self._tx() as db:
            n = 0
            for f in failures:
                cur = db.execute("UPDATE relayed SET state = ?, report = ?, updated_ts = ? "
                                 "WHERE link = ? AND up_item = ? AND token = ? AND state IN (?, ?)",
                                 (FAILING, _pack_body(protocol.Fail([f])), time.time(), link, f.item_id, f.token, LEASED, SUBMITTED))
                n += cur.rowcount
            self._bump(db, link, counter, n)

    def mark_returned(self, link: str, outcomes: list[protocol.ItemOutcome]) -> None:
        """The upstream confirmed these COMPLETEs (any outcome): downstream ACK next. A lost
        lease's result accepted anyway counts ``accepted_late`` too (it stays ``returned``)."""
        counter = {protocol.Outcome.ACCEPTED.value: "returned", protocol.Outcome.FENCED.value: "fenced",
                   protocol.Outcome.REJECTED.value: "proof_rejected"}
        with self._tx() as db:
            for o in outcomes:
                cur = db.execute("UPDATE relayed SET state = ?, outcome = ?, updated_ts = ? "
                                 "WHERE link = ? AND up_item = ? AND token = ? AND state = ?",
                                 (RETURNED, o.outcome, time.time(), link, o.item_id, o.token, RESULTED))
                self._bump(db, link, counter.get(o.outcome, "duplicate"), cur.rowcount)
                if cur.rowcount and o.outcome == protocol.Outcome.ACCEPTED.value:
                    late = db.execute("SELECT lost FROM relayed WHERE link = ? AND up_item = ? AND token = ?",
                                      (link, o.item_id, o.token)).fetchone()
                    self._bump(db, link, "accepted_late", 1 if late and late[0] else 0)

    def mark_lost(self, link: str, keys: list[Key]) -> None:
        """The upstream no longer lists these leases as ours; counted once each (``lost_leases``)."""
        with self._tx() as db:
            n = 0
            for i, t in keys:
                n += db.execute("UPDATE relayed SET lost = 1 WHERE link = ? AND up_item = ? AND token = ? AND lost = 0",
                                (link, i, t)).rowcount
            self._bump(db, link, "lost_leases", n)

    def set_broken(self, link: str, cause: str, reason: str, fix: str, since_ts: float) -> float:
        """The link stopped pulling (a swarm refused it); returns since when (the first
        ``since_ts`` of an unbroken series of breaks is kept, across restarts)."""
        with self._tx() as db:
            db.execute("INSERT INTO link_status VALUES (?, ?, ?, ?, ?) ON CONFLICT (link) DO UPDATE SET "
                       "cause = excluded.cause, reason = excluded.reason, fix = excluded.fix", (link, cause, reason, fix, since_ts))
            return db.execute("SELECT since_ts FROM link_status WHERE link = ?", (link,)).fetchone()[0]

    def clear_broken(self, link: str, causes: tuple[str, ...]) -> bool:
        """The cause of a break was seen fixed (e.g. the refusing broker let the relay in)."""
        with self._tx() as db:
            return db.execute(f"DELETE FROM link_status WHERE link = ? AND cause IN ({','.join('?' * len(causes))})",
                              (link, *causes)).rowcount > 0

    def broken(self, link: str) -> dict | None:
        """``{cause, reason, fix, since_ts}`` while the link is broken, else None (a journal
        older than the table: None)."""
        try:
            row = self._db.execute("SELECT cause, reason, fix, since_ts FROM link_status WHERE link = ?", (link,)).fetchone()
        except sqlite3.OperationalError:
            return None
        return None if row is None else dict(zip(("cause", "reason", "fix", "since_ts"), row))

    def end(self, link: str, keys: list[Key], counter: str, extra: str = "") -> int:
        """Delete rows (their story is over) and count them under ``counter``."""
        with self._tx() as db:
            n = 0
            for i, t in keys:
                n += db.execute("DELETE FROM relayed WHERE link = ? AND up_item = ? AND token = ?", (link, i, t)).rowcount
            self._bump(db, link, counter, n)
            if extra:
                self._bump(db, link, extra, n)
            return n

    def count(self, link: str, name: str, n: int = 1) -> None:
        with self._tx() as db:
            self._bump(db, link, name, n)

    # --- reads ---
    def rows(self, link: str | None = None) -> list[Row]:
        sql = "SELECT link, up_item, token, kind, state, task, down_item, report, outcome, lost, copied FROM relayed"
        args: tuple = ()
        if link is not None:
            sql, args = sql + " WHERE link = ?", (link,)
        out = []
        for lk, up_item, token, kind, state, task, down_item, report, outcome, lost, copied in self._db.execute(
                sql + " ORDER BY updated_ts", args):
            try:
                t = _one(protocol.MsgType.DISPATCH, task, "tasks")
                rep = None
                if report is not None:
                    rep = (_one(protocol.MsgType.FAIL, report, "failures") if state == FAILING
                           else _one(protocol.MsgType.COMPLETE, report, "results"))
            except Exception as exc:  # noqa: BLE001 - any decode problem names the row
                raise JournalCorrupt(f"relay journal {self.path}: row ({lk}, {up_item}, {token}) does not decode: {exc}") from None
            out.append(Row(lk, up_item, token, kind, state, t, down_item, rep, outcome, bool(lost), copied))
        return out

    def counters(self, link: str) -> dict[str, int]:
        out = dict.fromkeys(COUNTERS, 0)
        for name, n in self._db.execute("SELECT name, n FROM counters WHERE link = ?", (link,)):
            out[name] = n
        return out

    def links(self) -> list[str]:
        names = {r[0] for r in self._db.execute("SELECT DISTINCT link FROM counters")}
        names |= {r[0] for r in self._db.execute("SELECT DISTINCT link FROM relayed")}
        return sorted(names)
