"""``make chaos CHAOS_ARGS="--ha ..."``: the chaos run on a broker pair with etcd (issue 23, docs/ha.md).

Layout (one host, loopback): a one-member etcd, ``broker-1`` and ``broker-2`` on the
configs ``ccsq init --standby 127.0.0.1:PORT`` wrote (sync mode, a 3 s etcd lease),
``workers`` workers, the completion service on SQLite and the chaos producer with an
outbox; every peer's ``broker_endpoint`` lists both brokers (no proxy: the peers must
find the primary themselves).

Faults (seeded, :data:`HA_FAULTS`): SIGKILL the primary (restarted after 0-3 s: it rejoins
as a standby), SIGSTOP the primary longer than the etcd lease (then SIGCONT: it must
confirm nothing after and rejoin), a planned switchover (``ccsq failover``), SIGKILL the
standby, SIGKILL or a short SIGSTOP of a worker, the completion service or the producer.
A primary fault is injected only while the standby is in etcd's sync set and running (else
no standby may take over, by design, and the swarm waits), so every one is a failover.
The run counts failovers (the epoch in etcd going up) and fails with fewer than
``min_failovers`` (default 20). Then the faults stop, everything is healed, the run waits
until the producer is done and the primary's ledger has nothing open, and checks the
invariants of ``make chaos`` (:func:`tests.chaos.checks.check`) on the primary's ledger,
with the gap events of both ledgers.
"""

from __future__ import annotations

import base64
import dataclasses
import heapq
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ccsq.brokerd.ledger.store import LedgerError
from ccsq.brokerd.gap_report import load_report
from ccsq.tools.init import init_swarm
from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port, wait_until
from tests.chaos.checks import EventLog, Verdict, check
from tests.chaos.producer import key_for, payload_for, read_progress

REPO = Path(__file__).resolve().parents[2]
SWARM_ID = f"chaosha-{os.getpid()}"  # per process: the brokers' host-wide node flock (see tests/hanet.py)
LEASE_TTL_S = 3

#: fault name -> weight
HA_FAULTS = {
    "kill_primary": 10,
    "stop_primary": 4,
    "switchover": 2,
    "kill_standby": 3,
    "kill_peer": 4,
    "stop_peer": 3,
}


@dataclasses.dataclass
class HaChaosOptions:
    root: Path
    seed: int
    duration_s: float = 300.0
    rate: float = 20.0
    workers: int = 2
    fault_interval_s: float = 4.0
    settle_timeout_s: float = 300.0
    min_failovers: int = 20
    faults: dict[str, int] = dataclasses.field(default_factory=lambda: dict(HA_FAULTS))
    verbose: bool = True


@dataclasses.dataclass
class HaChaosResult:
    seed: int
    faults: Counter
    failovers: int
    epochs: list[int]
    crashes: list[str]
    verdict: Verdict
    min_failovers: int
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.crashes and self.failovers >= self.min_failovers

    def line(self) -> str:
        s = self.verdict.summary
        return (f"ha faults={sum(self.faults.values())} failovers={self.failovers} items={s['items']} lost={s['lost']} "
                f"stuck={s['stuck']} duplicates={s['duplicates']} gap_events={s['gap_events']} "
                f"unmatched={s['unmatched_duplicates']} redeliveries={s['redeliveries']} crashes={len(self.crashes)} "
                f"violations={len(self.verdict.violations)} balanced={'true' if s['balanced'] else 'false'} "
                f"seed={self.seed} wall_s={self.wall_s:.0f}")


def _pair_port() -> int:
    """A free port P whose P + 1 (the broker's replication endpoint) is free too."""
    for _ in range(200):
        p = free_tcp_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no free pair of consecutive ports")


