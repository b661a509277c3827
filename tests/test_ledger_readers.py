"""Issue 14: the ledger under dead readers, long readers and a full disk of history.

Real processes throughout: a ``ccsq-brokerd`` subprocess driven by scripted peers
(raw DEALER + codec, so items cycle fast without worker daemons), and real LMDB
reader processes (tests/ledger_reader_farm.py) that open the ledger, begin a read
transaction and are SIGKILLed holding it. See docs/ledger.md, "Readers and disk use".
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import lmdb
import pytest
import tomli_w

from ccsq.brokerd.ledger.maintenance import parse_readers
from ccsq.brokerd.ledger.store import Ledger, ReadersFull, data_paths
from ccsq.brokerd.gap_report import iter_blob_refs, load_report
from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm, wait_for
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import ExitCode, ledger_failure
from ccsq.tools.procs import free_tcp_port

FARM = Path(__file__).resolve().parent / "ledger_reader_farm.py"
PEERS = {"prod": "producer", "w": "worker", "comp": "completion", "adm": "admin", "cli": "admin"}
MIB = 1 << 20
pytestmark = pytest.mark.timeout(180)


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


class Farm:
    """tests/ledger_reader_farm.py as a subprocess: forks reader processes on command."""

    def __init__(self, ledger_dir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(FARM), str(ledger_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def cmd(self, line: str, timeout_s: float = 60.0) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"reader farm did not answer {line!r} within {timeout_s}s"
        return self.proc.stdout.readline().split()

    def open(self, n: int, wait_s: float = 0.0) -> tuple[int, int, list[int]]:
        ans = self.cmd(f"open {n} {wait_s}", timeout_s=wait_s + 60)
        assert ans[0] == "opened", ans
        return int(ans[1]), int(ans[2]), [] if ans[3] == "-" else [int(x) for x in ans[3].split(",")]

    def kill(self) -> int:
        return int(self.cmd("kill")[1])

    def pids(self) -> list[int]:
        ans = self.cmd("pids")
        return [] if ans[1] == "-" else [int(x) for x in ans[1].split(",")]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("quit", timeout_s=0.5)
            except (AssertionError, BrokenPipeError, OSError, IndexError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Swarm:
    """A broker subprocess plus scripted producer, worker, completion and admin peers."""

    def __init__(self, root: Path, **overrides) -> None:
        self.root = root
        self.config = make_swarm(root, PEERS, **{"liveness": 100, **overrides})
        self.broker = BrokerProcess(self.config).start()
        self.ledger_dir = data_paths(root / "broker-data")[0]
        self.peers: list[ScriptedPeer] = []
        self.n = 0
        self.connect()

    def connect(self) -> None:
        ep = self.broker.endpoint
        self.prod, self.w, self.comp, self.adm = (ScriptedPeer(self.root, pid, ep) for pid in ("prod", "w", "comp", "adm"))
        self.peers = [self.prod, self.w, self.comp, self.adm]
        self.prod.hello("producer")
        self.w.hello("worker", slots=1, credit=0, kinds=["echo"])
        self.comp.hello("completion", credit=0)
        self.adm.hello("admin")

    def cycle(self, n: int, batch: int = 250) -> list[str]:
        """Submit ``n`` new items, lease, complete and acknowledge each; returns their ids."""
        ids: list[str] = []
        for start in range(0, n, batch):
            k = min(batch, n - start)
            items = [protocol.SubmitItem(f"i{self.n + j}", "echo", blob(b"x%d" % (self.n + j))) for j in range(k)]
            self.n += k
            res = self.prod.submit(items, timeout_s=30)
            assert all(r.item_id and not r.error for r in res), res[:3]
            ids += [r.item_id for r in res]
            self.w.send(protocol.Credit(k))
            tasks: list[protocol.Task] = []
            while len(tasks) < k:
                tasks += self.w.recv_type(protocol.Dispatch, 30).tasks
            self.w.send(protocol.Complete([protocol.TaskResult(t.item_id, t.token, blob(b"r"), "echo", "1", 0.0) for t in tasks]))
            self.w.recv_type(protocol.CompleteAck, 30)
            self.comp.send(protocol.Credit(k))
            got: list[str] = []
            while len(got) < k:
                got += [d.item_id for d in self.comp.recv_type(protocol.Result, 30).deliveries]
            self.comp.send(protocol.Ack(got))
            self.comp.recv_type(protocol.AckOk, 30)
        return ids

    def status(self) -> dict:
        self.adm.connect()  # a fresh session: the last one may have been silent past the liveness window
        self.adm.hello("admin")
        return self.adm.admin_status(timeout_s=30)

    def file_bytes(self) -> int:
        return (self.ledger_dir / "data.mdb").stat().st_size

    def close(self) -> None:
        for sp in self.peers:
            sp.close()
        self.broker.kill()


@pytest.fixture
def farms():
    made: list[Farm] = []
    yield made
    for f in made:
        f.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ccsq.tools.cli", *args], capture_output=True, text=True, timeout=60)


def _admin_toml(sw: Swarm) -> Path:
    path = sw.root / "admin.toml"
    path.write_text(tomli_w.dumps({"peer_id": "cli", "private_key": "keys/cli.key", "authorized_keys": "authorized_keys.toml",
                                   "broker_endpoint": sw.broker.endpoint, "broker_id": "broker", "data_dir": "broker-data"}))
    return path


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _gap_report(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ccsq.tools.cli", "gap-report", "--config", str(config), "--json"],
                          capture_output=True, text=True, timeout=60)


# --- unit level: the reader table and the error sentences ---------------------------------
def test_parse_readers_of_lmdb_text() -> None:
    text = "    pid     thread     txnid\n     10226 7fdcc3ca7b80 2\n     10172 7fdcc3ca7b80 -\n"
    slots = parse_readers(text)
    assert [(r.pid, r.txnid) for r in slots] == [(10226, 2), (10172, None)]
    assert parse_readers("(no active readers)\n") == []


def test_every_lmdb_error_has_its_own_sentence() -> None:
    cases = {
        lmdb.ReadersFullError("mdb_txn_begin"): (ExitCode.TEMPFAIL, "reader table is full"),
        lmdb.MapFullError("mdb_put"): (ExitCode.CONFIG, "max_map_size_bytes"),
        lmdb.DiskError("mdb_txn_commit"): (ExitCode.LEDGER_IO, "disk holding the ledger is full"),
        OSError(28, "No space left on device"): (ExitCode.LEDGER_IO, "ENOSPC"),
        lmdb.Error("mdb_txn_commit: Input/output error"): (ExitCode.LEDGER_IO, "I/O error (EIO)"),
        lmdb.CorruptedError("mdb_get"): (ExitCode.LEDGER_CORRUPT, "corrupt"),
        lmdb.InvalidError("mdb_env_open"): (ExitCode.LEDGER_CORRUPT, "not a ledger this LMDB can read"),
        lmdb.VersionMismatchError("mdb_env_open"): (ExitCode.LEDGER_CORRUPT, "another LMDB version"),
        lmdb.LockError("mdb_env_open"): (ExitCode.TEMPFAIL, "locked by another process"),
        lmdb.Error("mdb_env_open: Permission denied"): (ExitCode.CONFIG, "permission denied"),
    }
    sentences = set()
    for exc, (code, phrase) in cases.items():
        got_code, sentence = ledger_failure(exc, "/x/data.mdb", "a ledger write")
        assert got_code == code and phrase in sentence, (type(exc).__name__, got_code, sentence)
        sentences.add(sentence)
        if not isinstance(exc, (lmdb.DiskError, OSError)):
            assert "free disk space" not in sentence
    assert len(sentences) == len(cases) - 1  # lmdb.DiskError and OSError(ENOSPC) are one condition, one sentence
    # a full disk shows up as EIO at commit (LMDB's short write): the free space says which it is
    eio = lmdb.Error("mdb_txn_commit: Input/output error")
    code, sentence = ledger_failure(eio, "/x/data.mdb", "a ledger write", free_bytes=4096)
    assert code == ExitCode.LEDGER_IO and "disk holding the ledger is full" in sentence and "4096 bytes free" in sentence
    code, sentence = ledger_failure(eio, "/x/data.mdb", "a ledger write", free_bytes=50 << 30)
    assert code == ExitCode.LEDGER_IO and "I/O error (EIO)" in sentence


_TOOL = """
import json, sys
from ccsq.brokerd.ledger.store import Ledger, LedgerError
try:
    led = Ledger(sys.argv[1], readonly=True)
