"""The primary's replication server and the standby mode (brokerd/replserver.py,
brokerd/standby.py, docs/ha.md) with a real LMDB ledger on each side, real sockets, a real
etcd (tests/test_election.py starts it) and the standby a real process (SIGKILL, restart).

The primary here is a Ledger and a ReplicationServer in this process's event loop (no actor:
what the broker adds on top is haprim's); the standby is ``run_standby`` in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from ccsq.brokerd.election import Election, _b64
from ccsq.brokerd.ledger import replication
from ccsq.brokerd.ledger.store import Ledger, Policy, data_paths
from ccsq.brokerd.replserver import ReplicationServer
from ccsq.brokerd.standby import DISCARDED, sync_key
from ccsq.brokerd.transport import Transport
from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import MAC_BYTES, EnvelopeCodec
from ccsq.common.wire.keys import (AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys,
                                   write_curve_keypair, write_keypair)
from tests.test_election import etcd_server  # noqa: F401 - the fixture (a real etcd in tmp_path)
from tests.test_ledger_replication import blob

pytest.importorskip("etcd3gw")
TTL_S, MARGIN_S = 2, 0.5
PEER_ENDPOINT = "tcp://primary.example:5555"  # what the primary advertises to peers (never dialled here)
ROOT = Path(__file__).resolve().parent.parent

STANDBY = """
import asyncio, json, signal, sys, types
from ccsq.brokerd.election import Election
from ccsq.brokerd.standby import run_standby
from ccsq.common.runtime.daemon import die
from ccsq.common.wire.errors import CcsqError
cfg = types.SimpleNamespace(**json.load(open(sys.argv[1])))
async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    e = Election([cfg.etcd], "s1", cfg.endpoint, ttl_s=2, margin_s=0.5)
    out = await run_standby(cfg, e, stop)
    print("OUTCOME", out.value, flush=True)
try:
    asyncio.run(main())
except CcsqError as exc:
    sys.exit(die("ccsq-brokerd", exc))
