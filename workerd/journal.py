"""The worker's local journal: held leases and finished-but-unconfirmed reports.

One SQLite file (``<journal_dir>/journal.sqlite3``, WAL, ``synchronous=FULL``,
so every write is fsynced before the call returns) with one row per lease the
worker holds, keyed by ``(item_id, token)``::

    state     meaning                                         written when
    held      dispatched to us, not started yet               DISPATCH arrives
    started   the handler was entered                         the slot is taken
    finished  a result is stored, COMPLETE not confirmed      before COMPLETE is sent
    failed    a failure is decided, FAIL not confirmed        before FAIL is sent

``report`` holds the msgpack body of a one-element COMPLETE or FAIL, so it is
decoded with the strict protocol codec. A row is deleted when the broker
confirms the report (any outcome) or tells us the lease is no longer ours.

The journal is single-writer: :meth:`Journal.open` takes an exclusive
``flock`` on ``<journal_dir>/LOCK`` and raises :class:`JournalLocked` when
another worker process holds it. A journal object is used from one thread at
a time (the worker runs every call on one dedicated thread).
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import os
import sqlite3
import time
from pathlib import Path

import msgpack

from ccsq.common import protocol as p
from ccsq.common.errors import DecodeError, RetryableError

Key = tuple[str, int]


class JournalLocked(RetryableError):
    """Another ccsq-workerd holds this journal_dir: give each worker its own journal_dir, or wait for the old process to exit."""

    code = "JOURNAL_LOCKED"


class JournalCorrupt(RetryableError):
    """A journal row could not be decoded; the message names the row. Move the journal aside to start clean."""

    code = "JOURNAL_CORRUPT"


class EntryState(str, enum.Enum):
    HELD = "held"
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, slots=True)
class JournalEntry:
    """One row: a lease, its state, and its report once decided."""

    item_id: str
    token: int
    kind: str
    state: EntryState
    report: p.TaskResult | p.TaskFailure | None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    item_id    TEXT    NOT NULL,
    token      INTEGER NOT NULL,
    kind       TEXT    NOT NULL,
    state      TEXT    NOT NULL,
    report     BLOB,
    updated_ts REAL    NOT NULL,
    PRIMARY KEY (item_id, token)
)
"""


def encode_report(report: p.TaskResult | p.TaskFailure) -> bytes:
    """msgpack bytes of a one-element COMPLETE or FAIL body holding ``report``."""
    msg: p.Message = p.Complete(results=[report]) if isinstance(report, p.TaskResult) else p.Fail(failures=[report])
    return msgpack.packb(p.encode_body(msg), use_bin_type=True)


def decode_report(state: EntryState, raw: bytes) -> p.TaskResult | p.TaskFailure:
    """Inverse of :func:`encode_report`; raises DecodeError on a malformed row."""
    body = msgpack.unpackb(raw, raw=False)
    msg_type = p.MsgType.COMPLETE if state is EntryState.FINISHED else p.MsgType.FAIL
    msg = p.decode_body(msg_type, body)
    reports = msg.results if isinstance(msg, p.Complete) else getattr(msg, "failures", [])
    if len(reports) != 1:
        raise DecodeError(f"journal row holds {len(reports)} reports, expected 1")
    report = reports[0]
    return report


class Journal:
    """The journal of one worker (see module doc). Every write commits with fsync."""

    path: Path
    _db: sqlite3.Connection
    _lock_fd: int

    def __init__(self, path: Path, db: sqlite3.Connection, lock_fd: int) -> None:
        self.path = path
        self._db = db
        self._lock_fd = lock_fd

    @classmethod
    def open(cls, journal_dir: str | Path) -> Journal:
        """Open (create) the journal in ``journal_dir``; raises JournalLocked if in use."""
        directory = Path(journal_dir)
        directory.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise JournalLocked(f"journal {directory} is in use by another ccsq-workerd (one journal_dir per worker)") from None
        path = directory / "journal.sqlite3"
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(_SCHEMA)
        return cls(path, db, lock_fd)

    def close(self) -> None:
        self._db.close()
        os.close(self._lock_fd)

    # --- writes (each one transaction, fsynced) ---
    def hold(self, leases: list[tuple[str, int, str]]) -> None:
        """Record newly dispatched leases ``(item_id, token, kind)`` in state held."""
        now = time.time()
        with self._tx():
            self._db.executemany(
                "INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, NULL, ?)",
                [(i, t, k, EntryState.HELD.value, now) for i, t, k in leases],
            )

    def mark_started(self, *keys: Key) -> None:
        """The handler is about to run these leases (one batch: one transaction)."""
        now = time.time()
        with self._tx():
            self._db.executemany(
                "UPDATE entries SET state = ?, updated_ts = ? WHERE item_id = ? AND token = ? AND state = ?",
                [(EntryState.STARTED.value, now, k[0], k[1], EntryState.HELD.value) for k in keys],
            )

    def record(self, report: p.TaskResult | p.TaskFailure, kind: str = "") -> None:
        """Store a finished result or a decided failure (upsert), before it is sent."""
        state = EntryState.FINISHED if isinstance(report, p.TaskResult) else EntryState.FAILED
        with self._tx():
            self._db.execute(
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (item_id, token) DO UPDATE SET state = excluded.state, "
                "report = excluded.report, updated_ts = excluded.updated_ts",
                (report.item_id, report.token, kind, state.value, encode_report(report), time.time()),
            )

    def forget(self, keys: list[Key]) -> None:
        """Delete rows (confirmed by the broker, or released by it)."""
        if not keys:
            return
        with self._tx():
            self._db.executemany("DELETE FROM entries WHERE item_id = ? AND token = ?", keys)

    # --- reads ---
    def entries(self) -> list[JournalEntry]:
        """Every row, oldest first. Raises JournalCorrupt naming a row that does not decode."""
        out: list[JournalEntry] = []
        rows = self._db.execute(
            "SELECT item_id, token, kind, state, report FROM entries ORDER BY updated_ts"
        ).fetchall()
        for item_id, token, kind, state_s, raw in rows:
            try:
                state = EntryState(state_s)
                report = decode_report(state, raw) if state in (EntryState.FINISHED, EntryState.FAILED) else None
            except (ValueError, DecodeError, TypeError, msgpack.UnpackException) as exc:
                raise JournalCorrupt(f"journal {self.path}: row ({item_id!r}, {token}) does not decode: {exc}") from None
            out.append(JournalEntry(item_id, token, kind, state, report))
        return out

    def _tx(self) -> _Tx:
        return _Tx(self._db)


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
