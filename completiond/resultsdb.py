"""The completion service's results database: SQLite (default) or PostgreSQL.

Two tables, ``results`` and ``results_quarantine`` (documented in
``docs/results-schema.md``), created on first connect. :meth:`ResultsDB.land`
writes a whole batch in ONE transaction with an idempotent upsert keyed by
``item_id``: a row that is already there keeps its first result and only
``deliveries`` goes up, so a redelivered result lands once and the redelivery
is still counted. Rows the database refuses for a data reason go to
``results_quarantine`` in the same transaction (gap G12). A SQLite database this
version creates stores each result once (``result_text`` is generated from ``result``
and the flag ``result_is_text``); one made before is written as it is
(:meth:`SqliteResults.schema_version`).

A ``ResultsDB`` is used from one thread (the completion service's DB thread);
only :meth:`ResultsDB.interrupt` may be called from another one.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import functools
import json
import json.encoder
import operator
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ccsq.common.wire.errors import ConfigError


class ResultRow(NamedTuple):
    """One result as stored, its fields in the column order of ``results`` (a tuple: the
    SQLite driver binds it as it is; a plain tuple in this order is accepted wherever a
    ResultRow is). ``params_json`` is a JSON object (bytes values as ``{"$b64": "..."}``);
    ``result_text`` is the result as UTF-8 text when it decodes (and holds no NUL), else
    None; timestamps are UNIX seconds."""

    item_id: str
    idem_key: str
    kind: str
    params_json: str
    result: bytes
    result_sha256: str
    result_text: str | None
    attempt: int
    handler: str
    handler_version: str
    completed_ts: float
    landed_ts: float


#: One encoder for every row (``json.dumps`` with arguments builds a new one per call).
_PARAMS_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
#: ``_PARAMS_JSON``'s C encoder, built once: ``JSONEncoder.encode`` builds one per call
#: (~2 µs of ~3 per row). Same arguments as ``iterencode`` gives it, but no circular-reference
#: markers (params decoded from msgpack cannot refer to themselves; too deep still raises).
#: None where ``_json`` is missing (the pure-Python encoder is used then).
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # (not in typeshed)
_PARAMS_C_ENCODER = (_C_MAKE_ENCODER(None, _PARAMS_JSON.default, json.encoder.encode_basestring_ascii,
                                     None, ":", ",", True, False, True)
                     if _C_MAKE_ENCODER is not None else None)


def params_to_json(params: dict[str, Any]) -> str:
    """``params`` as canonical JSON (sorted keys, no spaces; bytes values as ``{"$b64": "..."}``)."""
    for v in params.values():
        if isinstance(v, bytes):
            params = {k: {"$b64": base64.b64encode(v).decode("ascii")} if isinstance(v, bytes) else v
                      for k, v in params.items()}
            break
    if _PARAMS_C_ENCODER is not None and type(params) is dict:
        return "".join(_PARAMS_C_ENCODER(params, 0))
    return _PARAMS_JSON.encode(params)


def text_or_none(data: bytes) -> str | None:
    """``data`` as text if it is valid UTF-8 without NUL characters, else None."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


_COLUMNS = (
    "item_id, idem_key, kind, params, result, result_sha256, result_text, attempt, handler, "
    "handler_version, completed_ts, landed_ts"
)


#: A row for an item id already in ``results`` is a redelivery (``deliveries`` + 1) only when
#: its idempotency key is the stored one. Another key means the id was issued twice (a ledger
#: restored from a copy made without ``ccsq backup``): the key set to NULL breaks its NOT NULL
#: constraint, a data error, so the row goes to ``results_quarantine`` (counted, G12) instead of
#: being taken for a redelivery and dropped.
_ON_CONFLICT = ("ON CONFLICT (item_id) DO UPDATE SET deliveries = results.deliveries + 1, "
                "idem_key = CASE WHEN results.idem_key = excluded.idem_key THEN results.idem_key END")
#: the ``results`` and ``results_quarantine`` upserts (``{values}``: the driver's placeholders)
_RESULTS_UPSERT = f"INSERT INTO results ({_COLUMNS}, deliveries) VALUES ({{values}},1) " + _ON_CONFLICT
_QUARANTINE_UPSERT = ("INSERT INTO results_quarantine ({columns}, deliveries) VALUES ({values},1) "
                      "ON CONFLICT (item_id) DO UPDATE SET deliveries = results_quarantine.deliveries + 1, "
                      "error = excluded.error")


