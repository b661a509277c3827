"""ccsq-brokerd as the primary of a replicated pair (docs/ha.md, issue 23): real broker
processes, a real etcd (tests/test_election.py's fixture), scripted peers on real sockets.
The replication server and the standby mode are harepl's (brokerd/replserver.py,
brokerd/standby.py); until they land, tests/ha_brokerd.py puts tests/ha_fakes.py in their
place (no standby ever acknowledges)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import threading
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import msgpack
import pytest
import tomli_w
import tomllib

from ccsq.brokerd.election import Election
from ccsq.brokerd.ledger.schema import token_epoch
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import ExitCode
from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm, wait_for
from tests.test_broker import item, recv_tasks, result_of
from tests import test_election

etcd_server, etcd = test_election.etcd_server, test_election.etcd  # the real etcd fixtures

pytest.importorskip("etcd3gw")
HERE = Path(__file__).resolve().parent
PEERS = {"prod": "producer", "wA": "worker", "comp": "completion", "admin": "admin", "broker-1": "standby",
         "broker-2": "standby"}
SWARM = f"hs-{os.getpid()}"  # per process: the brokers take a host-wide flock per (swarm, node) in /run/lock
TTL_S, MARGIN_S = 2, 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HaBroker(BrokerProcess):
    """ccsq-brokerd through tests/ha_brokerd.py (the fakes only while harepl's modules are missing)."""

    def start(self, wait: bool = True, timeout_s: float = 30.0) -> "HaBroker":
        self.lines = []
        self.endpoint = ""
        self.proc = subprocess.Popen([sys.executable, str(HERE / "ha_brokerd.py"), "--config", str(self.config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env, text=True)
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        if wait:
            wait_for(lambda: self.endpoint or self.proc.poll() is not None, timeout_s, what="broker_started")
            if not self.endpoint:
                raise RuntimeError(f"broker exited {self.proc.returncode}: {''.join(self.lines)[-3000:]}")
        return self


def observer(url: str) -> Election:
    """The test's own view of etcd (a generous request timeout: the test machine is loaded)."""
    return Election([url], SWARM, "observer", ttl_s=TTL_S, margin_s=MARGIN_S, request_timeout_s=5.0)


def ha_swarm(root: Path, url: str, **overrides) -> Path:
    return make_swarm(root, PEERS, ha_etcd_endpoints=url, ha_node_id="broker-1", ha_node_key="keys/broker-1.key",
                      ha_repl_endpoint=f"tcp://127.0.0.1:{free_port()}", ha_swarm_id=SWARM, ha_lease_ttl_s=TTL_S,
                      ha_lease_margin_s=MARGIN_S, **overrides)


@pytest.fixture
def peers():
    made: list[ScriptedPeer] = []
    yield made
    for sp in made:
        sp.close()


@pytest.fixture
def brokers():
    made: list[HaBroker] = []
    yield made
    for b in made:
        if b.proc is not None:
            b.proc.send_signal(signal.SIGCONT)
        b.kill()


def start(brokers, config: Path, wait: bool = True, env: dict | None = None) -> HaBroker:
    b = HaBroker(config, env=env).start(wait=wait)
    brokers.append(b)
    return b


def peer(peers, root: Path, pid: str, endpoint: str) -> ScriptedPeer:
    sp = ScriptedPeer(root, pid, endpoint)
    peers.append(sp)
    return sp


def admin(sp: ScriptedPeer, command: str, wait_s: float = 20.0, **args) -> protocol.AdminReply:
    req = sp.next_req()
    sp.send(protocol.Admin(req, command, args))
    while True:
        reply = sp.recv_type(protocol.AdminReply, wait_s)
        if reply.req == req:
            return reply


def ha_doc(sp: ScriptedPeer) -> dict:
    return sp.admin_status()["ha"]


def test_async_primary_without_standby_serves_submit_complete_ack_and_publishes_its_key(tmp_path, etcd, brokers, peers):
    """ha_mode = async, no standby: the broker wins the election, writes the primary key
    (epoch, endpoint, repl_endpoint, node, ledger_id) and an empty sync set, WELCOMEs with
    the election epoch, grants tokens carrying it, and confirms a whole flow."""
    cfg = ha_swarm(tmp_path, etcd, ha_mode="async")
    b = start(brokers, cfg)
    el = observer(etcd)
    holder = el.holder()
    conf = tomllib.loads(cfg.read_text())
    assert holder is not None and holder.epoch >= 1
    assert (holder.endpoint, holder.repl_endpoint, holder.node) == (conf["endpoint"], conf["ha_repl_endpoint"], "broker-1")
    assert holder.ledger_id
    sync = wait_for(el.read_sync, what="the sync set")
    assert (sync.epoch, sync.members) == (holder.epoch, ())

    prod = peer(peers, tmp_path, "prod", b.endpoint)
    assert prod.hello("producer").broker_epoch == holder.epoch
    (r,) = prod.submit([item("doc-1")])
    assert r.item_id and not r.error
    w = peer(peers, tmp_path, "wA", b.endpoint)
    w.hello("worker", slots=1, credit=1)
    (t,) = recv_tasks(w, 1)
    assert t.item_id == r.item_id and token_epoch(t.token) == holder.epoch
    w.send(protocol.Complete([result_of(t)]))
    assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
    comp = peer(peers, tmp_path, "comp", b.endpoint)
    comp.hello("completion", credit=10)
    (d,) = comp.recv_type(protocol.Result, 10).deliveries
    comp.send(protocol.Ack([d.item_id]))
    assert comp.recv_type(protocol.AckOk).item_ids == [r.item_id]
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    ha = ha_doc(adm)
    assert (ha["role"], ha["epoch"], ha["node"], ha["mode"], ha["confirming"], ha["held_replies"]) == \
        ("primary", holder.epoch, "broker-1", "async", True, 0)
    assert ha["standbys"] == []
    assert b.stop() == 0
    assert el.holder() is None  # resigned at SIGTERM: a standby may take over at once


def _no_confirm(sp: ScriptedPeer, within_s: float) -> list[protocol.Message]:
    """Every message ``sp`` receives within ``within_s``; heartbeats and BYE aside, none may be a confirm."""
    got = []
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        env = sp.recv(left)
        if env is not None:
            got.append(env.message)
    confirms = (protocol.SubmitAck, protocol.CompleteAck, protocol.FailAck, protocol.AckOk, protocol.Dispatch, protocol.Result)
    return [m for m in got if isinstance(m, confirms)]


def test_sync_primary_without_standby_confirms_nothing_and_says_it_waits(tmp_path, etcd, brokers, peers):
    """ha_mode = sync (the default), ha_on_standby_loss = wait, no standby: the SUBMIT is
    committed but its SUBMIT_ACK never leaves; status (a read, not held) says why."""
    port = free_port()
    b = start(brokers, ha_swarm(tmp_path, etcd, metrics_port=port))
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    req = prod.next_req()
    prod.send(protocol.Submit(req, [item("doc-1")]))
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    ha = wait_for(lambda: (d := ha_doc(adm))["held_replies"] == 1 and d, what="the SUBMIT_ACK held")
    assert (ha["mode"], ha["confirming"]) == ("sync", False)
    assert "waiting for 1 standby" in ha["waiting"]
    assert _no_confirm(prod, 3.0) == []
    ha = ha_doc(adm)
    assert ha["held_replies"] == 1 and ha["oldest_held_s"] >= 3.0

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    text = wait_for(lambda: (t := scrape()) and "ccsq_ha_held_replies 1.0" in t and t, what="the held reply in the metrics")
    assert 'ccsq_ha_role{role="primary"} 1.0' in text and "ccsq_ha_confirming 0.0" in text


REAL_STANDBY = importlib.util.find_spec("ccsq.brokerd.replserver") is not None


def with_standby(brokers, cfg: Path) -> HaBroker:
    """The primary of ``cfg`` and a standby broker-2: a real second broker process when
    brokerd/replserver.py and brokerd/standby.py exist, else tests/ha_fakes.py's stub
    standby (in sync, acknowledging every turn at once) inside the primary."""
    if not REAL_STANDBY:
        return start(brokers, cfg, env={"CCSQ_TEST_STUB_STANDBY": "broker-2"})
    b = start(brokers, cfg)
    conf = tomllib.loads(cfg.read_text())
    conf.update(data_dir="broker-data-2", endpoint=f"tcp://127.0.0.1:{free_port()}", ha_node_id="broker-2",
                ha_node_key="keys/broker-2.key", ha_repl_endpoint=f"tcp://127.0.0.1:{free_port()}")
    second = cfg.parent / "brokerd-2.toml"
    second.write_text(tomli_w.dumps(conf))
    start(brokers, second, wait=False)
    return b


def test_sync_primary_with_a_standby_that_acknowledges_confirms_and_names_it_in_the_sync_set(tmp_path, etcd, brokers, peers):
    """ha_mode = sync with a standby that is in sync and acknowledges every turn (a real
    second broker, or the stub of tests/ha_fakes.py until harepl's server is merged): the
    primary writes it into /sync and confirms; status lists it, and the metrics have the hold of
    each confirm (``ccsq_ha_held_seconds``: its turn's commit until it left)."""
    port = free_port()
    b = with_standby(brokers, ha_swarm(tmp_path, etcd, metrics_port=port))
    el = observer(etcd)
    wait_for(lambda: (s := el.read_sync()) is not None and s.members == ("broker-2",), 30, what="broker-2 in /sync")
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("doc-1")], timeout_s=10)
    assert r.item_id
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    ha = ha_doc(adm)
    assert (ha["mode"], ha["confirming"], ha["sync_members"]) == ("sync", True, ["broker-2"])
    assert [(s["node"], s["in_sync"]) for s in ha["standbys"]] == [("broker-2", True)]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        counts = [float(line.split()[-1]) for line in resp.read().decode().splitlines()
                  if line.startswith("ccsq_ha_held_seconds_count")]
    assert counts and counts[0] >= 1, counts  # the SUBMIT_ACK's hold at least


def test_failover_hands_over_once_a_sync_standby_holds_the_last_turn(tmp_path, etcd, brokers, peers):
    """Admin failover with a standby of the sync set that holds every turn: answered ok
    naming it, the key is resigned at once, and the broker runs as standby (it does not
    take the key back: it is not in /sync); broker-2 (or, with the stub, the test in its
    place) takes the key with a higher epoch."""
    b = with_standby(brokers, ha_swarm(tmp_path, etcd))
    el = Election([etcd], SWARM, "tcp://127.0.0.1:2", ttl_s=TTL_S, margin_s=MARGIN_S, request_timeout_s=5.0)
    epoch = el.holder().epoch
    wait_for(lambda: (s := el.read_sync()) is not None and s.members == ("broker-2",), 30, what="broker-2 in /sync")
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    reply = admin(adm, "failover", timeout_s=5.0)
    assert reply.ok, reply.error
    doc = msgpack.unpackb(reply.body, raw=False)
    assert (doc["standby"], doc["epoch"]) == ("broker-2", epoch)
    wait_for(lambda: b.events("ha_standby"), 15, what="the old primary in the standby role")
    if REAL_STANDBY:
        h = wait_for(lambda: (h := el.holder()) is not None and h.node == "broker-2" and h, 20, what="broker-2 primary")
        assert h.epoch > epoch and len(b.events("broker_started")) == 1
        return
    assert el.holder() is None and len(b.events("broker_started")) == 1  # resigned, and not taken back
    new = el.campaign()
    el.start_keepalive()
    try:
        assert new is not None and new > epoch
        assert len(b.events("broker_started")) == 1 and el.holder().epoch == new
    finally:
        el.resign()


def test_failover_to_a_named_standby_hands_over_to_that_one_and_refuses_one_not_in_sync(tmp_path, etcd, brokers, peers):
    """Three brokers, broker-2 and broker-3 both standbys in the sync set (the server lists
    broker-2 first). ``failover to=broker-9`` (no such standby) is refused at once naming the
    standbys that are in sync, and nothing changes; ``failover to=broker-3`` hands over to
    broker-3 (the reply names it, etcd's sync set is pinned to it before the key goes) and
    broker-3, not broker-2, takes the key with a higher epoch."""
    if not REAL_STANDBY:
        pytest.skip("needs the real replication server and standby")
    cfg = make_swarm(tmp_path, {**PEERS, "broker-3": "standby"}, ha_etcd_endpoints=etcd, ha_node_id="broker-1",
                     ha_node_key="keys/broker-1.key", ha_repl_endpoint=f"tcp://127.0.0.1:{free_port()}", ha_swarm_id=SWARM,
                     ha_lease_ttl_s=TTL_S, ha_lease_margin_s=MARGIN_S)
    b = with_standby(brokers, cfg)
    conf = tomllib.loads(cfg.read_text())
    conf.update(data_dir="broker-data-3", endpoint=f"tcp://127.0.0.1:{free_port()}", ha_node_id="broker-3",
                ha_node_key="keys/broker-3.key", ha_repl_endpoint=f"tcp://127.0.0.1:{free_port()}")
    third = cfg.parent / "brokerd-3.toml"
    third.write_text(tomli_w.dumps(conf))
    start(brokers, third, wait=False)
    el = observer(etcd)
    epoch = el.holder().epoch
    wait_for(lambda: (s := el.read_sync()) is not None and s.members == ("broker-2", "broker-3"), 60,
             what="broker-2 and broker-3 in /sync")
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    t0 = time.monotonic()
    reply = admin(adm, "failover", timeout_s=5.0, to="broker-9")
    assert not reply.ok and "'broker-9' is not a connected standby in sync" in reply.error, reply.error
    assert "broker-2, broker-3" in reply.error and "nothing changed" in reply.error
    assert time.monotonic() - t0 < 3.0  # at once, not after timeout_s
    ha = ha_doc(adm)
    assert (ha["role"], ha["epoch"], ha["failover"]) == ("primary", epoch, "")
    assert [s["node"] for s in ha["standbys"]] == ["broker-2", "broker-3"]
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    assert prod.submit([item("after the refusal")], timeout_s=10)[0].item_id  # still confirming
    reply = admin(adm, "failover", timeout_s=10.0, to="broker-3")
    assert reply.ok, reply.error
    doc = msgpack.unpackb(reply.body, raw=False)
    assert (doc["standby"], doc["epoch"]) == ("broker-3", epoch)
    h = wait_for(lambda: (h := el.holder()) is not None and h.epoch > epoch and h, 20, what="a new primary")
    assert h.node == "broker-3", h
    assert wait_for(lambda: b.events("ha_standby"), 15, what="the old primary in the standby role")


def test_a_pairs_new_primary_after_its_primary_died_degrades_at_once_not_after_ha_degrade_after_s(tmp_path, etcd, brokers,
                                                                                                     peers):
    """A pair (sync, degrade after 4 s): SIGKILL the primary; broker-2, the last sync set's only
    member, takes the key and confirms alone at once (log ``ha_degrade_at_promotion``, status
    ``degraded``, etcd's set written empty first), not 4 s later: no standby could be back
    within the wait (the only other copy is the broker just lost). (4 s: below the scripted
    producer's 5 s silence window, after which the broker would drop its session.)"""
    if not REAL_STANDBY:
        pytest.skip("needs the real replication server and standby")
    b = with_standby(brokers, ha_swarm(tmp_path, etcd, ha_on_standby_loss="degrade", ha_degrade_after_s=4.0))
    second = brokers[1]
    el = observer(etcd)
    wait_for(lambda: (s := el.read_sync()) is not None and s.members == ("broker-2",), 30, what="broker-2 in /sync")
    epoch = el.holder().epoch
    b.kill()
    h = wait_for(lambda: (h := el.holder()) is not None and h.epoch > epoch and h, TTL_S + 20, 0.05, what="broker-2 primary")
    promoted = time.monotonic()
    assert h.node == "broker-2"
    prod = peer(peers, tmp_path, "prod", h.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("after the failover")], timeout_s=15)
    assert r.item_id and time.monotonic() - promoted < 3.0  # not after ha_degrade_after_s = 4 s
    assert second.events("ha_degrade_at_promotion") and el.read_sync().members == ()
    adm = peer(peers, tmp_path, "admin", h.endpoint)
    adm.hello("admin")
    assert ha_doc(adm)["mode"] == "degraded"