"""


@pytest.fixture
def etcd_url(request) -> str:
    return request.getfixturevalue("etcd_server")[0]


def base_cfg(tmp: Path, name: str, **kw) -> types.SimpleNamespace:
    d = dict(peer_id="broker", private_key=str(tmp / "keys" / "broker.key"),
             authorized_keys=str(tmp / "authorized_keys.toml"), endpoint="tcp://127.0.0.1:0", bind="",
             data_dir=str(tmp / name), heartbeat_interval_s=0.2, liveness=5, max_frame_bytes=64 << 10,
             max_clock_skew_s=60.0, curve=False, curve_secret_key="", map_size_bytes=1 << 20,
             max_map_size_bytes=1 << 30, sndhwm=1000, ha_repl_endpoint="tcp://127.0.0.1:0", ha_node_id="broker-1",
             ha_node_key=str(tmp / "keys" / "broker-1.key"), ha_mode="sync", config_path=f"{name}/brokerd.toml")
    d.update(kw)
    return types.SimpleNamespace(**d)


@pytest.fixture
def swarm(tmp_path):
    kd = tmp_path / "keys"
    for pid in ("broker", "broker-1", "broker-2", "worker"):
        write_keypair(kd, pid)
    pub = {pid: public_key_b64(load_private_key(kd / f"{pid}.key")) for pid in ("broker", "broker-1", "broker-2", "worker")}
    write_authorized_keys(tmp_path / "authorized_keys.toml", {"broker-1": ("standby", pub["broker-1"]),
                                                              "broker-2": ("standby", pub["broker-2"]),
                                                              "worker": ("worker", pub["worker"])})
    write_authorized_keys(tmp_path / "at_worker.toml", {"broker": ("broker", pub["broker"])})
    return tmp_path


def open_ledger(path: Path) -> Ledger:
    return Ledger(path, map_size_bytes=256 << 20, max_map_size_bytes=1 << 30,
                  policy=Policy(retry_backoff_base_s=0.0, max_attempts=2, retention_s=1.0, dedup_window_s=5.0),
                  rng=random.Random(7))


class Primary:
    """A primary without its actor: a Ledger, its ReplicationLog, a ReplicationServer and the
    election key (with repl_endpoint and ledger_id, as haprim writes it)."""

    def __init__(self, tmp: Path, etcd_url: str, *, backlog_turns: int | None = None, write_ledger_id: bool = True,
                 members_gate: threading.Event | None = None, **cfg_kw) -> None:
        self.cfg = base_cfg(tmp, "primary", **cfg_kw)
        self.ledger = open_ledger(data_paths(Path(self.cfg.data_dir))[0])
        self.election = Election([etcd_url], "s1", PEER_ENDPOINT, ttl_s=TTL_S, margin_s=MARGIN_S)
        self.backlog_turns, self.write_ledger_id = backlog_turns, write_ledger_id
        self.members_calls: list[tuple[list[str], int, list[int]]] = []
        self.members_gate = members_gate
        self.durable_wakes = 0
        self.n = 0
        self._term()

    def _term(self) -> None:
        """Win the election and serve as primary of the new epoch (as haprim's role loop does)."""
        self.epoch = self.election.campaign()
        assert self.epoch
        self.log = self.ledger.replicate(self.epoch, backlog_turns=self.backlog_turns)
        self.ledger.adopt_epoch(self.epoch)
        self.server = ReplicationServer(self.cfg, self.ledger, self.log, self.epoch, sync_standbys=1,
                                        on_durable=self._durable, on_members=self._members)
        value = {"epoch": self.epoch, "endpoint": PEER_ENDPOINT, "repl_endpoint": self.server.endpoint,
                 "node": "broker-0", "lease": self.election.lease_id}
        if self.write_ledger_id:
            value["ledger_id"] = self.ledger.ledger_id
        self.election._post("/kv/put", {"key": _b64(self.election.key), "value": _b64(json.dumps(value)),
                                        "lease": self.election.lease_id})
        self.election.start_keepalive()

    async def reelect(self, task: asyncio.Task) -> asyncio.Task:
        """Resign and win again: a new epoch, its turns continuing the seq. /sync is emptied
        first, so no standby may campaign meanwhile (a listed one would: rightly)."""
        self.server.stop()
        await task
        self.election._post("/kv/put", {"key": _b64(sync_key("s1")),
                                        "value": _b64(json.dumps({"epoch": self.epoch, "members": []}))})
        self.election.resign()
        self._term()
        return await serving(self)

    def _durable(self) -> None:
        self.durable_wakes += 1

    def _members(self, members: list[str]) -> None:
        acked = [s["seq"] for s in self.server.status()["standbys"]]
        self.members_calls.append((list(members), self.server.durable_seq(), acked))
        if self.members_gate is not None:
            assert self.members_gate.wait(30)
        self.election._post("/kv/put", {"key": _b64(sync_key("s1")),
                                        "value": _b64(json.dumps({"epoch": self.epoch, "members": members}))})

    def commit(self, turns: int, items: int = 1) -> None:
        """``turns`` turns of ``items`` submits each, committed (fsynced) one after the other."""
        for _ in range(turns):
            txn = self.ledger.begin()
            for _ in range(items):
                self.n += 1
                txn.submit(protocol.SubmitItem(f"k{self.n}", "echo", blob(b"%d" % self.n)), 1_000 + self.n)
            txn.commit()

    def standby(self, node: str = "broker-1") -> dict:
        for s in self.server.status()["standbys"]:
            if s["node"] == node:
                return s
        return {}

    def close(self) -> None:
        self.election.resign()
        self.ledger.close()


class StandbyProc:
    def __init__(self, tmp: Path, etcd_url: str, node: str = "broker-1", **kw) -> None:
        self.cfg = base_cfg(tmp, node, ha_node_id=node, ha_node_key=str(tmp / "keys" / f"{node}.key"),
                            etcd=etcd_url, **kw)
        self.cfg_path = tmp / f"{node}.json"
        self.cfg_path.write_text(json.dumps(vars(self.cfg)))
        self.log_path = tmp / f"{node}.log"
        self.proc: subprocess.Popen | None = None
        self.ledger_dir = data_paths(Path(self.cfg.data_dir))[0]

    def start(self) -> StandbyProc:
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait/kill
        self.proc = subprocess.Popen([sys.executable, "-c", STANDBY, str(self.cfg_path)], stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=ROOT)
        return self

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def peer_endpoint(self) -> str:
        return (Path(self.cfg.data_dir) / "endpoint").read_text().strip()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def wait(self, timeout_s: float = 20) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the standby did not exit within {timeout_s}s:\n{self.text()[-4000:]}") from None
        self.log.close()
        return rc

    def stop(self) -> int:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                return self.wait()
            except AssertionError:
                self.kill()
        return self.proc.returncode if self.proc else 0

    def dump(self) -> dict:
        env = replication._open_env(self.ledger_dir, 1 << 30, create=False)
        try:
            return replication.dump(env)
        finally:
            env.close()


async def until(cond, timeout_s: float = 30.0, what: str = "", proc: StandbyProc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}\n" + (proc.text()[-4000:] if proc else ""))
        await asyncio.sleep(0.02)


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 240))


