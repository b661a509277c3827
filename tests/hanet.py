"""A broker pair on network namespaces (tests/netns.py) for the failover tests (issue 23).

Hosts (one namespace each, on one bridge): ``etcd`` (a real one-member ``etcd``, Debian's
etcd-server, client URL on its host address), ``broker-1`` and ``broker-2`` (``ccsq-brokerd``
on the configs ``ccsq init --standby`` wrote: one service identity, a node key each,
``ha_etcd_endpoints`` naming the etcd host), ``gpu-1`` / ``gpu-2`` (a ``ccsq-workerd``
each), ``completion`` (``ccsq completion`` on SQLite) and ``producer`` (the chaos
producer, :mod:`tests.chaos.producer`: fixed keys and payloads, a progress file of what
it was told was accepted). Endpoints are host addresses (ZeroMQ binds addresses, not
names); every peer's ``broker_endpoint`` lists both brokers.

The test process sits in the root namespace: it reaches no host over the network, so it
reads files (ledgers read-only, the results database, JSON logs, the producer's
progress) and runs short commands inside a host (:meth:`HaNet.etcd_get` asks etcd from
the etcd host, :meth:`HaNet.ha_status` runs ``ccsq status --json`` on the producer host).

What every case checks at the end (:meth:`HaNet.verdict`): the invariants of ``make
chaos`` (:func:`tests.chaos.checks.check`) on the ledger of the primary at the end:
every item the producer was told was accepted is there once and acknowledged, with its
result row once (a duplicate only with its gap event), and the books balance.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from ccsq.tools.procs import ProcessGroup, bin_path, wait_until
from tests.chaos.checks import EventLog, Verdict, check
from tests.chaos.producer import key_for, payload_for, read_progress
from tests.netns import Network

REPO = Path(__file__).resolve().parents[1]
HOSTS = ["etcd", "broker-1", "broker-2", "gpu-1", "gpu-2", "producer", "completion"]
SUBNET = "10.214.0.0/24"
BROKER_PORT = 5555  # each host has its own network stack: fixed ports cannot collide
ETCD_PORT = 2379
#: Per test process: each broker holds a host-wide flock per (swarm, node id) in /run/lock
#: (brokerd/role.py node_lock), which network namespaces do not separate; two pairs run at once
#: (a test run beside a bench) would refuse each other's broker-1 as "the same node".
SWARM_ID = f"hanet-{os.getpid()}"
LEASE_TTL_S = 3  # the etcd lease of the primary key (the figure: failover <= 5 s with a 3 s lease)
PY = sys.executable
ETCD = shutil.which("etcd")

# Runs on the etcd host: GET one key through etcd's v3 JSON gateway; prints the value or "".
ETCD_GET = r"""
import base64, json, sys, urllib.request
body = json.dumps({"key": base64.b64encode(sys.argv[2].encode()).decode()}).encode()
req = urllib.request.Request(sys.argv[1] + "/v3/kv/range", data=body)
doc = json.loads(urllib.request.urlopen(req, timeout=3).read())
kvs = doc.get("kvs") or []
print(base64.b64decode(kvs[0]["value"]).decode() if kvs else "")
"""

ETCD_HEALTH = r"""
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1] + "/health", timeout=1).read().decode())
except OSError as exc:
    print("down", exc)
"""


def etcd_missing() -> str | None:
    """Why the pair cannot run here (no etcd binary, no etcd3gw), or None."""
    if ETCD is None:
        return "etcd is not installed (apt-get install etcd-server; .ci/run installs it)"
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "etcd3gw is not installed (the ha extra)"
    return None


def _iso_s(ts: str) -> float:
    """A log line's ISO-8601 UTC timestamp as epoch seconds."""
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


