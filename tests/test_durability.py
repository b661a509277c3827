"""A commit is on disk before it is reported: the broker's LMDB ledger and every SQLite
store (worker journal, relay journal, producer outbox, completion results database).

A SIGKILL keeps the page cache, so no crash test sees a store opened without its
syncs (LMDB ``sync=False``/``metasync=False``, SQLite ``synchronous=NORMAL``): only a
power loss would lose those commits. Two kinds of check close that blind spot:

* the flags, read back through the daemons' own open functions (LMDB's environment
  flags; ``PRAGMA synchronous`` / ``journal_mode`` on each SQLite connection);
* the behaviour, under ``strace``: a real writer process commits through the product
  code and reports each commit on stdout; every byte it wrote to a store file before
  a report must have been written through an ``O_DSYNC``/``O_SYNC`` descriptor or
  followed by an ``fsync``/``fdatasync`` of that file before the report. That is what a
  power loss tests (unsynced page-cache writes are what it loses);
* a power loss: a writer process killed mid-commit, then every write it had not made
  durable undone (tests/powerloss.py, an LD_PRELOAD write log); the store, opened again
  by the product code, must hold every commit reported. (Dropping the real page cache
  would need a block device under the test's control, dm-flakey / dm-log-writes, which
  the test machines do not offer; the undo log models the same loss, worst case.)
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ccsq.brokerd.ledger.store import Ledger, Policy
from ccsq.common.wire import protocol

SQLITE_FULL = 2  # PRAGMA synchronous: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA


def _blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def _ledger(path: Path) -> Ledger:
    return Ledger(path, map_size_bytes=1 << 20, max_map_size_bytes=8 << 20, policy=Policy())


# --- the stores, opened through the daemons' own open functions ------------------------------
def _open_journal(d: Path):
    from ccsq.workerd.worker_journal import Journal

    j = Journal.open(d)
    return j, j._db, j.close


def _open_relay_journal(d: Path):
    from ccsq.relayd.relay_journal import RelayJournal

    j = RelayJournal.open(d)
    return j, j._db, j.close


def _open_outbox(d: Path):
    from ccsq.producer.outbox import Outbox

    ob = Outbox(d)
    return ob, ob._db, ob.close


def _open_results(d: Path):
    from ccsq.completiond.resultsdb import open_results_db

    db = open_results_db("sqlite:///results.db", d)
    db.connect()
    return db, db._con, db.close


SQLITE_STORES = {"worker_journal": _open_journal, "relay_journal": _open_relay_journal, "producer_outbox": _open_outbox,
                 "completion_results": _open_results}


def test_the_ledger_environment_is_opened_durable(tmp_path):
    """The broker's ledger: every commit fsyncs its pages (``sync``) and writes its meta
    page durably (``metasync``); no asynchronous or write-mapped flushing."""
    led = _ledger(tmp_path / "l")
    try:
        flags = led.env.flags()
    finally:
        led.close()
    assert (flags["sync"], flags["metasync"], flags["map_async"], flags["writemap"]) == (True, True, False, False), flags


@pytest.mark.parametrize("store", sorted(SQLITE_STORES))
def test_every_sqlite_store_runs_with_synchronous_full(tmp_path, store):
    """Each SQLite connection a daemon writes through runs in WAL mode with
    ``synchronous=FULL`` (WAL with NORMAL loses the last commits on a power loss)."""
    obj, con, close = SQLITE_STORES[store](tmp_path / store if store != "completion_results" else tmp_path)
    try:
        if store == "producer_outbox":  # the outbox's connection belongs to its thread
            sync, mode = obj._exec.submit(lambda: (con.execute("PRAGMA synchronous").fetchone()[0],
                                                   con.execute("PRAGMA journal_mode").fetchone()[0])).result()
        else:
            sync, mode = con.execute("PRAGMA synchronous").fetchone()[0], con.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        close()
    assert (sync, mode.lower()) == (SQLITE_FULL, "wal"), (store, sync, mode)


# --- the behaviour: syncs before each reported commit, seen by strace -------------------------
COMMITS = 4
MARK = b"COMMITTED"


def _mark(n: int) -> None:
    os.write(1, MARK + b" %d\n" % n)


def write_commits(store: str, directory: str, commits: int = COMMITS) -> None:
    """Run in the traced subprocess: ``commits`` commits through the product code, each
    reported on stdout once the call that commits it returned."""
    d = Path(directory)
    if store == "ledger":
        led = _ledger(d / "ledger")
        for n in range(commits):
            txn = led.begin()
            txn.submit(protocol.SubmitItem(f"k{n}", "echo", _blob(b"x" * 100)), 1_000 + n)
            txn.commit()
            _mark(n)
        led.close()
    elif store == "worker_journal":
        j, _, close = _open_journal(d / store)
        for n in range(commits):
            j.hold([(f"item-{n}", n + 1, "echo")])
            _mark(n)
        close()
    elif store == "producer_outbox":
        ob, _, close = _open_outbox(d / store)
        for n in range(commits):
            asyncio.run(ob.add([protocol.SubmitItem(f"k{n}", "echo", _blob(b"x" * 100))]))
            _mark(n)
        close()
    elif store == "completion_results":
        db, _, close = _open_results(d)
        for n in range(commits):
            db.land([(f"item-{n}", f"key-{n}", "echo", "{}", b"r", hashlib.sha256(b"r").hexdigest(), "r", 1, "echo", "1",
                      time.time(), time.time())])
            _mark(n)
        close()
    else:
        raise ValueError(store)


_LINE = re.compile(r"^(\d+\.\d+) (\w+)\((.*)\) += (-?\d+)(?:<([^>]*)>)?")
_FD = re.compile(r"^(\d+)<([^>]*)>")
_WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2"}
_SYNCS = {"fsync", "fdatasync"}


def unsynced_at_commits(trace_prefix: Path, store_dir: Path) -> tuple[int, list[tuple[int, list[str]]]]:
    """Read the per-thread traces ``<prefix>.<tid>`` in time order; return (commits seen,
    [(commit, store files written and not yet synced when it was reported)])."""
    events = []
    for f in trace_prefix.parent.glob(trace_prefix.name + ".*"):
        for line in f.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m:
                events.append((float(m.group(1)), m.group(2), m.group(3), int(m.group(4)), m.group(5)))
    events.sort(key=lambda e: e[0])
    root = str(store_dir.resolve())
    sync_fd: dict[int, bool] = {}
    dirty: set[str] = set()
    commits, bad = 0, []
    for _ts, name, args, ret, ret_path in events:
        if name in ("openat", "open", "creat") and ret >= 0:
            sync_fd[ret] = "O_DSYNC" in args or "O_SYNC" in args
            continue
        m = _FD.match(args)
        if not m:
            continue
        fd, path = int(m.group(1)), m.group(2)
        if name in _WRITES:
            if fd == 1 and MARK.decode() in args:
                commits += 1
                if dirty:
                    bad.append((commits, sorted(dirty)))
            elif path.startswith(root) and not sync_fd.get(fd, False) and _durable(path):
                dirty.add(path)
        elif name in _SYNCS:
            dirty.discard(path)
    return commits, bad


def _durable(path: str) -> bool:
    """A file holding committed data (not a lock file, not SQLite's shared-memory index)."""
    name = os.path.basename(path)
    return not (name.endswith("-shm") or name in ("lock.mdb", "LOCK"))


@pytest.mark.parametrize("store", ["ledger", "worker_journal", "producer_outbox", "completion_results"])
def test_each_commit_is_synced_before_it_is_reported(tmp_path, store):
    """Under strace, a real writer process commits COMMITS times through the product code;
    when each commit is reported, nothing it wrote to its store is still only in the page
    cache (written without O_DSYNC and not fsynced since): a power loss keeps it."""
    strace = shutil.which("strace")
    if strace is None:
        if os.environ.get("CI"):
            pytest.fail("strace is missing (.ci/run installs it)")
        pytest.skip("strace is not installed")
    data = tmp_path / "data"
    data.mkdir()
    prefix = tmp_path / "trace"
    code = f"from tests.test_durability import write_commits; write_commits({store!r}, {str(data)!r})"
    proc = subprocess.run(
        [strace, "-f", "-ff", "-ttt", "-y", "-s", "64", "-o", str(prefix),
         "-e", "trace=openat,open,creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync",
         sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    assert proc.stdout.count(MARK) == COMMITS
    commits, bad = unsynced_at_commits(prefix, data)
    assert commits == COMMITS, f"saw {commits} commit reports in the trace"
    assert bad == [], f"{store}: commits reported with writes still unsynced: {bad}"


# --- a power loss: the writer killed, every write it had not made durable lost ---------------
def committed_count(store: str, directory: Path) -> int:
    """How many commits of :func:`write_commits` the store holds, opened by the product code."""
    if store == "ledger":
        led = _ledger(directory / "ledger")
        try:
            with led.read() as v:
                assert v.balanced(), (v.counters(), v.states())
                return v.counter("received")
        finally:
            led.close()
    if store == "worker_journal":
        j, _, close = _open_journal(directory / store)
        try:
            return len(j.entries())
        finally:
            close()
    if store == "producer_outbox":
        ob, _, close = _open_outbox(directory / store)
        try:
            return asyncio.run(ob.count())
        finally:
            close()
    db, con, close = _open_results(directory)
    try:
        return con.execute("SELECT count(*) FROM results").fetchone()[0]
    finally:
        close()


POWER_LOSS_AFTER = 6  # commits reported before the power goes (the writer is then in its next one)


@pytest.mark.parametrize("store", ["ledger", "worker_journal", "producer_outbox", "completion_results"])
def test_every_reported_commit_survives_a_power_loss(tmp_path, store):
    """A real writer process commits through the product code (every write logged by
    tests/powerloss_preload.c); after it reported POWER_LOSS_AFTER commits it is
    SIGKILLed mid-commit, every write it had not fsynced (nor written O_DSYNC) is undone
    (tests/powerloss.py), and the store, opened again by the product code, holds every
    reported commit."""
    from tests import powerloss

    lib = powerloss.build(tmp_path)
    if lib is None:
        if os.environ.get("CI"):
            pytest.fail("no C compiler (.ci/run installs gcc)")
        pytest.skip("no C compiler")
    data = tmp_path / "data"
    data.mkdir()
    log = tmp_path / "writes.log"
    code = f"from tests.test_durability import write_commits; write_commits({store!r}, {str(data)!r}, 10_000)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **powerloss.env(lib, log, data)})
    try:
        reported = 0
        while reported < POWER_LOSS_AFTER:
            line = proc.stdout.readline()
            assert line, proc.stderr.read().decode(errors="replace")[-3000:]
            reported += line.startswith(MARK)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    undone = powerloss.lose_unsynced(log, data)
    assert committed_count(store, data) >= POWER_LOSS_AFTER, f"{store}: undone {undone}"
