"""The worker's local journal: held leases and finished-but-unconfirmed reports.

One SQLite file (``<journal_dir>/journal.sqlite3``, WAL, ``synchronous=FULL``,
so every write is fsynced before the call returns). Its meaning is one entry per
lease the worker holds, keyed by ``(item_id, token)``::

    state     meaning                                         written when
    held      dispatched to us, not started yet               DISPATCH arrives
    started   the handler was entered                         the slot is taken (or with the hold, when
                                                              a free lane takes the lease at once)
    finished  a result is stored, COMPLETE not confirmed      before COMPLETE is sent
    failed    a failure is decided, FAIL not confirmed        before FAIL is sent

An entry is gone once the broker confirms the report (any outcome) or tells us the
lease is no longer ours.

Storage (format 2): a log, table ``log(seq, ops)``, ONE row per transaction (a group
commit of many jobs' writes), ``ops`` = msgpack ``[[op, rows], ...]`` with op ``h``
(rows ``[item_id, token, kind]``: held, unless the lease is known), ``s`` (``[item_id,
token]``: held -> started), ``r`` (``[item_id, token, kind, state, report]``: finished /
failed, upsert; report = ``[sha256, size, inline, handler, handler_version, runtime_s]``
or ``[reason, retryable, message]``)
and ``f`` (``[item_id, token]``: forget). Replaying the rows in ``seq`` order gives the
entries; the journal keeps them in memory too. When no entry is left, or after
``COMPACT_ROWS`` log rows, the same transaction replaces the log by one snapshot row
(``[["S", [[item_id, token, kind, state, report | None], ...]]]``), so the file stays
small. A transaction writes one row instead of one per job (hold, started, record and
forget of 64 jobs were 256 row writes with their index updates).

A report is read back through the strict protocol codec (as the body of a one-element
COMPLETE or FAIL, :func:`decode_report`).

Journals of format 1 (table ``entries``, one row per lease, written by earlier
workers) are still read: their rows come before the log's on replay, and the first
compaction deletes them.

The journal is single-writer: :meth:`Journal.open` takes an exclusive
``flock`` on ``<journal_dir>/LOCK`` and raises :class:`JournalLocked` when
another worker process holds it. A journal object is used from one thread at
a time (the worker runs every call on one dedicated thread), and the worker
writes through :class:`GroupCommit`: every write queued in the same event-loop tick
(or while the previous commit runs) shares ONE transaction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import cast

import msgpack

from ccsq.common.wire import protocol
from ccsq.common.wire.errors import DecodeError, JournalCorrupt, JournalLocked  # noqa: F401 (the journal errors live in the one exception tree)
from ccsq.common.storage.sqlite_journal import open_locked_sqlite

Key = tuple[str, int]

COMPACT_ROWS = 64  # log rows (transactions) before the log is replaced by one snapshot row


class OpKind(str, enum.Enum):
    """The four journal writes (rows of :meth:`Journal.apply`); call them through the typed
    methods :meth:`Journal.hold` ... :meth:`GroupCommit.forget`, never by name."""

    HOLD = "hold"  # rows (item_id, token, kind): new leases, state held
    STARTED = "started"  # rows key: held -> started
    RECORD = "record"  # rows (report, kind): upsert finished / failed with the report
    FORGET = "forget"  # rows key: delete (confirmed, or released by the broker)


Op = tuple[OpKind, list]  # (kind, rows): see Journal.apply


class EntryState(str, enum.Enum):
    HELD = "held"
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, slots=True)
class JournalEntry:
    """One entry: a lease, its state, and its report once decided."""

    item_id: str
    token: int
    kind: str
    state: EntryState
    report: protocol.TaskResult | protocol.TaskFailure | None


_LEGACY_SCHEMA = """
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
_LOG_SCHEMA = "CREATE TABLE IF NOT EXISTS log (seq INTEGER PRIMARY KEY, ops BLOB NOT NULL)"

_HELD, _STARTED, _FINISHED, _FAILED = (s.value for s in EntryState)
_OP_CODES = {OpKind.HOLD: "h", OpKind.STARTED: "s", OpKind.RECORD: "r", OpKind.FORGET: "f"}
_SNAPSHOT = "S"