class HaNet:
    """The running pair and its peers. ``nodes``: broker-1, broker-2 (process names too).

    ``broker``: extra keys for both brokers' configs (e.g. ``ha_mode``,
    ``ha_on_standby_loss``); ``handler``: the workers' handler (echo: the result is the
    payload, checked; sleep: items take time, so a failover lands mid-job)."""

    def __init__(self, net: Network, root: Path, *, broker: dict | None = None, handler: str = "echo",
                 worker: dict | None = None, seed: int = 23) -> None:
        self.net, self.root, self.seed, self.handler = net, root, seed, handler
        self.etcd_url = f"http://{net['etcd'].addr}:{ETCD_PORT}"
        self.procs = ProcessGroup(root / "logs")
        self.swarm = root / "swarm"
        self.progress = root / "producer-progress.txt"
        self.etcd_proc: subprocess.Popen | None = None
        self.configs = self._init(broker or {}, worker or {})
        self.nodes = ["broker-1", "broker-2"]
        self.events = EventLog(self.data_dir("broker-1"))
        self.events2 = EventLog(self.data_dir("broker-2"))
        self.produced = 0

    # --- set-up ---------------------------------------------------------------------------
    def _init(self, broker: dict, worker: dict) -> dict[str, Path]:
        """``ccsq init --standby`` as the operator runs it, then the tests' fast timings."""
        b1, b2 = self.net["broker-1"].addr, self.net["broker-2"].addr
        argv = [bin_path("ccsq"), "init", str(self.swarm), "--endpoint", f"tcp://{b1}:{BROKER_PORT}", "--standby", b2,
                "--etcd", self.etcd_url, "--workers", "2", "--handler", self.handler, "--swarm-id", SWARM_ID]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        configs = {"broker-1": self.swarm / "brokerd.toml", "broker-2": self.swarm / "brokerd-2.toml",
                   "worker-1": self.swarm / "workerd-0.toml", "worker-2": self.swarm / "workerd-1.toml",
                   "producer": self.swarm / "producer.toml", "completion": self.swarm / "completion.toml",
                   "admin": self.swarm / "admin.toml"}
        fast_peer = {"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0, "log_format": "json"}
        overrides = {
            "broker-1": {"heartbeat_interval_s": 0.2, "liveness": 5, "lease_ttl_s": 10.0, "retry_backoff_base_s": 0.05,
                         "retry_backoff_max_s": 0.3, "min_free_disk_bytes": 0, "max_attempts": 1000, "log_format": "json",
                         "ha_lease_ttl_s": LEASE_TTL_S, "ha_lease_margin_s": 1.0,
                         # a pair of two: the new primary has no standby until the old one is back; degrade after 1 s
                         # keeps the swarm serving (docs/ha.md "Operations"); the wait case sets "wait"
                         "ha_on_standby_loss": "degrade", "ha_degrade_after_s": 1.0, **broker},
            "worker-1": {**fast_peer, "slots": 1, "prefetch": 1, **worker},
            "worker-2": {**fast_peer, "slots": 1, "prefetch": 1, **worker},
            "producer": {**fast_peer, "submit_timeout_s": 5.0, "inline_max_bytes": 512},
            "completion": fast_peer,
            "admin": {"connect_timeout_s": 5.0, "hello_timeout_s": 2.0},
        }
        overrides["broker-2"] = overrides["broker-1"]
        for name, extra in overrides.items():
            doc = tomllib.loads(configs[name].read_text())
            assert doc.get("curve") is True, f"{configs[name]}: ccsq init did not turn CURVE on beyond loopback"
            doc.update(extra)
            configs[name].write_text(tomli_w.dumps(doc))
        return configs

    def start_etcd(self) -> None:
        """A one-member etcd on the etcd host (client URL on its address, peer URL on its loopback)."""
        host = self.net["etcd"]
        peer = "http://127.0.0.1:2380"
        log = open(self.root / "etcd.log", "ab")  # noqa: SIM115 - the process owns it
        self.etcd_proc = host.popen(
            [ETCD, "--name", "e1", "--data-dir", str(self.root / "etcd-data"), "--listen-client-urls", self.etcd_url,
             "--advertise-client-urls", self.etcd_url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"e1={peer}", "--initial-cluster-state", "new", "--logger", "zap", "--log-outputs", "stderr"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def healthy() -> bool:
            if self.etcd_proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.root / 'etcd.log').read_text()[-2000:]}")
            return '"true"' in host.run([PY, "-c", ETCD_HEALTH, self.etcd_url], timeout_s=10).stdout
        wait_until(healthy, 60, "etcd to answer /health on its host", interval_s=0.2)

    def etcd_get(self, key: str) -> str:
        """The value of ``key`` (asked from the etcd host), "" when absent."""
        res = self.net["etcd"].run([PY, "-c", ETCD_GET, self.etcd_url, key], timeout_s=15)
        if res.returncode != 0:
            raise RuntimeError(f"etcd get {key}: {res.stderr[-500:]}")
        return res.stdout.strip()

    def primary(self) -> dict[str, Any] | None:
        """etcd's word on who is primary: ``{"epoch", "endpoint", "repl_endpoint", "node", ...}`` or None."""
        text = self.etcd_get(f"/ccsq/{SWARM_ID}/primary")
        return json.loads(text) if text else None

    def sync_set(self) -> dict[str, Any] | None:
        text = self.etcd_get(f"/ccsq/{SWARM_ID}/sync")
        return json.loads(text) if text else None

    def _start(self, name: str, host: str, argv: list[str], ready: str | None, env: dict | None = None) -> None:
        self.procs.start(name, self.net[host].argv(argv), env=env, ready_event=ready, ready_timeout_s=60.0)

    def start_broker(self, node: str, ready: str | None = None) -> None:
        self._start(node, node, [bin_path("ccsq-brokerd"), "--config", str(self.configs[node])], ready)

    def start_pair(self) -> str:
        """etcd, broker-1 (it becomes primary), broker-2 (standby, in sync); returns the primary's node."""
        if self.etcd_proc is None:
            self.start_etcd()
        self.start_broker("broker-1")  # no log line to wait for: etcd says when it is primary
        first = self.wait_primary()
        self.start_broker("broker-2")
        self.wait_in_sync()
        return first["node"]

    def results_table_rule(self) -> None:
        """The chaos run's rule on the results table (keys ending in ``37`` refused: those results
        must end in the quarantine with a G12 event, never lost and never twice), before the
        completion service first opens it."""
        from ccsq.completiond.resultsdb import SqliteResults
        from tests.chaos.checks import REFUSED_KEY_SUFFIX

        db = SqliteResults(self.swarm / "results.db")
        db.connect()
        db._con.execute(f"CREATE TRIGGER IF NOT EXISTS chaos_rule BEFORE INSERT ON results "
                        f"WHEN NEW.idem_key GLOB '*{REFUSED_KEY_SUFFIX}' "
                        "BEGIN SELECT RAISE(ABORT, 'chaos: refused by the results table rule'); END")
        db.close()

    def start_peers(self) -> None:
        if not (self.swarm / "results.db").exists():
            self.results_table_rule()
        self._start("worker-1", "gpu-1", [bin_path("ccsq-workerd"), "--config", str(self.configs["worker-1"])], "broker_link_ready")
        self._start("worker-2", "gpu-2", [bin_path("ccsq-workerd"), "--config", str(self.configs["worker-2"])], "broker_link_ready")
        self._start("completion", "completion", [bin_path("ccsq"), "completion", "--config", str(self.configs["completion"])],
                    "broker_link_ready")

    def start_producer(self, count: int, rate: float, *, kind: str | None = None, sleep_max_s: float = 0.0) -> None:
        """The chaos producer on the producer host: items 0..count-1 (resumes after its progress);
        a previous producer is waited for first (it exits once its items are accepted)."""
        prev = self.procs.procs.get("producer")
        if prev is not None and prev.running:
            self.procs.wait_exit("producer", timeout_s=60)
        self.produced = max(self.produced, count)
        argv = [PY, "-m", "tests.chaos.producer", "--config", str(self.configs["producer"]), "--progress", str(self.progress),
                "--count", str(count), "--rate", str(rate), "--seed", str(self.seed), "--kind", kind or self.handler,
                "--sleep-max-s", str(sleep_max_s)]
        self._start("producer", "producer", argv, None, env={"PYTHONPATH": str(REPO)})

    def close(self) -> None:
        for name in list(self.procs.procs):
            proc = self.procs.procs[name]
            if proc.running:
                os.kill(proc.popen.pid, signal.SIGCONT)
        self.procs.stop_all()
        if self.etcd_proc is not None and self.etcd_proc.poll() is None:
            self.etcd_proc.send_signal(signal.SIGCONT)
            self.etcd_proc.terminate()
            try:
                self.etcd_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.etcd_proc.kill()
                self.etcd_proc.wait()

    # --- faults ---------------------------------------------------------------------------
    def kill(self, name: str) -> float:
        """SIGKILL ``name``; returns the wall time of the kill (epoch seconds)."""
        t = time.time()
        self.procs.kill(name)
        return t

    def signal(self, name: str, sig: int) -> float:
        t = time.time()
        os.kill(self.procs.procs[name].popen.pid, sig)
        return t

    def cut(self, node: str, how: str) -> float:
        """Pull ``node``'s cable (``link``) or DROP its traffic (``iptables``); returns the wall time."""
        t = time.time()
        self.net[node].cut(how)
        return t

    def restore(self, node: str) -> None:
        self.net[node].restore()

    def block_etcd(self, node: str, on: bool) -> None:
        """DROP the traffic between ``node`` and the etcd host only (iptables in ``node``): etcd
        unreachable from that broker while everyone else reaches both."""
        etcd = self.net["etcd"].addr
        for rule in (["OUTPUT", "-d", etcd, "-j", "DROP"], ["INPUT", "-s", etcd, "-j", "DROP"]):
            subprocess.run(self.net[node].argv(["iptables", "-I" if on else "-D", *rule]), check=True, capture_output=True,
                           timeout=15)

    # --- observations ---------------------------------------------------------------------
    def data_dir(self, node: str) -> Path:
        """``node``'s ledger directory (``ccsq init --standby``: broker-data, broker-2-data)."""
        return self.swarm / ("broker-data" if node == "broker-1" else f"broker-{node.split('-')[1]}-data")

    def wait_primary(self, *, other_than: str = "", above_epoch: int = 0, timeout_s: float = 60.0) -> dict[str, Any]:
        """etcd's primary record once it names a node other than ``other_than`` with an epoch above ``above_epoch``."""
        def ok() -> dict | None:
            doc = self.primary()
            return doc if doc and doc.get("node") != other_than and doc.get("epoch", 0) > above_epoch else None
        return wait_until(ok, timeout_s, f"a primary other than {other_than or '-'} above epoch {above_epoch}", interval_s=0.2)

    def ha_status(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """``ccsq status --json`` run on the producer host (the admin follows the endpoint list); {} when none answered."""
        res = self.net["producer"].run([bin_path("ccsq"), "status", "--json", "--config", str(self.configs["admin"])],
                                       timeout_s=timeout_s)
        try:
            doc = json.loads(res.stdout)
        except ValueError:
            return {}
        return doc if doc.get("source") == "broker" else {}

    def wait_in_sync(self, standby: str = "", timeout_s: float = 90.0) -> dict[str, Any]:
        """The primary's ha section once a standby (``standby``, or any) is in sync and in etcd's sync set."""
        def ok() -> dict | None:
            ha = self.ha_status().get("ha") or {}
            sbs = [s for s in ha.get("standbys", []) if s.get("in_sync") and (not standby or s.get("node") == standby)]
            return ha if sbs else None
        return wait_until(ok, timeout_s, f"standby {standby or 'any'} in sync", interval_s=0.5)

    def accepted(self) -> dict[str, str]:
        """{key: item_id} the producer was told were accepted (its progress file)."""
        return {key_for(self.seed, i): item_id for i, item_id in read_progress(self.progress).items()}

    def poll_events(self) -> None:
        self.events.poll()
        self.events2.poll()

    def report(self, node: str) -> dict[str, Any]:
        from ccsq.brokerd.gap_report import load_report

        return load_report(self.data_dir(node))

    def wait_settled(self, node: str, count: int, timeout_s: float = 180.0) -> dict[str, Any]:
        """Until the producer accepted ``count`` items and ``node``'s ledger holds nothing ready, leased or completed."""
        def ok() -> dict | None:
            self.poll_events()
            if len(read_progress(self.progress)) < count:
                return None
            try:
                rep = self.report(node)
            except Exception:  # noqa: BLE001 - the ledger being opened right now: next poll
                return None
            s = rep["states"]
            return rep if s["ready"] + s["leased"] + s["completed"] == 0 and rep["counters"]["received"] >= count else None
        return wait_until(ok, timeout_s, f"{node}'s ledger to settle with {count} items", interval_s=0.5)

    def verdict(self, node: str) -> Verdict:
        """The chaos invariants on ``node``'s ledger (the primary at the end); events from both ledgers."""
        self.poll_events()
        events = self.events if node == "broker-1" else self.events2
        other = self.events2 if node == "broker-1" else self.events
        for k, e in other.events.items():  # replicated: the same (window, seq) keys; a trimmed one may live on in the other
            events.events.setdefault(k, e)
        accepted = self.accepted()
        expected = {k: payload_for(self.seed, int(k.rsplit("-", 1)[1])) for k in accepted} if self.handler == "echo" else {}
        workers = [p for n, p in self.procs.procs.items() if n.startswith("worker-")]
        return check(data_dir=self.data_dir(node), results_db=self.swarm / "results.db", workers=workers, accepted=accepted,
                     expected_payload=expected, deleted_payload_keys=set(), events=events)

    def first_dispatch_after(self, t_wall: float) -> float | None:
        """Wall time of the first DISPATCH a worker received from a session that began after
        ``t_wall`` (so from the new primary: the old one's frames in flight do not count)."""
        best = None
        for name, proc in self.procs.procs.items():
            if not name.startswith("worker-"):
                continue
            session_at = None
            for e in proc.events():
                ts = e.get("timestamp")
                if not ts:
                    continue
                t = _iso_s(ts)
                if e.get("event") == "session_started" and t >= t_wall and session_at is None:
                    session_at = t
                elif e.get("event") == "dispatched" and session_at is not None and t >= session_at:
                    best = t if best is None else min(best, t)
                    break
        return best

    def failover_time_s(self, t_fault: float, timeout_s: float = 60.0) -> float:
        """Seconds from the fault (SIGKILL, cable pull) to the first DISPATCH by the new primary."""
        t = wait_until(lambda: self.first_dispatch_after(t_fault), timeout_s, "a DISPATCH from the new primary", interval_s=0.1)
        return t - t_fault
