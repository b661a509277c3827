"""The ledger's LMDB environment: open, reader slots, size, growth, backup (docs/ledger.md).

This is the only module that opens the LMDB env. :class:`Ledger` hands out the
transactions: :meth:`Ledger.read` (a :class:`~ccsq.brokerd.ledger.view.LedgerView`
snapshot) and :meth:`Ledger.begin` (a :class:`~ccsq.brokerd.ledger.rules.LedgerTxn`,
the one write transaction of a broker turn); :meth:`Ledger.transact` runs a turn's
step with the map-full rule (grow the map, else shed work, and run it again).

Errors: ``lmdb.MapFullError`` propagates out of any write (:meth:`Ledger.transact`
handles it); :class:`LedgerError` for a ledger that cannot be opened.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb
import structlog

from ccsq.brokerd.ledger import schema
from ccsq.common.wire.errors import CcsqError, ExitCode, ledger_failure

if TYPE_CHECKING:
    from ccsq.brokerd.ledger.replication import ReplicationLog, WriteSet
    from ccsq.brokerd.ledger.rules import LedgerTxn
    from ccsq.brokerd.ledger.view import LedgerView

log = structlog.get_logger("ccsq.brokerd")
T = TypeVar("T")

#: The broker runs LMDB's reader check at least this often (stale slots of dead readers
#: freed; in practice every 0.1 s while it commits); a process that finds the reader
#: table full while opening waits longer than this.
READER_CHECK_INTERVAL_S = 1.0
READERS_FULL_WAIT_S = 3.0


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


#: What a turn still does when the map is full and cannot grow, in the order
#: :meth:`Ledger.transact` falls back: everything; new items refused (QUEUE_FULL);
#: without dispatch and background work; only ACK and STATUS.
FULL_MODES = ("normal", "refuse", "minimal", "acks")
#: Runs of one turn's step before :meth:`Ledger.transact` gives up (growths + fallbacks).
TRANSACT_TRIES = 8


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
        #: the turns' write sets when replication is on (:meth:`replicate`); None: a single broker
        self.replication: ReplicationLog | None = None
        #: the election epoch every fencing token carries (:meth:`adopt_epoch`); 0: a single
        #: broker, whose tokens are the bare counter ``m:next_token`` as before
        self.fencing_epoch = 0
        # Committed records of items not yet done (ready, leased, completed), kept by the
        # writer between its transactions: item id -> (record, its format-3 head, payload,
        # result; a blob only when small, else None). Off (0) unless the broker turns it
        # on (:meth:`cache_records`); see LedgerTxn.commit.
        self.record_cache_max = 0
        self.record_cache_ready_max = 0
        self.record_cache: collections.OrderedDict[str, tuple[schema.Item, bytes | None, Any, Any]] = collections.OrderedDict()
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
                self.db = {name: self.env.open_db(name.encode(), create=not readonly) for name in schema.DB_NAMES}
            except lmdb.ReadersFullError:  # open_db reads too: clear dead readers' slots, try again
                self.clear_stale_readers()
                self.db = {name: self.env.open_db(name.encode(), create=not readonly) for name in schema.DB_NAMES}
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
        #: the ``keys`` index still holds raw idempotency keys an older version wrote (they
        #: sort before the digests, schema.key_index): looked up too until they age out
        self.legacy_keys = self._has_legacy_keys()
        #: sub-database handle -> name (a recorded write names its sub-database)
        self.db_names: dict[Any, str] = {handle: name for name, handle in self.db.items()}
        self.ledger_id = ""
        #: what new item ids begin with: the ledger id, or the prefix a restore gave it
        self.id_prefix = ""
        #: the id prefix before this open, when this open was the first write to a restored
        #: ``ccsq backup`` copy (a new prefix was taken: see :meth:`backup`); else ""
        self.restored_from = ""
        #: when this open was the first write to a restored copy: the items it may run or
        #: deliver again (ready, leased, completed in the copy; one G13 event each)
        self.restore_reruns = 0
        meta = self.db["meta"]
        if not readonly:
            with self.env.begin(write=True) as txn:
                lid = txn.get(schema.LEDGER_ID, db=meta)
                if lid is None:
                    lid = secrets.token_hex(4).encode()
                    txn.put(schema.LEDGER_ID, lid, db=meta)
                self.ledger_id = lid.decode()
                prefix = (txn.get(schema.ID_PREFIX, db=meta) or lid).decode()
                restoring = txn.get(schema.RESTORE_PENDING, db=meta) is not None
                self.id_prefix = prefix
            if restoring:
                try:
                    self._restored(prefix)
                except BaseException:
                    self.env.close()
                    raise
        else:
            try:
                txn = self._begin()
            except LedgerError:
                self.env.close()
                raise
            try:
                lid = txn.get(schema.LEDGER_ID, db=meta)
                raw_prefix = txn.get(schema.ID_PREFIX, db=meta) or lid
            finally:
                txn.abort()
            self.ledger_id = lid.decode() if lid else ""
            self.id_prefix = raw_prefix.decode() if raw_prefix else ""

    def _has_legacy_keys(self) -> bool:
        txn = self._begin()
        try:
            cur = txn.cursor(db=self.db["keys"])
            return cur.first() and not cur.key().startswith(schema.KEY_DIGEST)
        finally:
            txn.abort()

    def _restored(self, prefix: str) -> None:
        """The first write to a restored ``ccsq backup`` copy, in one transaction: a new
        item id prefix (the broker it was copied from may have issued ids after the copy,
        and their results may sit in the results database: never reuse them), a G13 event
        for each item the restore may run or deliver again (:meth:`LedgerTxn.restored_from_backup`),
        and the mark deleted."""
        fresh = _fresh_prefix({prefix, self.ledger_id})
        meta = self.db["meta"]

        def step(txn: LedgerTxn, _mode: str) -> int:
            n = txn.restored_from_backup(int(time.time() * 1000))
            txn.txn.put(schema.ID_PREFIX, fresh.encode(), db=meta)
            txn.txn.delete(schema.RESTORE_PENDING, db=meta)
            txn.changed = True
            txn.commit()
            return n

        _mode, n = self.transact(step)
        if n is None:
            raise LedgerError(f"ledger {self.path}: the map is too small to mark the restore (raise max_map_size_bytes)",
                              exit_code=ExitCode.CONFIG)
        self.restored_from, self.id_prefix, self.restore_reruns = prefix, fresh, n

    # --- environment ---
    def _open_env(self, map_size_bytes: int, readonly: bool, max_readers: int) -> lmdb.Environment:
        return lmdb.open(
            str(self.path),
            map_size=map_size_bytes,
            max_dbs=len(schema.DB_NAMES) + 2,
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
        from ccsq.brokerd.ledger.rules import LedgerTxn  # rules builds on this module

        return LedgerTxn(self)

    def cache_records(self, max_items: int, ready_max: int | None = None) -> None:
        """Keep up to ``max_items`` committed records of items not yet done in memory
        between write transactions (the oldest go first), so a transition reads its
        record without unpacking it (and its payload and result, when small). Only for the one writer of the ledger (the broker's
        actor): a record written by anything but a :class:`LedgerTxn` of this object
        would be read stale. 0 turns it off. Records of ready items are kept only while at
        most ``ready_max`` items are ready (default half of ``max_items``): in a deeper
        queue they would go before their lease, and push out the leased and completed
        records that COMPLETE, delivery and ACK read next."""
        self.record_cache_max = max_items
        self.record_cache_ready_max = max_items // 2 if ready_max is None else ready_max
        self.record_cache.clear()

    def read(self) -> LedgerView:
        """A read-only snapshot (use as a context manager)."""
        from ccsq.brokerd.ledger.view import LedgerView  # the view builds on this module

        return LedgerView(self)

    def transact(self, step: Callable[[LedgerTxn, str], T]) -> tuple[str, T | None]:
        """Run ``step(txn, mode)`` in a fresh write transaction; ``step`` commits or
        aborts it (nothing is half-applied: it confirms nothing before the commit).

        When a write or the commit hits ``MDB_MAP_FULL`` the transaction is aborted and
        ``step`` runs again in a new one: after doubling the map (same ``mode``, log
        ``ledger_map_grown``), else in the next of :data:`FULL_MODES` (log
        ``ledger_map_full``), at most :data:`TRANSACT_TRIES` runs. Returns ``(mode,
        step's value)``; the value is None when even ``"acks"`` did not fit (or the
        tries ran out). Any other error aborts the transaction and propagates."""
        mode = FULL_MODES[0]
        for _ in range(TRANSACT_TRIES):
            txn = self.begin()
            try:
                return mode, step(txn, mode)
            except lmdb.MapFullError:
                txn.abort()
                if self.grow_map():
                    log.info("ledger_map_grown", map_size_bytes=self.map_size_bytes())
                    continue
                if mode == FULL_MODES[-1]:
                    break
                mode = FULL_MODES[FULL_MODES.index(mode) + 1]
                log.warning("ledger_map_full", mode=mode, map_size_bytes=self.map_size_bytes())
            except BaseException:
                txn.abort()
                raise
        return mode, None

    def replicate(self, epoch: int, *, sink: Callable[[WriteSet], None] | None = None,
                  backlog_turns: int | None = None) -> ReplicationLog:
        """Turn replication on (a primary, docs/ha.md): from now on every committed write
        transaction is a :class:`~ccsq.brokerd.ledger.replication.WriteSet` of ``epoch``
        numbered after the ledger's replication position, passed to ``sink`` after its
        commit and kept in the returned log's backlog. Raises
        :class:`~ccsq.brokerd.ledger.replication.StaleEpoch` when ``epoch`` is older than
        the ledger's. Only with no write transaction open."""
        from ccsq.brokerd.ledger import replication  # replication builds on this module

        with self.read() as view:
            pos = replication.unpack_pos(view.txn.get(replication.REPL_POS, db=self.db["meta"]))
        kw = {} if backlog_turns is None else {"backlog_turns": backlog_turns}
        self.replication = replication.ReplicationLog(epoch, pos, sink=sink, **kw)
        return self.replication

    def bump_epoch(self) -> int:
        """Increment and return the broker epoch (once per broker start); with replication
        on, a turn like any other."""
        if self.replication is not None:
            turn = self.begin()
            epoch = turn.next_num(schema.EPOCH)
            turn.commit()
            return epoch
        with self.env.begin(write=True) as txn:
            raw = txn.get(schema.EPOCH, db=self.db["meta"])
            epoch = schema.unpack_num(raw) + 1
            txn.put(schema.EPOCH, schema.pack_num(epoch), db=self.db["meta"])
        return epoch

    def adopt_epoch(self, epoch: int) -> int:
        """Make ``epoch`` (an election's, docs/ha.md) the broker epoch in meta ``m:epoch``
        (what WELCOME carries), in a turn of its own, and the epoch of every fencing token
        granted from now on (``epoch << 32 | counter``, :func:`~ccsq.brokerd.ledger.schema.fencing_token`).
        Returns it. Raises
        :class:`~ccsq.brokerd.ledger.replication.StaleEpoch` when the ledger already holds
        a higher one: epochs never go back."""
        from ccsq.brokerd.ledger.replication import StaleEpoch  # replication builds on this module

        txn = self.begin()
        try:
            have = txn.epoch()
            if epoch < have:
                raise StaleEpoch(f"epoch {epoch} is below the ledger's epoch {have} ({self.path})")
            if epoch > have:
                txn._add(schema.EPOCH, epoch - have)  # noqa: SLF001 - the ledger's own transaction
            txn.commit()
        finally:
            txn.abort()
        self.fencing_epoch = epoch
        return epoch

    def map_size_bytes(self) -> int:
        return self.env.info()["map_size"]

    def used_bytes(self, txn: lmdb.Transaction[bytes] | None = None) -> int:
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
    def _begin(self, write: bool = False) -> lmdb.Transaction[bytes]:
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

    def backup(self, dest: Path, *, mark_restore: bool = True) -> dict[str, Any]:
        """A consistent, compacting copy of the ledger into the new or empty directory
        ``dest`` (``dest/data.mdb``; LMDB's ``mdb_env_copy2`` with ``MDB_CP_COMPACT``:
        one read snapshot, free pages left out, pages renumbered). Safe while the
        broker writes; the copy's snapshot pins history only while it runs. The copy is
        marked: the first broker (or tool) that opens it for writing, i.e. once it is
        restored, takes a new item id prefix, so ids the source broker issued after the copy
        are never issued again (their results may already be in the results database);
        ``mark_restore=False`` leaves that mark out (a standby's seed, which continues this
        ledger: :func:`~ccsq.brokerd.ledger.replication.take_copy`). The file is fsynced.
        Returns ``{path, bytes, source_bytes, last_txnid}``. Raises
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
            if mark_restore:
                _mark_restore_pending(dest)
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



def data_paths(data_dir: Path) -> tuple[Path, Path]:
    """(ledger directory, lock file) inside a broker's ``data_dir``."""
    return data_dir / "ledger", data_dir / "broker.lock"


def disk_free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fresh_prefix(taken: set[str]) -> str:
    """8 random hex chars not in ``taken`` (an item id prefix after a restore)."""
    while True:
        prefix = secrets.token_hex(4)
        if prefix not in taken:
            return prefix


def _mark_restore_pending(dest: Path) -> None:
    """Set ``RESTORE_PENDING`` in the ledger copy at ``dest`` (see :meth:`Ledger.backup`)."""
    # a compacted copy has no free page and LMDB would size the map to the file (py-lmdb's
    # default is 10 MiB): room for the one key's pages
    map_size = (dest / "data.mdb").stat().st_size + (1 << 20)
    env = lmdb.open(str(dest), map_size=map_size, max_dbs=len(schema.DB_NAMES) + 2, subdir=True, lock=True, sync=True,
                    metasync=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(schema.RESTORE_PENDING, b"", db=env.open_db(b"meta", txn=txn, create=False))
    finally:
        env.close()
    (dest / "lock.mdb").unlink(missing_ok=True)