_COMPLETE_BODY = protocol.encode_body(protocol.Complete(results=[]))  # the bodies around one report (field order kept)
_FAIL_BODY = protocol.encode_body(protocol.Fail(failures=[]))
_PLAIN_RESULT = len(_COMPLETE_BODY) == 0 and len(_FAIL_BODY) == 0  # only the list field: the fast path holds
_packb = msgpack.Packer(use_bin_type=True).pack


def encode_report(report: protocol.TaskResult | protocol.TaskFailure) -> bytes:
    """msgpack bytes of a one-element COMPLETE or FAIL body holding ``report``: the same
    bytes as ``packb(encode_body(Complete(results=[report])))`` without building the
    message (tests/test_worker_units.py checks the equality)."""
    if type(report) is protocol.TaskResult:
        if _PLAIN_RESULT and not report.proof and not report.proof_sig:
            b = report.result
            return _packb({"results": [{
                "item_id": report.item_id, "token": report.token,
                "result": {"sha256": b.sha256, "size": b.size, "inline": b.inline},
                "handler": report.handler, "handler_version": report.handler_version, "runtime_s": report.runtime_s,
            }]})
        return _packb({**_COMPLETE_BODY, "results": [protocol.encode_body(report)]})
    return _packb({**_FAIL_BODY, "failures": [protocol.encode_body(report)]})


def decode_report(state: EntryState, raw: bytes) -> protocol.TaskResult | protocol.TaskFailure:
    """Inverse of :func:`encode_report`; raises DecodeError on a malformed row."""
    body = msgpack.unpackb(raw, raw=False)
    msg_type = protocol.MsgType.COMPLETE if state is EntryState.FINISHED else protocol.MsgType.FAIL
    msg = protocol.decode_body(msg_type, body)
    reports = msg.results if isinstance(msg, protocol.Complete) else getattr(msg, "failures", [])
    if len(reports) != 1:
        raise DecodeError(f"journal row holds {len(reports)} reports, expected 1")
    report = reports[0]
    return report