except LedgerError as exc:
    print(json.dumps({"error": str(exc), "exit_code": int(exc.exit_code), "type": type(exc).__name__}))
    sys.exit(0)
with led.read() as view:
    print(json.dumps({"cleared": led.stale_readers_cleared, "balanced": view.balanced()}))
"""


def _tool(ledger_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _TOOL, str(ledger_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_transaction_that_finds_the_table_full_clears_dead_readers_and_names_live_ones(tmp_path, farms) -> None:
    """A read transaction that finds every slot taken runs LMDB's reader check and
    retries (what the broker does at every read); when live processes hold every slot,
    a tool gets ReadersFull (exit 75, "reader table is full"), never "free disk space"."""
    d = tmp_path / "ledger"
    led = Ledger(d, map_size_bytes=1 << 22, max_readers=8)  # held open: the table keeps its 8 slots
    try:
        farm = Farm(d)
        farms.append(farm)
        ok, full, _ = farm.open(8)
        assert (ok, full) == (8, 0)
        out = _tool(d)  # live readers hold every slot: a clear error, no disk advice
        assert out["type"] == "ReadersFull" and out["exit_code"] == ExitCode.TEMPFAIL, out
        assert "reader table is full" in out["error"] and "free disk" not in out["error"]
        with pytest.raises(ReadersFull):
            led.read()
        assert farm.kill() == 8  # SIGKILLed mid-transaction: 8 stale slots
        with led.read() as view:  # finds the table full, clears the dead, goes on
            assert view.balanced()
        assert led.stale_readers_cleared == 8
        assert _tool(d) == {"cleared": 0, "balanced": True}
    finally:
        led.close()


def test_gap_report_exit_code_when_the_reader_table_is_full_of_live_readers(tmp_path, farms) -> None:
    cfg = make_swarm(tmp_path, PEERS, max_readers=8)
    b = BrokerProcess(cfg).start()
    try:
        farm = Farm(data_paths(tmp_path / "broker-data")[0])
        farms.append(farm)
        ok, _full, _ = farm.open(8)
        # the broker holds an idle slot of its own: at most 7 of the farm get one
        assert ok >= 6
        done = _gap_report(cfg)
        assert done.returncode == ExitCode.TEMPFAIL, done.stderr
        assert "reader table is full" in done.stderr and "free disk" not in done.stderr
        assert b.proc.poll() is None  # the broker does not care
        farm.kill()
        done = wait_for(lambda: (r := _gap_report(cfg)).returncode == 0 and r, 20, 0.2, "gap-report after the kill")
        assert json.loads(done.stdout)["balanced"]
    finally:
        b.kill()


# --- 300 readers SIGKILLed while submits flow --------------------------------------------
def test_300_readers_sigkilled_mid_transaction_while_submits_flow(tmp_path, farms) -> None:
    """The broker clears the slots dead readers leave (its reader check, on a schedule
    and when a transaction finds the table full), keeps committing and never exits;
    after 300 SIGKILLed readers the table is back to (near) zero."""
    _readers_sigkilled_while_submits_flow(tmp_path, farms, readers=300, max_readers=64)


@pytest.mark.soak
def test_soak_3000_readers_sigkilled_with_the_default_table(tmp_path, farms) -> None:
    _readers_sigkilled_while_submits_flow(tmp_path, farms, readers=3000, max_readers=126)


def _readers_sigkilled_while_submits_flow(tmp_path: Path, farms: list, *, readers: int, max_readers: int) -> None:
    sw = Swarm(tmp_path, max_readers=max_readers)
    try:
        farm = Farm(sw.ledger_dir)
        farms.append(farm)
        stop = threading.Event()
        acked: list[int] = []
        errors: list[BaseException] = []

        def submits() -> None:
            try:
                n = 0
                while not stop.is_set():
                    res = sw.prod.submit([protocol.SubmitItem(f"s{n + j}", "echo", blob(b"s%d" % (n + j))) for j in range(20)], 30)
                    assert all(r.item_id and not r.error for r in res), res[:2]
                    n += 20
                    acked.append(n)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        t = threading.Thread(target=submits, daemon=True)
        t.start()
        killed = 0
        wave = max_readers - 4  # the table is nearly full at every wave
        while killed < readers:
            n = min(wave, readers - killed)
            before = len(acked)
            ok, full, _ = farm.open(n, wait_s=20.0)  # a wave after the first needs the broker to clear the last
            assert (ok, full) == (n, 0), f"the broker did not free the slots of the SIGKILLed readers: {sw.status()['readers']}"
            assert farm.kill() == n
            killed += n
            wait_for(lambda b=before: len(acked) > b or errors, 30, 0.01, "submits committed during the wave")
            assert sw.broker.proc.poll() is None, "".join(sw.broker.lines[-20:])
        stop.set()
        t.join(30)
        assert not errors, errors
        st = wait_for(lambda: (s := sw.status())["readers"]["slots"] <= 2 and s, 20, 0.2, "slots back to near zero")
        assert st["readers"]["stale_cleared"] >= readers
        assert sw.broker.proc.poll() is None and acked
        cleared = sum(e["cleared"] for e in sw.broker.events("ledger_stale_readers_cleared"))
        assert cleared >= readers
        assert not sw.broker.events("ledger_write_failed")
        done = _gap_report(sw.config)
        assert done.returncode == 0, done.stderr
    finally:
        sw.close()


# --- one reader SIGKILLed holding a snapshot while 10,000 items cycle -----------------------
def test_a_dead_readers_snapshot_stops_pinning_once_the_broker_clears_it(tmp_path, farms) -> None:
    """A reader SIGKILLed holding a snapshot pins every page freed after it until its
    slot is cleared: the broker's reader check clears it within about a second, so
    over 10,000 cycled items data.mdb stays a small multiple of the live data (a
    pinned snapshot would add ~3 KiB per item cycled: ~33 MiB here, see the next test)."""
    _dead_reader_while_items_cycle(tmp_path, farms, items=10_000)


@pytest.mark.soak
def test_soak_a_dead_reader_while_100000_items_cycle(tmp_path, farms) -> None:
    _dead_reader_while_items_cycle(tmp_path, farms, items=100_000)


def _dead_reader_while_items_cycle(tmp_path: Path, farms: list, *, items: int) -> None:
    sw = Swarm(tmp_path, retention_s=0.0, dedup_window_s=0.0)
    try:
        sw.cycle(500)
        farm = Farm(sw.ledger_dir)
        farms.append(farm)
        ok, _, (txnid,) = farm.open(1)
        assert ok == 1
        farm.kill()  # dies holding its snapshot: the slot stays listed until someone checks
        t0 = time.monotonic()
        peak_live, sizes = 0, []
        for _ in range(10):
            sw.cycle(items // 10)
            r = sw.status()["readers"]
            peak_live = max(peak_live, r["live_bytes"])
            sizes.append(sw.file_bytes())
        cycle_s = time.monotonic() - t0
        assert r["stale_cleared"] >= 1 and (r["oldest"] is None or r["oldest"]["txnid"] > txnid)
        print(f"\n{items} items cycled in {cycle_s:.1f} s past a dead reader at txn {txnid}: data.mdb "
              f"{' '.join(f'{x / MIB:.2f}' for x in sizes)} MiB; live peak {peak_live / MIB:.2f} MiB, now "
              f"{r['live_bytes'] / MIB:.2f} MiB; last txn {r['last_txnid']}")
        assert sizes[-1] <= 3 * peak_live + 2 * MIB, f"data.mdb {sizes[-1]} bytes for a live peak of {peak_live} bytes"
        # a pinned snapshot would add ~3.3 KiB per item over the second half: ~16 MiB for 10,000
        assert sizes[-1] - sizes[4] <= 2 * MIB, "the file kept growing after the slot was cleared"
        assert _gap_report(sw.config).returncode == 0
    finally:
        sw.close()


# --- a live reader held for a long cycle ------------------------------------------------------
def test_a_live_long_reader_is_warned_about_and_grows_the_file_as_documented(tmp_path, farms) -> None:
    """A live reader cannot be cleared: it is named (status, the ledger_reader_old
    warning past reader_warn_age_s, the pinned-bytes estimate) and the file grows by
    what the commits since its snapshot wrote, ~4 KiB per item cycled in batches of
    250 (docs/ledger.md); once it ends, the pages are reused and the file stops growing."""
    port = free_tcp_port()
    sw = Swarm(tmp_path, retention_s=0.0, dedup_window_s=0.0, reader_warn_age_s=1.0, metrics_port=port)
    try:
        sw.cycle(500)
        farm = Farm(sw.ledger_dir)
        farms.append(farm)
        ok, _, (txnid,) = farm.open(1)
        (pid,) = farm.pids()
        base = sw.file_bytes()
        base_txn = sw.status()["readers"]["last_txnid"]
        t0 = time.monotonic()
        items = len(sw.cycle(2000))
        while time.monotonic() - t0 < 2.5:  # a long cycle: past reader_warn_age_s
            items += len(sw.cycle(250))
        warned = wait_for(lambda: [e for e in sw.broker.events("ledger_reader_old") if e["pid"] == pid], 10, 0.1,
                          "the ledger_reader_old warning")
        r = sw.status()["readers"]
        old = r["oldest"]
        grown = sw.file_bytes() - base
        commits = r["last_txnid"] - base_txn
        print(f"\nheld reader: {items} items, {commits} commits: file +{grown / MIB:.2f} MiB = {grown / items / 1024:.1f} KiB/item, "
              f"{grown / commits / 4096:.1f} pages/commit; pinned estimate {old['pinned_bytes'] / MIB:.2f} MiB, "
              f"age {old['age_s']} s, lag {old['lag_txns']}")
        assert old["pid"] == pid and old["txnid"] == txnid and old["lag_txns"] >= commits and old["age_s"] >= 1.0
        assert warned[0]["age_s"] >= 1.0 and warned[0]["pinned_bytes"] > 0 and warned[0]["txnid"] == txnid
        # the documented growth (docs/ledger.md): ~4 KiB per item cycled in this shape
        assert 1024 * items <= grown <= 12 * 1024 * items
        # the estimate of what it pins follows the real growth
        assert 0.5 * grown <= old["pinned_bytes"] <= 1.5 * grown + MIB
        # visible where an operator looks: ccsq status (online, offline) and the metrics
        admin = _admin_toml(sw)
        online = _cli("status", "--config", str(admin))
        assert online.returncode == 0, online.stderr
        assert f"WARNING oldest reader: pid {pid}, snapshot {txnid}" in online.stdout, online.stdout
        offline = _cli("status", "--config", str(admin), "--offline", "--json")
        assert offline.returncode == 0, offline.stderr
        doc = json.loads(offline.stdout)["readers"]
        assert doc["oldest"]["pid"] == pid and doc["oldest"]["age_s"] >= 1.0 and doc["oldest"]["pinned_bytes"] > 0
        assert wait_for(lambda: _scrape(port).get("ccsq_ledger_oldest_reader_age_seconds", 0) >= 1.0, 10, 0.2, "age gauge")
        m = _scrape(port)
        assert m["ccsq_ledger_pinned_bytes"] > 0 and m["ccsq_ledger_reader_snapshots"] >= 1 and m["ccsq_ledger_max_readers"] == 126
        # released: the pages become reusable, the file stops growing
        farm.kill()
        wait_for(lambda: sw.status()["readers"]["oldest"] is None, 20, 0.2, "the stale slot cleared")
        size = sw.file_bytes()
        sw.cycle(3000)
        assert sw.file_bytes() <= size + MIB // 2
    finally:
        sw.close()


# --- backup while the broker runs, and a restore ------------------------------------------------
def test_hot_compacting_backup_then_restore_balances_and_brings_back_nothing_acknowledged(tmp_path) -> None:
    """``ccsq backup`` copies the ledger while the broker commits (one snapshot,
    compacted); the documented swap (stop, move the copy into place, start) gives a
    broker whose books balance and which never dispatches or delivers an item that
    was acknowledged before the backup."""
    sw = Swarm(tmp_path)
    try:
        acked = set(sw.cycle(600))
        stop = threading.Event()
        submitted: list[str] = []

        def submits() -> None:  # the broker keeps committing during the copy
            n = 0
            while not stop.is_set():
                res = sw.prod.submit([protocol.SubmitItem(f"b{n + j}", "echo", blob(b"b%d" % (n + j))) for j in range(10)], 30)
                submitted.extend(r.item_id for r in res)
                n += 10

        t = threading.Thread(target=submits, daemon=True)
        t.start()
        wait_for(lambda: len(submitted) >= 50, 30, 0.01, "submits before the backup")
        dest = tmp_path / "backup-1"
        done = subprocess.run([sys.executable, "-m", "ccsq.tools.cli", "backup", "--config", str(sw.config), str(dest), "--json"],
                              capture_output=True, text=True, timeout=120)
        wait_for(lambda: len(submitted) >= 100, 30, 0.01, "submits after the backup")
        stop.set()
        t.join(30)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["balanced"] and out["received"] >= 650 and (dest / "data.mdb").is_file() and not (dest / "lock.mdb").exists()
        assert out["bytes"] <= out["source_bytes"]
        # a second backup into a non-empty directory is refused (usage), nothing overwritten
        again = subprocess.run([sys.executable, "-m", "ccsq.tools.cli", "backup", "--config", str(sw.config), str(dest)],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == ExitCode.USAGE and "not empty" in again.stderr
        # the swap (docs/ledger.md, Backups): stop, move the copy into place, start
        for sp in sw.peers:
            sp.close()
        assert sw.broker.stop() == 0
        shutil.move(str(sw.ledger_dir), str(sw.ledger_dir.with_name("ledger.before-restore")))
        sw.ledger_dir.mkdir()
        shutil.copy2(dest / "data.mdb", sw.ledger_dir / "data.mdb")
        sw.broker = BrokerProcess(sw.config).start()
        rep = _gap_report(sw.config)
        assert rep.returncode == 0, rep.stderr
        restored = json.loads(rep.stdout)
        assert restored["counters"]["received"] == out["received"] and restored["counters"]["acknowledged"] == 600 and restored["balanced"]
        ready = restored["states"]["ready"]
        assert ready == out["received"] - 600
        # workers and completion services with plenty of credit: only the ready items come
        sw.connect()
        sw.w.send(protocol.Credit(5000))
        sw.comp.send(protocol.Credit(5000))
        tasks: list[protocol.Task] = []
        while len(tasks) < ready:
            tasks += sw.w.recv_type(protocol.Dispatch, 30).tasks
        assert not acked & {t.item_id for t in tasks}
        sw.w.send(protocol.Complete([protocol.TaskResult(t.item_id, t.token, blob(b"r"), "echo", "1", 0.0) for t in tasks]))
        got: list[protocol.Delivery] = []
        while len(got) < ready:
            got += sw.comp.recv_type(protocol.Result, 30).deliveries
        assert not acked & {d.item_id for d in got} and not any(d.redelivery for d in got)
        sw.comp.send(protocol.Ack([d.item_id for d in got]))
        sw.comp.recv_type(protocol.AckOk, 30)
        with pytest.raises(TimeoutError):  # nothing else: no redispatch, no redelivery
            sw.comp.recv_type(protocol.Result, 1.0)
        final = json.loads(_gap_report(sw.config).stdout)
        assert final["balanced"] and final["counters"]["acknowledged"] == 600 + ready and final["counters"]["redelivered"] == 0
        assert final["counters"]["routed"] == out["received"]  # each item leased once: none of the 600 again
        # ids the old broker issued after the copy (their results may be in the results database
        # already) are never issued again: the restored copy took a new id prefix at its first start
        after_backup = set(submitted)  # a superset of the ids issued after the copy (all of them fit)
        fresh = [r.item_id for r in sw.prod.submit([protocol.SubmitItem(f"new{j}", "echo", blob(b"n%d" % j)) for j in range(100)], 30)]
        assert len(set(fresh)) == 100 and not after_backup & set(fresh) and not acked & set(fresh)
        assert {i[:8] for i in fresh} != {i[:8] for i in submitted}
        # a second start of the restored ledger keeps its prefix (it is a restore once)
        for sp in sw.peers:
            sp.close()
        assert sw.broker.stop() == 0
        sw.broker = BrokerProcess(sw.config).start()
        sw.connect()
        again = [r.item_id for r in sw.prod.submit([protocol.SubmitItem(f"again{j}", "echo", blob(b"a%d" % j)) for j in range(5)], 30)]
        assert {i[:8] for i in again} == {i[:8] for i in fresh}
    finally:
        sw.close()


# --- the tools page through with fresh transactions -------------------------------------------
_READERS_OF = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=16)
print(env.readers())
"""