async def serving(primary: Primary):
    task = asyncio.get_running_loop().create_task(primary.server.run())
    await asyncio.sleep(0)
    return task


async def caught_up(primary: Primary, sb: StandbyProc, node: str = "broker-1", timeout_s: float = 60) -> None:
    await until(lambda: primary.standby(node).get("seq") == primary.log.position[1]
                and not primary.standby(node).get("copying"), timeout_s, f"{node} catches up", sb)


async def commit_async(primary: Primary, turns: int, items: int = 1) -> None:
    for _ in range(turns):
        primary.commit(1, items)
        await asyncio.sleep(0)


def worker_hello(endpoint: str, tmp: Path) -> protocol.Error:
    codec = EnvelopeCodec("worker", load_private_key(tmp / "keys" / "worker.key"),
                          AuthorizedKeys(tmp / "at_worker.toml"), require_hello=False)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    try:
        s.connect(endpoint)
        s.send_multipart(codec.encode(protocol.Hello(role="worker", slots=1, credit=1)))
        assert s.poll(10_000), "the standby did not answer the worker's HELLO"
        return codec.decode(s.recv_multipart()).message
    finally:
        s.close()
        ctx.term()


def test_turns_stream_to_a_standby_that_answers_peers_not_primary_and_promotes(swarm, etcd_url):
    """2,000 turns reach the standby (seeded by copy: it starts empty); sync mode counts it
    only once etcd lists it; a worker's HELLO to the standby is refused naming the primary;
    the primary resigns, the standby returns PROMOTE and its ledger opens as a Ledger equal
    to the primary's, record for record."""

    async def scenario():
        primary = Primary(swarm, etcd_url)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url).start()
        try:
            await caught_up(primary, sb)
            await until(lambda: primary.members_calls, 10, "on_members is called")
            assert primary.members_calls[0][0] == ["broker-1"]
            assert primary.members_calls[0][1] == 0  # listed before its acks counted
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "durable")
            t0 = time.monotonic()
            await commit_async(primary, 2000)
            await caught_up(primary, sb)
            took = time.monotonic() - t0
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "durable")
            st = primary.server.status()
            assert st["standbys"][0]["in_sync"] and st["standbys"][0]["lag_turns"] == 0 and st["copies"] == 1
            print(f"2000 turns committed and acknowledged in {took:.2f}s")
            err = await asyncio.to_thread(worker_hello, sb.peer_endpoint(), swarm)
            assert isinstance(err, protocol.Error) and err.code == protocol.REJECT_NOT_PRIMARY and err.primary == PEER_ENDPOINT
            want = replication.dump(primary.ledger.env)
            primary.server.stop()
            await task
            primary.election.resign()  # the key goes: broker-1 is listed in /sync
            assert await asyncio.to_thread(sb.wait, 20) == 0
            assert "OUTCOME promote" in sb.text()
            assert sb.dump() == want
            promoted = open_ledger(sb.ledger_dir)
            try:
                assert replication.dump(promoted.env) == want
                assert promoted.ledger_id == primary.ledger.ledger_id
            finally:
                promoted.close()
        finally:
            sb.stop()
            primary.server.stop()
            if not task.done():
                await task
            primary.close()

    run(scenario)