def test_only_a_new_primary_left_without_any_other_copy_degrades_at_promotion():
    """``alone_at_promotion``: yes for a pair's standby after an unplanned failover (the last
    set names only it); no when the set names another standby (it reconnects and is in sync
    within moments), after a planned failover (the old primary rejoins at once), in async
    mode, with ``wait``, or with no set written."""
    from ccsq.brokerd.election import SyncSet
    from ccsq.brokerd.primary import alone_at_promotion

    pair = SyncSet(7, ("broker-2",), "broker-1")
    assert "broker-1" in alone_at_promotion(pair, "broker-2", mode="sync", on_standby_loss="degrade")
    assert alone_at_promotion(SyncSet(7, (), "broker-1"), "broker-2", mode="sync", on_standby_loss="degrade")
    assert not alone_at_promotion(SyncSet(7, ("broker-2", "broker-3"), "broker-1"), "broker-2", mode="sync",
                                  on_standby_loss="degrade")
    assert not alone_at_promotion(SyncSet(7, ("broker-2",), "broker-1", handover=True), "broker-2", mode="sync",
                                  on_standby_loss="degrade")
    assert not alone_at_promotion(pair, "broker-2", mode="sync", on_standby_loss="wait")
    assert not alone_at_promotion(pair, "broker-2", mode="async", on_standby_loss="degrade")
    assert not alone_at_promotion(None, "broker-2", mode="sync", on_standby_loss="degrade")