def test_reconcile_pages_with_fresh_transactions_and_holds_no_snapshot_between_pages(tmp_path) -> None:
    """``iter_blob_refs`` (ccsq reconcile) reads 1000 references per short transaction:
    while its consumer works (lists the claim store) this process holds no snapshot,
    and every reference is still seen exactly once."""
    data_dir = tmp_path / "broker-data"
    ledger_dir = data_paths(data_dir)[0]
    led = Ledger(ledger_dir, map_size_bytes=1 << 26)
    txn = led.begin()
    for i in range(2500):
        body = b"payload %d" % i
        txn.submit(protocol.SubmitItem(f"k{i}", "ocr", protocol.Blob(hashlib.sha256(body).hexdigest(), len(body))), 1_000_000 + i)
    txn.commit()
    led.close()
    seen, mid = [], None
    for ref in iter_blob_refs(data_dir):
        seen.append(ref)
        if len(seen) == 1500:  # between pages: what does the reader table say about us?
            done = subprocess.run([sys.executable, "-c", _READERS_OF, str(ledger_dir)], capture_output=True, text=True, timeout=60)
            mid = parse_readers(done.stdout)
    assert len(seen) == 2500 and len({r[0] for r in seen}) == 2500 and all(r[1] == "ready" for r in seen)
    assert mid is not None and not [r for r in mid if r.pid == os.getpid() and r.txnid is not None], mid
    rep = load_report(data_dir)
    assert rep["balanced"] and rep["counters"]["received"] == 2500