def test_a_standby_started_after_10000_items_catches_up_by_copy_while_the_primary_commits(swarm, etcd_url, monkeypatch):
    async def scenario():
        primary = Primary(swarm, etcd_url)
        task = await serving(primary)
        primary.commit(100, items=100)  # 10,000 items before the standby exists
        sb = StandbyProc(swarm, etcd_url).start()
        seen_copy = []
        while_taken = []  # turns the primary committed while take_copy ran (in its thread)
        real_take = replication.take_copy

        def slow_take(ledger, dest):  # the copy waits for 5 more commits: only a thread lets them happen
            start, deadline = primary.log.position[1], time.monotonic() + 10
            while primary.log.position[1] < start + 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            while_taken.append(primary.log.position[1] - start)
            return real_take(ledger, dest)

        monkeypatch.setattr(replication, "take_copy", slow_take)
        try:
            async def writer():
                while not seen_copy or primary.standby().get("copying"):
                    copying = primary.standby().get("copying")
                    if copying:
                        seen_copy.append(primary.log.position[1])
                    primary.commit(1, items=5)
                    await asyncio.sleep(0.002)

            w = asyncio.get_running_loop().create_task(writer())
            await until(lambda: bool(seen_copy) and not primary.standby().get("copying"), 60, "copy", sb)
            await w
            during = primary.log.position[1] - seen_copy[0]
            assert during > 0, "the primary committed nothing while the copy was shipped"
            assert while_taken and while_taken[0] >= 5, f"the primary committed {while_taken} turns while the copy was taken"
            await caught_up(primary, sb)
            assert primary.server.status()["copies"] == 1
            assert sb.stop() == 0
            assert sb.dump() == replication.dump(primary.ledger.env)
            assert "standby_seeded" in sb.text()
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


def test_a_standby_killed_and_restarted_resumes_from_its_position_without_a_copy_and_follows_a_new_epoch(swarm, etcd_url):
    async def scenario():
        primary = Primary(swarm, etcd_url)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url).start()
        try:
            await caught_up(primary, sb)
            await commit_async(primary, 200)
            await caught_up(primary, sb)
            sb.kill()
            await commit_async(primary, 300)
            assert primary.server.durable_seq() < primary.log.position[1]  # nobody holds those
            sb.start()
            await caught_up(primary, sb)
            assert primary.server.status()["copies"] == 1  # the first seed only
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "listed again")
            # a failover to a new epoch (here the same ledger wins again): the standby follows it,
            # streaming on from its position, no copy
            old_epoch = primary.epoch
            task = await primary.reelect(task)
            assert primary.epoch > old_epoch
            await commit_async(primary, 50)
            await caught_up(primary, sb)
            assert primary.server.status()["copies"] == 0
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "listed in the new epoch")
            assert sb.stop() == 0
            assert sb.dump() == replication.dump(primary.ledger.env)
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