_IDEM_KEY = operator.itemgetter(1)  # ResultRow.idem_key


class ResultsDB(abc.ABC):
    """A results database connection that can be dropped and re-made.

    One connect-and-swap for both backends (:meth:`connect`): a subclass says how to
    open a connection (:meth:`_open`), make the schema on it (:meth:`_init_schema`),
    tell whether it is still open (:meth:`_alive`), cancel what runs on it
    (:meth:`_cancel`) and run one ``executemany`` (:meth:`_executemany`); the
    statements, the transaction shape and the quarantine are this class's."""

    url: str
    #: SQL placeholders of the driver for the 12 columns of ``results`` (a tuple of 12 strings)
    _RESULT_PLACEHOLDERS: tuple[str, ...]
    _PH: str  # the driver's placeholder for one value

    def __init__(self, url: str) -> None:
        self.url = url
        self._con: Any = None  # the connection; swapped under ``_lock`` (interrupt() reads it from another thread)
        self._lock = threading.Lock()
        self._results_sql = _RESULTS_UPSERT.format(values=",".join(self._RESULT_PLACEHOLDERS))
        self._quarantine_sql = _QUARANTINE_UPSERT.format(columns=_Q_COLUMNS, values=",".join([self._PH] * 12))
        self._in_results_sql = f"SELECT idem_key FROM results WHERE item_id = {self._PH}"

    def connect(self) -> None:
        """(Re)connect if not connected and create the schema. Raises the driver's error.
        A new connection becomes the connection only once its schema is made (closed
        again when that fails)."""
        if self._con is not None and self._alive(self._con):
            return
        con = self._open()
        try:
            self._init_schema(con)
        except BaseException:
            con.close()
            raise
        with self._lock:
            self._con = con

    def interrupt(self) -> None:
        """Abort a statement running on the DB thread (call from any thread)."""
        with self._lock:
            con = self._con
        if con is not None and self._alive(con):
            self._cancel(con)

    def reset(self) -> None:
        """Drop the connection after an error (the next call reconnects)."""
        with self._lock:
            con, self._con = self._con, None
        if con is not None:
            con.close()

    def close(self) -> None:
        self.reset()

    # --- per driver ---
    @abc.abstractmethod
    def _open(self) -> Any:
        """A new connection (no schema yet). Raises the driver's error."""

    @abc.abstractmethod
    def _init_schema(self, con: Any) -> None:
        """Create the tables on ``con`` if they are not there."""

    def _alive(self, con: Any) -> bool:
        """Is ``con`` still usable (not closed)?"""
        return True

    @abc.abstractmethod
    def _cancel(self, con: Any) -> None:
        """Abort the statement running on ``con`` (from another thread; nothing running is fine)."""

    @abc.abstractmethod
    def _executemany(self, sql: str, params: Sequence[Sequence[Any]]) -> int:
        """Run ``sql`` once per parameter tuple (inside a transaction); the rows written."""

    def _result_params(self, rows: Sequence[ResultRow]) -> Sequence[Sequence[Any]]:
        """``rows`` as the driver binds them (the rows themselves: they are tuples in column order)."""
        return rows

    @staticmethod
    @abc.abstractmethod
    def driver_errors() -> tuple[type[BaseException], ...]:
        """Exception types that mean "the database failed" (retry after backoff)."""

    def is_data_error(self, exc: BaseException) -> bool:
        """True when ``exc`` (one of :meth:`driver_errors`) means "the database refused
        this row's data" (a constraint, a trigger, a value the column cannot hold),
        which retrying cannot fix, unlike an outage. The base class never says so
        (a database without a quarantine retries every error)."""
        return False

    # --- one transaction, savepoints (per driver), the two inserts ---
    @abc.abstractmethod
    def _transaction(self) -> contextlib.AbstractContextManager[None]:
        """Connect if needed; commit on success, roll back and re-raise on error."""

    @abc.abstractmethod
    def _savepoint(self) -> contextlib.AbstractContextManager[None]:
        """Inside :meth:`_transaction`: on error roll back to here and re-raise."""

    def _insert_results(self, rows: Sequence[ResultRow]) -> None:
        """Upsert ``rows`` into ``results`` (inside a transaction): ONE executemany."""
        _check_all_written(self._executemany(self._results_sql, self._result_params(rows)), len(rows))

    def _in_results(self, row: ResultRow) -> bool:
        """Is ``row``'s result already in ``results``: its item id, with its idempotency key
        (inside a transaction)?"""
        stored = self._con.execute(self._in_results_sql, (row[0],)).fetchone()  # the key compared here: it may
        return stored is not None and stored[0] == row[1]  # be text the database cannot even take as a parameter

    def _insert_quarantine(self, refused: Sequence[tuple[ResultRow, str]], *, ascii_only: bool) -> None:
        """Upsert ``(row, error)`` pairs into ``results_quarantine`` (inside a transaction);
        ``ascii_only``: text columns escaped to ASCII (the last resort, see :meth:`land`)."""
        _check_all_written(self._executemany(self._quarantine_sql, [_q_values(r, e, ascii_only) for r, e in refused]),
                           len(refused))

    def land(self, rows: Sequence[ResultRow]) -> list[tuple[ResultRow, str]]:
        """Write ``rows`` in ONE transaction and return the ``(row, error)`` pairs quarantined.

        When the database refuses the batch for a data reason (:meth:`is_data_error`),
        savepoints halve it until each refused row stands alone; every other row is
        written and each refused row goes to ``results_quarantine`` with the
        database's error, all in the same transaction (one commit, nothing counted
        twice). If the quarantine insert is refused too, it is retried with its text
        columns escaped to ASCII. Any other error (an outage) rolls everything back
        and propagates: the caller retries the batch.

        Rows go in ``idem_key`` order: idempotency keys are digests, so in arrival order
        each row touches a random leaf of ``results_idem_key_idx``; in key order the
        B-tree is walked once, left to right (SQLite, 20,000 rows of 2 KiB: 15 % fewer
        pages written, a third fewer read, -10 % CPU per row).

        The whole batch is tried first in a transaction of its own, without a savepoint
        (the common case): under a savepoint SQLite copies every page the batch changes
        into a statement journal first (a temporary file past 64 KiB: one more 4 KiB
        write per page, ~30 % of all writes). Only when that is refused for a data
        reason is it rolled back and the batch written again, with savepoints, as above."""
        rows = sorted(rows, key=_IDEM_KEY)
        try:
            with self._transaction():
                self._insert_results(rows)
            return []
        except self.driver_errors() as exc:
            if not self.is_data_error(exc):
                raise
            refused_as_a_whole = exc  # rolled back: nothing of the batch is written
        with self._transaction():
            refused = self._isolate(list(rows), refused_as_a_whole)
            if refused and self._try(lambda: self._insert_quarantine(refused, ascii_only=False)):
                self._insert_quarantine(refused, ascii_only=True)
        return refused

    def _isolate(self, rows: list[ResultRow], exc: BaseException) -> list[tuple[ResultRow, str]]:
        """Insert what the database takes of ``rows`` (refused as a whole with ``exc``);
        return the rows it refuses alone, with their errors."""
        if len(rows) == 1:
            if self._in_results(rows[0]):
                # a redelivery of a result that landed before: only its deliveries count was
                # refused (e.g. an append-only rule on results); it is stored, not refused
                return []
            return [(rows[0], describe_error(exc)[:ERROR_MAX_CHARS])]
        refused: list[tuple[ResultRow, str]] = []
        mid = len(rows) // 2
        for half in (rows[:mid], rows[mid:]):
            sub = self._try(functools.partial(self._insert_results, half))
            if sub is not None:
                refused += self._isolate(half, sub)
        return refused

    def _try(self, insert: Callable[[], None]) -> BaseException | None:
        """Run ``insert`` under a savepoint: None if it went in, the data error that
        refused it (rolled back to the savepoint) otherwise. An outage propagates."""
        try:
            with self._savepoint():
                insert()
        except self.driver_errors() as exc:
            if not self.is_data_error(exc):
                raise
            return exc
        return None


