"""The broker's ledger: all item state in one LMDB environment (see docs/ledger.md).

This is the only module that touches the LMDB env. Every state change runs
inside a :class:`LedgerTxn` (one write transaction), which keeps the counters,
the per-state counts, the state indexes and the gap-register events in step
with the item records, so that the balance

    received == ready + leased + completed + acknowledged + dead + expired

holds at every commit. Times stored here are wall-clock milliseconds (they must
survive restarts); the broker keeps its monotonic lease timers in memory.

Errors: ``lmdb.MapFullError`` propagates out of any write so the caller can
abort, grow the map (:meth:`Ledger.grow_map`) and retry the whole batch;
:class:`LedgerError` for a ledger that cannot be opened.
"""

from __future__ import annotations

import dataclasses
import os
import random
import secrets
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from ccsq.brokerd import gaps
from ccsq.common.wire import protocol as p
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.errors import CcsqError, ExitCode, ledger_failure
from ccsq.common.wire.policy import FAIL_POLICY, fail_rule

S = p.ItemState
STATES: tuple[str, ...] = tuple(s.value for s in S)

#: Flow counters (monotonic, in the ledger, changed in the same txn as the state).
COUNTERS: tuple[str, ...] = (
    "received",
    "routed",
    "completed",
    "acknowledged",
    "retried",
    "failed",
    "dead",
    "expired",
    "duplicate_submits",
    "fenced_completions",
    "fenced_failures",
    "redelivered",
    "released",
    "late_results_accepted",
    "purged",
    "replayed",
    "dead_purged",
    "quarantined",
)

#: Shortest wait before an item whose worker could not reach the claim store is ready again.
STORE_RETRY_MIN_MS = 1000

#: Accounting samples kept in meta (``t:`` + >I slot), a ring: ``ccsq gap-report --html``
#: charts them. At the default 30 s interval this is 24 h (~1 MiB at most).
SAMPLES_KEPT = 2880
#: Most kinds recorded per sample (their per-state counts, for per-queue drain rates).
SAMPLE_MAX_KINDS = 64
#: Commit history in meta (``h:`` + >Q txnid): at most one entry a second, kept an hour
#: (<= 3600 entries, ~100 KiB): how old a reader's snapshot is and what it pins.
HISTORY_PREFIX = b"h:"
HISTORY_INTERVAL_MS = 1000
HISTORY_KEEP_MS = 3600 * 1000
#: The broker runs LMDB's reader check at least this often (stale slots of dead readers
#: freed; in practice every 0.1 s while it commits); a process that finds the reader
#: table full while opening waits longer than this.
READER_CHECK_INTERVAL_S = 1.0
READERS_FULL_WAIT_S = 3.0

DB_NAMES = (
    "items",  # item_id -> msgpack record
    "payloads",  # item_id -> msgpack Blob
    "results",  # item_id -> msgpack Blob
    "ready",  # kind \0 >I prio_key >Q not_before_ms >Q seq -> item_id
    "leased",  # item_id -> msgpack [token, worker]
    "completed",  # >Q completion_seq -> item_id
    "dead",  # item_id -> b""
    "acked",  # >Q acked_ms + item_id -> b""
    "deadline",  # >Q deadline_ms + item_id -> b""
    "keys",  # idempotency key -> msgpack [item_id, created_ms]
    "keytime",  # >Q created_ms + key -> b""
    "events",  # window \0 >Q n -> msgpack event
    "meta",  # counters, per-state counts, ids (see docs/ledger.md)
)

PRIO_MAX = p.PRIO_MAX
_Q = struct.Struct(">Q")
_q = struct.Struct(">q")
_READY = struct.Struct(">IQQ")


class LedgerError(CcsqError):
    """The ledger cannot be opened or is inconsistent; the message says which file and why.
    ``exit_code``: what a command or daemon stopped by it exits with (:func:`ledger_failure`)."""

    code = "LEDGER"
    exit_code: ExitCode = ExitCode.FAILURE

    def __init__(self, message: str = "", *, exit_code: ExitCode | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ReadersFull(LedgerError):
    """Every LMDB reader slot is held by a live process (stale ones were cleared): a read
    transaction cannot start. Transient (exit 75): the broker logs it and goes on."""

    code = "LEDGER_READERS_FULL"
    exit_code = ExitCode.TEMPFAIL


@dataclasses.dataclass(frozen=True)
class Policy:
    """Ledger-side policy (from BrokerConfig). Durations in seconds."""

    max_attempts: int = 5
    retry_backoff_base_s: float = 0.5
    retry_backoff_max_s: float = 60.0
    dedup_window_s: float = 7 * 86400.0
    retention_s: float = 3600.0
    max_ready_items: int = 0  # 0 = unlimited

    @classmethod
    def from_config(cls, cfg: Any) -> Policy:
        return cls(
            max_attempts=cfg.max_attempts,
            retry_backoff_base_s=cfg.retry_backoff_base_s,
            retry_backoff_max_s=cfg.retry_backoff_max_s,
            dedup_window_s=cfg.dedup_window_s,
            retention_s=cfg.retention_s,
            max_ready_items=cfg.max_ready_items,
        )


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False)


def _blob_to_wire(blob: p.Blob) -> dict:
    return {"sha256": blob.sha256, "size": blob.size, "inline": blob.inline}


def _blob_from_wire(d: dict) -> p.Blob:
    return p.Blob(d["sha256"], d["size"], d.get("inline"))


def ready_key(kind: str, priority: int, not_before_ms: int, seq: int) -> bytes:
    """Index key ordering ready items by priority desc, then not-before, then arrival."""
    return kind.encode() + b"\0" + _READY.pack(PRIO_MAX - priority, not_before_ms, seq)


def backoff_ms(attempt: int, policy: Policy, rng: random.Random) -> int:
    """Full-jitter exponential backoff for the retry after attempt ``attempt`` (1-based), in ms:
    :func:`ccsq.common.wire.backoff.backoff_delay_s` (the one backoff) with the ledger's seeded rng."""
    return int(backoff_delay_s(attempt - 1, policy.retry_backoff_base_s, policy.retry_backoff_max_s, rng) * 1000)


def validate_submit_item(item: p.SubmitItem) -> str:
    """Return "" when ``item`` is acceptable, else a human reason (answered as MALFORMED).
    The rule lives in :func:`ccsq.common.wire.protocol.submit_item_problem` (shared with the producer)."""
    return p.submit_item_problem(item)