def test_need_copy_for_a_truncated_backlog_and_for_a_deposed_primarys_tail(swarm, etcd_url):
    async def scenario():
        primary = Primary(swarm, etcd_url, backlog_turns=20)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url).start()
        try:
            await caught_up(primary, sb)
            assert sb.stop() == 0
            await commit_async(primary, 50)  # beyond the backlog
            sb.start()
            await caught_up(primary, sb)
            assert primary.server.status()["copies"] == 2
            assert sb.stop() == 0
            assert sb.dump() == replication.dump(primary.ledger.env)
            # a deposed primary's tail: the standby's ledger commits a turn of this epoch on its
            # own; the primary takes a new epoch whose turns have the same seqs
            tail = open_ledger(sb.ledger_dir)
            tail.replicate(primary.epoch)
            txn = tail.begin()
            txn.submit(protocol.SubmitItem("tail", "echo", blob(b"never confirmed")), 9_999_999)
            txn.commit()
            tail.close()
            task = await primary.reelect(task)
            await commit_async(primary, 3)
            sb.start()
            await caught_up(primary, sb)
            assert primary.server.status()["copies"] == 1  # the new epoch's server: the deposed tail's copy
            assert sb.stop() == 0
            assert sb.dump() == replication.dump(primary.ledger.env)
            aside = Path(sb.cfg.data_dir) / DISCARDED
            assert (aside / "data.mdb").exists() and "standby_ledger_discarded" in sb.text()
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


@pytest.mark.parametrize("ledger_id_in_etcd", [True, False])
def test_a_standby_of_another_ledger_is_refused_with_exit_78(swarm, etcd_url, ledger_id_in_etcd):
    async def scenario():
        primary = Primary(swarm, etcd_url, write_ledger_id=ledger_id_in_etcd)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url)
        other = open_ledger(sb.ledger_dir)  # another swarm's ledger in its data_dir
        other_id = other.ledger_id
        other.close()
        try:
            rc = await asyncio.to_thread(sb.start().wait, 30)
            assert rc == 78, sb.text()[-3000:]
            assert other_id in sb.text() and primary.ledger.ledger_id in sb.text()
            assert "another swarm" in sb.text()
            # with the ledger id in etcd the standby refuses before it connects; without, the primary refuses it
            assert ("points at another swarm's primary" in sb.text()) is ledger_id_in_etcd
            assert ("refused this standby" in sb.text()) is not ledger_id_in_etcd
            assert primary.server.status()["copies"] == 0
            check = open_ledger(sb.ledger_dir)
            assert check.ledger_id == other_id  # left as it was
            check.close()
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


def test_an_ack_that_came_while_the_loop_was_busy_is_read_at_once_after_the_next_turn_ships(swarm, etcd_url):
    """A REPL_ACK arrives while the primary's loop is busy (the actor's turn and fsync), and the
    next turn is shipped from that loop (``sink`` in the server's thread) before the server waits
    again: the send consumes ZMQ_FD's edge, and no later frame raises another while the ack is
    unread. The server reads it at once, not at its next tick (up to 250 ms): before the fix each
    confirm of a real pair waited for that tick (the pipeline's p50 at 100 jobs/s was 494 ms
    against 22 ms on one broker; bench/ha_sync.py)."""

    async def scenario():
        primary = Primary(swarm, etcd_url)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url).start()
        try:
            await caught_up(primary, sb)
            waits_s = []
            for _ in range(10):
                primary.commit(1)  # shipped in this thread: the standby applies, fsyncs and acks it
                seq = primary.log.position[1]
                deadline = time.monotonic() + 20
                while sb.dump() != replication.dump(primary.ledger.env):  # blocking: the loop is busy
                    assert time.monotonic() < deadline, "the standby did not apply the turn"
                    time.sleep(0.005)
                time.sleep(0.02)  # its REPL_ACK reaches the primary's socket meanwhile
                primary.commit(1)  # the next turn ships (a send on the ROUTER) before the loop runs again
                t0 = time.monotonic()
                await until(lambda: primary.server.durable_seq() >= seq, 10, "the ack read", sb)
                waits_s.append(time.monotonic() - t0)
                await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "caught up", sb)
            assert sum(waits_s) < 0.3, [round(w, 3) for w in waits_s]  # before the fix: the rest of a tick each, 0.64 s
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