class Journal:
    """The journal of one worker (see module doc). Every write commits with fsync.

    ``_live``: the entries, ``key -> [kind, state, report | None]`` (report: see
    :func:`_record_row`), in the order of their first write, as replaying the file gives them."""

    path: Path
    _db: sqlite3.Connection
    _lock_fd: int
    _live: dict[Key, list]
    _log_rows: int  # rows in the log table
    _legacy: bool  # format-1 rows still in table entries

    def __init__(self, path: Path, db: sqlite3.Connection, lock_fd: int) -> None:
        self.path = path
        self._db = db
        self._lock_fd = lock_fd
        self._live = {}
        self._log_rows = 0
        self._legacy = False
        self._load()

    @classmethod
    def open(cls, journal_dir: str | Path) -> Journal:
        """Open (create) the journal in ``journal_dir``; raises JournalLocked if in use,
        JournalCorrupt naming a log row that does not decode."""
        path, db, lock_fd = open_locked_sqlite(
            journal_dir, "journal.sqlite3", [_LEGACY_SCHEMA, _LOG_SCHEMA],
            f"journal {Path(journal_dir)} is in use by another ccsq-workerd (one journal_dir per worker)",
        )
        try:
            return cls(path, db, lock_fd)
        except BaseException:
            db.close()
            os.close(lock_fd)
            raise

    def close(self) -> None:
        self._db.close()
        os.close(self._lock_fd)

    def _load(self) -> None:
        """Replay the file into ``_live``: format-1 rows first (oldest first), then the log."""
        live = self._live
        for item_id, token, kind, state, raw in self._db.execute(
                "SELECT item_id, token, kind, state, report FROM entries ORDER BY updated_ts"):
            live[(item_id, token)] = [kind, state, raw]
            self._legacy = True
        for seq, raw in self._db.execute("SELECT seq, ops FROM log ORDER BY seq"):
            self._log_rows += 1
            try:
                ops = msgpack.unpackb(raw, raw=False, use_list=True)
                for code, rows in ops:
                    _REPLAY[code](live, rows)
            except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
                raise JournalCorrupt(f"journal {self.path}: log row {seq} does not decode: {exc!r}") from None

    # --- writes (each call one transaction, fsynced) ---
    def hold(self, leases: list[tuple[str, int, str]]) -> None:
        """Record newly dispatched leases ``(item_id, token, kind)`` in state held."""
        self.apply([(OpKind.HOLD, leases)])

    def mark_started(self, *keys: Key) -> None:
        """The handler is about to run these leases (one batch: one transaction)."""
        self.apply([(OpKind.STARTED, list(keys))])

    def record(self, report: protocol.TaskResult | protocol.TaskFailure, kind: str = "") -> None:
        """Store a finished result or a decided failure (upsert), before it is sent."""
        self.apply([(OpKind.RECORD, [(report, kind)])])

    def forget(self, keys: list[Key]) -> None:
        """Delete entries (confirmed by the broker, or released by it)."""
        if keys:
            self.apply([(OpKind.FORGET, list(keys))])

    def apply(self, ops: list[Op]) -> None:
        """Apply several writes, in order, in ONE transaction (one fsync): the
        group commit of :class:`GroupCommit`. Each op is ``(OpKind.HOLD, [(item_id,
        token, kind)])``, ``(OpKind.STARTED, [key])``, ``(OpKind.RECORD, [(report,
        kind)])`` or ``(OpKind.FORGET, [key])``. All or nothing: on an error (ValueError
        for an unknown op) nothing is written."""
        coded: list = []
        for op, rows in ops:
            code = _OP_CODES[OpKind(op)]
            if code == "r":
                rows = [_record_row(r, kind) for r, kind in rows]
            coded.append([code, rows])
        live = self._live
        try:
            for code, rows in coded:
                _REPLAY[code](live, rows)
            with self._tx():
                if not live or self._log_rows >= COMPACT_ROWS:
                    self._compact()
                else:
                    self._db.execute("INSERT INTO log (ops) VALUES (?)", (_packb(coded),))
                    self._log_rows += 1
        except BaseException:
            self._live = {}  # rolled back: the file is the truth (a rare path: read it again)
            self._log_rows = 0
            self._legacy = False
            self._load()
            raise

    def _compact(self) -> None:
        """In the caller's transaction: the log becomes one snapshot row of ``_live``
        (none when empty), and format-1 rows are deleted."""
        self._db.execute("DELETE FROM log")
        if self._legacy:
            self._db.execute("DELETE FROM entries")
        self._log_rows = 0
        if self._live:
            snap = [[k[0], k[1], v[0], v[1], v[2]] for k, v in self._live.items()]
            self._db.execute("INSERT INTO log (ops) VALUES (?)", (_packb([[_SNAPSHOT, snap]]),))
            self._log_rows = 1
        self._legacy = False

    # --- reads ---
    def entries(self) -> list[JournalEntry]:
        """Every entry, in the order of their first write. Raises JournalCorrupt naming one that
        does not decode."""
        out: list[JournalEntry] = []
        for (item_id, token), (kind, state_s, raw) in self._live.items():
            try:
                state = EntryState(state_s)
                report = (_decode_entry_report(item_id, token, state, raw)
                          if state in (EntryState.FINISHED, EntryState.FAILED) else None)
            except (ValueError, DecodeError, TypeError, msgpack.UnpackException) as exc:
                raise JournalCorrupt(f"journal {self.path}: entry ({item_id!r}, {token}) does not decode: {exc}") from None
            out.append(JournalEntry(item_id, token, kind, state, report))
        return out

    def _tx(self) -> _Tx:
        return _Tx(self._db)


# --- the four writes on the entries (applying, and replaying the log); rows as in the log --


def _replay_hold(live: dict[Key, list], rows: list) -> None:
    for item_id, token, kind in rows:
        key = (item_id, token)
        if key not in live:
            live[key] = [kind, _HELD, None]


def _replay_started(live: dict[Key, list], rows: list) -> None:
    for key in rows:
        v = live.get((key[0], key[1]))
        if v is not None and v[1] == _HELD:
            v[1] = _STARTED


def _replay_record(live: dict[Key, list], rows: list) -> None:
    for item_id, token, kind, state, report in rows:
        live[(item_id, token)] = [kind, state, report]