# --- real errors from a real disk -----------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs (root only; skipped elsewhere), unmounted after the test."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_exits_74_with_its_own_sentence_and_loses_nothing_confirmed(tmp_path, small_tmpfs) -> None:
    """ENOSPC at commit: the broker exits 74 saying the disk is full (not the reader
    table, not the map); once space is back every confirmed item is there and the
    books balance."""
    cfg = make_swarm(tmp_path, PEERS, data_dir=str(small_tmpfs / "broker-data"), map_size_bytes=1 << 20,
                     max_map_size_bytes=64 << 20)
    b = BrokerProcess(cfg).start()
    prod = ScriptedPeer(tmp_path, "prod", b.endpoint)
    try:
        prod.hello("producer")
        confirmed: list[str] = []
        for n in range(400):  # 400 x 8 x 4 KiB = 12.8 MiB: far past the 3 MiB disk
            try:
                res = prod.submit([protocol.SubmitItem(f"f{n}-{j}", "echo", blob(os.urandom(4096))) for j in range(8)], timeout_s=5)
            except TimeoutError:
                break
            confirmed += [r.item_id for r in res if r.item_id]
            if b.proc.poll() is not None:
                break
        assert b.wait(20) == ExitCode.LEDGER_IO
        err = "".join(b.lines)
        # LMDB reports the short write of a full disk as EIO: the sentence still says what it is
        assert "disk holding the ledger is full (ENOSPC" in err and "I/O error" not in err.split("advice")[-1], err[-1500:]
        assert "reader table" not in err
        assert confirmed
    finally:
        prod.close()
        b.kill()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    b = BrokerProcess(cfg).start()
    try:
        adm = ScriptedPeer(tmp_path, "prod", b.endpoint)
        adm.hello("producer")
        states = adm.status(confirmed[-50:])
        assert all(s.state == "ready" for s in states), states[:3]
        adm.close()
        rep = json.loads(_gap_report(cfg).stdout)
        assert rep["balanced"] and rep["counters"]["received"] >= len(confirmed)
    finally:
        b.kill()


