"""Opening a daemon's local SQLite journal: one writer per directory, every write fsynced.

Used by the worker's journal (:mod:`ccsq.workerd.worker_journal`) and the relay's journal
(:mod:`ccsq.relayd.relay_journal`); what the rows mean stays with each of them.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from ccsq.common.wire.errors import JournalLocked


def open_locked_sqlite(directory: str | Path, filename: str, schema: Iterable[str], in_use: str) -> tuple[Path, sqlite3.Connection, int]:
    """Create ``directory``, take an exclusive ``flock`` on ``<directory>/LOCK`` and open
    ``<directory>/<filename>`` (autocommit, WAL, ``synchronous=FULL``), running each
    statement of ``schema``. Returns ``(db path, connection, lock fd)``; the caller closes
    both. Raises :class:`JournalLocked` with ``in_use`` as its message when another
    process holds the lock."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise JournalLocked(in_use) from None
    path = directory / filename
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    for stmt in schema:
        db.execute(stmt)
    return path, db, lock_fd