def _replay_forget(live: dict[Key, list], rows: list) -> None:
    for key in rows:
        live.pop((key[0], key[1]), None)


def _record_row(r: protocol.TaskResult | protocol.TaskFailure, kind: str) -> list:
    """The log row of a report: ``[item_id, token, kind, state, report]`` where report is
    the compact list of :func:`_compact_report` (no per-report msgpack call), or the
    :func:`encode_report` bytes for a result that carries a federation proof."""
    if type(r) is protocol.TaskResult:
        if r.proof or r.proof_sig:
            return [r.item_id, r.token, kind, _FINISHED, encode_report(r)]
        b = r.result
        return [r.item_id, r.token, kind, _FINISHED, [b.sha256, b.size, b.inline, r.handler, r.handler_version, r.runtime_s]]
    f = cast(protocol.TaskFailure, r)  # the only other report type (TaskResult has no subclasses)
    return [f.item_id, f.token, kind, _FAILED, [f.reason, f.retryable, f.message]]


def _decode_entry_report(item_id: str, token: int, state: EntryState, rep: bytes | list) -> protocol.TaskResult | protocol.TaskFailure:
    """A report as kept in an entry: encode_report bytes (format 1, proofs) or the compact
    list of :func:`_record_row`, decoded by the strict protocol codec either way."""
    if isinstance(rep, (bytes, bytearray)):
        return decode_report(state, bytes(rep))
    if not isinstance(rep, list):
        raise DecodeError(f"report is a {type(rep).__name__}")
    if state is EntryState.FINISHED:
        sha256, size, inline, handler, version, runtime_s = rep
        body = {"results": [{"item_id": item_id, "token": token,
                             "result": {"sha256": sha256, "size": size, "inline": inline},
                             "handler": handler, "handler_version": version, "runtime_s": runtime_s}]}
    else:
        reason, retryable, message = rep
        body = {"failures": [{"item_id": item_id, "token": token, "reason": reason, "retryable": retryable,
                              "message": message}]}
    return decode_report(state, _packb(body))


_REPLAY: dict[str, Callable[[dict[Key, list], list], None]] = {
    "h": _replay_hold,
    "s": _replay_started,
    "r": _replay_record,
    "f": _replay_forget,
    _SNAPSHOT: _replay_record,  # a snapshot row: every live entry, as records (always the first row)
}


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