def test_a_wake_that_comes_between_two_waits_ends_the_next_wait_at_once(tmp_path):
    """The server's ``on_durable`` is the actor's ``transport.wake``, called in the loop while the
    actor is *not* inside ``wait_readable`` (asleep in its commit delay after a turn, or in its
    pass): the wake is kept, the actor's next wait returns at once, and the held DISPATCH leaves
    then. Before: the wake found no waiter and was dropped, so the actor slept up to
    primary.CHECK_INTERVAL_S (100 ms) or until another frame came (in bench.ha_sync's light run one
    DISPATCH in ten waited 80-100 ms after its turn was durable). A kept wake ends one wait only."""
    priv, _ = write_keypair(tmp_path / "keys", "broker")
    key = load_private_key(priv)
    write_authorized_keys(tmp_path / "ak.toml", {"broker": ("broker", public_key_b64(key))})
    codec = EnvelopeCodec("broker", key, AuthorizedKeys(tmp_path / "ak.toml"))
    transport = Transport("tcp://127.0.0.1:0", codec, sndhwm=100, max_frame_bytes=1 << 20)

    async def scenario():
        transport.wake()  # nobody waits (the actor is between two waits)
        t0 = time.monotonic()
        await transport.wait_readable(5.0)
        woken_s = time.monotonic() - t0
        assert woken_s < 0.5, f"the kept wake did not end the wait: {woken_s:.2f} s"  # before: 5 s
        t0 = time.monotonic()
        await transport.wait_readable(0.3)  # the wake was used up: this one waits its timeout
        assert time.monotonic() - t0 >= 0.25

    try:
        run(scenario)
    finally:
        transport.close()


def test_durable_seq_covers_only_what_a_listed_in_sync_standby_fsynced(swarm, etcd_url):
    async def scenario():
        gate = threading.Event()
        primary = Primary(swarm, etcd_url, members_gate=gate)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url).start()
        try:
            await caught_up(primary, sb)
            await commit_async(primary, 20)
            await caught_up(primary, sb)
            await until(lambda: primary.members_calls, 10, "on_members is called")
            assert primary.members_calls[0][0] == ["broker-1"]
            assert primary.server.durable_seq() == 0  # acknowledged, but etcd does not list it yet
            gate.set()
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "listed")
            held = primary.server.durable_seq()
            os.kill(sb.proc.pid, signal.SIGSTOP)  # it applies nothing more
            await commit_async(primary, 10)
            await asyncio.sleep(0.3)
            assert primary.server.durable_seq() == held
            assert primary.standby()["lag_turns"] == 10
            await until(lambda: primary.server.status()["members"] == [], 15, "lagging standby leaves the set")
            assert primary.members_calls[-1][0] == [] and primary.server.durable_seq() == held
            os.kill(sb.proc.pid, signal.SIGCONT)
            await caught_up(primary, sb)
            await until(lambda: primary.server.status()["members"] == ["broker-1"], 15, "back in sync")
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "durable again")
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


def test_a_standby_that_heartbeats_but_does_not_acknowledge_leaves_the_in_sync_set(swarm, etcd_url):
    """The lag bound (not the liveness rule): a session that stays alive but whose oldest
    unacknowledged turn is older than heartbeat_interval_s x liveness is no longer counted."""

    async def scenario():
        primary = Primary(swarm, etcd_url)
        task = await serving(primary)
        codec = EnvelopeCodec("broker-1", load_private_key(swarm / "keys" / "broker-1.key"),
                              AuthorizedKeys(swarm / "at_worker.toml"), require_hello=False)
        ctx = zmq.asyncio.Context()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(primary.server.endpoint)
        epoch, seq = primary.log.position
        try:
            await s.send_multipart(codec.encode(protocol.Hello(role="standby", info={
                "repl_ledger_id": primary.ledger.ledger_id, "repl_epoch": epoch, "repl_seq": seq})))
            await until(lambda: primary.server.status()["members"] == ["broker-1"], 10, "in sync at HELLO")
            assert primary.server.durable_seq() == seq
            primary.commit(5)
            t0 = time.monotonic()
            while primary.server.status()["members"]:
                await s.send_multipart(codec.encode(protocol.Heartbeat()))
                while await s.poll(0):
                    await s.recv_multipart()
                assert time.monotonic() - t0 < 10, "a standby that acknowledges nothing stays in the set"
                await asyncio.sleep(0.1)
            assert time.monotonic() - t0 >= primary.server.lag_out_s() * 0.9
            assert primary.standby()["lag_turns"] == 5 and primary.server.durable_seq() == seq
            assert primary.standby()["lag_bytes"] > 0 and primary.standby()["lag_s"] >= primary.server.lag_out_s()
        finally:
            s.close()
            ctx.term()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