def test_a_file_that_is_not_a_ledger_exits_80_with_its_own_sentence(tmp_path) -> None:
    cfg = make_swarm(tmp_path, PEERS)
    ledger_dir = data_paths(tmp_path / "broker-data")[0]
    ledger_dir.mkdir(parents=True)
    (ledger_dir / "data.mdb").write_bytes(os.urandom(64 << 10))
    b = BrokerProcess(cfg).start(wait=False)
    assert b.wait(30) == ExitCode.LEDGER_CORRUPT
    assert "not a ledger this LMDB can read" in "".join(b.lines) and "free disk" not in "".join(b.lines)
    done = _gap_report(cfg)
    assert done.returncode == ExitCode.LEDGER_CORRUPT and "not a ledger this LMDB can read" in done.stderr


def test_console_overview_shows_the_oldest_reader(tmp_path) -> None:
    """The console's overview renders the reader report of the status reply."""
    from ccsq.common.wire.config import AdminConfig, load
    from ccsq.console.app import Auth, Console, Viewer
    from ccsq.console.data import Source

    (tmp_path / "admin.toml").write_text('peer_id = "admin"\nprivate_key = "k"\n')
    console = Console(Source(load(AdminConfig, tmp_path / "admin.toml")), Auth([]))
    readers = {"slots": 3, "max_readers": 126, "snapshots": 1, "file_bytes": 40 * MIB, "live_bytes": 2 * MIB, "free_bytes": 38 * MIB,
               "stale_cleared": 4, "last_txnid": 900, "warn_age_s": 300.0, "readers": [],
               "oldest": {"pid": 4242, "thread": "7f", "txnid": 100, "lag_txns": 800, "age_s": 612.0, "age_at_least": False,
                          "pinned_bytes": 37 * MIB, "pinned_upper_bound": False, "self": False}}
    from ccsq.tools.admin_client import offline

    Ledger(data_paths(tmp_path / "broker-data")[0], map_size_bytes=1 << 22).close()
    status = offline(tmp_path / "broker-data", "status")  # a real reply, with a real (quiet) reader report
    assert status["readers"]["oldest"]["self"] and status["readers"]["oldest"]["lag_txns"] == 0
    status["readers"] = readers  # ... and one with an old reader
    try:
        page = console.env.get_template("overview.html").render(
            viewer=Viewer("local", "admin", csrf="c"), flash=[], path="/", refresh_s=0, now="", status=status, status_error="",
            report_error="", more={}, queues=[], samples=0)
    finally:
        console.source.close()
    assert 'id="readers"' in page and "pid 4242, 800 commits behind" in page and "pins ~37.0 MiB" in page
    assert 'id="reader-old"' in page