def test_a_sync_primary_sends_result_at_its_commit_and_holds_complete_ack_until_the_standby_has_the_turn(
        tmp_path, etcd, brokers, peers):
    """Sync pair; the standby SIGSTOPped after the lease was granted: the worker's COMPLETE is
    committed, its RESULT reaches the completion service at once (RESULT confirms nothing to
    anyone, docs/ha.md), while the COMPLETE_ACK (a confirm) waits until the standby, resumed,
    has acknowledged the turn."""
    if not REAL_STANDBY:
        pytest.skip("needs the real replication server and standby")
    b = with_standby(brokers, ha_swarm(tmp_path, etcd))
    standby = brokers[1]
    el = observer(etcd)
    wait_for(lambda: (s := el.read_sync()) is not None and s.members == ("broker-2",), 30, what="broker-2 in /sync")
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("doc-1")], timeout_s=10)
    w = peer(peers, tmp_path, "wA", b.endpoint)
    w.hello("worker", slots=1, credit=1)
    (t,) = recv_tasks(w, 1)
    comp = peer(peers, tmp_path, "comp", b.endpoint)
    comp.hello("completion", credit=10)
    standby.signal(signal.SIGSTOP)
    try:
        w.send(protocol.Complete([result_of(t)]))
        (d,) = comp.recv_type(protocol.Result, 3.0).deliveries  # at the commit, not after the standby's ack
        assert d.item_id == r.item_id
        with pytest.raises(TimeoutError):
            w.recv_type(protocol.CompleteAck, 0.5)  # the confirm waits for the standby
    finally:
        standby.signal(signal.SIGCONT)
    assert w.recv_type(protocol.CompleteAck, 10).outcomes[0].outcome == "accepted"
    comp.send(protocol.Ack([d.item_id]))
    assert comp.recv_type(protocol.AckOk, 10).item_ids == [r.item_id]


