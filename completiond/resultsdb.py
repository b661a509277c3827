"""The completion service's results database: SQLite (default) or PostgreSQL.

Two tables, ``results`` and ``results_quarantine`` (documented in
``docs/results-schema.md``), created on first connect. :meth:`ResultsDB.land`
writes a whole batch in ONE transaction with an idempotent upsert keyed by
``item_id``: a row that is already there keeps its first result and only
``deliveries`` goes up, so a redelivered result lands once and the redelivery
is still counted. Rows the database refuses for a data reason go to
``results_quarantine`` in the same transaction (gap G12).

A ``ResultsDB`` is used from one thread (the completion service's DB thread);
only :meth:`ResultsDB.interrupt` may be called from another one.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import dataclasses
import json
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ccsq.common.wire.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class ResultRow:
    """One result as stored. ``params_json`` is a JSON object (bytes values as
    ``{"$b64": "..."}``); ``result_text`` is the result as UTF-8 text when it
    decodes (and holds no NUL), else None; timestamps are UNIX seconds."""

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


def params_to_json(params: dict[str, Any]) -> str:
    def enc(v: Any) -> Any:
        if isinstance(v, bytes):
            return {"$b64": base64.b64encode(v).decode("ascii")}
        return v

    return json.dumps({k: enc(v) for k, v in params.items()}, sort_keys=True, separators=(",", ":"))


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


def _values(row: ResultRow) -> tuple:
    return (
        row.item_id, row.idem_key, row.kind, row.params_json, row.result, row.result_sha256, row.result_text,
        row.attempt, row.handler, row.handler_version, row.completed_ts, row.landed_ts,
    )


class ResultsDB(abc.ABC):
    """A results database connection that can be dropped and re-made."""

    url: str

    @abc.abstractmethod
    def connect(self) -> None:
        """(Re)connect if not connected and create the schema. Raises the driver's error."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Abort a statement running on the DB thread (call from any thread)."""

    def reset(self) -> None:
        """Drop the connection after an error (the next call reconnects)."""
        with self._lock:
            con, self._con = self._con, None
        if con is not None:
            con.close()

    def _adopt(self, con: Any, init: Callable[[Any], None]) -> None:
        """Run ``init(con)`` (the schema) on a new connection; close it and re-raise when
        that fails, else make it the connection (under the lock: :meth:`interrupt` reads
        it from another thread). Subclasses set ``_con`` (None) and ``_lock``."""
        try:
            init(con)
        except BaseException:
            con.close()
            raise
        with self._lock:
            self._con = con

    def close(self) -> None:
        self.reset()

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

    # --- one transaction, savepoints, the two inserts (per driver) ---
    @abc.abstractmethod
    def _transaction(self) -> contextlib.AbstractContextManager[None]:
        """Connect if needed; commit on success, roll back and re-raise on error."""

    @abc.abstractmethod
    def _savepoint(self) -> contextlib.AbstractContextManager[None]:
        """Inside :meth:`_transaction`: on error roll back to here and re-raise."""

    @abc.abstractmethod
    def _insert_results(self, rows: Sequence[ResultRow]) -> None:
        """Upsert ``rows`` into ``results`` (inside a transaction)."""

    @abc.abstractmethod
    def _in_results(self, item_id: str) -> bool:
        """Is ``item_id`` already in ``results`` (inside a transaction)?"""

    @abc.abstractmethod
    def _insert_quarantine(self, refused: Sequence[tuple[ResultRow, str]], *, ascii_only: bool) -> None:
        """Upsert ``(row, error)`` pairs into ``results_quarantine`` (inside a transaction);
        ``ascii_only``: text columns escaped to ASCII (the last resort, see :meth:`land`)."""

    def upsert(self, rows: Sequence[ResultRow]) -> None:
        """Write ``rows`` in one transaction; any error propagates (nothing written)."""
        with self._transaction():
            self._insert_results(rows)

    def land(self, rows: Sequence[ResultRow]) -> list[tuple[ResultRow, str]]:
        """Write ``rows`` in ONE transaction and return the ``(row, error)`` pairs quarantined.

        When the database refuses the batch for a data reason (:meth:`is_data_error`),
        savepoints halve it until each refused row stands alone; every other row is
        written and each refused row goes to ``results_quarantine`` with the
        database's error, all in the same transaction (one commit, nothing counted
        twice). If the quarantine insert is refused too, it is retried with its text
        columns escaped to ASCII. Any other error (an outage) rolls everything back
        and propagates: the caller retries the batch."""
        with self._transaction():
            refused_as_a_whole = self._try(lambda: self._insert_results(rows))
            refused = self._isolate(list(rows), refused_as_a_whole) if refused_as_a_whole else []
            if refused and self._try(lambda: self._insert_quarantine(refused, ascii_only=False)):
                self._insert_quarantine(refused, ascii_only=True)
        return refused

    def _isolate(self, rows: list[ResultRow], exc: BaseException) -> list[tuple[ResultRow, str]]:
        """Insert what the database takes of ``rows`` (refused as a whole with ``exc``);
        return the rows it refuses alone, with their errors."""
        if len(rows) == 1:
            if self._in_results(rows[0].item_id):
                # a redelivery of a result that landed before: only its deliveries count was
                # refused (e.g. an append-only rule on results); it is stored, not refused
                return []
            return [(rows[0], describe_error(exc)[:ERROR_MAX_CHARS])]
        refused: list[tuple[ResultRow, str]] = []
        mid = len(rows) // 2
        for half in (rows[:mid], rows[mid:]):
            sub = self._try(lambda h=half: self._insert_results(h))
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


