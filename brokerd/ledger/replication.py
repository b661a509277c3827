"""Ledger replication, the storage half (docs/ha.md): write sets and their apply.

A primary with replication on (:meth:`Ledger.replicate
<ccsq.brokerd.ledger.store.Ledger.replicate>`) records every committed write
transaction (a broker turn) as a :class:`WriteSet`: each ``put`` and ``delete`` on a
named sub-database, in commit order, numbered by ``(epoch, seq)``. The turn's own
position is its last write (meta ``m:repl_pos``, ``>QQ`` epoch, seq), so a
consistent copy of the ledger (:meth:`Ledger.backup
<ccsq.brokerd.ledger.store.Ledger.backup>` with ``mark_restore=False``) says which
turn it holds, and a standby that applies the write set writes the same key in the
same transaction as the rest of the turn.

A standby keeps a :class:`ReplicaLedger`: it applies one turn in one LMDB transaction
(committed with fsync), refuses a gap, a turn from an older epoch, a turn of another
ledger or one that overwrites a tail the primary never had (typed errors below), and
its content (every key and value of every sub-database) is then identical to the
primary's. Replication off (the default, a single broker) records nothing: the write
transaction is LMDB's own object, not a wrapper.

What is *not* here (docs/ha.md): the link that ships write sets to standbys and
carries their acknowledgements, and the actor holding confirms until they come.

Errors: :class:`ReplicationGap`, :class:`StaleEpoch`, :class:`Diverged`,
:class:`NotSeeded`, :class:`BacklogTruncated` (all :class:`ReplicationError`).
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import structlog

from ccsq.brokerd.ledger import schema
from ccsq.common.wire.errors import CcsqError, ExitCode

log = structlog.get_logger("ccsq.brokerd")

#: Meta key of the replication position: ``>QQ`` (epoch, seq) of the last turn in this ledger.
REPL_POS = schema.META + b"repl_pos"
_POS = struct.Struct(">QQ")
#: Turns a primary keeps after their commit for a standby that catches up (about a
#: minute at 1000 turns/s; older ones: the standby takes a new copy).
BACKLOG_TURNS = 65536
#: The index of a sub-database in a write set's ops (its position in ``schema.DB_NAMES``).
DB_INDEX = {name: i for i, name in enumerate(schema.DB_NAMES)}
META_INDEX = DB_INDEX["meta"]
_ABSENT = object()


class ReplicationError(CcsqError):
    """A write set cannot be applied; the message says which position and why."""

    code = "REPLICATION"
    exit_code: ExitCode = ExitCode.FAILURE


class ReplicationGap(ReplicationError):
    """The turn is not the next one: ``expected`` seq, ``got`` seq. The standby asks the
    primary for the turns it lacks (:meth:`ReplicationLog.since`) or takes a new copy."""

    code = "REPLICATION_GAP"

    def __init__(self, message: str, *, expected: int, got: int) -> None:
        super().__init__(message)
        self.expected, self.got = expected, got


class StaleEpoch(ReplicationError):
    """The turn comes from an epoch older than the one this ledger already holds: a
    deposed primary. Fenced: nothing applied."""

    code = "REPLICATION_STALE_EPOCH"


class Diverged(ReplicationError):
    """This ledger holds turns the sender never had (a deposed primary's unconfirmed
    tail), or belongs to another ledger: it must be discarded and seeded again from a
    consistent copy of the primary's."""

    code = "REPLICATION_DIVERGED"


class NotSeeded(ReplicationError):
    """A standby's ledger directory holds no ledger yet: seed it from a consistent
    copy of the primary's (:func:`take_copy`) first."""

    code = "REPLICATION_NOT_SEEDED"


class BacklogTruncated(ReplicationError):
    """The primary no longer holds the turns after the standby's position: take a new copy."""

    code = "REPLICATION_BACKLOG_TRUNCATED"


def pack_pos(epoch: int, seq: int) -> bytes:
    return _POS.pack(epoch, seq)


def unpack_pos(raw: bytes | None) -> tuple[int, int]:
    """(epoch, seq) from meta ``m:repl_pos``; (0, 0) when absent (no turn replicated yet)."""
    return _POS.unpack(raw) if raw else (0, 0)