def test_sync_primary_degrades_after_ha_degrade_after_s_and_says_so(tmp_path, etcd, brokers, peers):
    """ha_on_standby_loss = degrade: with no standby for ha_degrade_after_s the primary
    writes its sync set (empty) in etcd, then confirms alone; log and status say so."""
    b = start(brokers, ha_swarm(tmp_path, etcd, ha_on_standby_loss="degrade", ha_degrade_after_s=1.5))
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    t0 = time.monotonic()
    (r,) = prod.submit([item("doc-1")], timeout_s=15)
    assert r.item_id and time.monotonic() - t0 >= 1.0
    assert b.events("ha_degraded")
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    ha = ha_doc(adm)
    assert (ha["mode"], ha["confirming"], ha["held_replies"], ha["degraded_count"]) == ("degraded", True, 0, 1)
    el = observer(etcd)
    assert el.read_sync().members == ()
    w = peer(peers, tmp_path, "wA", b.endpoint)
    w.hello("worker", slots=1, credit=1)
    (t,) = recv_tasks(w, 1)
    assert t.item_id == r.item_id


def test_a_sigstopped_primary_confirms_nothing_after_its_lease_and_leaves_the_role(tmp_path, etcd, brokers, peers):
    """SIGSTOP the primary longer than ha_lease_ttl_s, another broker takes the key with a
    higher epoch, SIGCONT: the SUBMIT it reads on waking is committed but never
    confirmed (no frame but heartbeats and BYE), and it leaves the primary role (standby)."""
    b = start(brokers, ha_swarm(tmp_path, etcd, ha_mode="async"))
    el = Election([etcd], SWARM, "tcp://127.0.0.1:1", ttl_s=TTL_S, margin_s=MARGIN_S, request_timeout_s=3.0)
    first = el.holder()
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    assert prod.submit([item("before")])[0].item_id  # it confirms while it holds the lease
    b.signal(signal.SIGSTOP)
    try:
        prod.send(protocol.Submit(prod.next_req(), [item("while-stopped")]))
        wait_for(lambda: el.holder() is None, TTL_S + 5, 0.05, what="etcd to expire the stopped primary's lease")
        epoch = el.campaign()
        assert epoch is not None and epoch > first.epoch
        el.start_keepalive()
    finally:
        b.signal(signal.SIGCONT)
    assert _no_confirm(prod, 3.0) == []
    wait_for(lambda: b.events("ha_primary_ended"), 10, what="the primary to leave its role")
    wait_for(lambda: b.events("ha_standby") and len(b.events("ha_standby")) >= 1, 10, what="the standby role")
    assert el.holder().epoch == epoch  # the deposed broker took nothing back
    el.resign()


