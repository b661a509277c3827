"""The chaos run: a real swarm, random faults while items flow, then the invariants.

Layout: broker, ``workers`` workers (echo handler), the completion service on
SQLite, and a producer subprocess with an outbox (:mod:`tests.chaos.producer`).
Every peer reaches the broker through its own link of a :class:`FaultProxy`;
a :class:`HostilePeer` sends bad frames to the broker directly all run long.

Every ``fault_interval_s`` (jittered) the scheduler picks one fault with the
seeded RNG (see :data:`FAULTS`); a supervisor restarts any process that exits
(as systemd would), noting every exit it did not cause as a crash. After
``duration_s`` the faults stop and are healed, the run waits until the
producer is done and the ledger has nothing ready, leased or completed, stops
everything and runs :func:`tests.chaos.checks.check`.

Replay a failure with the printed seed (timing still varies run to run, so a
replay re-creates the same fault sequence, not the same interleaving).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import random
import re
import shutil
import signal
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from ccsq.brokerd.ledger.store import Ledger, LedgerError, data_paths
from ccsq.brokerd.gap_report import load_report
from ccsq.common.runtime.faults import env_for
from ccsq.tools.procs import Proc
from tests.chaos.checks import REFUSED_KEY_SUFFIX, EventLog, Verdict, check
from tests.chaos.hostile import HostilePeer
from tests.chaos.producer import key_for, payload_for, read_progress
from tests.chaos.proxy import FaultProxy
from tests.swarm import Swarm

REPO = Path(__file__).resolve().parents[2]

CRASH_POINTS = {
    "broker": ["broker.after_submit_commit", "broker.after_lease_commit", "broker.after_complete_commit",
               "broker.after_ack_commit"],
    "worker": ["worker.after_infer", "worker.after_result_stored"],
    "completion": ["completion.after_db_commit"],
    "producer": ["producer.after_blob_put"],
}

#: Crashes already reported to their owners, tolerated (and printed as KNOWN) until fixed:
#: reason -> regex on the crash's last log lines. Remove an entry once its fix lands.
KNOWN_CRASHES: dict[str, str] = {}

#: fault name -> weight
FAULTS = {
    "kill": 12,
    "crash_point": 12,
    "stop_short": 6,
    "stop_long": 5,
    "net_delay": 6,
    "net_blackhole": 6,
    "net_reset": 6,
    "net_cut": 4,
    "disk_full": 2,
    "queue_full": 2,
    "blob_outage": 2,
    "blob_delete": 3,
}


@dataclasses.dataclass
class ChaosOptions:
    """One run. Durations in seconds; ``rate`` in items per second."""

    root: Path
    seed: int
    duration_s: float = 60.0
    rate: float = 40.0
    workers: int = 3
    handler: str = "echo"  # or "sleep": items run 0..sleep_max_s each, so faults hit them mid-run
    sleep_max_s: float = 0.5
    fault_interval_s: float = 0.5
    hostile_interval_s: float = 0.05
    settle_timeout_s: float = 180.0
    faults: dict[str, int] = dataclasses.field(default_factory=lambda: dict(FAULTS))
    verbose: bool = True


@dataclasses.dataclass
class ChaosResult:
    seed: int
    faults: Counter
    hostile_frames: int
    crashes: list[str]
    known_crashes: Counter
    verdict: Verdict
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.crashes

    def line(self) -> str:
        s = self.verdict.summary
        return (f"faults={sum(self.faults.values())} hostile_frames={self.hostile_frames} items={s['items']} "
                f"lost={s['lost']} stuck={s['stuck']} duplicates={s['duplicates']} gap_events={s['gap_events']} "
                f"unmatched={s['unmatched_duplicates']} redeliveries={s['redeliveries']} crashes={len(self.crashes)} "
                f"known_crashes={sum(self.known_crashes.values())} "
                f"violations={len(self.verdict.violations)} balanced={'true' if s['balanced'] else 'false'} "
                f"seed={self.seed} wall_s={self.wall_s:.0f}")


class ChaosRun:
    """Owns the swarm, the proxy, the hostile peer, the fault timers and the supervisor."""

    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.root = opts.root
        self.swarm = Swarm(
            self.root / "swarm", workers=opts.workers, handler=opts.handler,
            broker={"max_attempts": 1000, "retention_s": 30 * 86400.0, "log_format": "json"},
            worker={"log_format": "json", "drain_timeout_s": 1.0},
            producer={"outbox_dir": "outbox", "inline_max_bytes": 512, "log_format": "json"},
            completion={"log_format": "json"},
        )
        self.names = ["broker", *[f"worker-{n}" for n in range(1, opts.workers + 1)], "completion", "producer"]
        self.peer_configs = {f"worker-{n}": f"workerd-{n - 1}" for n in range(1, opts.workers + 1)}
        self.peer_configs.update({"completion": "completion", "producer": "producer"})
        self.proxy = FaultProxy(self.swarm.port, list(self.peer_configs))
        self.hostile: HostilePeer | None = None
        self.events = EventLog(self.root / "swarm" / "broker-data")
        self.progress = self.root / "producer-progress.txt"
        self.count = max(10, int(opts.rate * opts.duration_s))
        self.faults: Counter = Counter()
        self.crashes: list[str] = []
        self.known_crashes: Counter = Counter()
        self.timers: list[tuple[float, int, str, Callable[[], None]]] = []
        self._tseq = 0
        self.down: set[str] = set()  # intentionally not running (a restart is scheduled)
        self.armed: dict[str, str] = {}  # name -> crash point it runs with
        self.env: dict[str, dict[str, str]] = {}
        self.killed: set[str] = set()  # exits we caused (SIGKILL) since the last start
        self.producer_done = False
        self.deleted_payload_keys: set[str] = set()
        self.broker_cfg_base = tomllib.loads(self.swarm.configs["brokerd"].read_text())
        self.broker_override: str = ""
        self.blob_outage = False
        self.outage_end_mono = -1e9
        self.log_path = self.root / "chaos.log"

    # --- output ---
    def say(self, msg: str) -> None:
        line = f"[chaos {time.monotonic() - self.t0:7.2f}s] {msg}"
        with open(self.log_path, "a") as f:
            f.write(line + "\n")
        if self.opts.verbose:
            print(line, flush=True)

    # --- setup ---
    def _point_peers_at_proxy(self) -> None:
        for peer, cfg_name in self.peer_configs.items():
            path = self.swarm.configs[cfg_name]
            cfg = tomllib.loads(path.read_text())
            cfg["broker_endpoint"] = f"tcp://127.0.0.1:{self.proxy.port(peer)}"
            path.write_text(tomli_w.dumps(cfg))

    def _results_table_rule(self) -> None:
        """An operator's rule on the results table that refuses some rows (keys ending in
        :data:`REFUSED_KEY_SUFFIX`, ~1 %): those results must end in the quarantine
        (gap G12), under every fault, never lost and never twice."""
        from ccsq.completiond.resultsdb import SqliteResults

        db = SqliteResults(self.swarm.root / "results.db")
        db.connect()
        db._con.execute(f"CREATE TRIGGER IF NOT EXISTS chaos_rule BEFORE INSERT ON results "
                        f"WHEN NEW.idem_key GLOB '*{REFUSED_KEY_SUFFIX}' "
                        "BEGIN SELECT RAISE(ABORT, 'chaos: refused by the results table rule'); END")
        db.close()

    def _start(self, name: str, *, wait: bool = False) -> None:
        env = self.env.get(name, {})
        self.killed.discard(name)
        if name == "broker":
            self.swarm.start_broker(env=env, wait=wait)
        elif name.startswith("worker-"):
            self.swarm.start_worker(int(name.split("-")[1]), env=env, wait=wait)
        elif name == "completion":
            self.swarm.start_completion(env=env, wait=wait)
        elif name == "producer":
            argv = [sys.executable, "-m", "tests.chaos.producer", "--config", str(self.swarm.configs["producer"]),
                    "--progress", str(self.progress), "--count", str(self.count), "--rate", str(self.opts.rate),
                    "--seed", str(self.opts.seed), "--kind", self.opts.handler,
                    "--sleep-max-s", str(self.opts.sleep_max_s)]
            self.swarm.procs.start("producer", argv, env={**env, "PYTHONPATH": str(REPO)})

    def _proc(self, name: str) -> Proc | None:
        return self.swarm.procs.procs.get(name)

    def _running(self, name: str) -> bool:
        proc = self._proc(name)
        return proc is not None and proc.running

    # --- timers ---
    def at(self, delay_s: float, what: str, fn: Callable[[], None]) -> None:
        self._tseq += 1
        heapq.heappush(self.timers, (time.monotonic() + delay_s, self._tseq, what, fn))

    def _run_timers(self, *, all_now: bool = False) -> None:
        while self.timers and (all_now or self.timers[0][0] <= time.monotonic()):
            _, _, what, fn = heapq.heappop(self.timers)
            fn()

    # --- the supervisor (systemd's Restart=always, with a note for every crash) ---
    def _supervise(self) -> None:
        for name in self.names:
            proc = self._proc(name)
            if proc is None or proc.running or name in self.down:
                continue
            rc = proc.popen.returncode
            if name == "producer" and rc == 0:
                if not self.producer_done:
                    self.producer_done = True
                    self.say("producer finished: every item accepted and the outbox flushed")
                continue
            if name in self.killed or (rc == -signal.SIGKILL and name in self.armed):
                pass  # we did it (SIGKILL, or a crash point we armed)
            else:
                self._note_crash(name, rc)
            if rc == -signal.SIGKILL and name in self.armed:
                self.say(f"{name} died at crash point {self.armed[name]}")
                self.armed.pop(name)
                self.env.pop(name, None)
            self._start(name)

    def _note_crash(self, name: str, rc: int) -> None:
        tail = self.swarm.procs.tail(name, 40).replace("\\n", "\n")
        lines = [ln for ln in tail.splitlines() if ln.strip() and not set(ln.strip()) <= {"^", "~"}]
        reason = (lines[-1] if lines else "")[:300]
        in_outage = self.blob_outage or time.monotonic() - self.outage_end_mono < 5.0
        if in_outage and rc == 75 and "claim store unavailable" in tail:
            self.say(f"{name} refused to start during the claim-store outage (exit 75, restarted as systemd would)")
            return  # by design: a store that does not answer at start is transient
        for known, pattern in KNOWN_CRASHES.items():
            if in_outage and re.search(pattern, tail):
                self.known_crashes[known] += 1
                self.say(f"known crash: {name} exited with {rc}: {reason}")
                return
        self.crashes.append(f"{name} exited with {rc}: {reason}")
        self.say(f"CRASH: {name} exited with {rc} (not caused by the harness)\n{tail}")

    # --- faults ---
    def _pick_process(self, allow_producer: bool = True) -> str:
        names = [n for n in self.names if (allow_producer or n != "producer")
                 and not (n == "producer" and self.producer_done)]
        return self.rng.choice(names)

    def _kill(self, name: str) -> None:
        if self._running(name):
            self.killed.add(name)
            self.swarm.procs.kill(name)

    def _kill_restart(self, name: str, delay_s: float) -> None:
        self._kill(name)
        self.down.add(name)

        def restart() -> None:
            self.down.discard(name)
            if not self._running(name):
                self._start(name)
        self.at(delay_s, f"restart {name}", restart)

    def inject(self) -> None:
        kinds = list(self.opts.faults)
        kind = self.rng.choices(kinds, weights=[self.opts.faults[k] for k in kinds])[0]
        rng = self.rng
        if kind == "kill":
            name = self._pick_process()
            if name in self.down:
                return
            delay = rng.choice([0.0, rng.uniform(0.1, 1.0), rng.uniform(1.0, 4.0)])
            self.say(f"fault kill: SIGKILL {name}, restart in {delay:.2f}s")
            self._kill_restart(name, delay)
        elif kind == "crash_point":
            name = self._pick_process()
            if name in self.down or name in self.armed:
                return
            role = "worker" if name.startswith("worker-") else name
            point = rng.choice(CRASH_POINTS[role])
            after_n = rng.randint(1, 4)
            self.say(f"fault crash_point: restart {name} armed at {point} (after {after_n})")
            self._kill(name)
            self.armed[name] = point
            self.env[name] = env_for(point, after_n)
            self._start(name)
        elif kind in ("stop_short", "stop_long"):
            name = self._pick_process()
            if not self._running(name):
                return
            window_s = 0.2 * 5  # Swarm: heartbeat 0.2 s x liveness 5
            d = rng.uniform(0.2, 0.8 * window_s) if kind == "stop_short" else rng.uniform(1.5 * window_s, 6.0)
            self.say(f"fault {kind}: SIGSTOP {name} for {d:.2f}s (liveness window {window_s:.1f}s)")
            pid = self._proc(name).popen.pid
            os.kill(pid, signal.SIGSTOP)
            self.at(d, f"SIGCONT {name}", lambda: _signal_pid(pid, signal.SIGCONT))
        elif kind.startswith("net_"):
            link = rng.choice(list(self.peer_configs))
            if kind == "net_delay":
                delay_s, d = rng.choice([0.02, 0.1, 0.5, 1.5]), rng.uniform(0.5, 5.0)
                self.say(f"fault net_delay: {link} +{delay_s * 1000:.0f} ms for {d:.2f}s")
                self.proxy.set_mode(link, "delay", delay_s)
                self.at(d, f"heal {link}", lambda: self.proxy.set_mode(link, "pass"))
            elif kind == "net_blackhole":
                d, reset = rng.uniform(0.3, 5.0), rng.random() < 0.5
                self.say(f"fault net_blackhole: {link} for {d:.2f}s, then {'reset' if reset else 'resume'}")
                self.proxy.set_mode(link, "blackhole")
                self.at(d, f"heal {link}", lambda: self.proxy.end_blackhole(link, reset=reset))
            elif kind == "net_reset":
                self.say(f"fault net_reset: RST {link}")
                self.proxy.reset(link)
            else:
                self.say(f"fault net_cut: FIN {link}")
                self.proxy.cut(link)
        elif kind in ("disk_full", "queue_full"):
            if self.broker_override or "broker" in self.down:
                return
            d = rng.uniform(1.0, 6.0)
            override = {"min_free_disk_bytes": 1 << 46} if kind == "disk_full" else {"max_ready_items": rng.randint(1, 20)}
            self.say(f"fault {kind}: broker restarted with {override} for {d:.2f}s")
            self.broker_override = kind
            self._broker_config(override)
            self._kill_restart("broker", 0.0)
            self.at(d, f"end {kind}", self._end_broker_override)
        elif kind == "blob_outage":
            if self.blob_outage:
                return
            d = rng.uniform(0.3, 3.0)
            self.say(f"fault blob_outage: claim store unreadable/unwritable for {d:.2f}s")
            self._blob_outage(True)
            self.at(d, "end blob_outage", lambda: self._blob_outage(False))
        elif kind == "blob_delete":
            self._delete_payload_blob()  # counts itself: there may be no candidate
            return
        self.faults[kind] += 1

    def _broker_config(self, override: dict[str, Any]) -> None:
        self.swarm.configs["brokerd"].write_text(tomli_w.dumps({**self.broker_cfg_base, **override}))

    def _end_broker_override(self) -> None:
        self.say(f"end {self.broker_override}: broker restarted with its normal config")
        self._broker_config({})
        self.broker_override = ""
        self._kill_restart("broker", 0.0)

    def _blob_outage(self, on: bool) -> None:
        blobs = self.swarm.root / "blobs"
        away = self.swarm.root / "blobs.outage"
        if on and not self.blob_outage:
            os.rename(blobs, away)
            blobs.write_bytes(b"claim store outage\n")  # not a directory: every read and write fails
            self.blob_outage = True
        elif not on and self.blob_outage:
            blobs.unlink()
            os.rename(away, blobs)
            self.blob_outage = False
            self.outage_end_mono = time.monotonic()

    def _delete_payload_blob(self) -> None:
        """Delete the claim-store payload of an item that is still ready (it must end dead, payload_missing)."""
        if self.blob_outage:
            return
        ledger_dir, _ = data_paths(self.swarm.root / "broker-data")
        try:
            ledger = Ledger(ledger_dir, readonly=True)
        except LedgerError:
            return
        candidates: list[tuple[str, str]] = []
        try:
            with ledger.read() as view:
                for n, (_, item_id) in enumerate(view.txn.cursor(db=view.db["ready"])):
                    blob = view.payload(item_id.decode())
                    rec = view.get(item_id.decode())
                    if blob.inline is None and rec is not None:
                        candidates.append((rec["key"], blob.sha256))
                    if n >= 200:
                        break
        finally:
            ledger.close()
        if not candidates:
            return
        key, sha = self.rng.choice(candidates)
        path = self.swarm.root / "blobs" / sha[:2] / sha[2:4] / sha
        try:
            path.unlink()
        except FileNotFoundError:
            return
        self.deleted_payload_keys.add(key)
        self.say(f"fault blob_delete: payload blob of ready item {key} deleted")
        self.faults["blob_delete"] += 1
        # workers give such an item back uncounted (store_unavailable); only reconcile dead-letters it (G7)
        self.at(1.0, "reconcile", self._reconcile)

    def _reconcile(self, force: bool = False) -> None:
        """What the operator does when workers report payloads missing: ``ccsq reconcile
        --apply`` (orphans kept: a long grace). Best effort: a ready item leased meanwhile,
        or a broker that does not answer, waits for the next run. ``force``: when the only
        items left open are ones whose payload the harness deleted, reconcile rightly refuses
        ("holds none of the payloads": a wrong --store?); the operator who knows adds --force."""
        import subprocess

        from ccsq.tools.procs import bin_path

        if self.blob_outage:
            return
        res = subprocess.run([bin_path("ccsq"), "reconcile", "--config", str(self.swarm.configs["brokerd"]),
                              "--store", "file://blobs", "--grace-s", "86400", "--apply", "--json",
                              *(["--force"] if force else [])],
                             capture_output=True, text=True, timeout=60)
        try:
            doc = json.loads(res.stdout)
            what = f"dead-lettered {doc['dead_lettered']}, not yet {doc['not_dead_lettered'] + doc['leased_missing']}"
        except (ValueError, KeyError):
            what = res.stderr.strip()[-300:]
        self.say(f"reconcile --apply: exit {res.returncode}: {what}")

    # --- the run ---
    def run(self) -> ChaosResult:
        self.t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        self.proxy.start()
        self._point_peers_at_proxy()
        self.say(f"seed={self.opts.seed} duration_s={self.opts.duration_s} rate={self.opts.rate} items={self.count} "
                 f"handler={self.opts.handler} "
                 f"dir={self.root}")
        self._results_table_rule()
        try:
            self.swarm.start_broker()
            for name in self.names[1:]:
                self._start(name, wait=name.startswith("worker-") or name == "completion")
            self.hostile = HostilePeer(self.swarm.root, self.swarm.endpoint, random.Random(self.opts.seed + 1),
                                       interval_s=self.opts.hostile_interval_s).start()
            self._chaos_phase()
            self._heal()
            self._settle()
        finally:
            if self.hostile is not None:
                self.hostile.stop()
            self._run_timers(all_now=True)
            self.swarm.procs.stop_all()
            self.proxy.close()
            if self.blob_outage:
                self._blob_outage(False)
        verdict = self._verdict()
        result = ChaosResult(self.opts.seed, self.faults, self.hostile.total if self.hostile else 0, self.crashes,
                             self.known_crashes, verdict, time.monotonic() - self.t0)
        (self.root / "summary.json").write_text(json.dumps({
            "line": result.line(), "faults": dict(self.faults),
            "hostile": dict(self.hostile.sent) if self.hostile else {}, "crashes": self.crashes,
            "known_crashes": dict(self.known_crashes),
            "violations": verdict.violations, **verdict.summary}, indent=2, default=str))
        return result

    def _chaos_phase(self) -> None:
        end = self.t0 + self.opts.duration_s
        next_fault = time.monotonic() + 2.0
        next_poll = 0.0
        while time.monotonic() < end:
            now = time.monotonic()
            self._run_timers()
            self._supervise()
            if now >= next_fault:
                self.inject()
                next_fault = now + self.rng.uniform(0.3, 1.7) * self.opts.fault_interval_s
            if now >= next_poll:
                self.events.poll()
                next_poll = now + 1.0
            time.sleep(0.02)  # the scheduler's tick

    def _heal(self) -> None:
        self.say(f"faults stop ({sum(self.faults.values())} injected); healing")
        self._run_timers(all_now=True)
        self.proxy.heal_all()
        if self.blob_outage:
            self._blob_outage(False)
        if self.broker_override:
            self._end_broker_override()
            self._run_timers(all_now=True)
        for name in self.names:
            if self._running(name):
                _signal_pid(self._proc(name).popen.pid, signal.SIGCONT)
        for name in list(self.armed):
            self.say(f"disarming {name} ({self.armed[name]})")
            self._kill(name)
            proc = self._proc(name)
            if proc is not None and not proc.running and proc.popen.returncode == -signal.SIGKILL:
                self.killed.add(name)  # it died at that crash point just now (not yet seen by _supervise): ours
            self.armed.pop(name)
            self.env.pop(name, None)
        self.down.clear()
        self._supervise()

    def _settle(self) -> None:
        """Wait until the producer is done and nothing is ready, leased or completed."""
        deadline = time.monotonic() + self.opts.settle_timeout_s
        last = ""
        next_poll = 0.0
        next_reconcile = 0.0
        while time.monotonic() < deadline:
            self._supervise()
            if time.monotonic() >= next_poll:
                self.events.poll()
                next_poll = time.monotonic() + 1.0
            try:
                rep = load_report(self.swarm.root / "broker-data")
            except LedgerError as exc:  # the ledger is being opened by a restarting broker
                rep = None
                last = f"report unavailable: {exc}"
            if rep is not None:
                open_items = rep["states"]["ready"] + rep["states"]["leased"] + rep["states"]["completed"]
                last = f"producer_done={self.producer_done} open={open_items} states={rep['states']}"
                if self.producer_done and open_items == 0:
                    self.say(f"settled: {last}")
                    return
                if self.deleted_payload_keys and open_items and time.monotonic() >= next_reconcile:
                    self._reconcile(force=True)  # deleted payloads: their items wait for reconcile (G7)
                    next_reconcile = time.monotonic() + 3.0
            time.sleep(0.2)  # polling the ledger for a condition, with a deadline
        self.say(f"NOT SETTLED after {self.opts.settle_timeout_s}s: {last}")

    def _verdict(self) -> Verdict:
        accepted_idx = read_progress(self.progress)
        accepted = {key_for(self.opts.seed, i): item_id for i, item_id in accepted_idx.items()}
        expected = ({key_for(self.opts.seed, i): payload_for(self.opts.seed, i) for i in accepted_idx}
                    if self.opts.handler == "echo" else {})  # echo returns its payload
        workers = [p for n, p in self.swarm.procs.procs.items() if n.startswith("worker-")]
        return check(data_dir=self.swarm.root / "broker-data", results_db=self.swarm.root / "results.db",
                     workers=workers, accepted=accepted, expected_payload=expected,
                     deleted_payload_keys=self.deleted_payload_keys, events=self.events)


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_chaos(opts: ChaosOptions) -> ChaosResult:
    """Run once; prints the summary line (and every violation) and returns the result."""
    result = ChaosRun(opts).run()
    for v in result.verdict.violations:
        print(f"VIOLATION: {v}", flush=True)
    for c in result.crashes:
        print(f"CRASH: {c}", flush=True)
    for known, n in result.known_crashes.items():
        print(f"KNOWN CRASH x{n}: {known}", flush=True)
    print(result.line(), flush=True)
    return result


def clean(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