class HaChaosRun:
    def __init__(self, opts: HaChaosOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.root = opts.root
        self.root.mkdir(parents=True, exist_ok=True)
        self.etcd_url = f"http://127.0.0.1:{free_tcp_port()}"
        self.etcd_peer = f"http://127.0.0.1:{free_tcp_port()}"
        p1, p2 = _pair_port(), _pair_port()
        self.swarm = self.root / "swarm"
        fast = {"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0, "log_format": "json"}
        self.configs = init_swarm(
            self.swarm, endpoint=f"tcp://127.0.0.1:{p1}", standbys=[f"127.0.0.1:{p2}"], etcd=self.etcd_url, swarm_id=SWARM_ID,
            workers=opts.workers, handler="echo",
            broker={"heartbeat_interval_s": 0.2, "liveness": 5, "lease_ttl_s": 10.0, "retry_backoff_base_s": 0.05,
                    "retry_backoff_max_s": 0.5, "min_free_disk_bytes": 0, "max_attempts": 1000, "retention_s": 30 * 86400.0,
                    "log_format": "json", "ha_lease_ttl_s": LEASE_TTL_S, "ha_lease_margin_s": 1.0,
                    "ha_on_standby_loss": "degrade", "ha_degrade_after_s": 1.0},  # a pair of two keeps serving alone
            worker={**fast, "drain_timeout_s": 1.0},
            producer={**fast, "outbox_dir": "outbox", "inline_max_bytes": 512, "submit_timeout_s": 5.0},
            completion=fast,
        )
        self.nodes = ["broker-1", "broker-2"]
        self.data = {"broker-1": self.swarm / "broker-data", "broker-2": self.swarm / "broker-2-data"}
        self.broker_cfg = {"broker-1": self.configs["brokerd"], "broker-2": self.configs["brokerd-2"]}
        self.peers = [*[f"worker-{n}" for n in range(1, opts.workers + 1)], "completion", "producer"]
        self.procs = ProcessGroup(self.root / "logs")
        self.events = {n: EventLog(d) for n, d in self.data.items()}
        self.progress = self.root / "producer-progress.txt"
        self.count = max(10, int(opts.rate * opts.duration_s))
        self.faults: Counter = Counter()
        self.crashes: list[str] = []
        self.timers: list[tuple[float, int, str, Callable[[], None]]] = []
        self._tseq = 0
        self.down: set[str] = set()
        self.killed: set[str] = set()
        self.stopped: set[str] = set()
        self.epochs: list[int] = []
        self.producer_done = False
        self.etcd: subprocess.Popen | None = None
        self.log_path = self.root / "chaos.log"
        self.t0 = time.monotonic()

    # --- output, timers ------------------------------------------------------------------
    def say(self, msg: str) -> None:
        line = f"[chaos-ha {time.monotonic() - self.t0:7.2f}s] {msg}"
        with open(self.log_path, "a") as f:
            f.write(line + "\n")
        if self.opts.verbose:
            print(line, flush=True)

    def at(self, delay_s: float, what: str, fn: Callable[[], None]) -> None:
        self._tseq += 1
        heapq.heappush(self.timers, (time.monotonic() + delay_s, self._tseq, what, fn))

    def _run_timers(self, *, all_now: bool = False) -> None:
        while self.timers and (all_now or self.timers[0][0] <= time.monotonic()):
            _, _, _, fn = heapq.heappop(self.timers)
            fn()

    # --- etcd ----------------------------------------------------------------------------
    def _start_etcd(self) -> None:
        log = open(self.root / "etcd.log", "ab")  # noqa: SIM115 - the process owns it
        self.etcd = subprocess.Popen(
            [shutil.which("etcd") or "etcd", "--name", "e1", "--data-dir", str(self.root / "etcd-data"), "--listen-client-urls",
             self.etcd_url, "--advertise-client-urls", self.etcd_url, "--listen-peer-urls", self.etcd_peer,
             "--initial-advertise-peer-urls", self.etcd_peer, "--initial-cluster", f"e1={self.etcd_peer}",
             "--initial-cluster-state", "new", "--logger", "zap", "--log-outputs", "stderr"], stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(self.etcd_url + "/health", timeout=1) as r:
                    return b'"true"' in r.read()
            except OSError:
                return False
        wait_until(healthy, 60, "etcd to answer /health", interval_s=0.1)

    def etcd_get(self, key: str) -> dict | None:
        body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(self.etcd_url + "/v3/kv/range", data=body), timeout=3) as r:
                kvs = json.loads(r.read()).get("kvs") or []
        except OSError:
            return None
        return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

    def primary(self) -> dict | None:
        return self.etcd_get(f"/ccsq/{SWARM_ID}/primary")

    def _note_epoch(self) -> dict | None:
        doc = self.primary()
        if doc and (not self.epochs or doc.get("epoch", 0) > self.epochs[-1]):
            if self.epochs:
                self.say(f"failover #{len(self.epochs)}: {doc.get('node')} is primary at epoch {doc.get('epoch')}")
            self.epochs.append(doc.get("epoch", 0))
        return doc

    # --- processes -----------------------------------------------------------------------
    def _proc(self, name: str):
        return self.procs.procs.get(name)

    def _running(self, name: str) -> bool:
        p = self._proc(name)
        return p is not None and p.running

    def _start(self, name: str, *, ready: str | None = None) -> None:
        self.killed.discard(name)
        if name in self.nodes:
            argv = [bin_path("ccsq-brokerd"), "--config", str(self.broker_cfg[name])]
        elif name.startswith("worker-"):
            argv = [bin_path("ccsq-workerd"), "--config", str(self.configs[f"workerd-{int(name.split('-')[1]) - 1}"])]
        elif name == "completion":
            argv = [bin_path("ccsq"), "completion", "--config", str(self.configs["completion"])]
        else:
            argv = [sys.executable, "-m", "tests.chaos.producer", "--config", str(self.configs["producer"]), "--progress",
                    str(self.progress), "--count", str(self.count), "--rate", str(self.opts.rate), "--seed", str(self.opts.seed)]
        self.procs.start(name, argv, env={"PYTHONPATH": str(REPO)}, ready_event=ready, ready_timeout_s=60.0)

    def _kill(self, name: str) -> None:
        if self._running(name):
            self.killed.add(name)
            self.stopped.discard(name)
            self.procs.kill(name)

    def _kill_restart(self, name: str, delay_s: float) -> None:
        self._kill(name)
        self.down.add(name)

        def restart() -> None:
            self.down.discard(name)
            if not self._running(name):
                self._start(name)
        self.at(delay_s, f"restart {name}", restart)

    def _stop(self, name: str, d: float) -> None:
        pid = self._proc(name).popen.pid
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(name)

        def cont() -> None:
            self.stopped.discard(name)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.at(d, f"SIGCONT {name}", cont)

    def _supervise(self) -> None:
        for name in [*self.nodes, *self.peers]:
            proc = self._proc(name)
            if proc is None or proc.running or name in self.down:
                continue
            rc = proc.popen.returncode
            if name == "producer" and rc == 0:
                if not self.producer_done:
                    self.producer_done = True
                    self.say("producer finished: every item accepted and the outbox flushed")
                continue
            if name not in self.killed:
                tail = self.procs.tail(name, 30)
                self.crashes.append(f"{name} exited with {rc}: {tail.strip().splitlines()[-1][:300] if tail.strip() else ''}")
                self.say(f"CRASH: {name} exited with {rc} (not caused by the harness)\n{tail}")
            self._start(name)

    def _results_table_rule(self) -> None:
        """The results-table rule of ``make chaos`` (keys ending in 37 refused: quarantine, G12)."""
        from ccsq.completiond.resultsdb import SqliteResults
        from tests.chaos.checks import REFUSED_KEY_SUFFIX

        db = SqliteResults(self.swarm / "results.db")
        db.connect()
        db._con.execute(f"CREATE TRIGGER IF NOT EXISTS chaos_rule BEFORE INSERT ON results "
                        f"WHEN NEW.idem_key GLOB '*{REFUSED_KEY_SUFFIX}' "
                        "BEGIN SELECT RAISE(ABORT, 'chaos: refused by the results table rule'); END")
        db.close()

    # --- faults --------------------------------------------------------------------------
    def _roles(self) -> tuple[str | None, str | None]:
        """(primary node, standby node that may take over now) or Nones."""
        doc = self._note_epoch()
        if not doc:
            return None, None
        prim = doc.get("node")
        other = next((n for n in self.nodes if n != prim), None)
        sync = self.etcd_get(f"/ccsq/{SWARM_ID}/sync") or {}
        ready = (other is not None and other in sync.get("members", []) and self._running(other) and other not in self.stopped
                 and other not in self.down and prim not in self.stopped and prim not in self.down)
        return prim, (other if ready else None)

    def inject(self) -> None:
        kinds = list(self.opts.faults)
        kind = self.rng.choices(kinds, weights=[self.opts.faults[k] for k in kinds])[0]
        rng = self.rng
        prim, standby = self._roles()
        if kind in ("kill_primary", "stop_primary", "switchover"):
            if prim is None or standby is None:
                return  # no standby may take over now: not a failover fault
            if kind == "kill_primary":
                delay = rng.choice([0.0, rng.uniform(0.2, 1.0), rng.uniform(1.0, 3.0)])
                self.say(f"fault kill_primary: SIGKILL {prim}, restart in {delay:.2f}s")
                self._kill_restart(prim, delay)
            elif kind == "stop_primary":
                d = rng.uniform(LEASE_TTL_S + 1.0, LEASE_TTL_S + 4.0)
                self.say(f"fault stop_primary: SIGSTOP {prim} for {d:.2f}s (etcd lease {LEASE_TTL_S}s)")
                self._stop(prim, d)
            else:
                self.say(f"fault switchover: ccsq failover --to {standby}")
                log = open(self.root / "logs" / "failover.log", "ab")  # noqa: SIM115 - the process owns it
                subprocess.Popen([bin_path("ccsq"), "failover", "--config", str(self.configs["admin"]), "--to", standby,
                                  "--timeout-s", "15", "--json"], stdout=log, stderr=subprocess.STDOUT)
                log.close()
        elif kind == "kill_standby":
            other = next((n for n in self.nodes if n != prim), None) if prim else None
            if other is None or other in self.down or not self._running(other):
                return
            delay = rng.uniform(0.5, 4.0)
            self.say(f"fault kill_standby: SIGKILL {other}, restart in {delay:.2f}s")
            self._kill_restart(other, delay)
        elif kind == "kill_peer":
            name = rng.choice([n for n in self.peers if not (n == "producer" and self.producer_done)])
            if name in self.down:
                return
            delay = rng.choice([0.0, rng.uniform(0.1, 2.0)])
            self.say(f"fault kill_peer: SIGKILL {name}, restart in {delay:.2f}s")
            self._kill_restart(name, delay)
        else:
            name = rng.choice(self.peers)
            if not self._running(name) or name in self.stopped:
                return
            d = rng.uniform(0.2, 3.0)
            self.say(f"fault stop_peer: SIGSTOP {name} for {d:.2f}s")
            self._stop(name, d)
        self.faults[kind] += 1

    # --- the run -------------------------------------------------------------------------
    def run(self) -> HaChaosResult:
        self.say(f"seed={self.opts.seed} duration_s={self.opts.duration_s} rate={self.opts.rate} items={self.count} dir={self.root}")
        node = "broker-1"
        try:
            self._start_etcd()
            self._results_table_rule()
            self._start("broker-1")  # etcd says when it is primary
            wait_until(self._note_epoch, 60, "broker-1 to become primary", interval_s=0.2)
            self._start("broker-2")
            for name in self.peers:
                self._start(name, ready="broker_link_ready" if name != "producer" else None)
            end = time.monotonic() + self.opts.duration_s
            next_fault, next_poll = time.monotonic() + 3.0, 0.0
            while time.monotonic() < end:
                self._run_timers()
                self._supervise()
                now = time.monotonic()
                if now >= next_fault:
                    self.inject()
                    next_fault = now + self.rng.uniform(0.5, 1.5) * self.opts.fault_interval_s
                if now >= next_poll:
                    self._note_epoch()
                    for ev in self.events.values():
                        ev.poll()
                    next_poll = now + 1.0
                time.sleep(0.05)  # the scheduler's tick
            self.say(f"faults stop ({sum(self.faults.values())} injected, {max(0, len(self.epochs) - 1)} failovers); healing")
            self._run_timers(all_now=True)
            self.down.clear()
            self._supervise()
            node = self._settle()
        finally:
            self._run_timers(all_now=True)
            for name in list(self.procs.procs):
                if self._running(name):
                    os.kill(self._proc(name).popen.pid, signal.SIGCONT)
            self.procs.stop_all()
            if self.etcd is not None:
                self.etcd.terminate()
                try:
                    self.etcd.wait(10)
                except subprocess.TimeoutExpired:
                    self.etcd.kill()
        verdict = self._verdict(node)
        result = HaChaosResult(self.opts.seed, self.faults, max(0, len(self.epochs) - 1), self.epochs, self.crashes, verdict,
                               self.opts.min_failovers, time.monotonic() - self.t0)
        if result.failovers < self.opts.min_failovers:
            verdict.violations.append(f"only {result.failovers} failovers (at least {self.opts.min_failovers} wanted): "
                                      "lengthen --duration-s or shorten --fault-interval-s")
        (self.root / "summary.json").write_text(json.dumps({"line": result.line(), "faults": dict(self.faults),
                                                            "epochs": self.epochs, "crashes": self.crashes,
                                                            "violations": verdict.violations, **verdict.summary},
                                                           indent=2, default=str))
        return result

    def _settle(self) -> str:
        """Wait until the producer is done and the primary's ledger has nothing open; returns the primary."""
        deadline = time.monotonic() + self.opts.settle_timeout_s
        last, node = "", "broker-1"
        while time.monotonic() < deadline:
            self._supervise()
            self._run_timers()
            doc = self._note_epoch()
            node = (doc or {}).get("node", node)
            for ev in self.events.values():
                ev.poll()
            try:
                rep = load_report(self.data[node])
            except (LedgerError, OSError) as exc:
                rep, last = None, f"report unavailable: {exc}"
            if rep is not None:
                s = rep["states"]
                open_items = s["ready"] + s["leased"] + s["completed"]
                last = f"primary={node} producer_done={self.producer_done} open={open_items} states={s}"
                if self.producer_done and open_items == 0:
                    self.say(f"settled: {last}")
                    return node
            time.sleep(0.5)  # polling the ledger for a condition, with a deadline
        self.say(f"NOT SETTLED after {self.opts.settle_timeout_s}s: {last}")
        return node

    def _verdict(self, node: str) -> Verdict:
        events = self.events[node]
        for other, ev in self.events.items():  # replicated ledgers: the same (window, seq) keys
            if other != node:
                for k, e in ev.events.items():
                    events.events.setdefault(k, e)
        accepted = {key_for(self.opts.seed, i): item_id for i, item_id in read_progress(self.progress).items()}
        expected = {key_for(self.opts.seed, i): payload_for(self.opts.seed, i) for i in read_progress(self.progress)}
        workers = [p for n, p in self.procs.procs.items() if n.startswith("worker-")]
        return check(data_dir=self.data[node], results_db=self.swarm / "results.db", workers=workers, accepted=accepted,
                     expected_payload=expected, deleted_payload_keys=set(), events=events)


def run_ha_chaos(opts: HaChaosOptions) -> HaChaosResult:
    """Run once; prints the violations, crashes and the summary line."""
    result = HaChaosRun(opts).run()
    for v in result.verdict.violations:
        print(f"VIOLATION: {v}", flush=True)
    for c in result.crashes:
        print(f"CRASH: {c}", flush=True)
    print(result.line(), flush=True)
    return result


def options_from(args: Any, seed: int, root: Path) -> HaChaosOptions:
    """``python -m tests.chaos --ha`` arguments -> options (the shared flags keep their meaning)."""
    faults = dict(HA_FAULTS)
    if args.only:
        want = {k.strip() for k in args.only.split(",") if k.strip()}
        unknown = want - set(HA_FAULTS)
        if unknown:
            raise SystemExit(f"unknown --ha fault kinds {sorted(unknown)} (of {','.join(HA_FAULTS)})")
        faults = {k: w for k, w in HA_FAULTS.items() if k in want}
    return HaChaosOptions(root=root, seed=seed, duration_s=args.duration_s, rate=args.rate, workers=args.workers,
                          fault_interval_s=args.fault_interval_s, settle_timeout_s=args.settle_timeout_s,
                          min_failovers=args.min_failovers, faults=faults, verbose=not args.quiet)