class Ledger:
    """The LMDB environment and its sub-databases.

    ``path``: the ledger directory (created). ``map_size_bytes`` is the initial
    map; :meth:`grow_map` doubles it up to ``max_map_size_bytes``. With
    ``readonly=True`` (reports) nothing is created and the lock table is used,
    so it is safe while a broker writes. Call :meth:`close` when done; never
    fork with an open ledger.
    """

    def __init__(
        self,
        path: Path,
        *,
        map_size_bytes: int = 1 << 30,
        max_map_size_bytes: int = 64 << 30,
        policy: Policy | None = None,
        readonly: bool = False,
        rng: random.Random | None = None,
        max_readers: int = 126,
    ) -> None:
        self.path = Path(path)
        self.stale_readers_cleared = 0  # stale reader slots this process cleared (LMDB reader check)
        self.policy = policy or Policy()
        self.max_map_size_bytes = max(max_map_size_bytes, map_size_bytes)
        self.readonly = readonly
        self.rng = rng or random.Random()
        if readonly:
            if not (self.path / "data.mdb").exists():
                raise LedgerError(f"no ledger at {self.path} (data.mdb missing)")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + READERS_FULL_WAIT_S
        while True:
            try:
                self.env = self._open_env(map_size_bytes, readonly, max_readers)
                break
            except lmdb.ReadersFullError as exc:
                # py-lmdb begins a read transaction while opening, so a process that
                # does not have the env open yet cannot run the reader check itself:
                # wait for the broker's (READER_CHECK_INTERVAL_S), then give up
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                code, why = ledger_failure(exc, self.path / "data.mdb", "opening the ledger")
                raise ReadersFull(f"cannot open ledger {self.path}: {why}", exit_code=code) from None
            except lmdb.Error as exc:
                code, why = ledger_failure(exc, self.path / "data.mdb", "opening the ledger")
                raise LedgerError(f"cannot open ledger {self.path}: {why}", exit_code=code) from None
        if not readonly:
            self.clear_stale_readers()
        try:
            try:
                self.db = {name: self.env.open_db(name.encode(), create=not readonly) for name in DB_NAMES}
            except lmdb.ReadersFullError:  # open_db reads too: clear dead readers' slots, try again
                self.clear_stale_readers()
                self.db = {name: self.env.open_db(name.encode(), create=not readonly) for name in DB_NAMES}
        except lmdb.ReadersFullError as exc:
            self.env.close()
            code, why = ledger_failure(exc, self.path / "data.mdb", "opening the ledger")
            raise ReadersFull(f"cannot open ledger {self.path}: {why}", exit_code=code) from None
        except lmdb.Error as exc:
            self.env.close()
            raise LedgerError(f"ledger {self.path} lacks its sub-databases: {exc}") from None
        except LedgerError:
            self.env.close()
            raise
        self.ledger_id = ""
        if not readonly:
            with self.env.begin(write=True) as txn:
                lid = txn.get(b"m:ledger_id", db=self.db["meta"])
                if lid is None:
                    lid = secrets.token_hex(4).encode()
                    txn.put(b"m:ledger_id", lid, db=self.db["meta"])
                self.ledger_id = lid.decode()
        else:
            try:
                txn = self._begin()
            except LedgerError:
                self.env.close()
                raise
            try:
                lid = txn.get(b"m:ledger_id", db=self.db["meta"])
            finally:
                txn.abort()
            self.ledger_id = lid.decode() if lid else ""

    # --- environment ---
    def _open_env(self, map_size_bytes: int, readonly: bool, max_readers: int) -> lmdb.Environment:
        return lmdb.open(
            str(self.path),
            map_size=map_size_bytes,
            max_dbs=len(DB_NAMES) + 2,
            subdir=True,
            readonly=readonly,
            lock=True,
            sync=True,
            metasync=True,
            writemap=False,
            max_readers=max_readers,
            create=not readonly,
        )

    def close(self) -> None:
        self.env.close()

    def begin(self) -> LedgerTxn:
        """Open the write transaction of one batch (commit or abort it)."""
        return LedgerTxn(self)

    def read(self) -> LedgerView:
        """A read-only snapshot (use as a context manager)."""
        return LedgerView(self)

    def bump_epoch(self) -> int:
        """Increment and return the broker epoch (once per broker start)."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"m:epoch", db=self.db["meta"])
            epoch = (_q.unpack(raw)[0] if raw else 0) + 1
            txn.put(b"m:epoch", _q.pack(epoch), db=self.db["meta"])
        return epoch

    def map_size_bytes(self) -> int:
        return self.env.info()["map_size"]

    def used_bytes(self, txn: lmdb.Transaction | None = None) -> int:
        """Bytes of pages in use by all trees (freed pages, reused by LMDB, not counted).
        Pass the open transaction when there is one (a thread holds one at a time)."""
        psize = self.env.stat()["psize"]
        pages = 0
        own = txn is None
        txn = txn or self._begin()
        try:
            for db in self.db.values():
                st = txn.stat(db)
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        finally:
            if own:
                txn.abort()
        main = self.env.stat()
        pages += main["branch_pages"] + main["leaf_pages"] + main["overflow_pages"]
        return (pages + 4) * psize  # + 2 meta pages and the 2 roots of the free/main trees

    def can_grow(self) -> bool:
        return self.map_size_bytes() < self.max_map_size_bytes

    def grow_map(self) -> bool:
        """Double the map (capped at the max). Only with no transaction open. False if at max."""
        cur = self.map_size_bytes()
        if cur >= self.max_map_size_bytes:
            return False
        self.env.set_mapsize(min(cur * 2, self.max_map_size_bytes))
        return True

    # --- reader slots (see docs/ledger.md, "Readers and disk use") ---
    def _begin(self, write: bool = False) -> lmdb.Transaction:
        """``env.begin``; when no reader slot is free (``MDB_READERS_FULL``) clear the
        slots of dead processes (LMDB's reader check) and try again. Raises
        :class:`ReadersFull` when live processes hold every slot."""
        for attempt in range(3):
            try:
                return self.env.begin(write=write)
            except lmdb.ReadersFullError:
                if self.clear_stale_readers() == 0 and attempt:
                    break
        code, why = ledger_failure(lmdb.ReadersFullError("mdb_txn_begin"), self.path, "a read transaction")
        raise ReadersFull(f"{why} ({self.env.info()['max_readers']} slots)", exit_code=code)

    def clear_stale_readers(self) -> int:
        """LMDB's reader check: free the reader slots of processes that died holding
        them. Returns how many were cleared (also added to :attr:`stale_readers_cleared`)."""
        n = self.env.reader_check()
        self.stale_readers_cleared += n
        return n

    def reader_slots(self) -> list[ReaderSlot]:
        """The reader table now (``env.readers()`` parsed): one :class:`ReaderSlot` per
        owned slot; ``txnid`` None for a slot whose process holds no snapshot now."""
        return parse_readers(self.env.readers())

    def backup(self, dest: Path) -> dict[str, Any]:
        """A consistent, compacting copy of the ledger into the new or empty directory
        ``dest`` (``dest/data.mdb``; LMDB's ``mdb_env_copy2`` with ``MDB_CP_COMPACT``:
        one read snapshot, free pages left out, pages renumbered). Safe while the
        broker writes; the copy's snapshot pins history only while it runs. The file
        is fsynced. Returns ``{path, bytes, source_bytes, last_txnid}``. Raises
        :class:`LedgerError` (with its exit code) on an LMDB or OS error."""
        dest = Path(dest)
        try:
            dest.mkdir(parents=True, exist_ok=True)
            if any(dest.iterdir()):
                raise LedgerError(f"backup destination {dest} is not empty: give a new or empty directory",
                                  exit_code=ExitCode.USAGE)
            txn = self._begin()
            try:
                last_txnid = txn.id()
                self.env.copy(str(dest), compact=True, txn=txn)
            finally:
                txn.abort()
            out = dest / "data.mdb"
            fd = os.open(out, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dfd = os.open(dest, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except (lmdb.Error, OSError) as exc:
            try:
                free = disk_free_bytes(dest)
            except OSError:
                free = None
            code, why = ledger_failure(exc, dest, "the backup", free_bytes=free)
            raise LedgerError(why, exit_code=code) from None
        return {"path": str(out), "bytes": out.stat().st_size, "source_bytes": (self.path / "data.mdb").stat().st_size,
                "last_txnid": last_txnid}


class LedgerView:
    """Read-only queries on a snapshot; also the base of :class:`LedgerTxn`."""

    def __init__(self, ledger: Ledger, *, write: bool = False) -> None:
        self.ledger = ledger
        self.db = ledger.db
        self.txn = ledger._begin(write)  # noqa: SLF001 - the ledger's own transaction factory

    def __enter__(self) -> LedgerView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.txn.abort()

    # --- numbers in meta ---
    def num(self, key: bytes) -> int:
        raw = self.txn.get(key, db=self.db["meta"])
        return _q.unpack(raw)[0] if raw else 0

    def counter(self, name: str) -> int:
        return self.num(b"c:" + name.encode())

    def draining(self) -> list[str]:
        """Worker ids an operator drained (``ccsq drain``; meta ``d:<worker>``), sorted.
        Kept in the ledger so a drain survives a broker restart."""
        out: list[str] = []
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(b"d:"):
            for k in cur.iternext(keys=True, values=False):
                if not k.startswith(b"d:"):
                    break
                out.append(k[2:].decode())
        return out

    def kinds_served(self, since_ms: int) -> set[str]:
        """Kinds a worker served (HELLO) at or after ``since_ms`` (meta ``w:<kind>`` ->
        ``>q`` ms of its last HELLO; ``""`` = a worker that takes every kind). Read at
        broker start, so the unserved-kind hint needs no grace period after a restart."""
        out: set[str] = set()
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(b"w:"):
            for k, v in cur.iternext():
                if not k.startswith(b"w:"):
                    break
                if _q.unpack(v)[0] >= since_ms:
                    out.add(k[2:].decode())
        return out

    def state_count(self, state: str) -> int:
        return self.num(b"s:" + state.encode())

    def counters(self) -> dict[str, int]:
        return {name: self.counter(name) for name in COUNTERS}

    def states(self) -> dict[str, int]:
        return {s: self.state_count(s) for s in STATES}

    def balanced(self) -> bool:
        return self.counter("received") == sum(self.states().values())

    def epoch(self) -> int:
        return self.num(b"m:epoch")

    def gap_counts(self) -> dict[str, int]:
        return {w.id: self.num(b"g:" + w.id.encode()) for w in gaps.WINDOWS}

    def rejects(self) -> dict[str, int]:
        out = {}
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(b"r:"):
            for k, v in cur:
                if not k.startswith(b"r:"):
                    break
                out[k[2:].decode()] = _q.unpack(v)[0]
        return out

    def kind_states(self) -> dict[str, dict[str, int]]:
        """{kind: {state: count}} (acknowledged counts keep purged items)."""
        out: dict[str, dict[str, int]] = {}
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(b"k:"):
            for k, v in cur:
                if not k.startswith(b"k:"):
                    break
                kind, _, state = k[2:].decode().partition("\0")
                n = _q.unpack(v)[0]
                if n:
                    out.setdefault(kind, {})[state] = n
        return out

    def sample(self, n: int) -> dict | None:
        """Accounting sample number ``n`` (1-based), if still in the ring."""
        raw = self.txn.get(b"t:" + struct.pack(">I", n % SAMPLES_KEPT), db=self.db["meta"])
        return _unpack(raw) if raw is not None else None

    def samples(self) -> list[dict]:
        """Every accounting sample in the ring, oldest first:
        ``{ts_ms, counters: {name: n}, states: {state: n}, kinds: {kind: {state: n}}}``."""
        out = []
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(b"t:"):
            for k, v in cur:
                if not k.startswith(b"t:"):
                    break
                out.append(_unpack(v))
        out.sort(key=lambda d: d["ts_ms"])
        return out

    def nearest_deadlines(self, scan_limit: int = 10_000) -> dict[str, int]:
        """{kind: earliest deadline_ms} among ready and leased items, from the deadline
        index (at most ``scan_limit`` entries looked at, earliest first)."""
        out: dict[str, int] = {}
        for i, (k, _) in enumerate(self.txn.cursor(db=self.db["deadline"])):
            if i >= scan_limit:
                break
            rec = self.get(k[8:].decode())
            if rec is not None and rec["state"] in (S.READY.value, S.LEASED.value):
                out.setdefault(rec["kind"], _Q.unpack(k[:8])[0])
        return out

    def recent_events(self, window: str, limit: int) -> list[dict]:
        """The newest ``limit`` events of ``window``, newest first."""
        prefix = window.encode() + b"\0"
        cur = self.txn.cursor(db=self.db["events"])
        out: list[dict] = []
        if not cur.set_range(prefix + b"\xff" * 8):
            if not cur.last():
                return out
        else:
            if not cur.prev():
                return out
        while len(out) < limit:
            k = cur.key()
            if not k.startswith(prefix):
                break
            out.append(_unpack(cur.value()))
            if not cur.prev():
                break
        return out

    # --- items ---
    def get(self, item_id: str) -> dict | None:
        raw = self.txn.get(item_id.encode(), db=self.db["items"])
        return _unpack(raw) if raw is not None else None

    def payload(self, item_id: str) -> p.Blob:
        return _blob_from_wire(_unpack(self.txn.get(item_id.encode(), db=self.db["payloads"])))

    def result(self, item_id: str) -> p.Blob | None:
        raw = self.txn.get(item_id.encode(), db=self.db["results"])
        return _blob_from_wire(_unpack(raw)) if raw is not None else None

    def item_status(self, item_id: str) -> p.ItemStatus:
        rec = self.get(item_id)
        if rec is None:
            return p.ItemStatus(item_id, "unknown")
        result = self.result(item_id) if rec["state"] in (S.COMPLETED.value, S.ACKNOWLEDGED.value) else None
        return p.ItemStatus(item_id, rec["state"], rec["attempt"], rec["kind"], rec.get("error", ""), result)

    def blob_refs(self) -> Iterator[tuple[str, str, str]]:
        """``(item_id, state, sha256)`` of every claim-store reference the ledger holds:
        payloads and results stored by reference (inline blobs are not in the store)."""
        items = self.db["items"]
        for name in ("payloads", "results"):
            for k, v in self.txn.cursor(db=self.db[name]):
                b = _unpack(v)
                if b.get("inline") is not None:
                    continue
                raw = self.txn.get(k, db=items)
                state = _unpack(raw)["state"] if raw is not None else "unknown"
                yield k.decode(), state, b["sha256"]

    def leased_items(self) -> Iterator[tuple[str, int, str]]:
        """(item_id, token, worker) of every leased item (restart recovery)."""
        for k, v in self.txn.cursor(db=self.db["leased"]):
            token, worker = _unpack(v)
            yield k.decode(), token, worker

    def dead_listed(self) -> int:
        """Dead items still listed (not purged); O(1) from the index's entry count.
        State ``dead`` also counts purged ones, so the balance holds."""
        return self.txn.stat(self.db["dead"])["entries"]

    def dead_items(self, limit: int) -> list[dict]:
        out = []
        for k, _ in self.txn.cursor(db=self.db["dead"]):
            rec = self.get(k.decode())
            if rec is not None:
                out.append(rec)
            if len(out) >= limit:
                break
        return out

    def ready_kinds(self) -> list[str]:
        """Kinds that have at least one ready item (skips from prefix to prefix)."""
        kinds = []
        cur = self.txn.cursor(db=self.db["ready"])
        ok = cur.first()
        while ok:
            kind = cur.key().split(b"\0", 1)[0]
            kinds.append(kind.decode())
            ok = cur.set_range(kind + b"\x01")
        return kinds

    def oldest_ready_created_ms(self) -> int | None:
        """Creation time of the oldest ready item (heads of each kind/priority bucket)."""
        best: int | None = None
        cur = self.txn.cursor(db=self.db["ready"])
        ok = cur.first()
        while ok:
            k = cur.key()
            kind, _, rest = k.partition(b"\0")
            pk, _nb, _seq = _READY.unpack(rest)
            rec = self.get(cur.value().decode())
            if rec is not None:
                best = rec["created_ms"] if best is None else min(best, rec["created_ms"])
            if pk == 0xFFFFFFFF:
                ok = cur.set_range(kind + b"\x01")
            else:
                ok = cur.set_range(kind + b"\0" + struct.pack(">I", pk + 1))
        return best

    def completed_ids(self, skip: Callable[[str], bool], limit: int, start_cseq: int = 0) -> tuple[list[str], int]:
        """Up to ``limit`` completed item ids, oldest completion first, except ``skip``ped
        ones, scanning the completed index from completion seq ``start_cseq`` on.

        Returns ``(ids, next_cseq)``: every entry in ``[start_cseq, next_cseq)`` was
        either skipped or returned, so a caller that delivers the returned ids (and
        still skips the skipped ones) may start its next scan at ``next_cseq``
        instead of rescanning in-flight deliveries from the start."""
        out: list[str] = []
        next_cseq = start_cseq
        cur = self.txn.cursor(db=self.db["completed"])
        if not cur.set_range(_Q.pack(start_cseq)):
            return out, next_cseq
        for k, v in cur:
            next_cseq = _Q.unpack(k)[0] + 1
            item_id = v.decode()
            if skip(item_id):
                continue
            out.append(item_id)
            if len(out) >= limit:
                break
        return out, next_cseq

    def delivery(self, item_id: str, redelivery: bool) -> p.Delivery:
        rec = self.get(item_id)
        if rec is None:
            raise LedgerError(f"completed index points at missing item {item_id}")
        result = self.result(item_id)
        if result is None:
            raise LedgerError(f"completed item {item_id} has no result")
        return p.Delivery(
            item_id=item_id,
            key=rec["key"],
            kind=rec["kind"],
            result=result,
            params=rec["params"],
            attempt=rec["attempt"],
            handler=rec.get("handler", ""),
            handler_version=rec.get("handler_version", ""),
            completed_ts=rec.get("completed_ms", 0) / 1000.0,
            redelivery=redelivery,
        )

    def scan_ready(self, kinds: list[str] | None, limit: int, now_ms: int) -> tuple[list[str], int | None]:
        """Eligible ready item ids for ``kinds`` (None: every kind), best first.

        Returns ``(item_ids, next_not_before_ms)``: the earliest not-before time
        among skipped (backing-off) items, or None if none was seen.
        """
        kinds = self.ready_kinds() if kinds is None else sorted(set(kinds))
        cands: list[tuple[int, int, int, str]] = []
        hint: int | None = None
        cur = self.txn.cursor(db=self.db["ready"])
        for kind in kinds:
            prefix = kind.encode() + b"\0"
            found = 0
            ok = cur.set_range(prefix)
            while ok and found < limit:
                k = cur.key()
                if not k.startswith(prefix):
                    break
                pk, nb, seq = _READY.unpack(k[len(prefix):])
                if nb > now_ms:
                    hint = nb if hint is None else min(hint, nb)
                    if pk == 0xFFFFFFFF:
                        break
                    ok = cur.set_range(prefix + struct.pack(">I", pk + 1))
                    continue
                cands.append((pk, nb, seq, cur.value().decode()))
                found += 1
                ok = cur.next()
        cands.sort()
        return [c[3] for c in cands[:limit]], hint

    # --- commit history (meta ``h:`` + >Q txnid -> [ts_ms, last_pgno, live_pages]) ---
    def history_after(self, txnid: int) -> tuple[int, list] | None:
        """The first commit-history entry with a transaction id above ``txnid``, as
        ``(txnid, [ts_ms, last_pgno, live_pages])``, or None."""
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(HISTORY_PREFIX + _Q.pack(txnid + 1)) and cur.key().startswith(HISTORY_PREFIX):
            return _Q.unpack(cur.key()[2:])[0], _unpack(cur.value())
        return None

    def history_at_or_before(self, txnid: int) -> tuple[int, list] | None:
        """The last commit-history entry with a transaction id <= ``txnid``, or None."""
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(HISTORY_PREFIX + _Q.pack(txnid + 1)):
            ok = cur.prev()
        else:
            ok = cur.last()
        if ok and cur.key().startswith(HISTORY_PREFIX):
            return _Q.unpack(cur.key()[2:])[0], _unpack(cur.value())
        return None

    def blob_refs_page(self, name: str, after: bytes, limit: int) -> tuple[list[tuple[str, str, str]], bytes | None]:
        """One page of :meth:`blob_refs` for table ``name`` (payloads or results):
        up to ``limit`` entries with keys after ``after``. Returns ``(refs, last key
        looked at)``; the key is None when the table is exhausted."""
        items = self.db["items"]
        out: list[tuple[str, str, str]] = []
        cur = self.txn.cursor(db=self.db[name])
        ok = cur.set_range(after + b"\0") if after else cur.first()
        seen = 0
        last = None
        while ok and seen < limit:
            k, v = cur.key(), cur.value()
            last, seen = k, seen + 1
            b = _unpack(v)
            if b.get("inline") is None:
                raw = self.txn.get(k, db=items)
                out.append((k.decode(), _unpack(raw)["state"] if raw is not None else "unknown", b["sha256"]))
            ok = cur.next()
        return out, (last if ok else None)


class LedgerTxn(LedgerView):
    """One write transaction. Every mutation of item state goes through here.

    Use :meth:`commit` or :meth:`abort` exactly once. Methods take ``now_ms``
    (wall clock, milliseconds) so tests can drive time.
    """

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger, write=True)
        self._nums: dict[bytes, int] = {}
        self._dirty: set[bytes] = set()
        self.changed = False
        self.records = 0  # item records written (group-commit size, exported as a metric)

    def __exit__(self, *exc: object) -> None:
        if self.txn is not None:
            self.abort()

    def commit(self) -> None:
        """Write the counters and commit (fsync). Raises MapFullError (txn aborted) on a full map."""
        meta = self.db["meta"]
        try:
            for key in self._dirty:
                self.txn.put(key, _q.pack(self._nums[key]), db=meta)
            self.txn.commit()
        except BaseException:
            self.txn.abort()
            self.txn = None
            raise
        self.txn = None

    def abort(self) -> None:
        if self.txn is not None:
            self.txn.abort()
            self.txn = None

    # --- numbers ---
    def num(self, key: bytes) -> int:
        if key in self._nums:
            return self._nums[key]
        v = super().num(key)
        self._nums[key] = v
        return v

    def _add(self, key: bytes, delta: int) -> None:
        self._nums[key] = self.num(key) + delta
        self._dirty.add(key)
        self.changed = True

    def bump(self, name: str, delta: int = 1) -> None:
        self._add(b"c:" + name.encode(), delta)

    def kind_states(self) -> dict[str, dict[str, int]]:
        """As :meth:`LedgerView.kind_states`, including this transaction's changes."""
        out = super().kind_states()
        for key in self._dirty:
            if key.startswith(b"k:"):
                kind, _, state = key[2:].decode().partition("\0")
                per = out.setdefault(kind, {})
                if self._nums[key]:
                    per[state] = self._nums[key]
                else:
                    per.pop(state, None)
                if not per:
                    del out[kind]
        return out

    def _next(self, name: bytes) -> int:
        v = self.num(b"m:" + name) + 1
        self._add(b"m:" + name, 1)
        return v

    def set_draining(self, worker: str, on: bool) -> None:
        """Record (``on``) or clear a drain of ``worker`` (see :meth:`LedgerView.draining`)."""
        key = b"d:" + worker.encode()
        if on:
            self.txn.put(key, b"", db=self.db["meta"])
        else:
            self.txn.delete(key, db=self.db["meta"])
        self.changed = True

    def note_kinds_served(self, kinds: set[str], now_ms: int) -> None:
        """Record that a worker serving ``kinds`` said HELLO now (see :meth:`LedgerView.kinds_served`)."""
        for kind in kinds:
            self.txn.put(b"w:" + kind.encode(), _q.pack(now_ms), db=self.db["meta"])
        self.changed = self.changed or bool(kinds)

    def count_reject(self, code: str, n: int = 1) -> None:
        self._add(b"r:" + code.encode(), n)

    def event(self, window: str, item_id: str, now_ms: int, detail: str) -> None:
        """Append a gap-register event and bump the window's count."""
        n = self.num(b"g:" + window.encode()) + 1
        self._add(b"g:" + window.encode(), 1)
        ev = {"window": window, "item_id": item_id, "ts": now_ms / 1000.0, "detail": detail}
        self.txn.put(window.encode() + b"\0" + _Q.pack(n), _pack(ev), db=self.db["events"])

    # --- records and indexes ---
    def _put(self, rec: dict) -> None:
        self.txn.put(rec["id"].encode(), _pack(rec), db=self.db["items"])
        self.changed = True
        self.records += 1

    def _index_remove(self, rec: dict) -> None:
        st, iid = rec["state"], rec["id"].encode()
        if st == S.READY.value:
            self.txn.delete(ready_key(rec["kind"], rec["priority"], rec["nb_ms"], rec["seq"]), db=self.db["ready"])
        elif st == S.LEASED.value:
            self.txn.delete(iid, db=self.db["leased"])
        elif st == S.COMPLETED.value:
            self.txn.delete(_Q.pack(rec["cseq"]), db=self.db["completed"])
        elif st == S.DEAD.value:
            self.txn.delete(iid, db=self.db["dead"])
        elif st == S.ACKNOWLEDGED.value:
            self.txn.delete(_Q.pack(rec["acked_ms"]) + iid, db=self.db["acked"])

    def _index_add(self, rec: dict) -> None:
        st, iid = rec["state"], rec["id"].encode()
        if st == S.READY.value:
            self.txn.put(ready_key(rec["kind"], rec["priority"], rec["nb_ms"], rec["seq"]), iid, db=self.db["ready"])
        elif st == S.LEASED.value:
            self.txn.put(iid, _pack([rec["token"], rec["worker"]]), db=self.db["leased"])
        elif st == S.COMPLETED.value:
            self.txn.put(_Q.pack(rec["cseq"]), iid, db=self.db["completed"])
        elif st == S.DEAD.value:
            self.txn.put(iid, b"", db=self.db["dead"])
        elif st == S.ACKNOWLEDGED.value:
            self.txn.put(_Q.pack(rec["acked_ms"]) + iid, b"", db=self.db["acked"])

    def _transition(self, rec: dict, new_state: str, **updates: Any) -> None:
        """Move ``rec`` to ``new_state`` applying ``updates``; keeps indexes and counts in step."""
        old = rec["state"]
        self._index_remove(rec)
        rec.update(updates)
        rec["state"] = new_state
        self._index_add(rec)
        if old != new_state:
            self._add(b"s:" + old.encode(), -1)
            self._add(b"s:" + new_state.encode(), 1)
            kind = rec["kind"].encode()
            self._add(b"k:" + kind + b"\0" + old.encode(), -1)
            self._add(b"k:" + kind + b"\0" + new_state.encode(), 1)
        self._put(rec)

    def _max_attempts(self, rec: dict) -> int:
        return rec["max_attempts"] or self.ledger.policy.max_attempts

    def _deadline_passed(self, rec: dict, now_ms: int) -> bool:
        return rec.get("deadline_ms") is not None and rec["deadline_ms"] <= now_ms

    def _expire(self, rec: dict, now_ms: int, why: str) -> None:
        self._transition(rec, S.EXPIRED.value, error="deadline", ended_ms=now_ms)
        self.bump("expired")
        self.event(gaps.G6_DEADLINE_EXPIRED, rec["id"], now_ms, why)

    def _dead(self, rec: dict, now_ms: int, reason: str, message: str) -> None:
        self._transition(rec, S.DEAD.value, error=reason, error_message=message[:500], ended_ms=now_ms)
        self.bump("dead")
        self.event(gaps.G7_DEAD_LETTERED, rec["id"], now_ms, f"{reason} after attempt {rec['attempt']}: {message[:200]}")

    def _requeue(self, rec: dict, now_ms: int, *, min_delay_ms: int = 0, backoff_attempt: int | None = None) -> None:
        """Ready again after the backoff of ``backoff_attempt`` (default: the item's
        attempt), at least ``min_delay_ms`` from now."""
        attempt = rec["attempt"] if backoff_attempt is None else backoff_attempt
        nb = now_ms + max(min_delay_ms, backoff_ms(attempt, self.ledger.policy, self.ledger.rng))
        self._transition(rec, S.READY.value, nb_ms=nb, worker="", lease_expires_ms=0)

    # --- SUBMIT ---
    def submit(self, item: p.SubmitItem, now_ms: int, *, refuse: str = "", origin: dict | None = None,
               reply_to: str = "") -> p.SubmitResult:
        """Create one item (or answer a duplicate). ``refuse`` is an error code
        (QUEUE_FULL/DISK_FULL) to answer for new items without writing them.
        ``origin``/``reply_to``: a relayed item's verified origin ({swarm, item_id, hops})
        and the relay its result goes back to (common/wire/federation.py)."""
        policy = self.ledger.policy
        why = validate_submit_item(item)
        if why:
            return p.SubmitResult(item.key, "", error="MALFORMED", message=why)
        kb = item.key.encode()
        raw = self.txn.get(kb, db=self.db["keys"])
        window_ms = int(policy.dedup_window_s * 1000)
        stale_key = None
        if raw is not None:
            item_id, created_ms = _unpack(raw)
            if now_ms - created_ms <= window_ms:
                self.bump("duplicate_submits")
                self.event(gaps.G9_SUBMIT_RETRIED, item_id, now_ms, f"key {item.key[:80]!r}")
                return p.SubmitResult(item.key, item_id, duplicate=True)
            stale_key = (item_id, created_ms)
        if refuse:
            return p.SubmitResult(item.key, "", error=refuse, message=_REFUSE_MESSAGES.get(refuse, refuse))
        if policy.max_ready_items and self.state_count(S.READY.value) >= policy.max_ready_items:
            return p.SubmitResult(
                item.key, "", error="QUEUE_FULL", message=f"{policy.max_ready_items} items ready (max_ready_items)"
            )
        if item.deadline_ts is not None and item.deadline_ts * 1000 <= now_ms:
            return p.SubmitResult(item.key, "", error="DEADLINE_EXCEEDED", message="deadline_ts is already past")
        seq = self._next(b"next_seq")
        item_id = f"{self.ledger.ledger_id}{seq:012x}"
        deadline_ms = int(item.deadline_ts * 1000) if item.deadline_ts is not None else None
        rec = {
            "id": item_id,
            "key": item.key,
            "kind": item.kind,
            "params": item.params,
            "priority": item.priority,
            "deadline_ms": deadline_ms,
            "max_attempts": item.max_attempts,
            "max_runtime_s": item.max_runtime_s,
            "state": S.READY.value,
            "attempt": 0,
            "token": 0,
            "worker": "",
            "nb_ms": now_ms,
            "seq": seq,
            "created_ms": now_ms,
            "error": "",
        }
        if origin:
            rec["origin"], rec["reply_to"] = origin, reply_to
        self.txn.put(item_id.encode(), _pack(_blob_to_wire(item.payload)), db=self.db["payloads"])
        self._put(rec)
        self._index_add(rec)
        self._add(b"s:ready", 1)
        self._add(b"k:" + item.kind.encode() + b"\0ready", 1)
        self.bump("received")
        self.txn.put(kb, _pack([item_id, now_ms]), db=self.db["keys"])
        self.txn.put(_Q.pack(now_ms) + kb, b"", db=self.db["keytime"])
        if deadline_ms is not None:
            self.txn.put(_Q.pack(deadline_ms) + item_id.encode(), b"", db=self.db["deadline"])
        if stale_key is not None:
            self.event(
                gaps.G5_DEDUP_WINDOW_PASSED, item_id, now_ms, f"key {item.key[:80]!r} was item {stale_key[0]} (window passed)"
            )
        return p.SubmitResult(item.key, item_id)

    # --- LEASE ---
    def lease(self, item_id: str, worker: str, now_ms: int, lease_ttl_ms: int) -> p.Task | None:
        """Lease a ready item to ``worker`` with a fresh fencing token; None if it is
        not ready (or its deadline passed: then it is expired here)."""
        rec = self.get(item_id)
        if rec is None or rec["state"] != S.READY.value:
            return None
        if self._deadline_passed(rec, now_ms):
            self._expire(rec, now_ms, "deadline passed while ready")
            return None
        token = self._next(b"next_token")
        self._transition(
            rec, S.LEASED.value, attempt=rec["attempt"] + 1, token=token, worker=worker, lease_expires_ms=now_ms + lease_ttl_ms,
            token_worker=worker,  # kept after the lease ends: only its holder may report under this token
        )
        self.bump("routed")
        return p.Task(
            item_id=item_id,
            token=token,
            kind=rec["kind"],
            payload=self.payload(item_id),
            params=rec["params"],
            attempt=rec["attempt"],
            max_runtime_s=rec["max_runtime_s"],
            deadline_ts=rec["deadline_ms"] / 1000.0 if rec["deadline_ms"] is not None else None,
        )

    def release(self, item_id: str, token: int, now_ms: int) -> bool:
        """Give a lease back without counting the attempt (never sent, or the worker
        released it). True if it was leased with ``token``."""
        rec = self.get(item_id)
        if rec is None or rec["state"] != S.LEASED.value or rec["token"] != token:
            return False
        self._transition(rec, S.READY.value, attempt=max(rec["attempt"] - 1, 0), nb_ms=now_ms, worker="", lease_expires_ms=0)
        self.bump("released")
        return True

    def expire_lease(self, item_id: str, token: int, now_ms: int, why: str = "lease expired") -> str:
        """A lease ran out: requeue with backoff, or dead-letter (worker_lost) after
        max attempts, or expire past the deadline. Returns the new state, or "" if
        the lease was not current (nothing done)."""
        rec = self.get(item_id)
        if rec is None or rec["state"] != S.LEASED.value or rec["token"] != token:
            return ""
        worker = rec["worker"]
        if FAIL_POLICY[p.FailReason.WORKER_LOST].dead_letters_at_once or rec["attempt"] >= self._max_attempts(rec):
            self._dead(rec, now_ms, p.FailReason.WORKER_LOST.value, f"{why} on {worker}")
            return S.DEAD.value
        if self._deadline_passed(rec, now_ms):
            self._expire(rec, now_ms, f"{why} on {worker} after the deadline")
            return S.EXPIRED.value
        self._requeue(rec, now_ms)
        self.bump("retried")
        self.event(gaps.G2_LEASE_EXPIRED, item_id, now_ms, f"{why}: token {token} on {worker}, attempt {rec['attempt']}")
        return S.READY.value

    # --- COMPLETE / FAIL ---
    def complete(self, res: p.TaskResult, now_ms: int, sender: str = "") -> str:
        """Record a result. Returns an :class:`Outcome` value.

        Rule for late results: accepted if the item is leased with this token,
        or if its lease with this token expired and nobody leased it since
        (state ready, same token: the same work, G8 event). A replay of an
        accepted result is ``duplicate``; any other token is ``fenced`` (G4).
        ``sender``: the reporting peer; a token is honoured only from the worker
        it was leased to (another peer quoting it is ``fenced``, G4)."""
        rec = self.get(res.item_id)
        if rec is None:
            return p.Outcome.UNKNOWN.value
        st = rec["state"]
        if st in (S.COMPLETED.value, S.ACKNOWLEDGED.value) and rec.get("completed_token") == res.token:
            return p.Outcome.DUPLICATE.value
        late = st == S.READY.value and rec["token"] == res.token and res.token != 0
        if ((st == S.LEASED.value and rec["token"] == res.token) or late) and not self._not_holder(rec, sender):
            self.txn.put(res.item_id.encode(), _pack(_blob_to_wire(res.result)), db=self.db["results"])
            cseq = self._next(b"next_cseq")
            self._transition(
                rec,
                S.COMPLETED.value,
                cseq=cseq,
                completed_token=res.token,
                completed_ms=now_ms,
                completed_epoch=self.epoch(),
                handler=res.handler,
                handler_version=res.handler_version,
                runtime_s=res.runtime_s,
                worker_done=rec["worker"] or rec.get("token_worker") or sender,
                lease_expires_ms=0,
            )
            self.bump("completed")
            if late:
                self.bump("late_results_accepted")
                self.event(gaps.G8_LATE_RESULT_ACCEPTED, res.item_id, now_ms, f"token {res.token} after its lease expired")
            return p.Outcome.ACCEPTED.value
        self.bump("fenced_completions")
        self.event(
            gaps.G4_FENCED_COMPLETION,
            res.item_id,
            now_ms,
            f"token {res.token} was leased to {rec.get('token_worker')}, reported by {sender}; result discarded"
            if rec["token"] == res.token else f"token {res.token} is stale (item {st}, token {rec['token']}); result discarded",
        )
        return p.Outcome.FENCED.value

    @staticmethod
    def _not_holder(rec: dict, sender: str) -> bool:
        """True when ``sender`` is known and is not the worker the item's current token was leased to."""
        holder = rec.get("token_worker") or rec.get("worker")
        return bool(sender and holder and sender != holder)

    def fail(self, f: p.TaskFailure, now_ms: int, sender: str = "") -> str:
        """Record a failure report. Returns an :class:`Outcome` value.

        The reason's rule comes from the one failure policy (:data:`ccsq.common.wire.policy.FAIL_POLICY`;
        the wire's ``retryable`` only for a reason this version does not know).
        ``released``: back to ready now, attempt not counted. ``store_unavailable``:
        ready after a backoff, attempt not counted. Retryable: ready after backoff
        unless attempts are exhausted (dead) or the deadline passed (expired).
        Dead-lettered at once (fatal, payload_missing): dead with ``reason``."""
        rec = self.get(f.item_id)
        if rec is None:
            return p.Outcome.UNKNOWN.value
        if rec["state"] != S.LEASED.value or rec["token"] != f.token or self._not_holder(rec, sender):
            if rec.get("fail_token") == f.token and not self._not_holder(rec, sender):
                return p.Outcome.DUPLICATE.value
            self.bump("fenced_failures")
            return p.Outcome.FENCED.value
        rec["fail_token"] = f.token
        rule = fail_rule(f.reason, f.retryable)
        if f.reason == p.FailReason.RELEASED.value:
            attempt = rec["attempt"] if rule.counts_attempt else max(rec["attempt"] - 1, 0)
            self._transition(
                rec, S.READY.value, attempt=attempt, nb_ms=now_ms, worker="", lease_expires_ms=0
            )
            self.bump("released")
            return p.Outcome.ACCEPTED.value
        if f.reason == p.FailReason.STORE_UNAVAILABLE.value:
            return self._store_unavailable(rec, now_ms, f.message)
        self.bump("failed")
        reason = f.reason or p.FailReason.HANDLER_ERROR.value
        if rule.dead_letters_at_once:
            self._dead(rec, now_ms, reason, f.message)
        elif rec["attempt"] >= self._max_attempts(rec):
            self._dead(rec, now_ms, reason, f.message)
        elif self._deadline_passed(rec, now_ms):
            self._expire(rec, now_ms, f"failed ({reason}) after the deadline")
        else:
            rec["error"] = reason
            self._requeue(rec, now_ms)
            self.bump("retried")
        return p.Outcome.ACCEPTED.value

    def _store_unavailable(self, rec: dict, now_ms: int, message: str) -> str:
        """The worker could not reach the claim store: not the item's fault, so the
        attempt is not counted (no dead letter however long the outage lasts); the
        item is ready again after a backoff of at least :data:`STORE_RETRY_MIN_MS`, or
        expires if its deadline passed."""
        self.bump("failed")
        if not FAIL_POLICY[p.FailReason.STORE_UNAVAILABLE].counts_attempt:
            rec["attempt"] = max(rec["attempt"] - 1, 0)
        if self._deadline_passed(rec, now_ms):
            self._expire(rec, now_ms, f"claim store unavailable after the deadline: {message[:200]}")
            return p.Outcome.ACCEPTED.value
        rec["error"] = p.FailReason.STORE_UNAVAILABLE.value
        self._requeue(rec, now_ms, min_delay_ms=STORE_RETRY_MIN_MS, backoff_attempt=rec["attempt"] + 1)
        self.bump("retried")
        return p.Outcome.ACCEPTED.value

    # --- ACK ---
    def ack(self, item_id: str, now_ms: int, quarantine_error: str = "") -> bool | None:
        """Mark a completed item acknowledged. True: done now; False: it was already
        acknowledged (idempotent); None: unknown / not completed.

        ``quarantine_error``: the completion service stored the result in its
        quarantine table, not its results table (counter ``quarantined``, gap G12)."""
        rec = self.get(item_id)
        if rec is None:
            return None
        if rec["state"] == S.ACKNOWLEDGED.value:
            return False
        if rec["state"] != S.COMPLETED.value:
            return None
        if quarantine_error:
            self._transition(rec, S.ACKNOWLEDGED.value, acked_ms=now_ms, quarantined=quarantine_error[:500])
            self.bump("quarantined")
            self.event(gaps.G12_RESULT_QUARANTINED, item_id, now_ms, quarantine_error[:200])
        else:
            self._transition(rec, S.ACKNOWLEDGED.value, acked_ms=now_ms)
        self.bump("acknowledged")
        return True

    def note_redelivery(self, item_id: str, now_ms: int, why: str) -> None:
        self.bump("redelivered")
        self.event(gaps.G3_RESULT_REDELIVERED, item_id, now_ms, why)

    # --- dead letters ---
    def dead_letter(self, item_id: str, token: int, reason: str, message: str, now_ms: int) -> bool:
        """Dead-letter a leased item (e.g. it can never be dispatched). False if not leased with ``token``."""
        rec = self.get(item_id)
        if rec is None or rec["state"] != S.LEASED.value or rec["token"] != token:
            return False
        self._dead(rec, now_ms, reason, message)
        return True

    def replay_dead(self, item_id: str, now_ms: int, who: str = "operator") -> bool:
        """Make a dead item ready again with its attempt count reset (a fresh attempt
        budget) and a G10 event. False if not dead."""
        rec = self.get(item_id)
        if rec is None or rec["state"] != S.DEAD.value:
            return False
        was = f"{rec.get('error', '')} after attempt {rec['attempt']}"
        self._transition(rec, S.READY.value, attempt=0, nb_ms=now_ms, error="", worker="")
        self.bump("replayed")
        self.event(gaps.G10_DEAD_LETTER_REPLAYED, item_id, now_ms, f"replayed by {who} (was dead: {was})")
        return True

    def dead_letter_ready(self, item_id: str, reason: str, message: str, now_ms: int) -> bool:
        """Dead-letter a *ready* item (operator or reconcile: e.g. ``payload_missing``).
        False if it is not ready (a leased item's worker reports the failure itself)."""
        rec = self.get(item_id)
        if rec is None or rec["state"] != S.READY.value:
            return False
        self._dead(rec, now_ms, reason, message)
        return True

    def purge_dead(self, item_id: str, now_ms: int, who: str = "operator") -> bool:
        """Delete a dead item's record, payload and idempotency key (a resubmit then
        makes a new item) with a G11 event. Like purged acknowledged items, it stays
        counted in state ``dead`` so the balance holds. False if not dead."""
        rec = self.get(item_id)
        if rec is None or rec["state"] != S.DEAD.value:
            return False
        iid = item_id.encode()
        self.txn.delete(iid, db=self.db["dead"])
        for name in ("items", "payloads", "results"):
            self.txn.delete(iid, db=self.db[name])
        kb = rec["key"].encode()
        raw = self.txn.get(kb, db=self.db["keys"])
        if raw is not None and _unpack(raw)[0] == item_id:
            self.txn.delete(kb, db=self.db["keys"])
        self.bump("dead_purged")
        self.event(gaps.G11_DEAD_LETTER_PURGED, item_id, now_ms, f"purged by {who} (dead: {rec.get('error', '')})")
        return True

    # --- accounting samples (a bounded ring in meta) ---
    def append_sample(self, now_ms: int, interval_s: float) -> bool:
        """Append ``{ts, counters, states, kinds}`` to the sample ring when the last
        sample is ``interval_s`` old and the counters changed since. True if written."""
        n = self.num(b"m:sample_n")
        counters = self.counters()
        if n:
            last = self.sample(n)
            if last is not None and (now_ms - last["ts_ms"] < interval_s * 1000 or last["counters"] == counters):
                return False
        kinds = dict(list(self.kind_states().items())[:SAMPLE_MAX_KINDS])
        n = self._next(b"sample_n")
        doc = {"ts_ms": now_ms, "counters": counters, "states": self.states(), "kinds": kinds}
        self.txn.put(b"t:" + struct.pack(">I", n % SAMPLES_KEPT), _pack(doc), db=self.db["meta"])
        return True

    # --- background slices ---
    def expire_deadlines(self, now_ms: int, limit: int) -> int:
        """Expire up to ``limit`` ready items whose deadline passed; drop stale index
        entries. Returns the number of index entries looked at."""
        cur = self.txn.cursor(db=self.db["deadline"])
        seen = 0
        todo: list[bytes] = []
        for k, _ in cur:
            if seen >= limit or _Q.unpack(k[:8])[0] > now_ms:
                break
            todo.append(k)
            seen += 1
        for k in todo:
            self.txn.delete(k, db=self.db["deadline"])
            self.changed = True
            rec = self.get(k[8:].decode())
            if rec is not None and rec["state"] == S.READY.value:
                self._expire(rec, now_ms, "deadline passed while ready")
        return seen

    def purge(self, now_ms: int, limit: int) -> int:
        """Delete up to ``limit`` acknowledged items older than retention_s, stale
        idempotency keys and surplus events. Returns entries processed."""
        policy = self.ledger.policy
        done = 0
        cut = now_ms - int(policy.retention_s * 1000)
        todo = []
        for k, _ in self.txn.cursor(db=self.db["acked"]):
            if done + len(todo) >= limit or _Q.unpack(k[:8])[0] > cut:
                break
            todo.append(k)
        for k in todo:
            iid = k[8:]
            self.txn.delete(k, db=self.db["acked"])
            for name in ("items", "payloads", "results"):
                self.txn.delete(iid, db=self.db[name])
            self.bump("purged")
            done += 1
        kcut = now_ms - int(policy.dedup_window_s * 1000)
        ktodo = []
        for k, _ in self.txn.cursor(db=self.db["keytime"]):
            if done + len(ktodo) >= limit or _Q.unpack(k[:8])[0] >= kcut:
                break
            ktodo.append(k)
        for k in ktodo:
            created_ms, key = _Q.unpack(k[:8])[0], k[8:]
            self.txn.delete(k, db=self.db["keytime"])
            raw = self.txn.get(key, db=self.db["keys"])
            if raw is not None and _unpack(raw)[1] == created_ms:
                self.txn.delete(key, db=self.db["keys"])
            self.changed = True
            done += 1
        for w in gaps.WINDOWS:
            if done >= limit:
                break
            total = self.num(b"g:" + w.id.encode())
            keep_from = total - gaps.EVENTS_KEPT_PER_WINDOW
            if keep_from <= 0:
                continue
            prefix = w.id.encode() + b"\0"
            cur = self.txn.cursor(db=self.db["events"])
            etodo = []
            if cur.set_range(prefix):
                for k, _ in cur:
                    if not k.startswith(prefix) or _Q.unpack(k[len(prefix):])[0] > keep_from or done + len(etodo) >= limit:
                        break
                    etodo.append(k)
            for k in etodo:
                self.txn.delete(k, db=self.db["events"])
                self.changed = True
                done += 1
        return done

    def note_history(self, now_ms: int, live_pages: int) -> bool:
        """Record this commit in the commit history (``h:`` + >Q txnid -> [ts_ms,
        last_pgno, live_pages]) when the newest entry is :data:`HISTORY_INTERVAL_MS`
        old; entries older than :data:`HISTORY_KEEP_MS` go. A reader's snapshot age and
        the pages it pins are estimated from it (:func:`reader_report`). Entries above
        this transaction's id (a restored, compacted copy restarts the ids) are
        dropped first. True if written; call only in a transaction that commits."""
        meta = self.db["meta"]
        txnid = self.txn.id()
        cur = self.txn.cursor(db=meta)
        stale = []
        if cur.set_range(HISTORY_PREFIX + _Q.pack(txnid)):
            for k in cur.iternext(keys=True, values=False):
                if not k.startswith(HISTORY_PREFIX):
                    break
                stale.append(k)
        for k in stale:
            self.txn.delete(k, db=meta)
        last = self.history_at_or_before(txnid)
        if last is not None and now_ms - last[1][0] < HISTORY_INTERVAL_MS:
            return False
        old = []
        if cur.set_range(HISTORY_PREFIX):
            for k, v in cur:
                if not k.startswith(HISTORY_PREFIX) or len(old) >= 16 or _unpack(v)[0] >= now_ms - HISTORY_KEEP_MS:
                    break
                old.append(k)
        for k in old:
            self.txn.delete(k, db=meta)
        info = self.ledger.env.info()
        self.txn.put(HISTORY_PREFIX + _Q.pack(txnid), _pack([now_ms, info["last_pgno"], live_pages]), db=meta)
        self.changed = True
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
    slots = ledger.reader_slots()
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


_REFUSE_MESSAGES = {
    "QUEUE_FULL": "the broker's ledger is full (max_map_size_bytes, counting the room kept for the results of accepted items: result_reserve_bytes): retry with backoff or spool",
    "DISK_FULL": "the broker's disk is nearly full (min_free_disk_bytes): retry with backoff or spool",
}


def data_paths(data_dir: Path) -> tuple[Path, Path]:
    """(ledger directory, lock file) inside a broker's ``data_dir``."""
    return data_dir / "ledger", data_dir / "broker.lock"


def disk_free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