def _refused(brokers, config: Path) -> str:
    b = start(brokers, config, wait=False)
    assert b.wait(30) == ExitCode.CONFIG, "".join(b.lines)[-2000:]
    return "".join(b.lines)


@pytest.mark.parametrize("problem, key", [
    ("malformed_endpoints", "ha_etcd_endpoints"),
    ("unreachable_endpoints", "ha_etcd_endpoints"),
    ("missing_node_key", "ha_node_key"),
    ("no_swarm_id", "ha_swarm_id"),
    ("margin_over_ttl", "ha_lease_margin_s"),
])
def test_ha_misconfiguration_is_refused_at_start_naming_file_and_key(tmp_path, brokers, problem, key):
    """Exit 78 with the config file and the key named (no etcd needed: refused before or at the check)."""
    kw = {"malformed_endpoints": {"ha_url": "etcd-1:2379"},
          "unreachable_endpoints": {"ha_url": f"http://127.0.0.1:{free_port()}"},
          "missing_node_key": {"ha_node_key": "keys/broker-9.key"},
          "no_swarm_id": {"ha_swarm_id": ""},
          "margin_over_ttl": {"ha_lease_margin_s": 2.5}}[problem]
    url = kw.pop("ha_url", f"http://127.0.0.1:{free_port()}")
    cfg = ha_swarm(tmp_path, url)
    conf = tomllib.loads(cfg.read_text())
    conf.update(kw)
    cfg.write_text(tomli_w.dumps(conf))
    err = _refused(brokers, cfg)
    assert str(cfg) in err and key in err, err


def test_two_brokers_on_one_host_claiming_one_node_id_are_refused(tmp_path, etcd, brokers):
    """A second config on this host with the same ha_node_id (its own data_dir and ports)
    is refused 78 naming ha_node_id while the first runs."""
    cfg = ha_swarm(tmp_path, etcd, ha_mode="async")
    start(brokers, cfg)
    conf = tomllib.loads(cfg.read_text())
    conf.update(data_dir="broker-data-2", ha_repl_endpoint=f"tcp://127.0.0.1:{free_port()}")
    second = tmp_path / "brokerd-2.toml"
    second.write_text(tomli_w.dumps(conf))
    err = _refused(brokers, second)
    assert "ha_node_id" in err and "broker-1" in err and str(second) in err, err


