"""The producer's local outbox: a durable spool of SUBMIT items for when the broker is away.

SQLite in WAL mode with ``synchronous=FULL``: :meth:`Outbox.add` returns only
after the spooled items are on disk. Items keep their order (``seq``); an item
is removed only after the broker's SUBMIT_ACK for it (:meth:`Outbox.remove`),
so a crash at any point re-sends it, and the broker's key dedup makes that a
no-op. Items the broker refuses for good move to the ``rejected`` table, never
silently dropped.

The outbox owns its SQLite connection; every call runs on one private thread
(``async`` methods) so the caller's event loop never waits on an fsync.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import msgpack

from ccsq.common.wire import protocol

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    item BLOB NOT NULL,          -- msgpack of the SubmitItem body
    spooled_ts REAL NOT NULL     -- wall clock, for humans
);
CREATE TABLE IF NOT EXISTS rejected (
    key TEXT PRIMARY KEY,
    item BLOB NOT NULL,
    error TEXT NOT NULL,
    message TEXT NOT NULL,
    rejected_ts REAL NOT NULL
);
"""


def _pack(item: protocol.SubmitItem) -> bytes:
    return msgpack.packb(protocol.encode_body(item), use_bin_type=True)


def _unpack(raw: bytes) -> protocol.SubmitItem:
    body = {"req": 0, "items": [msgpack.unpackb(raw, raw=False)]}
    submit = cast(protocol.Submit, protocol.decode_body(protocol.MsgType.SUBMIT, body))  # strict schema check on what we read back
    return submit.items[0]


class Outbox:
    """Durable FIFO of :class:`~ccsq.common.wire.protocol.SubmitItem` keyed by idempotency key.

    ``path`` is the directory; the database is ``path/outbox.sqlite3``.
    """

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._exec = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ccsq-outbox")
        self._db: sqlite3.Connection = self._exec.submit(self._open).result()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.dir / "outbox.sqlite3", isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        return db

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    # --- sync bodies (outbox thread only) ---
    def _add(self, items: Sequence[protocol.SubmitItem]) -> int:
        now = time.time()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            cur = self._db.executemany(
                "INSERT OR IGNORE INTO outbox(key, item, spooled_ts) VALUES (?, ?, ?)",
                [(it.key, _pack(it), now) for it in items],
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return cur.rowcount

    def _peek(self, limit: int) -> list[tuple[int, protocol.SubmitItem]]:
        rows = self._db.execute("SELECT seq, item FROM outbox ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [(seq, _unpack(raw)) for seq, raw in rows]

    def _remove(self, keys: Sequence[str]) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        self._db.executemany("DELETE FROM outbox WHERE key = ?", [(k,) for k in keys])
        self._db.execute("COMMIT")

    def _reject(self, item: protocol.SubmitItem, error: str, message: str) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        self._db.execute(
            "INSERT OR REPLACE INTO rejected(key, item, error, message, rejected_ts) VALUES (?, ?, ?, ?, ?)",
            (item.key, _pack(item), error, message, time.time()),
        )
        self._db.execute("DELETE FROM outbox WHERE key = ?", (item.key,))
        self._db.execute("COMMIT")

    def _count(self) -> int:
        return self._db.execute("SELECT count(*) FROM outbox").fetchone()[0]

    def _rejected(self) -> list[tuple[str, str, str]]:
        return self._db.execute("SELECT key, error, message FROM rejected ORDER BY rejected_ts").fetchall()

    # --- async API (any task on the owner's loop) ---
    async def add(self, items: Sequence[protocol.SubmitItem]) -> int:
        """Spool ``items`` durably (one fsync'd transaction); returns how many were new
        (an item whose key is already spooled is ignored)."""
        return await self._run(self._add, list(items))

    async def peek(self, limit: int) -> list[tuple[int, protocol.SubmitItem]]:
        """The oldest ``limit`` spooled items as ``(seq, item)``, in order."""
        return await self._run(self._peek, limit)

    async def remove(self, keys: Sequence[str]) -> None:
        """Forget items the broker confirmed (call only after SUBMIT_ACK)."""
        await self._run(self._remove, list(keys))

    async def reject(self, item: protocol.SubmitItem, error: str, message: str) -> None:
        """Move an item the broker refused for good to the ``rejected`` table."""
        await self._run(self._reject, item, error, message)

    async def count(self) -> int:
        return await self._run(self._count)

    async def rejected(self) -> list[tuple[str, str, str]]:
        """``(key, error, message)`` of every item the broker refused for good."""
        return await self._run(self._rejected)

    def close(self) -> None:
        self._exec.submit(self._db.close).result()
        self._exec.shutdown(wait=True)