class GroupCommit:
    """Group commit of one worker's journal writes (used from one event loop).

    :meth:`hold`, :meth:`started`, :meth:`record` and :meth:`forget` queue a write
    (see :meth:`Journal.apply`) and return once it is durable. Ops queued while a commit is running, or in
    the same loop tick as the first one (or within ``window_s`` seconds of it, monotonic; 0 by default: a
    sleep before each commit only adds its length to every write's wait, while under load the writes
    queued during a commit form the next one anyway), go into the NEXT commit together: one SQLite
    transaction, one fsync, ops applied in the order queued. An error fails every op of that commit
    (nothing of it was written).

    A *lazy* write (``forget(..., lazy=True)``: rows of confirmed reports, whose
    deletion nothing waits for) starts no commit of its own: it rides with the next
    eager write, or is committed ``lazy_s`` seconds later if none comes (and by
    :meth:`drain`). A crash before that only re-sends reports the broker already
    confirmed (it answers them ``duplicate``).

    ``executor`` must be the single thread that every other journal call uses,
    so commits and reads stay in order. An op is applied even if its waiter is
    cancelled after queueing it (as a write handed to a thread always was).
    """

    journal: Journal
    window_s: float
    commits: int  # transactions committed
    ops: int  # ops in them
    observe_commit: Callable[[int, float], None] | None = None  # metrics hook: (ops, seconds) once per commit

    def __init__(self, journal: Journal, executor: Executor, window_s: float = 0.0, lazy_s: float = 0.05) -> None:
        self.journal = journal
        self.window_s = window_s
        self.lazy_s = lazy_s
        self.commits = 0
        self.ops = 0
        self._executor = executor
        self._queue: list[tuple[Op, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._eager = 0  # eager ops in _queue (a commit is due for them)
        self._lazy_timer: asyncio.TimerHandle | None = None

    async def hold(self, leases: list[tuple[str, int, str]]) -> None:
        """Newly dispatched leases ``(item_id, token, kind)``, state held (DISPATCH)."""
        await self.write(OpKind.HOLD, leases)

    async def started(self, keys: list[Key]) -> None:
        """Held -> started: the handler is about to run these (one batch)."""
        await self.write(OpKind.STARTED, keys)

    async def record(self, reports: list[tuple[protocol.TaskResult | protocol.TaskFailure, str]]) -> None:
        """``(report, kind)`` rows: a finished result or a decided failure, before it is sent."""
        await self.write(OpKind.RECORD, reports)

    async def forget(self, keys: list[Key], *, lazy: bool = False) -> None:
        """Delete rows: confirmed by the broker, released by it, or lost in a crash.
        ``lazy``: start no commit for it (class doc)."""
        await self.write(OpKind.FORGET, keys, lazy=lazy)

    async def write(self, op: OpKind, rows: list, *, lazy: bool = False) -> None:
        """Queue ``(op, rows)`` and wait until it is committed (raises the commit's error;
        an unknown ``op`` fails its whole commit with ValueError). Prefer the typed methods."""
        await self.queue(op, rows, lazy=lazy)

    def queue(self, op: OpKind, rows: list, *, lazy: bool = False) -> asyncio.Future:
        """:meth:`write` without a coroutine: queue ``(op, rows)`` now and return the future
        that the commit resolves (no task per write; the caller must consume its error)."""
        if not lazy:
            return self.queue_ops([(op, rows)])
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append(((op, rows), fut))
        self._commit_later(loop)
        return fut

    def queue_ops(self, ops: list[Op]) -> asyncio.Future:
        """:meth:`queue` of several ops, in order, resolved by ONE future: they are queued in the
        same call, so they always go into the same commit (one transaction, all or nothing)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.extend((op, fut) for op in ops)
        self._eager += len(ops)
        self._commit_soon(loop)
        return fut

    def _commit_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush(), name="journal-group-commit")

    def _commit_later(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._lazy_timer is None:
            self._lazy_timer = loop.call_later(self.lazy_s, self._lazy_due, loop)

    def _lazy_due(self, loop: asyncio.AbstractEventLoop) -> None:
        self._lazy_timer = None
        if self._queue:
            self._eager += 1  # the lazy ops are due now: commit them even alone
            self._commit_soon(loop)

    async def drain(self) -> None:
        """Wait until every queued op (lazy ones too) is committed (or failed): call before closing."""
        loop = asyncio.get_running_loop()
        while True:
            if self._queue:
                self._eager += 1
                self._commit_soon(loop)
            if self._flusher is None or self._flusher.done():
                return
            await asyncio.wait({self._flusher})

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        if self.window_s > 0:
            await asyncio.sleep(self.window_s)
        else:
            await asyncio.sleep(0)  # one loop tick: the writes of this tick go together
        while self._queue and self._eager > 0:  # only lazy ops left: they wait for company
            batch, self._queue, self._eager = self._queue, [], 0
            if self._lazy_timer is not None:  # its lazy ops go now
                self._lazy_timer.cancel()
                self._lazy_timer = None
            t0 = time.perf_counter()
            try:
                await loop.run_in_executor(self._executor, self.journal.apply, _merge_adjacent([op for op, _ in batch]))
            except Exception as exc:  # noqa: BLE001 - handed to every waiter of this commit
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.commits += 1
            self.ops += len(batch)
            if self.observe_commit is not None:
                self.observe_commit(len(batch), time.perf_counter() - t0)
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)
        if self._queue:  # lazy ops only
            self._commit_later(loop)


def _merge_adjacent(ops: list[Op]) -> list[Op]:
    """Adjacent ops of the same kind as one op (their rows in order): one ``executemany``
    for the ~64 per-job ``record`` writes of a batch instead of 64. Same rows, same order,
    same single transaction."""
    out: list[Op] = []
    for name, rows in ops:
        if out and out[-1][0] == name:
            out[-1][1].extend(rows)
        else:
            out.append((name, list(rows)))
    return out