def test_tokens_carry_the_election_epoch_and_an_older_epochs_token_is_fenced(tmp_path, etcd, brokers, peers):
    """A single broker's ledger (bare counter tokens) opens as a primary and its worker
    resumes the old lease; a lease of the first primary epoch, expired and re-leased under
    the next epoch, is fenced for COMPLETE and FAIL while the new token is accepted."""
    cfg = ha_swarm(tmp_path, etcd, ha_mode="async", lease_ttl_s=1.0, heartbeat_interval_s=0.25)
    conf = tomllib.loads(cfg.read_text())
    single = dict(conf)
    single.pop("ha_etcd_endpoints")
    cfg.write_text(tomli_w.dumps(single))
    b = BrokerProcess(cfg).start()
    brokers.append(b)  # (killed at the end like the others)
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    prod.submit([item("old"), item("new")])
    w = peer(peers, tmp_path, "wA", b.endpoint)
    w.hello("worker", slots=1, credit=1)
    (t0,) = recv_tasks(w, 1)
    assert token_epoch(t0.token) == 0  # a single broker's numbering is unchanged
    assert b.stop() == 0
    conf["endpoint"] = b.endpoint
    cfg.write_text(tomli_w.dumps(conf))
    b1 = start(brokers, cfg)
    e1 = observer(etcd).holder().epoch
    w.connect()
    welcome = w.hello("worker", slots=1, credit=1, leases=[protocol.LeaseRef(t0.item_id, t0.token)])
    assert welcome.broker_epoch == e1 and welcome.resumed == [protocol.LeaseRef(t0.item_id, t0.token)]
    (t1,) = recv_tasks(w, 1)
    assert token_epoch(t1.token) == e1
    w.send(protocol.Complete([result_of(t0)]))
    assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"  # the single broker's lease, resumed
    b1.kill()  # t1 is held by nobody now: its lease runs out under the next primary
    b2 = start(brokers, cfg)
    e2 = observer(etcd).holder().epoch
    assert e2 > e1
    w.connect()
    w.hello("worker", slots=1, credit=1)
    (t2,) = recv_tasks(w, 1, timeout_s=20)  # after t1's lease expired
    assert t2.item_id == t1.item_id and token_epoch(t2.token) == e2 and t2.token != t1.token
    w.send(protocol.Complete([result_of(t1)]))
    assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "fenced"
    w.send(protocol.Fail([protocol.TaskFailure(t1.item_id, t1.token, protocol.FailReason.HANDLER_ERROR.value, True, "late")]))
    assert w.recv_type(protocol.FailAck).outcomes[0].outcome == "fenced"
    w.send(protocol.Complete([result_of(t2)]))
    assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
    assert b2.stop() == 0


def test_failover_without_a_standby_in_sync_is_refused_and_changes_nothing(tmp_path, etcd, brokers, peers):
    """Admin ``failover`` with no standby: refused after its timeout with the reason; the
    broker stays primary with the same epoch and confirms again. A single broker refuses at once."""
    b = start(brokers, ha_swarm(tmp_path, etcd, ha_mode="async"))
    el = observer(etcd)
    epoch = el.holder().epoch
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    t0 = time.monotonic()
    reply = admin(adm, "failover", timeout_s=1.0)
    assert not reply.ok and "no standby" in reply.error and "nothing changed" in reply.error
    assert time.monotonic() - t0 >= 0.9
    ha = ha_doc(adm)
    assert (ha["role"], ha["epoch"], ha["confirming"], ha["failover"]) == ("primary", epoch, True, "")
    assert el.holder().epoch == epoch
    prod = peer(peers, tmp_path, "prod", b.endpoint)
    prod.hello("producer")
    assert prod.submit([item("after")])[0].item_id
    assert b.stop() == 0


def test_failover_on_a_single_broker_is_refused_at_once(tmp_path, brokers, peers):
    cfg = make_swarm(tmp_path, PEERS)
    b = BrokerProcess(cfg).start()
    brokers.append(b)
    adm = peer(peers, tmp_path, "admin", b.endpoint)
    adm.hello("admin")
    reply = admin(adm, "failover", timeout_s=1.0)
    assert not reply.ok and "single broker" in reply.error
    assert adm.admin_status()["ha"] == {"role": "single", "epoch": 1}


class StubServer:
    """The two reads ConfirmGate makes of the replication server, set by the test (real etcd underneath)."""

    def __init__(self) -> None:
        self.standbys: list[dict] = []
        self.durable = 0

    def durable_seq(self) -> int:
        return self.durable

    def status(self) -> dict:
        return {"standbys": self.standbys, "durable_seq": self.durable, "last_seq": 0}