@dataclasses.dataclass(frozen=True)
class WriteSet:
    """One committed turn. ``ops``: ``(db index, key, value)`` in commit order (the index
    of the sub-database in ``schema.DB_NAMES``, :data:`DB_INDEX`); value None is a delete.
    ``ledger_id``: the ledger's id (meta ``m:ledger_id``), so a standby seeded from
    another ledger refuses it. The last op writes :data:`REPL_POS`. The ops are what the
    primary recorded (or what :meth:`unpack` read, its types checked by the apply, which
    refuses a malformed op as :class:`ReplicationError`)."""

    ledger_id: str
    epoch: int
    seq: int
    ops: tuple[tuple[int, bytes, bytes | None], ...]
    #: the packed bytes, once :meth:`pack` made them (a turn is packed once, however often shipped)
    raw: bytes | None = dataclasses.field(default=None, compare=False, repr=False)

    def pack(self) -> bytes:
        """msgpack ``[ledger_id, epoch, seq, [[db index, key, value or nil], ...]]`` (the ops
        tuples are msgpack arrays as they are: no list built per op), made once."""
        raw = self.raw
        if raw is None:
            raw = schema.pack([self.ledger_id, self.epoch, self.seq, self.ops])
            object.__setattr__(self, "raw", raw)
        return raw

    @classmethod
    def unpack(cls, raw: bytes) -> WriteSet:
        """Inverse of :meth:`pack` (the ops as tuples, no copy per op). Raises
        :class:`ReplicationError` on a malformed header or op list; a malformed op (a
        db index out of range, a key or value that is not bytes) is refused by the apply."""
        try:
            lid, epoch, seq, ops = msgpack.unpackb(raw, raw=False, use_list=False)
            if not (type(lid) is str and type(epoch) is int and type(seq) is int and type(ops) is tuple) \
                    or epoch < 0 or seq < 1:
                raise ValueError("bad header")
        except (ValueError, TypeError, IndexError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ReplicationError(f"malformed write set ({len(raw)} bytes): {exc}") from None
        return cls(lid, epoch, seq, ops, raw)

    def nbytes(self) -> int:
        """The packed size (what the link carries for this turn)."""
        return len(self.pack())

    def named_ops(self) -> list[tuple[str, bytes, bytes | None]]:
        """``ops`` with sub-database names (for logs and tests)."""
        return [(schema.DB_NAMES[i], k, v) for i, k, v in self.ops]


class ReplicationLog:
    """The primary's side: numbers the turns of ``epoch`` after the ledger's position,
    keeps the last ``backlog_turns`` of them, and passes each committed one to ``sink``
    (the link, later; called in the writer's thread right after the LMDB commit)."""

    def __init__(self, epoch: int, position: tuple[int, int], *, backlog_turns: int = BACKLOG_TURNS,
                 sink: Callable[[WriteSet], None] | None = None) -> None:
        if epoch < position[0]:
            raise StaleEpoch(f"epoch {epoch} is older than the ledger's replication epoch {position[0]}")
        self.epoch = epoch
        self.position = position
        #: the ledger's position when this log began: the one turn before the backlog whose
        #: epoch is known once the backlog is full (older ones: BacklogTruncated)
        self.start = position
        self.sink = sink
        self.backlog: collections.deque[WriteSet] = collections.deque(maxlen=backlog_turns)

    def next_seq(self) -> int:
        return self.position[1] + 1

    def committed(self, ws: WriteSet) -> None:
        """After the LMDB commit of ``ws``: keep it and pass it on. A sink that raises is
        logged, not raised (the commit stands; a standby catches up from the backlog)."""
        self.position = (ws.epoch, ws.seq)
        self.backlog.append(ws)
        if self.sink is not None:
            try:
                self.sink(ws)
            except Exception:  # noqa: BLE001 - the turn is committed whatever the link does
                log.exception("replication_sink_failed", epoch=ws.epoch, seq=ws.seq)

    def since(self, position: tuple[int, int]) -> list[WriteSet]:
        """The turns after ``position`` (a standby's, or a copy's), oldest first.
        Raises :class:`BacklogTruncated` when some are no longer kept, :class:`Diverged`
        when ``position`` is ahead of this primary's."""
        epoch, seq = position
        if seq > self.position[1] or (seq == self.position[1] and epoch != self.position[0]):
            raise Diverged(f"position {position} is not one this primary has written (it is at {self.position})")
        if seq == self.position[1]:
            return []
        if not self.backlog or self.backlog[0].seq > seq + 1:
            first = self.backlog[0].seq if self.backlog else self.position[1] + 1
            raise BacklogTruncated(f"turns after seq {seq} are gone (the backlog begins at {first}): take a new copy")
        start = seq + 1 - self.backlog[0].seq
        # the turn at the standby's seq must be this primary's turn of that seq: the same
        # epoch (a deposed primary's tail of an older epoch has the same seqs, other turns)
        held = self.backlog[start - 1].epoch if start > 0 else (self.start[0] if self.start[1] == seq else None)
        if held is None:
            raise BacklogTruncated(f"the epoch of turn {seq} is no longer known here: take a new copy")
        if held != epoch:
            raise Diverged(f"position {position}: this primary's turn {seq} is of epoch {held}; the standby holds "
                           "another turn there (a deposed primary's tail)")
        return list(self.backlog)[start:]


class RecordingTxn:
    """An LMDB write transaction that records its effective puts and deletes (a put that
    wrote nothing, an append out of order, a delete of an absent key: not recorded).
    Everything else is LMDB's transaction. Writes through a cursor are not recorded:
    the ledger writes only with ``put`` and ``delete``."""

    __slots__ = ("_txn", "_index", "ops", "get", "cursor", "id", "stat", "_put", "_delete", "_append")

    def __init__(self, txn: lmdb.Transaction, names: dict[Any, str]) -> None:
        self._txn = txn
        self._index = {db: DB_INDEX[name] for db, name in names.items()}  # LMDB handle -> index in DB_NAMES
        self.ops: list[tuple[int, bytes, bytes | None]] = []
        # reads go straight to LMDB's bound methods (no Python frame per read)
        self.get, self.cursor, self.id, self.stat = txn.get, txn.cursor, txn.id, txn.stat
        # the write path: bound once per turn
        self._put, self._delete, self._append = txn.put, txn.delete, self.ops.append

    def put(self, key: bytes, value: bytes, *, db: Any = None, dupdata: bool = True, overwrite: bool = True,
            append: bool = False) -> bool:
        if overwrite and not append:  # the ledger's usual put (its sub-databases are not DUPSORT:
            # dupdata changes nothing, and an overwriting put always writes): nothing to forward or test
            self._put(key, value, db=db)
        elif not self._put(key, value, db=db, dupdata=dupdata, overwrite=overwrite, append=append):
            return False  # wrote nothing (the key exists, or an append out of order): not recorded
        # bytes(b) of a bytes object is that object: a copy only of a memoryview or bytearray
        self._append((self._index[db], key if type(key) is bytes else bytes(key),
                      value if type(value) is bytes else bytes(value)))
        return True

    def delete(self, key: bytes, value: bytes = b"", db: Any = None) -> bool:
        if not self._delete(key, value, db=db):
            return False  # absent: nothing deleted, not recorded
        self._append((self._index[db], key if type(key) is bytes else bytes(key), None))
        return True

    def commit(self) -> None:
        self._txn.commit()

    def abort(self) -> None:
        self._txn.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


# --- the standby's side ------------------------------------------------------------------
def _open_env(path: Path, map_size_bytes: int, *, create: bool) -> lmdb.Environment:
    return lmdb.open(str(path), map_size=map_size_bytes, max_dbs=len(schema.DB_NAMES) + 2, subdir=True, lock=True,
                     sync=True, metasync=True, writemap=False, create=create)


class ReplicaLedger:
    """A standby's copy of the primary's ledger at ``path`` (seeded by :func:`take_copy`).

    :meth:`apply` writes one :class:`WriteSet` in one LMDB transaction, committed with
    fsync (the env is opened ``sync=True, metasync=True``, as the primary's). The
    position (:attr:`position`) is the :data:`REPL_POS` the turn itself writes. The map
    doubles on ``MDB_MAP_FULL`` up to ``max_map_size_bytes``. Only one process may
    write it; a broker opens it as its :class:`~ccsq.brokerd.ledger.store.Ledger` once
    promoted. Raises :class:`NotSeeded` when ``path`` holds no ledger.
    """

    def __init__(self, path: Path, *, map_size_bytes: int = 1 << 30, max_map_size_bytes: int = 64 << 30) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").exists():
            raise NotSeeded(f"standby ledger {self.path} is empty (no data.mdb): seed it from a consistent copy "
                            "of the primary's ledger first")
        self.max_map_size_bytes = max(map_size_bytes, max_map_size_bytes)
        self.env = _open_env(self.path, map_size_bytes, create=False)
        try:
            self.db = {name: self.env.open_db(name.encode(), create=False) for name in schema.DB_NAMES}
        except lmdb.Error as exc:
            self.env.close()
            raise NotSeeded(f"standby ledger {self.path} lacks its sub-databases ({exc}): seed it again") from None
        #: index in a write set's ops -> LMDB handle (a dict: a negative or bool index is no sub-database)
        self._by_index = {i: self.db[name] for i, name in enumerate(schema.DB_NAMES)}
        with self.env.begin() as txn:
            lid = txn.get(schema.LEDGER_ID, db=self.db["meta"])
            if txn.get(schema.RESTORE_PENDING, db=self.db["meta"]) is not None:
                self.env.close()
                raise Diverged(f"standby ledger {self.path} is a `ccsq backup` copy marked for restore (a new "
                               "id prefix on first write): seed it with take_copy, not ccsq backup")
            self.position = unpack_pos(txn.get(REPL_POS, db=self.db["meta"]))
        if lid is None:
            self.env.close()
            raise NotSeeded(f"standby ledger {self.path} has no ledger id: seed it from a copy of the primary's")
        self.ledger_id = lid.decode()

    def close(self) -> None:
        self.env.close()

    def check(self, ws: WriteSet) -> bool:
        """Whether ``ws`` is the next turn (True), one already applied (False), or
        refused (raises :class:`StaleEpoch`, :class:`ReplicationGap`, :class:`Diverged`)."""
        return self._check_at(ws, self.position)

    def _check_at(self, ws: WriteSet, position: tuple[int, int]) -> bool:
        epoch, seq = position
        if ws.ledger_id != self.ledger_id:
            raise Diverged(f"write set of ledger {ws.ledger_id!r}, this standby holds ledger {self.ledger_id!r}")
        if ws.epoch < epoch:
            raise StaleEpoch(f"turn ({ws.epoch}, {ws.seq}) is from an older epoch than this ledger's ({epoch}, {seq})")
        if ws.seq <= seq:
            if ws.epoch == epoch:
                return False
            raise Diverged(f"turn ({ws.epoch}, {ws.seq}) of a newer epoch rewrites turns this ledger holds up to "
                           f"({epoch}, {seq}): its tail was never confirmed; seed again from the primary")
        if ws.seq != seq + 1:
            raise ReplicationGap(f"turn ({ws.epoch}, {ws.seq}) after ({epoch}, {seq}): turns "
                                 f"{seq + 1}..{ws.seq - 1} are missing", expected=seq + 1, got=ws.seq)
        return True

    def _net_effect(self, todo: list[WriteSet]) -> list[tuple[Any, dict[bytes, bytes | None], list[bytes], WriteSet | None]]:
        """What the ops of ``todo`` in order leave, per sub-database: ``(LMDB handle, {key:
        last value or None for deleted}, keys to check, the first turn deleting one of them)``.
        The ledger's sub-databases hold one value per key (none is DUPSORT), so a key ends as its
        last op left it; the keys to check are those whose first op in the batch is a delete:
        in order, that delete needs the key present before the batch (a delete after a delete
        of the same key, with no put between: absent, :class:`Diverged` at once). A batch of
        several turns writes each key once (an item's record rewritten by each turn, the
        ready index put by one turn and deleted by the next, the counters and the position).
        Raises :class:`ReplicationError` for a malformed op, :class:`Diverged` as said."""
        by_index = self._by_index
        nets: dict[int, dict[bytes, bytes | None]] = {i: {} for i in by_index}
        checks: dict[int, list[bytes]] = {}
        first_check: dict[int, WriteSet] = {}
        for ws in todo:
            try:
                for i, key, value in ws.ops:
                    if value is not None:
                        nets[i][key] = value  # (a value that is not bytes: TypeError at the write)
                        continue
                    d = nets[i]
                    prev = d.get(key, _ABSENT)
                    if prev is None:
                        raise Diverged(f"turn ({ws.epoch}, {ws.seq}) deletes {schema.DB_NAMES[i]}/{key!r}, "
                                       "absent here (deleted before in this batch)")
                    if prev is _ABSENT:
                        checks.setdefault(i, []).append(key)
                        first_check.setdefault(i, ws)
                    d[key] = None
            except (ValueError, TypeError, KeyError) as exc:
                raise ReplicationError(f"turn ({ws.epoch}, {ws.seq}) holds a malformed op: {exc!r}") from None
        return [(by_index[i], d, checks.get(i, []), first_check.get(i)) for i, d in nets.items() if d]

    def _write(self, txn: lmdb.Transaction, net: list[tuple[Any, dict[bytes, bytes | None], list[bytes], WriteSet | None]]) -> None:
        """Write ``net`` (:meth:`_net_effect`) in ``txn``: per sub-database its deletes (one to
        check that finds its key absent: :class:`Diverged`; a key to check that ends put: read
        first), then its puts in key order through one cursor (LMDB's ``putmulti``: no Python
        call per put). A raise leaves the caller to abort: nothing of the batch is written."""
        delete, get = txn.delete, txn.get
        for db, d, check, ws in net:
            puts: list[tuple[bytes, bytes]] = [kv for kv in d.items() if kv[1] is not None]  # type: ignore[misc]
            absent = None
            if len(puts) < len(d):
                must = set(check)
                for key in [k for k, v in d.items() if v is None]:
                    if not delete(key, db=db) and key in must:
                        absent = key
                        break
            if absent is None:
                absent = next((k for k in check if d[k] is not None and get(k, db=db) is None), None)
            if absent is not None:
                assert ws is not None
                raise Diverged(f"turn ({ws.epoch}, {ws.seq}) or a later one of its batch deletes "
                               f"{self._name(db)}/{absent!r}, absent here")
            if puts:
                puts.sort()
                with txn.cursor(db=db) as cur:
                    cur.putmulti(puts)

    def _name(self, db: Any) -> str:
        return next((n for n, h in self.db.items() if h is db), "?")

    def apply(self, ws: WriteSet) -> bool:
        """Apply ``ws`` (see :meth:`check`): True when written and fsynced, False when it
        was already applied (a resend). A delete of an absent key or a turn whose last
        write is not its own position is :class:`Diverged` (nothing written)."""
        return self.apply_many([ws]) == 1

    def apply_many(self, batch: list[WriteSet]) -> int:
        """Apply the turns of ``batch`` in order in **one** LMDB transaction, committed with
        one fsync (a standby that drained several turns at once: group commit). Each is
        checked as by :meth:`check` against the position the ones before it leave; those
        already applied are skipped. Returns how many were written. All or nothing: a
        refused turn (the errors of :meth:`apply`) writes none of the batch."""
        todo, pos = [], self.position
        for ws in batch:
            if not self._check_at(ws, pos):
                continue
            if not ws.ops or tuple(ws.ops[-1]) != (META_INDEX, REPL_POS, pack_pos(ws.epoch, ws.seq)):
                raise ReplicationError(f"turn ({ws.epoch}, {ws.seq}) does not end with its own position")
            todo.append(ws)
            pos = (ws.epoch, ws.seq)
        if not todo:
            return 0
        net = self._net_effect(todo)
        while True:
            txn = self.env.begin(write=True)
            try:
                self._write(txn, net)
                txn.commit()
            except (TypeError, lmdb.BadValsizeError) as exc:  # a key or value not bytes, an empty or oversized key
                txn.abort()
                raise ReplicationError(f"a turn of ({todo[0].epoch}, {todo[0].seq})..({pos[0]}, {pos[1]}) holds a "
                                       f"malformed op: {exc}") from None
            except lmdb.MapFullError:
                txn.abort()
                cur = self.env.info()["map_size"]
                if cur >= self.max_map_size_bytes:
                    raise ReplicationError(f"standby ledger {self.path} is full at {cur} bytes "
                                           "(max_map_size_bytes)") from None
                self.env.set_mapsize(min(cur * 2, self.max_map_size_bytes))
                continue
            except BaseException:
                txn.abort()
                raise
            self.position = pos
            return len(todo)


def take_copy(ledger: Any, dest: Path) -> dict[str, Any]:
    """A consistent copy of the primary's ``ledger`` into the new or empty ``dest``
    for a standby to start from (:meth:`Ledger.backup` without the restore mark: it
    continues this ledger, same id prefix). Safe while the primary writes. Returns the
    backup's dict plus ``position``: the (epoch, seq) of the last turn the copy holds;
    the standby then applies :meth:`ReplicationLog.since` of it."""
    out = ledger.backup(dest, mark_restore=False)
    env = _open_env(Path(dest), (Path(dest) / "data.mdb").stat().st_size + (1 << 20), create=False)
    try:
        with env.begin() as txn:
            out["position"] = unpack_pos(txn.get(REPL_POS, db=env.open_db(b"meta", txn=txn, create=False)))
    finally:
        env.close()
    return out


def dump(env: lmdb.Environment) -> dict[str, dict[bytes, bytes]]:
    """Every key and value of every ledger sub-database (for comparing a standby with its primary)."""
    out: dict[str, dict[bytes, bytes]] = {}
    with env.begin() as txn:
        for name in schema.DB_NAMES:
            db = env.open_db(name.encode(), txn=txn, create=False)
            out[name] = {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
    return out
