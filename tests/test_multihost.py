"""A swarm spread over several hosts: real network namespaces (``tests/netns.py``).

Hosts (one namespace each, on one bridge, addresses 10.213.0.10...):

- ``broker-host``: ``ccsq-brokerd`` bound to its host address (not loopback), so
  CURVE with the ZAP allow-list is on (``ccsq init`` wrote the keys and
  ``curve = true`` everywhere); its Prometheus ``metrics_listen`` on the same address;
- ``gpu-1``, ``gpu-2``: one ``ccsq-workerd`` each (``sleep`` handler);
- ``completion-host``: ``ccsq completion`` with its SQLite results database;
- ``producer-host``: ``ccsq submit`` and a small producer script;
- ``stranger``: a host with the broker's public keys but no authorized CURVE key.

Peers reach the broker by name (``tcp://broker-host:5555``), resolved through each
namespace's ``/etc/hosts``. The swarm directory is on the one shared filesystem:
the ``file://`` claim store plays the part of a store every host reaches (S3 in a
real deployment); each process only uses its own files.

The swarm is started once for the module; the tests run in file order and each
leaves it serving. Skips where namespaces cannot be made, fails under ``CI``.
Budget: the whole file within 75 s on 2 shared cores.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from ccsq.brokerd.ledger.store import Ledger, data_paths
from ccsq.brokerd.gap_report import load_report
from ccsq.common.wire.keys import write_curve_keypair, write_keypair
from ccsq.tools.procs import ProcessGroup, bin_path, wait_until
from tests.netns import Network, netns_module, remove_stale, require_netns  # noqa: F401 (netns_module: fixture)

REPO = Path(__file__).resolve().parents[1]
PORT = 5555  # every host has its own network stack: fixed ports cannot collide with anything
METRICS_PORT = 9464
HOSTS = ["broker-host", "gpu-1", "gpu-2", "completion-host", "producer-host", "stranger"]
LEASE_TTL_S = 2.0
PY = sys.executable

# What a producer host runs: submit N sleep items (optionally wait); prints the ids as JSON.
PRODUCER = r"""
import json, sys
from ccsq.producer import Client
cfg, n, seconds, tag, wait_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], float(sys.argv[5])
with Client.from_config_file(cfg) as c:
    rs = c.submit_many([{"payload": f"{tag}-{i}".encode(), "kind": "sleep", "params": {"seconds": seconds}} for i in range(n)])
    ids = [r.item_id for r in rs]
    states = {i: s.state for i, s in c.wait(ids, timeout_s=wait_s).items()} if wait_s > 0 else {}
print(json.dumps({"ids": ids, "states": states}))
"""

# What the stranger runs: a ccsq client with keys the broker does not list.
STRANGER = r"""
import json, logging, sys
from ccsq.common.wire.errors import BrokerUnavailable, Unauthorized
from ccsq.producer import Client
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
try:
    with Client.from_config_file(sys.argv[1]) as c:
        c.submit(b"let me in", "sleep", timeout_s=float(sys.argv[2]))
    print(json.dumps({"outcome": "submitted"}))
except (Unauthorized, BrokerUnavailable) as exc:
    print(json.dumps({"outcome": type(exc).__name__, "error": str(exc)}))
