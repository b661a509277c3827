"""Peers follow the primary (issue 23, docs/ha.md "Peers"), with real processes.

Every peer's ``broker_endpoint`` may list the brokers of a pair. These tests run a real
broker behind a list whose first entry is dead (nothing listens), behind a scripted
standby (tests/standby_stub.py: a real ROUTER signing as the pair's service identity,
answering HELLO with NOT_PRIMARY), and across a "failover": broker A SIGKILLed at a
crash point, broker B started on a copy of A's ledger directory (taken after A's death:
the disk that survived) at the second endpoint. Nothing is lost and nothing lands twice.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from ccsq.common.runtime.faults import env_for
from ccsq.common.wire.config import WorkerConfig, load
from ccsq.common.wire.errors import ConfigError, DecodeError
from ccsq.tools.procs import bin_path, free_tcp_port
from tests.standby_stub import StandbyStub
from tests.swarm import Swarm, wait_until

PEER_CONFIGS = ("workerd-0", "producer", "completion", "admin")


def _set_broker_endpoints(swarm: Swarm, value: str) -> None:
    """Rewrite ``broker_endpoint`` in every peer config of ``swarm`` (workers, producer,
    completion service, admin)."""
    for name in PEER_CONFIGS:
        path = Path(swarm.configs[name])
        doc = tomllib.loads(path.read_text())
        doc["broker_endpoint"] = value
        path.write_text(tomli_w.dumps(doc))


def _dead_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_tcp_port()}"  # free a moment ago: nothing listens there


def _events(swarm: Swarm, name: str, event: str) -> list[dict]:
    return [e for e in swarm.procs.procs[name].events() if e.get("event") == event]


def _assert_landed_once(swarm: Swarm, n: int, data_dir: Path | None = None) -> dict:
    from ccsq.brokerd.gap_report import load_report

    data_dir = data_dir or swarm.root / "broker-data"
    rep = wait_until(lambda: (r := load_report(str(data_dir)))["counters"]["acknowledged"] >= n and r, 90,
                     f"{n} acknowledged items")
    rows = wait_until(lambda: r if len(r := swarm.results()) >= n else None, 30, f"{n} result rows")
    assert len(rows) == n and len({r["item_id"] for r in rows}) == n, rows
    rep = load_report(str(data_dir))
    assert rep["counters"]["received"] == rep["counters"]["acknowledged"] == n, rep["counters"]
    assert rep["balanced"] is True
    return rep


def _copy_ledger(src: Path, dst: Path) -> None:
    """What survives a broker host's death for this simulation: the ledger's data file,
    copied after the broker was SIGKILLed (LMDB commits are fsynced: the copy is what a restart
    on that disk would open). Not the locks (LMDB's reader table, the broker's flock)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("broker.lock", "lock.mdb"))


