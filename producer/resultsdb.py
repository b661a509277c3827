"""The completion service's results database: SQLite (default) or PostgreSQL.

One table, ``results`` (documented in ``docs/results-schema.md``), created on
first connect. :meth:`ResultsDB.upsert` writes a whole batch in ONE
transaction with an idempotent upsert keyed by ``item_id``: a row that is
already there keeps its first result and only ``deliveries`` goes up, so a
redelivered result lands once and the redelivery is still counted.

A ``ResultsDB`` is used from one thread (the completion service's DB thread);
only :meth:`ResultsDB.interrupt` may be called from another one.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ccsq.common.errors import ConfigError


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
    def upsert(self, rows: Sequence[ResultRow]) -> None:
        """Write ``rows`` in one transaction (connects first if needed)."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Abort a statement running on the DB thread (call from any thread)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop the connection after an error (the next call reconnects)."""

    def close(self) -> None:
        self.reset()

    @staticmethod
    @abc.abstractmethod
    def driver_errors() -> tuple[type[BaseException], ...]:
        """Exception types that mean "the database failed" (retry after backoff)."""

    @staticmethod
    @abc.abstractmethod
    def data_errors() -> tuple[type[BaseException], ...]:
        """Exception types (a subset of :meth:`driver_errors`) that mean "the database
        refused this data" (a constraint, a trigger, a value the column cannot hold):
        retrying the same row cannot help, unlike an outage."""

    @abc.abstractmethod
    def quarantine(self, refused: Sequence[tuple[ResultRow, str]]) -> None:
        """Write ``(row, error)`` pairs to ``results_quarantine`` in one transaction
        (idempotent upsert by item id, like :meth:`upsert`)."""

    def land(self, rows: Sequence[ResultRow]) -> list[tuple[ResultRow, str]]:
        """Write ``rows``, in one transaction when the database takes them all.

        When it refuses the batch for a data reason (:meth:`data_errors`), the batch
        is halved until each refused row stands alone; every other row is written
        (each half in one transaction) and each refused row goes to
        ``results_quarantine`` with the database's error (gap G12). Returns those
        ``(row, error)`` pairs. Any other error (an outage) propagates, and the caller
        retries the whole batch: a row already written is absorbed by the upsert."""
        try:
            self.upsert(rows)
            return []
        except self.data_errors() as exc:
            refused = self._isolate(list(rows), exc)
        self.quarantine(refused)
        return refused

    def _isolate(self, rows: list[ResultRow], exc: BaseException) -> list[tuple[ResultRow, str]]:
        if len(rows) == 1:
            return [(rows[0], f"{type(exc).__name__}: {exc}".strip()[:1000])]
        refused: list[tuple[ResultRow, str]] = []
        mid = len(rows) // 2
        for half in (rows[:mid], rows[mid:]):
            try:
                self.upsert(half)
            except self.data_errors() as sub:
                refused += self._isolate(half, sub)
        return refused


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


def _q_values(row: ResultRow, error: str) -> tuple:
    return (
        row.item_id, row.idem_key, row.kind, row.params_json, row.result, row.result_sha256, row.attempt,
        row.handler, row.handler_version, row.completed_ts, row.landed_ts, error,
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
        return (sqlite3.Error, OSError)

    @staticmethod
    def data_errors() -> tuple[type[BaseException], ...]:
        return (sqlite3.IntegrityError, sqlite3.DataError)

    def connect(self) -> None:
        if self._con is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=FULL")
            con.executescript(_SQLITE_SCHEMA)
        except BaseException:
            con.close()
            raise
        with self._lock:
            self._con = con

    def upsert(self, rows: Sequence[ResultRow]) -> None:
        self._write(
            f"INSERT INTO results ({_COLUMNS}, deliveries) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,1) "
            "ON CONFLICT(item_id) DO UPDATE SET deliveries = results.deliveries + 1",
            [_values(r) for r in rows],
        )

    def quarantine(self, refused: Sequence[tuple[ResultRow, str]]) -> None:
        self._write(
            f"INSERT INTO results_quarantine ({_Q_COLUMNS}, deliveries) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,1) "
            "ON CONFLICT(item_id) DO UPDATE SET deliveries = results_quarantine.deliveries + 1, error = excluded.error",
            [_q_values(r, e) for r, e in refused],
        )

    def _write(self, sql: str, params: list[tuple]) -> None:
        """One statement over ``params`` in one IMMEDIATE transaction (rolled back on error)."""
        self.connect()
        con = self._con
        assert con is not None
        con.execute("BEGIN IMMEDIATE")
        try:
            con.executemany(sql, params)
            con.execute("COMMIT")
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise

    def interrupt(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.interrupt()

    def reset(self) -> None:
        with self._lock:
            con, self._con = self._con, None
        if con is not None:
            con.close()


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

        return (psycopg.Error, OSError)

    @staticmethod
    def data_errors() -> tuple[type[BaseException], ...]:
        # SQLSTATE classes 22 (data exception) and 23 (integrity constraint violation),
        # 54 (program limit exceeded: a value too large for an index or a row) and P0001
        # (a trigger's RAISE EXCEPTION): about this row, not the server
        from psycopg import errors

        return (errors.DataError, errors.IntegrityError, errors.ProgramLimitExceeded, errors.RaiseException)

    def connect(self) -> None:
        if self._con is not None and not self._con.closed:
            return
        con = self._psycopg.connect(self.url, autocommit=False, connect_timeout=max(1, int(self.connect_timeout_s)))
        try:
            with con.transaction():
                con.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
                for stmt in filter(str.strip, _PG_SCHEMA.split(";")):
                    con.execute(stmt)
        except BaseException:
            con.close()
            raise
        with self._lock:
            self._con = con

    def upsert(self, rows: Sequence[ResultRow]) -> None:
        self.connect()
        con = self._con
        with con.transaction():
            with con.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO results ({_COLUMNS}, deliveries) "
                    "VALUES (%s,%s,%s,%s::jsonb,%s,%s,%s,%s,%s,%s,%s,%s,1) "
                    "ON CONFLICT (item_id) DO UPDATE SET deliveries = results.deliveries + 1",
                    [_pg_values(r) for r in rows],
                )

    def quarantine(self, refused: Sequence[tuple[ResultRow, str]]) -> None:
        self.connect()
        con = self._con
        with con.transaction():
            with con.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO results_quarantine ({_Q_COLUMNS}, deliveries) "
                    "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,1) "
                    "ON CONFLICT (item_id) DO UPDATE SET deliveries = results_quarantine.deliveries + 1, "
                    "error = excluded.error",
                    [_q_values(r, e.replace("\0", "")) for r, e in refused],
                )

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

    def reset(self) -> None:
        with self._lock:
            con, self._con = self._con, None
        if con is not None:
            con.close()


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