class RowsIgnored(Exception):
    """The database skipped rows of an insert without an error (a trigger that returns
    NULL, SQLite's ``RAISE(IGNORE)``): they did not land, so they are refused rows."""


def _check_all_written(rowcount: int, expected: int) -> None:
    if rowcount != expected:
        raise RowsIgnored(f"the database skipped {expected - rowcount} of {expected} row(s) without an error "
                          "(a trigger returning NULL or RAISE(IGNORE))")


def describe_error(exc: BaseException) -> str:
    """``"TypeName: message"`` of a database error (for logs, ACKs and the quarantine)."""
    return f"{type(exc).__name__}: {exc}".strip()


#: The longest database error kept with a quarantined row (the ACK carries 200 chars of it).
ERROR_MAX_CHARS = 1000


def _ascii(text: str) -> str:
    """``text`` with every non-ASCII and control character backslash-escaped."""
    return text.encode("unicode_escape").decode("ascii")


#: ``results`` as this version creates it in SQLite: the result is stored once (``result``);
#: ``result_text`` is a VIRTUAL generated column (computed when read, from ``result`` and the
#: ``result_is_text`` flag the service sets), so a row holds its result once instead of twice
#: (a 1 KiB text result: ~1.4 KiB per row instead of ~2.3 KiB, i.e. two rows per 4 KiB page
#: instead of one). Needs SQLite >= 3.31 (generated columns); an older library creates
#: :data:`_SQLITE_RESULTS_V1`.
_SQLITE_RESULTS_V2 = """
CREATE TABLE IF NOT EXISTS results (
    item_id TEXT PRIMARY KEY,
    idem_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    params TEXT NOT NULL,
    result BLOB NOT NULL,
    result_sha256 TEXT NOT NULL,
    result_text TEXT GENERATED ALWAYS AS (CASE WHEN result_is_text THEN CAST(result AS TEXT) END) VIRTUAL,
    attempt INTEGER NOT NULL,
    handler TEXT NOT NULL,
    handler_version TEXT NOT NULL,
    completed_ts REAL NOT NULL,
    landed_ts REAL NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1,
    result_is_text INTEGER NOT NULL DEFAULT 0
);
"""
#: ``results`` as versions before 2026-12 created it in SQLite (``result_text`` stored). Such a
#: database is opened and written as it is (no migration: :meth:`SqliteResults._init_schema`
#: picks the upsert that fits the table it finds).
_SQLITE_RESULTS_V1 = """
CREATE TABLE IF NOT EXISTS results (
    item_id TEXT PRIMARY KEY,
    idem_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    params TEXT NOT NULL,
    result BLOB NOT NULL,
    result_sha256 TEXT NOT NULL,
    result_text TEXT,
    attempt INTEGER NOT NULL,
    handler TEXT NOT NULL,
    handler_version TEXT NOT NULL,
    completed_ts REAL NOT NULL,
    landed_ts REAL NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1
);
"""
#: the rest of the SQLite schema (both versions)
_SQLITE_SCHEMA = """
CREATE INDEX IF NOT EXISTS results_idem_key_idx ON results(idem_key);
CREATE TABLE IF NOT EXISTS results_quarantine (
    item_id TEXT PRIMARY KEY,
    idem_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    params TEXT NOT NULL,
    result BLOB NOT NULL,
    result_sha256 TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    handler TEXT NOT NULL,
    handler_version TEXT NOT NULL,
    completed_ts REAL NOT NULL,
    landed_ts REAL NOT NULL,
    error TEXT NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1
);
"""
#: the upsert into a :data:`_SQLITE_RESULTS_V2` table: the row tuple binds as it is (``?7``,
#: the result's text or NULL, sets only the flag ``result_is_text``)
_SQLITE_RESULTS_V2_UPSERT = (
    "INSERT INTO results (item_id, idem_key, kind, params, result, result_sha256, result_is_text, attempt, handler, "
    "handler_version, completed_ts, landed_ts, deliveries) VALUES (?1,?2,?3,?4,?5,?6,?7 IS NOT NULL,?8,?9,?10,?11,?12,1) "
    + _ON_CONFLICT)