def _gate(etcd_url: str, server: StubServer, **kw):
    from ccsq.brokerd.primary import ConfirmGate

    el = Election([etcd_url], SWARM, "tcp://127.0.0.1:9", ttl_s=TTL_S, margin_s=MARGIN_S, request_timeout_s=5.0)
    assert el.campaign() is not None
    el.start_keepalive()
    last = {"seq": 0}
    gate = ConfirmGate(mode=kw.pop("mode", "sync"), sync_standbys=1, on_standby_loss=kw.pop("on_loss", "wait"),
                       degrade_after_s=kw.pop("degrade_after_s", 10.0), election=el, server=server,
                       last_seq=lambda: last["seq"], wake=lambda: None)
    gate.set_members([], initial=True)
    wait_for(lambda: (s := el.read_sync()) is not None and s.epoch == el.epoch, what="the first sync set")
    return gate, el, last


def _ack(n: int) -> protocol.SubmitAck:
    return protocol.SubmitAck(n, [protocol.SubmitResult(f"k{n}", f"i{n}")])


def test_a_sync_primary_counts_a_standby_only_once_the_sync_set_names_it_and_never_drops_it_when_waiting(etcd):
    server = StubServer()
    gate, el, last = _gate(etcd, server)
    sent: list = []
    send = lambda rid, msg: sent.append(msg.req)  # noqa: E731
    try:
        for seq in (1, 2):
            last["seq"] = seq
            gate.hold(seq, [(b"r", _ack(seq))], set(), send)
        server.standbys = [{"node": "broker-2", "seq": 1, "in_sync": True}]
        server.durable = 1
        gate.recheck()
        assert gate.release(send) == 0 and sent == []  # acknowledged, but not yet in /sync: not counted
        gate.on_members(["broker-2"])  # (blocks until etcd has it)
        assert el.read_sync().members == ("broker-2",)
        wait_for(lambda: (gate.recheck(), gate.release(send))[1] or sent, what="the release")
        assert sent == [1]  # seq 2 waits for its acknowledgement
        server.standbys, server.durable = [], 1  # the standby goes away: wait, and keep it in the set
        gate.on_members([])
        gate.recheck()
        assert gate.release(send) == 0 and el.read_sync().members == ("broker-2",)
        assert gate.status()["held_replies"] == 1 and "waiting for 1 standby" in gate.status()["waiting"]
    finally:
        el.resign()


def test_an_acknowledgement_read_between_two_turns_releases_the_held_dispatch_in_that_call(etcd):
    """The replication server's ``on_durable`` is ``Broker.release_durable`` (brokerd/role.py), called
    in the loop when an acknowledgement made turns durable: the held DISPATCH of such a turn leaves in
    that call, between two turns of the actor, and dispatch and delivery are woken. Before, on_durable
    only woke the actor, whose next pass ran its turn (frames, transaction, commit and fsync) before
    it released anything: under load one more turn on every held DISPATCH (bench.ha_sync paced)."""
    from ccsq.brokerd.actor import Broker

    server = StubServer()
    gate, el, last = _gate(etcd, server)
    sent, woken = [], []
    broker = types.SimpleNamespace(gate=gate, _send=lambda rid, msg: sent.append(msg),
                                   _wake_dispatch=lambda: woken.append("dispatch"), _wake_delivery=lambda: woken.append("delivery"),
                                   transport=types.SimpleNamespace(wake=lambda: woken.append("actor")))
    try:
        gate.on_members(["broker-2"])
        last["seq"] = 1
        dispatch = protocol.Dispatch([])
        gate.hold(1, [(b"w", dispatch)], set(), broker._send)
        assert sent == []  # held: nobody acknowledged turn 1
        server.standbys, server.durable = [{"node": "broker-2", "seq": 1, "in_sync": True}], 1
        Broker.release_durable(broker)  # type: ignore[arg-type]  # what the server calls on the ack
        assert sent == [dispatch] and woken == ["dispatch", "delivery", "actor"]
    finally:
        el.resign()


def test_degrade_rewrites_the_sync_set_before_the_first_confirm_alone_and_a_lapsed_lease_confirms_nothing(etcd):
    server = StubServer()
    gate, el, last = _gate(etcd, server, on_loss="degrade", degrade_after_s=0.3)
    gate.on_members(["broker-2"])
    assert el.read_sync().members == ("broker-2",)
    seen_sync: list = []

    def send(rid, msg):  # what etcd's sync set says at the moment a confirm leaves
        seen_sync.append(el.read_sync().members)

    real_write, may_write, writing = el.write_sync, threading.Event(), threading.Event()

    def slow_write(members):  # the etcd write of the shrunk set takes its time
        writing.set()
        may_write.wait(10)
        return real_write(members)

    el.write_sync = slow_write
    try:
        last["seq"] = 1
        gate.hold(1, [(b"r", _ack(1))], set(), send)
        wait_for(lambda: (gate.recheck(), gate.release(send), writing.is_set())[2], 10, what="the degrade to begin")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # not one confirm alone before etcd has the smaller set
            gate.recheck()
            assert gate.release(send) == 0 and not seen_sync
            time.sleep(0.02)
        may_write.set()
        wait_for(lambda: (gate.recheck(), gate.release(send))[1] or seen_sync, 10, what="the degraded confirm")
        assert seen_sync == [()] and gate.status()["mode"] == "degraded"
        last["seq"] = 2
        el.renewed_at = el.renewed_at - TTL_S  # the lease is in doubt (as after a pause): confirm nothing
        el.resign()
        gate.hold(2, [(b"r", _ack(2))], set(), send)
        gate.recheck()
        assert gate.release(send) == 0 and seen_sync == [()]
    finally:
        el.resign()