"""

# The stranger's junk flood: N CURVE connections with fresh keys, as fast as they go.
FLOOD = r"""
import json, sys, zmq
sys.path.insert(0, sys.argv[5])
from bench.junk_flood import flood
endpoint, conns, frame_bytes, duration_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
server_key = open(sys.argv[6]).read().strip().encode()
print(json.dumps(flood(endpoint, conns, frame_bytes, duration_s, [zmq.curve_keypair() for _ in range(conns)], server_key)))
"""

SCRAPE = r"""
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
"""


def _init_swarm(broker_host, root: Path) -> dict[str, Path]:
    """``ccsq init`` as an operator runs it on the broker host; returns {name: config path}.

    Peers connect to ``tcp://broker-host:PORT``; the broker binds its host address.
    ``ccsq init --bind`` (separate bind and advertised endpoints) is used when this
    checkout has it; without it the broker's ``endpoint`` is rewritten to the bind
    address, since ZeroMQ binds addresses and interfaces, not host names."""
    bind = f"tcp://{broker_host.addr}:{PORT}"
    argv = [bin_path("ccsq"), "init", str(root), "--endpoint", f"tcp://broker-host:{PORT}", "--workers", "2", "--handler", "sleep"]
    has_bind_flag = "--bind" in broker_host.run([bin_path("ccsq"), "init", "--help"]).stdout
    if has_bind_flag:
        argv += ["--bind", bind]
    res = broker_host.run(argv, timeout_s=60)
    assert res.returncode == 0, res.stdout + res.stderr
    configs = {name: root / f"{name}.toml" for name in ("brokerd", "producer", "completion", "admin")}
    # worker configs are named after the GPU index (workerd-0.toml...) or the peer (workerd-1.toml...): key them by peer id
    for path in root.glob("workerd-*.toml"):
        configs[tomllib.loads(path.read_text())["peer_id"]] = path
    assert {"worker-1", "worker-2"} <= set(configs), sorted(configs)
    fast_peer = {"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0}
    overrides = {
        "brokerd": {"heartbeat_interval_s": 0.2, "liveness": 5, "lease_ttl_s": LEASE_TTL_S, "retry_backoff_base_s": 0.05,
                    "retry_backoff_max_s": 0.3, "min_free_disk_bytes": 0, "metrics_listen": f"{broker_host.addr}:{METRICS_PORT}",
                    **({} if has_bind_flag else {"endpoint": bind})},
        "worker-1": {**fast_peer, "slots": 1, "prefetch": 1},
        "worker-2": {**fast_peer, "slots": 1, "prefetch": 1},
        "producer": {**fast_peer, "submit_timeout_s": 3.0},
        "completion": fast_peer,
        "admin": {},
    }
    for name, extra in overrides.items():
        doc = tomllib.loads(configs[name].read_text())
        # CURVE is on by default beyond loopback: ccsq init must have written it, not this test
        assert doc.get("curve") is True, f"{configs[name]}: ccsq init did not turn CURVE on for a non-loopback endpoint"
        doc.update(extra)
        configs[name].write_text(tomli_w.dumps(doc))
    return configs


class Cluster:
    """The running multi-host swarm of this module."""

    def __init__(self, net: Network, root: Path) -> None:
        self.net, self.root = net, root
        self.configs = _init_swarm(net["broker-host"], root)
        self.procs = ProcessGroup(root / "logs")

    def start(self, name: str, host: str, argv: list[str], ready: str) -> None:
        self.procs.start(name, self.net[host].argv(argv), ready_event=ready, ready_timeout_s=60.0)

    def start_all(self) -> None:
        self.start("broker", "broker-host", [bin_path("ccsq-brokerd"), "--config", str(self.configs["brokerd"])], "broker_started")
        self.start("worker-1", "gpu-1", [bin_path("ccsq-workerd"), "--config", str(self.configs["worker-1"])], "broker_link_ready")
        self.start("worker-2", "gpu-2", [bin_path("ccsq-workerd"), "--config", str(self.configs["worker-2"])], "broker_link_ready")
        self.start("completion", "completion-host", [bin_path("ccsq"), "completion", "--config", str(self.configs["completion"])],
                   "broker_link_ready")

    # --- observations from the test (root namespace: files only, the network is out of reach) ---
    def report(self) -> dict:
        return load_report(self.root / "broker-data")

    def items(self, ids: list[str]) -> dict[str, dict]:
        ledger = Ledger(data_paths(self.root / "broker-data")[0], readonly=True)
        try:
            with ledger.read() as view:
                return {i: view.get(i) for i in ids}
        finally:
            ledger.close()

    def leased_to(self, worker: str) -> dict[str, int]:
        """{item_id: token} of the items now leased to ``worker``."""
        ledger = Ledger(data_paths(self.root / "broker-data")[0], readonly=True)
        try:
            with ledger.read() as view:
                return {i: t for i, t, w in view.leased_items() if w == worker}
        finally:
            ledger.close()

    def results(self) -> list[str]:
        """item ids of the rows in the completion host's results table (one per row)."""
        db = self.root / "results.db"
        if not db.exists():
            return []
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return [r[0] for r in con.execute("SELECT item_id FROM results")]
        except sqlite3.OperationalError:
            return []
        finally:
            con.close()

    def events(self, window: str) -> list[dict]:
        return next(w["recent"] for w in self.report()["windows"] if w["id"] == window)

    # --- actions on a host ---
    def produce(self, n: int, seconds: float, tag: str, wait_s: float = 0.0) -> dict:
        res = self.net["producer-host"].run([PY, "-c", PRODUCER, str(self.configs["producer"]), str(n), str(seconds), tag, str(wait_s)],
                                            timeout_s=wait_s + 40)
        assert res.returncode == 0, res.stdout + res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    def scrape(self, from_host: str) -> str:
        res = self.net[from_host].run([PY, "-c", SCRAPE, f"http://broker-host:{METRICS_PORT}/metrics"], timeout_s=20)
        assert res.returncode == 0, f"scrape from {from_host} failed: {res.stderr}"
        return res.stdout

    def broker_rss_mib(self) -> float:
        pid = self.procs.procs["broker"].popen.pid
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
        raise AssertionError("no VmRSS")

    def assert_balanced(self) -> dict:
        res = self.net["broker-host"].run([bin_path("ccsq"), "gap-report", "--config", str(self.configs["brokerd"]), "--json"])
        assert res.returncode == 0, f"gap-report exit {res.returncode}: {res.stdout[-2000:]} {res.stderr[-2000:]}"
        report = json.loads(res.stdout)
        assert report["balanced"], report["counters"]
        return report