_SQLITE_SCHEMA = """
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
_Q_COLUMNS = (
    "item_id, idem_key, kind, params, result, result_sha256, attempt, handler, handler_version, completed_ts, "
    "landed_ts, error"
)


def _q_values(row: ResultRow, error: str, ascii_only: bool) -> tuple:
    text = _ascii if ascii_only else (lambda t: t)
    return (
        row.item_id, text(row.idem_key), text(row.kind), text(row.params_json), row.result, row.result_sha256,
        row.attempt, text(row.handler), text(row.handler_version), row.completed_ts, row.landed_ts,
        _ascii(error) if ascii_only else error.replace("\0", ""),
    )


class SqliteResults(ResultsDB):
    """``sqlite:///PATH``: WAL mode, ``synchronous=FULL`` (a commit is on disk)."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 5.0) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self.busy_timeout_s = busy_timeout_s
        self._con: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @staticmethod
    def driver_errors() -> tuple[type[BaseException], ...]:
        return (sqlite3.Error, OSError, RowsIgnored)

    def is_data_error(self, exc: BaseException) -> bool:
        # constraint / trigger RAISE(ABORT|FAIL|IGNORE) refusals, and values SQLite cannot hold
        return isinstance(exc, (sqlite3.IntegrityError, sqlite3.DataError, RowsIgnored))

    def connect(self) -> None:
        if self._con is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)

        def init(con: sqlite3.Connection) -> None:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=FULL")
            con.executescript(_SQLITE_SCHEMA)

        self._adopt(con, init)

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

    def _insert_results(self, rows: Sequence[ResultRow]) -> None:
        cur = self._con.executemany(
            f"INSERT INTO results ({_COLUMNS}, deliveries) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,1) "
            "ON CONFLICT(item_id) DO UPDATE SET deliveries = results.deliveries + 1",
            [_values(r) for r in rows],
        )
        _check_all_written(cur.rowcount, len(rows))

    def _in_results(self, item_id: str) -> bool:
        return self._con.execute("SELECT 1 FROM results WHERE item_id = ?", (item_id,)).fetchone() is not None

    def _insert_quarantine(self, refused: Sequence[tuple[ResultRow, str]], *, ascii_only: bool) -> None:
        cur = self._con.executemany(
            f"INSERT INTO results_quarantine ({_Q_COLUMNS}, deliveries) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,1) "
            "ON CONFLICT(item_id) DO UPDATE SET deliveries = results_quarantine.deliveries + 1, error = excluded.error",
            [_q_values(r, e, ascii_only) for r, e in refused],
        )
        _check_all_written(cur.rowcount, len(refused))

    def interrupt(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.interrupt()



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

    def __init__(self, dsn: str, *, connect_timeout_s: float = 5.0) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise ConfigError(f"database {dsn!r}: install the postgres extra (pip install 'ccsq[postgres]'): {exc}") from None
        self._psycopg = psycopg
        self.url = dsn
        self.connect_timeout_s = connect_timeout_s
        self._con: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def driver_errors() -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error, OSError, RowsIgnored)

    def is_data_error(self, exc: BaseException) -> bool:
        return isinstance(exc, RowsIgnored) or (getattr(exc, "sqlstate", None) or "").startswith(PG_DATA_SQLSTATES)

    def connect(self) -> None:
        if self._con is not None and not self._con.closed:
            return
        # client_encoding UTF8: the server converts to the database encoding and refuses what it
        # cannot hold with SQLSTATE 22P05 (a data error), instead of the driver raising UnicodeEncodeError
        con = self._psycopg.connect(self.url, autocommit=False, connect_timeout=max(1, int(self.connect_timeout_s)),
                                    client_encoding="utf8")

        def init(con: Any) -> None:
            with con.transaction():
                con.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
                for stmt in filter(str.strip, _PG_SCHEMA.split(";")):
                    con.execute(stmt)

        self._adopt(con, init)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self.connect()
        with self._con.transaction():
            yield

    def _savepoint(self) -> contextlib.AbstractContextManager[None]:
        return self._con.transaction()  # nested: a SAVEPOINT, rolled back to on error

    def _insert_results(self, rows: Sequence[ResultRow]) -> None:
        with self._con.cursor() as cur:
            cur.executemany(
                f"INSERT INTO results ({_COLUMNS}, deliveries) "
                "VALUES (%s,%s,%s,%s::jsonb,%s,%s,%s,%s,%s,%s,%s,%s,1) "
                "ON CONFLICT (item_id) DO UPDATE SET deliveries = results.deliveries + 1",
                [_pg_values(r) for r in rows],
            )
            _check_all_written(cur.rowcount, len(rows))

    def _in_results(self, item_id: str) -> bool:
        return self._con.execute("SELECT 1 FROM results WHERE item_id = %s", (item_id,)).fetchone() is not None

    def _insert_quarantine(self, refused: Sequence[tuple[ResultRow, str]], *, ascii_only: bool) -> None:
        with self._con.cursor() as cur:
            cur.executemany(
                f"INSERT INTO results_quarantine ({_Q_COLUMNS}, deliveries) "
                "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,1) "
                "ON CONFLICT (item_id) DO UPDATE SET deliveries = results_quarantine.deliveries + 1, "
                "error = excluded.error",
                [_q_values(r, e, ascii_only) for r, e in refused],
            )
            _check_all_written(cur.rowcount, len(refused))

    def interrupt(self) -> None:
        with self._lock:
            con = self._con
        if con is not None and not con.closed:
            try:
                if hasattr(con, "cancel_safe"):
                    con.cancel_safe(timeout=5.0)
                else:
                    con.cancel()
            except self._psycopg.Error:
                pass  # nothing running, or the server is gone: the write fails by itself



def _pg_values(row: ResultRow) -> tuple:
    # JSONB cannot hold \u0000: keep it as an escaped literal instead of failing the batch forever
    params = row.params_json.replace("\\u0000", "\\\\u0000")
    v = list(_values(row))
    v[3] = params
    return tuple(v)


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
        return SqliteResults(path, busy_timeout_s=timeout_s)
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresResults(url, connect_timeout_s=timeout_s)
    raise ConfigError(f"database {url!r}: use sqlite:///PATH or postgresql://user@host/db")