def test_a_second_config_with_a_replication_endpoint_in_use_is_refused(tmp_path, etcd, brokers):
    """Another process holds ha_repl_endpoint (here a plain socket, as the other broker's
    replication server would): refused 78 naming ha_repl_endpoint."""
    port = free_port()
    cfg = ha_swarm(tmp_path, etcd, ha_mode="async")
    conf = tomllib.loads(cfg.read_text())
    conf["ha_repl_endpoint"] = f"tcp://127.0.0.1:{port}"
    cfg.write_text(tomli_w.dumps(conf))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        err = _refused(brokers, cfg)
    assert "ha_repl_endpoint" in err and str(port) in err and str(cfg) in err, err


def test_every_member_of_the_sync_set_holds_every_confirmed_turn(etcd):
    """ha_sync_standbys = 1 with two members: a confirm waits for the slower member too,
    and goes without it only once etcd's sync set no longer lists it (Patroni's rule), so
    whichever listed standby takes over holds it."""
    server = StubServer()
    gate, el, last = _gate(etcd, server)
    gate.on_members(["broker-2", "broker-3"])
    seen: list = []

    def send(rid, msg):
        seen.append((msg.req, el.read_sync().members))

    try:
        last["seq"] = 3
        gate.hold(3, [(b"r", _ack(3))], set(), send)
        server.standbys = [{"node": "broker-2", "seq": 1, "in_sync": True}, {"node": "broker-3", "seq": 3, "in_sync": True}]
        server.durable = 3
        gate.recheck()
        assert gate.release(send) == 0  # broker-2 has not acknowledged seq 3
        server.standbys[0]["in_sync"] = False  # the server lags it out, and tells the gate
        gate.recheck()
        assert gate.release(send) == 0  # ... but etcd still lists it
        gate.on_members(["broker-3"])
        gate.recheck()
        assert gate.release(send) == 1 and seen == [(3, ("broker-3",))]
    finally:
        el.resign()


def test_a_node_outside_the_sync_set_does_not_take_a_vacant_key(tmp_path, etcd, brokers):
    """Only a node that holds every confirmed turn campaigns: broker-1 was primary, then
    broker-2 was (its sync set: broker-3 only), now the key is vacant. broker-1 restarted
    stays standby (log says why); once /sync lists it, it takes the key with a higher epoch.
    A node with no ledger yet never takes over an existing swarm."""
    cfg = ha_swarm(tmp_path, etcd)
    b = start(brokers, cfg)
    assert b.stop() == 0, "".join(b.lines)[-3000:]
    other = Election([etcd], SWARM, "tcp://127.0.0.1:3", ttl_s=TTL_S, margin_s=MARGIN_S, request_timeout_s=5.0,
                     fields={"node": "broker-2"})
    e2 = other.campaign()
    assert e2 is not None and other.write_sync(["broker-3"])
    other.resign()
    b = start(brokers, cfg, wait=False)
    wait_for(lambda: b.events("ha_not_campaigning"), 20, what="broker-1 to decline")
    assert "not in the sync set" in b.events("ha_not_campaigning")[0]["why"]
    el = observer(etcd)
    assert el.holder() is None and not b.events("broker_started")
    fresh = tomllib.loads(cfg.read_text())
    fresh.update(data_dir="broker-data-3", endpoint=f"tcp://127.0.0.1:{free_port()}", ha_node_id="broker-3",
                 ha_node_key="keys/broker-1.key", ha_repl_endpoint=f"tcp://127.0.0.1:{free_port()}")
    third = tmp_path / "brokerd-3.toml"
    third.write_text(tomli_w.dumps(fresh))
    c = start(brokers, third, wait=False)  # listed, but holds no ledger: it must seed, not lead
    wait_for(lambda: c.events("ha_not_campaigning"), 20, what="broker-3 to decline")
    assert "no ledger yet" in c.events("ha_not_campaigning")[0]["why"]
    assert el.holder() is None
    c.kill()
    other.campaign()
    assert other.write_sync(["broker-1"])
    other.resign()
    h = wait_for(lambda: (h := el.holder()) is not None and h, 20, what="broker-1 to take the key")
    assert h.node == "broker-1" and h.epoch > e2