def test_after_the_signed_hello_and_welcome_the_link_uses_session_macs_both_ways(swarm, etcd_url):
    """As on the peer link: a standby that offers session MACs in its signed HELLO gets a
    signed WELCOME answering the offer; every REPL_TURNS after it carries a 32-byte HMAC tag
    (not a 64-byte Ed25519 signature of its whole body, the primary's largest cost per
    turn), and the standby's tagged REPL_ACK counts (the turns become durable)."""

    async def scenario():
        primary = Primary(swarm, etcd_url)
        task = await serving(primary)
        codec = EnvelopeCodec("broker-1", load_private_key(swarm / "keys" / "broker-1.key"),
                              AuthorizedKeys(swarm / "at_worker.toml"), require_hello=False, session_macs=True)
        ctx = zmq.asyncio.Context()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(primary.server.endpoint)
        epoch, seq = primary.log.position
        try:
            await s.send_multipart(codec.encode(protocol.Hello(role="standby", info={
                "repl_ledger_id": primary.ledger.ledger_id, "repl_epoch": epoch, "repl_seq": seq})))
            frames = await asyncio.wait_for(s.recv_multipart(), 10)
            assert len(frames[1]) == protocol.SIGNATURE_BYTES  # the WELCOME is signed
            welcome = codec.decode(frames).message
            assert isinstance(welcome, protocol.Welcome) and welcome.mac_x25519
            assert codec.mac_active
            primary.commit(3)
            turns: list[protocol.ReplTurns] = []
            deadline = time.monotonic() + 10
            while sum(len(t.turns) for t in turns) < 3:
                assert time.monotonic() < deadline, f"3 turns shipped, got {turns}"
                frames = await asyncio.wait_for(s.recv_multipart(), 10)
                env = codec.decode(frames)  # verifies the tag with the session's key
                if isinstance(env.message, protocol.ReplTurns):
                    assert len(frames[1]) == MAC_BYTES, len(frames[1])
                    turns.append(env.message)
            top = primary.log.position[1]
            ack = codec.encode(protocol.ReplAck(epoch=primary.log.position[0], seq=top))
            assert len(ack[1]) == MAC_BYTES
            await s.send_multipart(ack)
            await until(lambda: primary.standby()["seq"] == top, 10, "the tagged REPL_ACK to count")
        finally:
            s.close()
            ctx.term()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