def _gap_report(config: Path) -> dict:
    out = subprocess.run([bin_path("ccsq"), "gap-report", "--config", str(config), "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# --- the config key ------------------------------------------------------------------------
def test_broker_endpoint_takes_a_list_each_entry_checked(tmp_path: Path) -> None:
    """One endpoint loads as before; a list loads as its entries; a bad entry is named with its
    position, an empty or repeated entry is refused (file and key named: exit 78)."""
    path = tmp_path / "workerd-0.toml"

    def load_with(value: str) -> WorkerConfig:
        path.write_text(tomli_w.dumps({"peer_id": "worker-1", "broker_endpoint": value}))
        return load(WorkerConfig, path)

    assert load_with("tcp://127.0.0.1:5555").broker_endpoint == "tcp://127.0.0.1:5555"
    assert load_with("tcp://b1:5555, tcp://b2:5555").broker_endpoint == "tcp://b1:5555, tcp://b2:5555"
    for value, needle in [
        ("tcp://b1:5555,tcp://b2", "entry 2 of 2.*'tcp://b2'.*no port"),
        ("tcp://b1:5555,", "entry 2 of 2 is empty"),
        ("tcp://b1:5555,tcp://b1:5555", "entry 2.*listed twice"),
        ("tcp://b1:5555,udp://b2:1", "entry 2 of 2.*unknown scheme"),
        ("tcp://b1", "broker_endpoint = 'tcp://b1': no port"),  # one endpoint: today's sentence
    ]:
        with pytest.raises(ConfigError, match=needle) as err:
            load_with(value)
        assert str(path) in str(err.value) and "broker_endpoint" in str(err.value)


def test_a_relay_link_takes_lists_and_refuses_a_broker_on_both_sides(tmp_path: Path) -> None:
    from ccsq.relayd.config import load_relay_config

    path = tmp_path / "relayd.toml"
    link = {"name": "a-to-b", "kinds": ["echo"], "upstream_endpoint": "tcp://a1:5555,tcp://a2:5555",
            "downstream_endpoint": "tcp://b1:5555,tcp://b2:5555", "upstream_authorized_keys": "a.toml",
            "downstream_authorized_keys": "b.toml"}
    path.write_text(tomli_w.dumps({"peer_id": "relay", "private_key": "relay.key", "links": [link]}))
    cfg = load_relay_config(path)
    assert cfg.side(cfg.links[0], upstream=True).broker_endpoint == "tcp://a1:5555,tcp://a2:5555"
    path.write_text(tomli_w.dumps({"peer_id": "relay", "private_key": "relay.key",
                                   "links": [{**link, "downstream_endpoint": "tcp://b1:5555,tcp://a2:5555"}]}))
    with pytest.raises(ConfigError, match="same broker.*tcp://a2:5555"):
        load_relay_config(path)
    path.write_text(tomli_w.dumps({"peer_id": "relay", "private_key": "relay.key",
                                   "links": [{**link, "upstream_endpoint": "tcp://a1:5555,a2"}]}))
    with pytest.raises(ConfigError, match="upstream_endpoint entry 2 of 2"):
        load_relay_config(path)


def test_the_peer_codec_keeps_replay_memory_per_broker_of_the_pair(tmp_path: Path) -> None:
    """Two broker processes of a pair sign as the one service identity, each with its own
    session: a peer that met the standby, then the primary, then the standby again reads the
    standby's answer (its own scope), while a replay inside one broker's scope stays refused."""
    from ccsq.common.wire import protocol
    from ccsq.common.wire.envelope import EnvelopeCodec
    from ccsq.common.wire.keys import AuthorizedKeys, load_private_key
    from tests.scripted_broker import make_pki

    ak = make_pki(tmp_path, {"broker": "broker", "worker-1": "worker"})
    key = load_private_key(tmp_path / "keys" / "broker.key")
    standby, primary = (EnvelopeCodec("broker", key, AuthorizedKeys(ak)) for _ in range(2))
    peer = EnvelopeCodec("worker-1", load_private_key(tmp_path / "keys" / "worker-1.key"), AuthorizedKeys(ak),
                         require_hello=False)

    def meet(scope: str, broker: EnvelopeCodec) -> list[bytes]:
        peer.replay_scope(scope)
        peer.new_session()
        frames = broker.encode(protocol.Error(protocol.REJECT_NOT_PRIMARY, "standby", 0, primary="tcp://b2:5555"))
        peer.decode(frames, bound_sender="broker")
        return frames

    meet("tcp://b1:5555", standby)
    meet("tcp://b2:5555", primary)
    old = meet("tcp://b1:5555", standby)  # refused as a replay with one memory for the pair
    with pytest.raises(DecodeError) as err:
        peer.decode(old, bound_sender="broker")  # the same frame again, in the same scope
    assert err.value.code == protocol.REJECT_REPLAY


# --- a dead first entry --------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_peers_pass_a_dead_first_endpoint_and_a_flow_completes(tmp_path: Path) -> None:
    """broker_endpoint = "DEAD,BROKER" for worker, producer, completion service and admin CLI:
    each connects to the broker (a refused connect moves to the next entry at once, not after
    hello_timeout_s), the items land once, the books balance."""
    with Swarm(tmp_path / "s", worker={"hello_timeout_s": 30.0}, producer={"hello_timeout_s": 30.0},
               completion={"hello_timeout_s": 30.0}) as swarm:
        dead = _dead_endpoint()
        _set_broker_endpoints(swarm, f"{dead},{swarm.endpoint}")
        swarm.start_all(workers=1)
        for name in ("worker-1", "completion"):
            ready = _events(swarm, name, "broker_link_ready")
            assert ready and ready[0]["endpoint"] == swarm.endpoint, ready
            lost = _events(swarm, name, "broker_link_lost")
            assert lost and dead in lost[0]["reason"] and "refused" in lost[0]["reason"], lost
        with swarm.client() as client:
            t0 = time.monotonic()
            receipts = client.submit_many([(f"item-{i}".encode(), "echo") for i in range(5)], timeout_s=60)
            # hello_timeout_s is 30 s: only the refused connect's rotation makes this quick
            assert time.monotonic() - t0 < 15.0
        assert len({r.item_id for r in receipts}) == 5
        _assert_landed_once(swarm, 5)
        out = subprocess.run([bin_path("ccsq"), "status", "--config", str(swarm.configs["admin"]), "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["counters"]["acknowledged"] == 5
        assert _gap_report(Path(swarm.configs["brokerd"]))["balanced"] is True


# --- a standby first ----------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_standby_sends_every_peer_to_the_primary_at_once(tmp_path: Path) -> None:
    """broker_endpoint = "STANDBY,DEAD": the standby answers NOT_PRIMARY naming the real broker
    (not in the list: followed, its keys are the pinned ones). Every peer goes there at once
    (reconnect_in_s 0, no backoff: rotating would only reach the dead entry), a flow completes."""
    with Swarm(tmp_path / "s", worker={"reconnect_backoff_max_s": 30.0},
               producer={"reconnect_backoff_max_s": 30.0}, completion={"reconnect_backoff_max_s": 30.0}) as swarm:
        stub_endpoint = _dead_endpoint()
        with StandbyStub(swarm.root, stub_endpoint, [swarm.endpoint]):
            _set_broker_endpoints(swarm, f"{stub_endpoint},{_dead_endpoint()}")
            swarm.start_all(workers=1)
            for name in ("worker-1", "completion"):
                ready = _events(swarm, name, "broker_link_ready")
                assert ready and ready[0]["endpoint"] == swarm.endpoint, ready
                redirect = _events(swarm, name, "broker_not_primary")
                assert redirect and redirect[0]["primary"] == swarm.endpoint and redirect[0]["endpoint"] == stub_endpoint
                lost = _events(swarm, name, "broker_link_lost")
                assert lost[0]["reconnect_in_s"] == 0.0 and lost[0]["next_endpoint"] == swarm.endpoint, lost
                gap_s = _ts(ready[0]) - _ts(redirect[0])
                assert gap_s < 2.0, gap_s
            with swarm.client() as client:
                receipts = client.submit_many([(f"item-{i}".encode(), "echo") for i in range(3)], timeout_s=60)
            assert len(receipts) == 3
            _assert_landed_once(swarm, 3)


def _ts(event: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(120)
def test_no_primary_named_means_retry_by_backoff_then_follow(tmp_path: Path) -> None:
    """A standby during an election answers primary = "": the peer stays on (not refused for
    good), retries by the backoff, and once the standby names the primary it goes there.
    broker_endpoint lists only the standby: without following NOT_PRIMARY it never arrives."""
    with Swarm(tmp_path / "s") as swarm:
        stub_endpoint = _dead_endpoint()
        with StandbyStub(swarm.root, stub_endpoint, ["", "", swarm.endpoint]) as stub:
            _set_broker_endpoints(swarm, stub_endpoint)
            swarm.start_broker()
            swarm.start_worker(1)
            assert stub.hello_count("worker-1") >= 3
            redirects = _events(swarm, "worker-1", "broker_not_primary")
            assert [e["primary"] for e in redirects[:3]] == ["", "", swarm.endpoint], redirects
            lost = _events(swarm, "worker-1", "broker_link_lost")
            assert "not the primary" in lost[0]["reason"] and lost[0]["next_endpoint"] == stub_endpoint
            assert _events(swarm, "worker-1", "broker_link_ready")[0]["endpoint"] == swarm.endpoint


# --- a failover -----------------------------------------------------------------------------
FAILOVER_POINTS = [
    # (crash point of broker A, the Nth time): what is unconfirmed when A dies
    ("broker.after_submit_commit", 2),    # a producer's SUBMIT: committed, never acknowledged
    ("broker.after_complete_commit", 1),  # a worker's COMPLETE, with three more leases held
    ("broker.after_ack_commit", 1),       # the completion service's ACK, with leases held
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point,nth", FAILOVER_POINTS)
def test_failover_to_a_second_broker_loses_nothing_lands_once(tmp_path: Path, point: str, nth: int) -> None:
    """Broker A dies (SIGKILL at ``point``) with leases held and something unconfirmed; broker
    B starts at the second endpoint of every peer's list on a copy of A's ledger directory.
    Workers resume their leases by HELLO at B and report what they finished; the producer's
    unconfirmed SUBMIT is resent and confirmed once; the completion service's results land
    once; gap-report on B balances."""
    with Swarm(tmp_path / "s", handler="sleep", broker={"lease_ttl_s": 60.0},
               worker={"slots": 4, "prefetch": 0, "max_batch": 1}) as swarm:
        port_b = free_tcp_port()
        endpoint_b = f"tcp://127.0.0.1:{port_b}"
        _set_broker_endpoints(swarm, f"{swarm.endpoint},{endpoint_b}")
        doc = tomllib.loads(Path(swarm.configs["brokerd"]).read_text())
        config_b = swarm.root / "brokerd-b.toml"
        config_b.write_text(tomli_w.dumps({**doc, "endpoint": endpoint_b, "data_dir": "broker-b-data"}))
        env = {**env_for(point), "CCSQ_CRASH_AFTER_N": str(nth)}
        swarm.start_broker(env=env)
        swarm.start_worker(1)
        swarm.start_completion()
        done: list = []
        with swarm.client() as client:
            # one quick item (its COMPLETE and ACK come first), three that run across the failover
            first = client.submit_many([(b"quick", "sleep", {"seconds": 0.05})]
                                       + [(f"slow-{i}".encode(), "sleep", {"seconds": 5.0}) for i in range(3)],
                                       timeout_s=30)
            assert len(first) == 4
            wait_until(lambda: len(_events(swarm, "worker-1", "job_started")) >= 4, 60, "4 jobs started")
            if point == "broker.after_submit_commit":
                t = threading.Thread(target=lambda: done.extend(
                    client.submit_many([(b"late", "sleep", {"seconds": 0.05})], timeout_s=120)))
                t.start()
            wait_until(lambda: not swarm.procs.procs["broker"].running, 60, "broker A to die at " + point)
            held = _events(swarm, "worker-1", "job_started")
            # the disk survived: B opens a copy of A's ledger, taken after A's death
            _copy_ledger(swarm.root / "broker-data", swarm.root / "broker-b-data")
            swarm.procs.start("broker-b", [bin_path("ccsq-brokerd"), "--config", str(config_b)],
                              ready_event="broker_started")
            if point == "broker.after_submit_commit":
                t.join(120)
                assert done and done[0].item_id and done[0].duplicate, done  # confirmed by B: A had committed it
        n = 5 if point == "broker.after_submit_commit" else 4
        rep = _assert_landed_once(swarm, n, swarm.root / "broker-b-data")
        assert len(held) >= 4
        # the worker's new session at B resumed the leases it held (three slow jobs still running or
        # finished and unconfirmed), by HELLO, as after a broker restart
        sessions = _events(swarm, "worker-1", "session_started")
        assert len(sessions) >= 2 and sessions[-1]["resumed"] >= 3, sessions
        assert _events(swarm, "worker-1", "broker_link_ready")[-1]["endpoint"] == endpoint_b
        assert _events(swarm, "completion", "broker_link_ready")[-1]["endpoint"] == endpoint_b
        assert rep["counters"]["dead"] == 0 and rep["counters"]["expired"] == 0, rep["counters"]
        rows = swarm.results()
        assert sorted(json.loads(r["params"]).get("seconds") for r in rows).count(5.0) == 3
        gap = _gap_report(config_b)
        assert gap["balanced"] is True and gap["counters"]["acknowledged"] == n


# --- no request waits on a broker that is gone ----------------------------------------------
@pytest.mark.timeout(60)
def test_an_admin_command_in_flight_fails_at_once_when_the_session_ends(tmp_path: Path) -> None:
    """The broker WELCOMEs the admin, takes its command and goes silent (a primary lost
    mid-command): the command fails as soon as the link's disconnect rule ends the session
    (heartbeat x liveness = 1 s), naming it, instead of after its 20 s reply timeout; not
    re-sent to the next broker (a state-changing command may have taken effect)."""
    from ccsq.common.wire.config import AdminConfig
    from ccsq.common.wire.errors import BrokerUnavailable
    from ccsq.tools.admin_client import with_broker
    from tests.scripted_broker import ScriptedBroker, make_pki, write_config

    make_pki(tmp_path, {"broker": "broker", "admin": "admin"})
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    cfg = load(AdminConfig, write_config(tmp_path, "admin", "admin", endpoint, data_dir="nowhere"))
    with ScriptedBroker(tmp_path, endpoint) as broker:
        async def run(session) -> dict:
            broker.set_silent(True)  # the command goes out; nothing ever answers it
            return await session.call("status", timeout_s=20.0)

        t0 = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="session ended before the reply"):
            with_broker(cfg, run)
        assert time.monotonic() - t0 < 10.0


@pytest.mark.timeout(60)
def test_two_standbys_naming_each_other_cost_the_backoff_not_a_busy_loop(tmp_path: Path, caplog) -> None:
    """Standby 1 names standby 2 as primary and 2 names 1 (stale etcd answers): the first
    redirect is taken at once, the next one in a row waits the backoff (never a busy loop)."""
    import asyncio
    import logging

    from ccsq.common.link.peer import BrokerLink
    from ccsq.common.wire import protocol
    from ccsq.common.wire.config import PeerSettings
    from tests.scripted_broker import make_pki

    make_pki(tmp_path, {"broker": "broker", "worker-1": "worker"})
    e1, e2 = _dead_endpoint(), _dead_endpoint()
    settings = PeerSettings(peer_id="worker-1", private_key=str(tmp_path / "keys" / "worker-1.key"),
                            authorized_keys=str(tmp_path / "authorized_keys.toml"), broker_endpoint=e1,
                            reconnect_backoff_max_s=0.2, hello_timeout_s=2.0)

    async def run_until(stubs: tuple[StandbyStub, ...], hellos: int) -> BrokerLink:
        link = BrokerLink(settings, hello=lambda: protocol.Hello(role="worker"), on_message=lambda env: None)
        task = asyncio.create_task(link.run())
        deadline = time.monotonic() + 30
        while sum(s.hello_count() for s in stubs) < hellos and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await link.stop()
        await asyncio.wait_for(task, 5)
        return link

    caplog.set_level(logging.INFO, logger="ccsq.peer")
    with StandbyStub(tmp_path, e1, [e2]) as s1, StandbyStub(tmp_path, e2, [e1]) as s2:
        link = asyncio.run(run_until((s1, s2), 12))
    assert link.sessions == 0 and s1.hello_count() >= 5 and s2.hello_count() >= 5
    delays = [r.ccsq_event["reconnect_in_s"] for r in caplog.records
              if getattr(r, "ccsq_event", {}).get("event") == "broker_link_lost"][:10]
    assert len(delays) == 10
    immediate = [d == 0.0 for d in delays]
    # at once, then by the backoff, alternately: two immediate redirects never follow each other
    assert immediate[0] and not any(a and b for a, b in zip(immediate, immediate[1:])), delays


@pytest.mark.timeout(300)
def test_after_a_failover_the_standby_leads_peers_to_the_new_primary(tmp_path: Path) -> None:
    """The pair as peers see it: broker_endpoint = "STANDBY,A". The standby names A; every peer
    works with A. A is SIGKILLed with leases held; B starts on a copy of A's ledger at an
    endpoint no peer lists, and the standby now names B. Each peer comes back to the
    standby (whose session it met before A's: not a replay), follows it to B, resumes its
    leases there, and the items land once. The producer's outbox spools what is submitted
    while no broker answers and delivers it to B."""
    with Swarm(tmp_path / "s", handler="sleep", broker={"lease_ttl_s": 60.0},
               worker={"slots": 3, "prefetch": 0, "max_batch": 1}, producer={"outbox_dir": "outbox"}) as swarm:
        endpoint_b = _dead_endpoint()
        doc = tomllib.loads(Path(swarm.configs["brokerd"]).read_text())
        config_b = swarm.root / "brokerd-b.toml"
        config_b.write_text(tomli_w.dumps({**doc, "endpoint": endpoint_b, "data_dir": "broker-b-data"}))
        stub_endpoint = _dead_endpoint()
        with StandbyStub(swarm.root, stub_endpoint, [swarm.endpoint]) as stub:
            _set_broker_endpoints(swarm, f"{stub_endpoint},{swarm.endpoint}")
            swarm.start_all(workers=1)
            with swarm.client() as client:
                client.submit_many([(f"slow-{i}".encode(), "sleep", {"seconds": 4.0}) for i in range(3)], timeout_s=30)
            wait_until(lambda: len(_events(swarm, "worker-1", "job_started")) >= 3, 60, "3 jobs started")
            swarm.procs.kill("broker")
            with stub.lock:
                stub.primaries = [swarm.endpoint] * len(stub.hellos) + [endpoint_b]  # the election's outcome
            _copy_ledger(swarm.root / "broker-data", swarm.root / "broker-b-data")
            with swarm.client() as client:
                # no broker answers (A dead, B not started): spooled after submit_timeout_s
                spooled = client.submit_many([(f"spooled-{i}".encode(), "sleep", {"seconds": 0.05}) for i in range(2)],
                                             timeout_s=60)
                assert len(spooled) == 2 and all(r.spooled for r in spooled), spooled
                swarm.procs.start("broker-b", [bin_path("ccsq-brokerd"), "--config", str(config_b)],
                                  ready_event="broker_started")
                client.flush(timeout_s=60)
            rep = _assert_landed_once(swarm, 5, swarm.root / "broker-b-data")
            assert rep["counters"]["dead"] == 0 and rep["counters"]["expired"] == 0, rep["counters"]
            for name in ("worker-1", "completion"):
                ready = _events(swarm, name, "broker_link_ready")
                assert [e["endpoint"] for e in ready][-1] == endpoint_b, ready
                assert _events(swarm, name, "broker_not_primary")[-1]["primary"] == endpoint_b
            sessions = _events(swarm, "worker-1", "session_started")
            assert sessions[-1]["resumed"] == 3, sessions
            assert not stub.errors, stub.errors


# --- a relay: both sides ----------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_relay_follows_lists_on_both_sides(tmp_path: Path) -> None:
    """The relay's upstream_endpoint = "DEAD,A" and downstream_endpoint = "B's STANDBY,DEAD":
    both sides reach their brokers (the downstream at once, by NOT_PRIMARY), and a's items run
    on b's worker and land once in a's results."""
    from tests.fedswarm import FedPair

    with FedPair(tmp_path, a_workers=0) as pair:
        stub_endpoint = _dead_endpoint()
        doc = tomllib.loads(Path(pair.relay_cfg).read_text())
        doc["links"][0]["upstream_endpoint"] = f"{_dead_endpoint()},{pair.a.endpoint}"
        doc["links"][0]["downstream_endpoint"] = f"{stub_endpoint},{_dead_endpoint()}"
        Path(pair.relay_cfg).write_text(tomli_w.dumps(doc))
        with StandbyStub(pair.b.root, stub_endpoint, [pair.b.endpoint]) as stub:
            pair.a.start_broker()
            pair.a.start_completion()
            pair.b.start_broker()
            pair.b.start_worker(1)
            pair.start_relay()
            pair.wait_connected()
            with pair.a.client() as client:
                receipts = client.submit_many([(f"fed-{i}".encode(), "echo") for i in range(4)], timeout_s=60)
            assert len({r.item_id for r in receipts}) == 4
            pair.a.wait_acknowledged(4, timeout_s=90)
            rows = wait_until(lambda: r if len(r := pair.a.results()) >= 4 else None, 30, "4 rows in a's results")
            assert len({r["item_id"] for r in rows}) == 4
            assert pair.a.report()["balanced"] is True and pair.b.report()["balanced"] is True
            assert stub.hello_count() >= 1 and not stub.errors
            relay = pair.procs.procs["relay"].events()
            ready = {e.get("endpoint") for e in relay if e.get("event") == "broker_link_ready"}
            assert {pair.a.endpoint, pair.b.endpoint} <= ready, ready


@pytest.mark.timeout(120)
def test_a_killed_primary_is_left_at_once_not_after_the_silence(tmp_path: Path) -> None:
    """With a list, a peer ends its session as soon as the broker's TCP connection closes (the
    process was SIGKILLed), not after heartbeat x liveness (10 s here), and tries the next
    entry: the failover does not wait for the peers' silence rule."""
    with Swarm(tmp_path / "s", broker={"heartbeat_interval_s": 1.0, "liveness": 10, "lease_ttl_s": 60.0}) as swarm:
        stub_endpoint = _dead_endpoint()
        with StandbyStub(swarm.root, stub_endpoint, [""]) as stub:
            _set_broker_endpoints(swarm, f"{swarm.endpoint},{stub_endpoint}")
            swarm.start_broker()
            swarm.start_worker(1)
            swarm.start_completion()
            t0 = time.time()
            swarm.procs.kill("broker")
            for name in ("worker-1", "completion"):
                lost = wait_until(lambda: _events(swarm, name, "broker_link_lost"), 30, f"{name} to lose the broker")
                assert "closed" in lost[0]["reason"] and lost[0]["next_endpoint"] == stub_endpoint, lost
                assert _ts(lost[0]) - t0 < 4.0, (_ts(lost[0]) - t0, lost[0])
            wait_until(lambda: stub.hello_count("worker-1") >= 1, 10, "the worker at the next entry")


@pytest.mark.timeout(300)
def test_a_relay_and_its_downstream_swarm_follow_a_downstream_failover(tmp_path: Path) -> None:
    """The downstream broker b dies (SIGKILL) while b's worker runs three of a's items the
    relay submitted there; b2 starts on a copy of b's ledger at the second endpoint of the
    relay's downstream_endpoint and of b's worker. The worker resumes its leases at b2, b2
    routes the results to the relay, the relay completes them upstream: each lands once in a's
    results, and a's, b2's and the link's books balance."""
    from tests.fedswarm import FedPair

    with FedPair(tmp_path, a_workers=0, handler="sleep", kinds=("sleep",), broker={"lease_ttl_s": 60.0},
                 worker={"slots": 3, "prefetch": 0, "max_batch": 1}) as pair:
        b = pair.b
        endpoint_b2 = _dead_endpoint()
        doc = tomllib.loads(Path(b.configs["brokerd"]).read_text())
        config_b2 = b.root / "brokerd-b2.toml"
        config_b2.write_text(tomli_w.dumps({**doc, "endpoint": endpoint_b2, "data_dir": "broker-b2-data"}))
        _set_broker_endpoints(b, f"{b.endpoint},{endpoint_b2}")
        relay_doc = tomllib.loads(Path(pair.relay_cfg).read_text())
        relay_doc["links"][0]["downstream_endpoint"] = f"{b.endpoint},{endpoint_b2}"
        Path(pair.relay_cfg).write_text(tomli_w.dumps(relay_doc))
        pair.a.start_broker()
        pair.a.start_completion()
        b.start_broker()
        b.start_worker(1)
        pair.start_relay()
        pair.wait_connected()
        with pair.a.client() as client:
            client.submit_many([(f"fed-slow-{i}".encode(), "sleep", {"seconds": 4.0}) for i in range(3)], timeout_s=60)
        wait_until(lambda: len(_events(b, "worker-1", "job_started")) >= 3, 60, "b's worker runs the 3 relayed items")
        b.procs.kill("broker")
        _copy_ledger(b.root / "broker-data", b.root / "broker-b2-data")
        b.procs.start("broker-b2", [bin_path("ccsq-brokerd"), "--config", str(config_b2)], ready_event="broker_started")
        pair.a.wait_acknowledged(3, timeout_s=120)
        rows = wait_until(lambda: r if len(r := pair.a.results()) >= 3 else None, 30, "3 rows in a's results")
        assert len(rows) == 3 and len({r["item_id"] for r in rows}) == 3, rows
        rep_a = pair.a.report()
        assert rep_a["counters"]["received"] == rep_a["counters"]["acknowledged"] == 3 and rep_a["balanced"] is True
        def drained() -> dict | None:
            r = pair.report()
            return r if all(k["in_flight"] == 0 for k in r["links"]) else None

        fed = wait_until(drained, 60, "the link drained")
        assert fed["balanced"] is True, fed
        from ccsq.brokerd.gap_report import load_report

        rep_b2 = load_report(str(b.root / "broker-b2-data"))
        assert rep_b2["balanced"] is True and rep_b2["counters"]["dead"] == 0, rep_b2["counters"]
        assert _events(b, "worker-1", "session_started")[-1]["resumed"] == 3
        relay = pair.procs.procs["relay"].events()
        assert endpoint_b2 in {e.get("endpoint") for e in relay if e.get("event") == "broker_link_ready"}


# --- a stalled primary, a standby met for the first time -----------------------------------
@pytest.mark.timeout(240)
def test_a_stalled_primary_is_rejoined_after_a_standby_first_met_names_it(tmp_path: Path) -> None:
    """The livelock of a failover-bench trial: broker_endpoint = "A,STANDBY". Every peer works
    with A; A stalls (SIGSTOP 2.5 s, still primary, not restarted), the peers' sessions go
    silent and they try the standby, met now for the first time (a fresh session: a broker
    that just stepped down to standby), which names A. A resumes and WELCOMEs them again from
    the session they knew. With one replay memory for the pair, the standby's answer retired
    A's session and every WELCOME of A was 'REPLAY: message from retired session of broker'
    for 2 x max_clock_skew_s; with the memory per endpoint the peers are back on A at once."""
    with Swarm(tmp_path / "s", broker={"heartbeat_interval_s": 0.2, "liveness": 5}) as swarm:
        stub_endpoint = _dead_endpoint()
        with StandbyStub(swarm.root, stub_endpoint, [swarm.endpoint]) as stub:
            _set_broker_endpoints(swarm, f"{swarm.endpoint},{stub_endpoint}")
            swarm.start_all(workers=1)
            peers = ("worker-1", "completion")
            for name in peers:
                assert [e["endpoint"] for e in _events(swarm, name, "broker_link_ready")] == [swarm.endpoint]
            stopped_mono = time.monotonic()
            swarm.procs.signal("broker", signal.SIGSTOP)
            try:
                wait_until(lambda: all(stub.hello_count(p) >= 1 for p in ("worker-1", "completion-1")), 30,
                           "both peers asked the standby while A is stopped")
            finally:
                time.sleep(max(0.0, stopped_mono + 2.5 - time.monotonic()))  # the fault itself: a 2.5 s stall
                swarm.procs.signal("broker", signal.SIGCONT)
            for name in peers:
                wait_until(lambda n=name: len(_events(swarm, n, "broker_link_ready")) >= 2, 30, f"{name} back on A")
            with swarm.client() as client:
                receipts = client.submit_many([(f"item-{i}".encode(), "echo") for i in range(3)], timeout_s=60)
            assert len(receipts) == 3
            _assert_landed_once(swarm, 3)
            for name in peers:
                ready = _events(swarm, name, "broker_link_ready")
                assert all(e["endpoint"] == swarm.endpoint for e in ready), ready
                refused = [e["reason"] for e in _events(swarm, name, "broker_link_lost") if "REPLAY" in e["reason"]]
                assert not refused, refused
            assert not stub.errors, stub.errors


def _unanswering_endpoint() -> tuple[str, list]:
    """An endpoint whose host never completes a TCP handshake (as a host whose cable is pulled):
    a listening socket with a full accept queue (backlog 0, filled, never accepted) drops every
    further SYN. Returns the endpoint and the sockets to keep open."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    keep = [srv]
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        keep.append(c)
    return f"tcp://127.0.0.1:{port}", keep


@pytest.mark.timeout(120)
def test_a_host_that_never_accepts_the_connection_is_passed_at_once_not_after_hello_timeout_s(tmp_path: Path) -> None:
    """broker_endpoint = "GONE,BROKER" where GONE never answers the TCP handshake (a cut cable,
    DROPped packets; a standby still naming that primary sends peers there): the admin CLI moves
    on after PAIR_CONNECT_TIMEOUT_S (0.5 s), not after hello_timeout_s (10 s here)."""
    with Swarm(tmp_path / "s") as swarm:
        gone, keep = _unanswering_endpoint()
        try:
            _set_broker_endpoints(swarm, f"{gone},{swarm.endpoint}")
            admin = Path(swarm.configs["admin"])
            doc = tomllib.loads(admin.read_text())
            doc.update(hello_timeout_s=10.0, connect_timeout_s=30.0)
            admin.write_text(tomli_w.dumps(doc))
            swarm.start_broker()
            t0 = time.monotonic()
            out = subprocess.run([bin_path("ccsq"), "status", "--config", str(admin), "--json"], capture_output=True,
                                 text=True, timeout=60)
            took = time.monotonic() - t0
            assert out.returncode == 0, out.stderr
            assert took < 6.0, took  # the old rule: 10 s of hello_timeout_s at GONE first
        finally:
            for s in keep:
                s.close()