def metric(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (any labels) in a Prometheus exposition."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"{name} not in the scrape"
    return total


@pytest.fixture(scope="module")
def cluster(netns_module, tmp_path_factory):
    """The swarm on its six hosts; stopped before ``netns_module`` removes the namespaces."""
    net = netns_module(HOSTS)
    c = Cluster(net, tmp_path_factory.mktemp("multihost") / "swarm")
    try:
        c.start_all()
        yield c
    finally:
        for h in net.hosts.values():
            h.restore()
        c.procs.stop_all(timeout_s=10)


# --- the fixture itself ----------------------------------------------------------------


def test_netns_fixture_isolates_resolves_cuts_and_cleans_up():
    """Two hosts reach each other by name, not from the root namespace; both cut methods
    stop traffic and restore it; destroy leaves nothing; a dead run's leftovers are removed."""
    remove_stale()
    require_netns()
    server = ("import socket\ns=socket.socket();s.bind(('0.0.0.0',7000));s.listen(16)\n"
              "while True:\n c,_=s.accept();c.sendall(b'ok');c.close()")
    probe = ("import socket,sys\ntry:\n s=socket.create_connection((sys.argv[1],7000),timeout=0.7);print(s.recv(2).decode())\n"
             "except OSError as e:\n print('unreachable')")
    with Network(["a", "b"]) as net:
        names = [net.switch_ns, net["a"].ns, net["b"].ns]
        srv = net["b"].popen([PY, "-c", server])
        try:
            wait_until(lambda: net["a"].run([PY, "-c", probe, "b"]).stdout.strip() == "ok", 15, "b reachable from a by name")
            assert "10.213.0.11\tb" in net["a"].run(["cat", "/etc/hosts"]).stdout
            # the root namespace has no route to the test range
            assert subprocess.run([PY, "-c", probe, net["b"].addr], capture_output=True, text=True).stdout.strip() == "unreachable"
            hows = ["link"] + (["iptables"] if net["b"].iptables_usable() else [])
            for how in hows:
                net["b"].cut(how)
                assert net["a"].run([PY, "-c", probe, "b"]).stdout.strip() == "unreachable", how
                net["b"].restore()
                assert net["a"].run([PY, "-c", probe, "b"]).stdout.strip() == "ok", how
        finally:
            srv.kill()
            srv.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert not any((Path("/etc/netns") / n).exists() for n in names)
    # leftovers of a killed run (its pid no longer exists) are removed by the next one
    dead_pid = 2 ** 22 + 7  # above pid_max's default 4194304: never a live process
    stale = f"ccsqt-{dead_pid}-dead-x"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    (Path("/etc/netns") / stale).mkdir(parents=True, exist_ok=True)
    assert stale in remove_stale()
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not (Path("/etc/netns") / stale).exists()


# --- the swarm across hosts ------------------------------------------------------------


def test_items_from_a_producer_host_are_acknowledged_and_the_books_balance(cluster, tmp_path):
    """``ccsq submit --wait`` on the producer host; both GPU hosts work; results land on the
    completion host; ``ccsq gap-report`` balances."""
    files = []
    for i in range(12):
        f = tmp_path / f"page-{i:02d}.txt"
        f.write_text(f"page {i}\n")
        files.append(str(f))
    res = cluster.net["producer-host"].run([bin_path("ccsq"), "submit", "--config", str(cluster.configs["producer"]), "--kind",
                                            "sleep", "--wait", "--timeout-s", "40", "--json", *files], timeout_s=60)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(res.stdout)
    ids = [r["item_id"] for r in rows]
    assert len(set(ids)) == 12 and all(r["state"] == "acknowledged" for r in rows)
    recs = cluster.items(ids)
    assert {recs[i]["worker_done"] for i in ids} == {"worker-1", "worker-2"}, "both GPU hosts must have worked"
    got = cluster.results()
    assert all(got.count(i) == 1 for i in ids)
    cluster.assert_balanced()


def test_stranger_without_an_authorized_curve_key_is_dropped_at_the_handshake(cluster):
    """Case C09 across hosts: a client with a CURVE key the broker does not list never gets a session, and a junk
    flood over such connections does not make the broker hold memory."""
    stranger = cluster.net["stranger"]
    sdir = cluster.root / "stranger"
    write_keypair(sdir, "stranger")  # what `ccsq keygen` (with and without --curve) writes, never listed
    write_curve_keypair(sdir, "stranger")
    cfg = sdir / "producer.toml"
    cfg.write_text(tomli_w.dumps({
        "peer_id": "stranger", "private_key": "stranger.key", "authorized_keys": str(cluster.root / "authorized_keys.toml"),
        "broker_endpoint": f"tcp://broker-host:{PORT}", "curve": True, "curve_secret_key": "stranger.curve.key",
        "broker_curve_public_key": str(cluster.root / "keys" / "broker.curve.pub"), "claim_store": f"file://{cluster.root / 'blobs'}",
        "reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0, "submit_timeout_s": 2.0,
    }))
    before = metric(cluster.scrape("completion-host"), "ccsq_zap_refused_total")
    received_before = cluster.report()["counters"]["received"]

    r = stranger.run([PY, "-c", STRANGER, str(cfg), "3"], timeout_s=40)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # refused at the CURVE handshake (ZAP), told so with the fix: not left retrying
    assert out["outcome"] == "Unauthorized" and "CURVE_REFUSED" in out["error"], out

    # junk flood: 8 connections with fresh unlisted keys, 256 KiB frames, 1.5 s
    rss_before = cluster.broker_rss_mib()
    peak = [rss_before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], cluster.broker_rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        r = stranger.run([PY, "-c", FLOOD, f"tcp://broker-host:{PORT}", "8", str(256 * 1024), "1.5", str(REPO),
                          str(cluster.root / "keys" / "broker.curve.pub")], timeout_s=40)
    finally:
        stop.set()
        sampler.join()
    assert r.returncode == 0, r.stdout + r.stderr
    flooded = json.loads(r.stdout.strip().splitlines()[-1])
    # nothing was ever read from the stranger: the broker's memory stays put
    assert peak[0] - rss_before < 16.0, (rss_before, peak[0], flooded)
    after = wait_until(lambda: (v := metric(cluster.scrape("completion-host"), "ccsq_zap_refused_total")) >= before + 2 and v,
                       15, "the ZAP refusals to be counted")
    assert after >= before + 2
    assert cluster.report()["counters"]["received"] == received_before  # the stranger never submitted anything
    print(f"stranger flood: {flooded}, broker RSS {rss_before:.1f} -> peak {peak[0]:.1f} MiB, "
          f"ccsq_zap_refused_total {before:.0f} -> {after:.0f}")
    assert cluster.procs.procs["broker"].running
    cluster.assert_balanced()


def test_gpu_host_cut_longer_than_the_lease_requeues_to_the_other_host(cluster):
    """Cases C02 and C04 across hosts: gpu-2's cable is pulled while it holds leases, for longer than lease_ttl_s: its leases
    expire (G2) and the items run on gpu-1; once the cable is back the worker resumes, its late
    results are fenced (G4) or accepted (G8) by the ledger's rule, and nothing is lost or doubled."""
    first = cluster.produce(20, 0.3, "cut")["ids"]
    wait_until(lambda: cluster.leased_to("worker-1") and cluster.leased_to("worker-2"), 30, "both workers to hold leases")
    g2_before = len([e for e in cluster.events("G2") if "worker-2" in e.get("detail", "")])
    ready_before = cluster.procs.procs["worker-2"].count("broker_link_ready")
    broker = cluster.procs.procs["broker"]
    gone_before = broker.count("peer_disconnected", peer="worker-2")
    gpu2 = cluster.net["gpu-2"]
    gpu2.cut("link")
    t_cut = time.monotonic()
    try:
        # once the broker has given gpu-2 up (silent for heartbeat x liveness), nothing of it is in flight:
        # what the ledger still leases to it is what it held at the cut
        wait_until(lambda: broker.count("peer_disconnected", peer="worker-2") > gone_before, 20, "the broker to see gpu-2 gone")
        held = cluster.leased_to("worker-2")
        assert held, "gpu-2 held no lease at the cut (the batch drained too fast?)"

        # every lease gpu-2 held at the cut expires and its item is done by gpu-1
        def requeued_and_done() -> bool:
            recs = cluster.items(list(held))
            return all(r["state"] in ("completed", "acknowledged") and r["worker_done"] == "worker-1" for r in recs.values())

        wait_until(requeued_and_done, 30, f"items {sorted(held)} of the cut host to be redone by gpu-1")
        assert time.monotonic() - t_cut >= LEASE_TTL_S * 0.9
        assert cluster.procs.procs["worker-2"].running
    finally:
        gpu2.restore()
        t_restore = time.monotonic()
    # the cut worker comes back (a new session) ...
    wait_until(lambda: cluster.procs.procs["worker-2"].count("broker_link_ready") > ready_before, 30, "worker-2 to reconnect")
    # ... reports what it finished during the cut: the lease moved on, so the ledger fences it
    wait_until(lambda: any(e["item_id"] in held for e in cluster.events("G4") + cluster.events("G8")), 30,
               "worker-2's late result to be fenced or accepted")
    # the broker confirmed each fenced report to worker-2 (so it forgets the result): its log says so
    fenced = {e["item_id"] for e in cluster.events("G4")} & set(held)
    w2 = cluster.procs.procs["worker-2"]
    wait_until(lambda: all(w2.count("report_fenced", item_id=i) for i in fenced), 20, "worker-2 to be told its results were fenced")
    g2 = [e for e in cluster.events("G2") if "worker-2" in e.get("detail", "")]
    assert {e["item_id"] for e in g2} >= set(held) and len(g2) - g2_before >= len(held)
    # ... and takes new work
    second = cluster.produce(10, 0.2, "after-cut", wait_s=40)
    assert set(second["states"].values()) == {"acknowledged"}, second["states"]
    wait_until(lambda: all(r["state"] == "acknowledged" for r in cluster.items(first).values()), 40, "the first batch acknowledged")
    recs = cluster.items(second["ids"])
    assert "worker-2" in {r["worker_done"] for r in recs.values()}, "the cut worker did not resume"
    got = cluster.results()
    assert all(got.count(i) == 1 for i in first + second["ids"]), "an item landed twice or not at all"
    report = cluster.assert_balanced()
    assert report["counters"]["fenced_completions"] + report["counters"]["late_results_accepted"] >= 1
    print(f"cut: gpu-2 held {len(held)} leases, cut {t_restore - t_cut:.1f} s; G2 on worker-2 {len(g2) - g2_before}, "
          f"fenced {report['counters']['fenced_completions']}, late accepted {report['counters']['late_results_accepted']}, "
          f"after the cut gpu-2 did {sum(r['worker_done'] == 'worker-2' for r in recs.values())}/10")


def test_late_result_for_an_expired_lease_nobody_took_is_accepted(cluster):
    """The other rule for late results (G8): gpu-2 finishes its items while cut off, its leases
    expire, and nobody leases the items meanwhile (both workers drained by an operator on
    another host): once the cable is back its results are accepted, not run again."""
    admin = cluster.net["completion-host"]

    def drain(worker: str, undo: bool = False) -> None:
        r = admin.run([bin_path("ccsq"), "drain", worker, *(["--undo"] if undo else []), "--config", str(cluster.configs["admin"])])
        assert r.returncode == 0, r.stdout + r.stderr

    drain("worker-1")
    try:
        broker = cluster.procs.procs["broker"]
        gone_before = broker.count("peer_disconnected", peer="worker-2")
        ready_before = cluster.procs.procs["worker-2"].count("broker_link_ready")
        g8_before = cluster.report()["counters"]["late_results_accepted"]
        ids = cluster.produce(2, 0.5, "late")["ids"]  # gpu-2 runs them one after the other
        wait_until(lambda: set(cluster.leased_to("worker-2")) == set(ids), 30, "gpu-2 to hold both items")
        gpu2 = cluster.net["gpu-2"]
        gpu2.cut("iptables" if gpu2.iptables_usable() else "link")
        try:
            drain("worker-2")  # while it is away: it will get no new lease when it is back
            wait_until(lambda: broker.count("peer_disconnected", peer="worker-2") > gone_before, 20, "the broker to see gpu-2 gone")
            wait_until(lambda: all(r["state"] == "ready" for r in cluster.items(ids).values()), 20, "gpu-2's leases to expire")
            # both results are in gpu-2's journal before it is back (a job still running when the broker
            # answers the new HELLO that its lease is gone would be finished and discarded, by design)
            w2 = cluster.procs.procs["worker-2"]
            wait_until(lambda: all(w2.count("job_completed", item_id=i) for i in ids), 20, "gpu-2 to finish both items while cut off")
        finally:
            gpu2.restore()
        wait_until(lambda: cluster.procs.procs["worker-2"].count("broker_link_ready") > ready_before, 30, "worker-2 to reconnect")
        recs = wait_until(lambda: (r := cluster.items(ids)) and all(x["state"] in ("completed", "acknowledged") for x in r.values()) and r,
                          30, "gpu-2's late results to be accepted")
        assert {r["worker_done"] for r in recs.values()} == {"worker-2"}
        assert {e["item_id"] for e in cluster.events("G8")} >= set(ids)
        assert cluster.report()["counters"]["late_results_accepted"] - g8_before == 2
        assert not {e["item_id"] for e in cluster.events("G4")} & set(ids), "nothing ran twice"
    finally:
        drain("worker-1", undo=True)
        drain("worker-2", undo=True)
    wait_until(lambda: all(r["state"] == "acknowledged" for r in cluster.items(ids).values()), 30, "the late items acknowledged")
    got = cluster.results()
    assert all(got.count(i) == 1 for i in ids)
    cluster.assert_balanced()


def test_broker_metrics_on_its_host_address_are_scraped_from_another_host(cluster):
    """``metrics_listen = "<broker host address>:9464"``: Prometheus on another host scrapes it."""
    text = cluster.scrape("gpu-1")
    assert "ccsq_build_info" in text
    acked = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("ccsq_items_total{") and 'counter="acknowledged"' in line)
    assert acked >= 12
    # and it is bound to the host address, not loopback: from the broker host itself via 127.0.0.1 it is closed
    res = cluster.net["broker-host"].run([PY, "-c", SCRAPE, f"http://127.0.0.1:{METRICS_PORT}/metrics"], timeout_s=20)
    assert res.returncode != 0