def test_the_link_runs_over_curve_and_a_plain_client_gets_nothing(swarm, etcd_url):
    write_curve_keypair(swarm / "keys", "broker")  # the service CURVE key, on every broker host
    curve = {"curve": True, "curve_secret_key": str(swarm / "keys" / "broker.curve.key")}

    async def scenario():
        primary = Primary(swarm, etcd_url, **curve)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url, **curve).start()
        try:
            await caught_up(primary, sb)
            await commit_async(primary, 50)
            await caught_up(primary, sb)
            codec = EnvelopeCodec("broker-2", load_private_key(swarm / "keys" / "broker-2.key"),
                                  AuthorizedKeys(swarm / "at_worker.toml"), require_hello=False)
            ctx = zmq.asyncio.Context()
            plain = ctx.socket(zmq.DEALER)
            plain.linger = 0
            plain.connect(primary.server.endpoint)
            await plain.send_multipart(codec.encode(protocol.Hello(role="standby", info={
                "repl_ledger_id": "", "repl_epoch": 0, "repl_seq": 0})))
            assert not await plain.poll(1500), "a client without CURVE was answered"
            plain.close()
            ctx.term()
            assert [s["node"] for s in primary.server.status()["standbys"]] == ["broker-1"]
            assert sb.stop() == 0
            assert sb.dump() == replication.dump(primary.ledger.env)
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_only_a_standby_listed_in_sync_promotes_unless_async(swarm, etcd_url, mode):
    """The primary key goes while etcd's /sync does not list the standby (its on_members
    write never got through): a sync standby waits (it may lack confirmed turns); listed,
    it promotes. An async standby promotes at once (the risk docs/ha.md states)."""

    async def scenario():
        gate = threading.Event()  # never set: /sync is never written by the primary
        primary = Primary(swarm, etcd_url, members_gate=gate)
        task = await serving(primary)
        sb = StandbyProc(swarm, etcd_url, ha_mode=mode).start()
        try:
            await caught_up(primary, sb)
            primary.server.stop()
            await task
            primary.election.resign()
            if mode == "async":
                assert await asyncio.to_thread(sb.wait, 20) == 0 and "OUTCOME promote" in sb.text()
                return
            await asyncio.sleep(2.0)
            assert sb.proc.poll() is None and "standby_promoting" not in sb.text()
            primary.election._post("/kv/put", {"key": _b64(sync_key("s1")), "value": _b64(json.dumps(
                {"epoch": primary.epoch, "members": ["broker-1"]}))})
            assert await asyncio.to_thread(sb.wait, 20) == 0 and "OUTCOME promote" in sb.text()
        finally:
            gate.set()
            sb.stop()
            primary.server.stop()
            if not task.done():
                await task
            primary.close()

    run(scenario)


@pytest.mark.soak
def test_bench_the_cost_of_sync_replication(swarm, etcd_url):
    """Figures for docs/ha.md (run with -m soak -s): turns of 10 submits committed (each
    fsynced) by the primary alone, then with a sync standby (each turn also fsynced there),
    back to back; and one turn at a time, commit to durable_seq (the added latency)."""

    async def scenario():
        primary = Primary(swarm, etcd_url)
        task = await serving(primary)
        n = 500
        t0 = time.perf_counter()
        await commit_async(primary, n, items=10)
        alone = n / (time.perf_counter() - t0)
        sb = StandbyProc(swarm, etcd_url).start()
        try:
            await caught_up(primary, sb)
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 10, "durable")
            t0 = time.perf_counter()
            await commit_async(primary, n, items=10)
            await until(lambda: primary.server.durable_seq() == primary.log.position[1], 60, "durable")
            synced = n / (time.perf_counter() - t0)
            commit_s, durable_s = [], []
            for _ in range(200):
                t0 = time.perf_counter()
                primary.commit(1, items=10)
                t1 = time.perf_counter()
                seq = primary.log.position[1]
                while primary.server.durable_seq() < seq:
                    await asyncio.sleep(0)
                commit_s.append(t1 - t0)
                durable_s.append(time.perf_counter() - t1)
            commit_s.sort()
            durable_s.sort()
            print(f"\nturns/s (10 submits each) primary alone {alone:.0f}, with a sync standby {synced:.0f} "
                  f"({100 * (1 - synced / alone):.0f} % less); one turn: commit p50 {1e3 * commit_s[100]:.2f} ms, "
                  f"commit -> durable p50 {1e3 * durable_s[100]:.2f} ms, p99 {1e3 * durable_s[197]:.2f} ms")
        finally:
            sb.stop()
            primary.server.stop()
            await task
            primary.close()

    run(scenario)