#: SQLite generated columns (3.31.0, 2020-01-22)
_SQLITE_HAS_GENERATED_COLUMNS = sqlite3.sqlite_version_info >= (3, 31, 0)
_Q_COLUMNS = (
    "item_id, idem_key, kind, params, result, result_sha256, attempt, handler, handler_version, completed_ts, "
    "landed_ts, error"
)


def _q_values(row: ResultRow, error: str, ascii_only: bool) -> tuple:
    (item_id, idem_key, kind, params_json, result, result_sha256, _text, attempt, handler, handler_version,
     completed_ts, landed_ts) = row
    text = _ascii if ascii_only else (lambda t: t)
    return (
        item_id, text(idem_key), text(kind), text(params_json), result, result_sha256,
        attempt, text(handler), text(handler_version), completed_ts, landed_ts,
        _ascii(error) if ascii_only else error.replace("\0", ""),
    )


class SqliteResults(ResultsDB):
    """``sqlite:///PATH``: WAL mode, ``synchronous=FULL`` (a commit is on disk)."""

    _PH = "?"
    _RESULT_PLACEHOLDERS = ("?",) * 12

    def __init__(self, path: Path, *, busy_timeout_s: float = 5.0) -> None:
        super().__init__(f"sqlite:///{path}")
        self._results_v1_sql = self._results_sql  # set per connection by _init_schema
        self.path = path
        self.busy_timeout_s = busy_timeout_s

    @staticmethod
    def driver_errors() -> tuple[type[BaseException], ...]:
        return (sqlite3.Error, OSError, RowsIgnored)

    def is_data_error(self, exc: BaseException) -> bool:
        # constraint / trigger RAISE(ABORT|FAIL|IGNORE) refusals, and values SQLite cannot hold
        return isinstance(exc, (sqlite3.IntegrityError, sqlite3.DataError, RowsIgnored))

    def _open(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)

    def _init_schema(self, con: sqlite3.Connection) -> None:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=FULL")
        # CAST(result AS TEXT) reads the bytes in the database's text encoding: UTF-8 only
        once = _SQLITE_HAS_GENERATED_COLUMNS and con.execute("PRAGMA encoding").fetchone()[0] == "UTF-8"
        # one transaction: a reader (or a crash) sees the whole schema or none of it, never
        # ``results`` without ``results_quarantine``
        con.executescript("BEGIN;\n" + (_SQLITE_RESULTS_V2 if once else _SQLITE_RESULTS_V1) + _SQLITE_SCHEMA + "\nCOMMIT;")
        self._results_sql = _SQLITE_RESULTS_V2_UPSERT if self.schema_version(con) == 2 else self._results_v1_sql

    @staticmethod
    def schema_version(con: sqlite3.Connection) -> int:
        """2 when ``results`` on ``con`` stores its result once (``result_text`` generated:
        :data:`_SQLITE_RESULTS_V2`), 1 when it stores ``result_text`` too (a database made
        before 2026-12, or by a SQLite older than 3.31)."""
        hidden = {name: h for _cid, name, _type, _nn, _dflt, _pk, h in con.execute("PRAGMA table_xinfo(results)")}
        return 2 if hidden.get("result_text") in (2, 3) and "result_is_text" in hidden else 1

    def _cancel(self, con: sqlite3.Connection) -> None:
        try:
            con.interrupt()
        except sqlite3.ProgrammingError:
            pass  # closed meanwhile (reset): nothing runs on it any more

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self.connect()
        con = self._con
        assert con is not None
        con.execute("BEGIN IMMEDIATE")
        try:
            yield
            con.execute("COMMIT")
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _savepoint(self) -> Iterator[None]:
        con = self._con
        assert con is not None
        con.execute("SAVEPOINT ccsq_land")
        try:
            yield
        except BaseException as exc:
            if not con.in_transaction:
                # a trigger's RAISE(ROLLBACK) ended the whole transaction: nothing may run
                # after it (each statement would commit on its own), so this is no longer
                # one refused row but a failed batch: an outage, retried from scratch
                raise sqlite3.OperationalError(f"the database rolled the whole transaction back: {exc}") from exc
            con.execute("ROLLBACK TO ccsq_land")
            con.execute("RELEASE ccsq_land")
            raise
        con.execute("RELEASE ccsq_land")

    def _executemany(self, sql: str, params: Sequence[Sequence[Any]]) -> int:
        return self._con.executemany(sql, params).rowcount


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    item_id TEXT PRIMARY KEY,
    idem_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    params JSONB NOT NULL,
    result BYTEA NOT NULL,
    result_sha256 TEXT NOT NULL,
    result_text TEXT,
    attempt INTEGER NOT NULL,
    handler TEXT NOT NULL,
    handler_version TEXT NOT NULL,
    completed_ts DOUBLE PRECISION NOT NULL,
    landed_ts DOUBLE PRECISION NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS results_idem_key_idx ON results(idem_key);
CREATE TABLE IF NOT EXISTS results_quarantine (
    item_id TEXT PRIMARY KEY,
    idem_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    params TEXT NOT NULL,
    result BYTEA NOT NULL,
    result_sha256 TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    handler TEXT NOT NULL,
    handler_version TEXT NOT NULL,
    completed_ts DOUBLE PRECISION NOT NULL,
    landed_ts DOUBLE PRECISION NOT NULL,
    error TEXT NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1
);
"""
_PG_SCHEMA_LOCK = 0x63637371  # "ccsq": serializes concurrent first starts
#: SQLSTATEs (prefixes) that mean "this row's data was refused" (quarantine, gap G12):
#: class 22 data exception, class 23 integrity constraint violation, 54000 program
#: limit exceeded (a value too large for an index or row), P0001 / P0004 a trigger's
#: RAISE EXCEPTION / ASSERT. Everything else is an outage (retried).
PG_DATA_SQLSTATES = ("22", "23", "54000", "P0001", "P0004")


class PostgresResults(ResultsDB):
    """``postgresql://...``: psycopg 3, one connection, one transaction per batch."""

    _PH = "%s"
    _RESULT_PLACEHOLDERS = ("%s", "%s", "%s", "%s::jsonb") + ("%s",) * 8  # params is JSONB

    def __init__(self, dsn: str, *, connect_timeout_s: float = 5.0) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise ConfigError(f"database {dsn!r}: install the postgres extra (pip install 'ccsq[postgres]'): {exc}") from None
        super().__init__(dsn)
        self._psycopg = psycopg
        self.connect_timeout_s = connect_timeout_s

    @staticmethod
    def driver_errors() -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error, OSError, RowsIgnored)

    def is_data_error(self, exc: BaseException) -> bool:
        return isinstance(exc, RowsIgnored) or (getattr(exc, "sqlstate", None) or "").startswith(PG_DATA_SQLSTATES)

    def _open(self) -> Any:
        # client_encoding UTF8: the server converts to the database encoding and refuses what it
        # cannot hold with SQLSTATE 22P05 (a data error), instead of the driver raising UnicodeEncodeError
        return self._psycopg.connect(self.url, autocommit=False, connect_timeout=max(1, int(self.connect_timeout_s)),
                                     client_encoding="utf8")

    def _init_schema(self, con: Any) -> None:
        with con.transaction():
            con.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
            for stmt in filter(str.strip, _PG_SCHEMA.split(";")):
                con.execute(stmt)

    def _alive(self, con: Any) -> bool:
        return not con.closed

    def _cancel(self, con: Any) -> None:
        try:
            if hasattr(con, "cancel_safe"):
                con.cancel_safe(timeout=5.0)
            else:
                con.cancel()
        except self._psycopg.Error:
            pass  # nothing running, or the server is gone: the write fails by itself

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self.connect()
        with self._con.transaction():
            yield

    def _savepoint(self) -> contextlib.AbstractContextManager[None]:
        return self._con.transaction()  # nested: a SAVEPOINT, rolled back to on error

    def _executemany(self, sql: str, params: Sequence[Sequence[Any]]) -> int:
        with self._con.cursor() as cur:
            cur.executemany(sql, params)
            return cur.rowcount

    def _result_params(self, rows: Sequence[ResultRow]) -> Sequence[Sequence[Any]]:
        # JSONB cannot hold \u0000: keep it as an escaped literal instead of failing the batch forever
        return [r if "\\u0000" not in r[3] else (*r[:3], r[3].replace("\\u0000", "\\\\u0000"), *r[4:]) for r in rows]


def open_results_db(url: str, base_dir: str | Path, *, timeout_s: float = 5.0) -> ResultsDB:
    """Open ``sqlite:///PATH`` (relative to ``base_dir``; ``sqlite:////abs`` for an
    absolute path) or ``postgresql://...`` / ``postgres://...``. ConfigError otherwise.
    ``timeout_s`` bounds waiting for SQLite's lock and for a PostgreSQL connection."""
    if url.startswith("sqlite:///"):
        raw = url[len("sqlite:///"):]
        if not raw:
            raise ConfigError(f"database {url!r}: needs a path, e.g. sqlite:///results.db")
        path = Path(raw)
        if not path.is_absolute():
            path = Path(base_dir).resolve() / path
        if not path.parent.is_dir():
            # a typo must not send acknowledged results to a file nobody reads: the directory
            # is never created here (the database file in it is), like the claim store's root
            raise ConfigError(f"database {url!r}: directory {path.parent} does not exist; create it (the "
                              "completion service creates the database file, never its directory) or fix the path")
        return SqliteResults(path, busy_timeout_s=timeout_s)
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresResults(url, connect_timeout_s=timeout_s)
    raise ConfigError(f"database {url!r}: use sqlite:///PATH or postgresql://user@host/db")
