"""The real ``ccsq-brokerd`` subprocess driven by scripted peers (raw DEALER + codec).

Each test names the failure case it covers (shared/cases/CASES.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import msgpack
import pytest
import tomli_w

from ccsq.brokerd.gap_report import load_report, render_text
from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm, wait_for
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import ExitCode
from ccsq.common.runtime.faults import env_for

PEERS = {
    "prod": "producer",
    "wA": "worker",
    "wB": "worker",
    "comp": "completion",
    "adm": "admin",
}


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def item(key: str, kind: str = "echo", data: bytes | None = None, **kw) -> protocol.SubmitItem:
    return protocol.SubmitItem(key, kind, blob(data if data is not None else key.encode()), **kw)


def result_of(t: protocol.Task, data: bytes = b"result") -> protocol.TaskResult:
    return protocol.TaskResult(t.item_id, t.token, blob(data), "echo", "1", 0.01)


class Harness:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.brokers: list[BrokerProcess] = []
        self.peers: list[ScriptedPeer] = []
        self.config: Path | None = None

    def start(self, env: dict | None = None, **overrides) -> BrokerProcess:
        if self.config is None:
            self.config = make_swarm(self.root, PEERS, **overrides)
        b = BrokerProcess(self.config, env=env).start()
        self.brokers.append(b)
        return b

    def pin_endpoint(self, endpoint: str) -> None:
        """Write the bound endpoint into the config so a restart binds the same one."""
        assert self.config is not None
        cfg = tomllib.loads(self.config.read_text())
        cfg["endpoint"] = endpoint
        self.config.write_text(tomli_w.dumps(cfg))

    def peer(self, peer_id: str, endpoint: str, **kw) -> ScriptedPeer:
        sp = ScriptedPeer(self.root, peer_id, endpoint, **kw)
        self.peers.append(sp)
        return sp

    def report(self) -> dict:
        return load_report(self.root / "broker-data")

    def close(self) -> None:
        for sp in self.peers:
            sp.close()
        for b in self.brokers:
            b.kill()


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def recv_tasks(w: ScriptedPeer, n: int, timeout_s: float = 10.0) -> list[protocol.Task]:
    tasks: list[protocol.Task] = []
    deadline = time.monotonic() + timeout_s
    while len(tasks) < n:
        tasks += w.recv_type(protocol.Dispatch, max(0.01, deadline - time.monotonic())).tasks
    return tasks


# --- C04 -------------------------------------------------------------------------------
def test_late_completion_is_fenced_and_result_delivered_once(h):
    """C04: worker A's COMPLETE is lost, its lease expires, worker B gets the item;
    A's replayed COMPLETE is confirmed but fenced (counted, gap event), B's wins,
    B's replay is a duplicate; the completion service gets the result once."""
    b = h.start(lease_ttl_s=0.5)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("doc-1")])
    a = h.peer("wA", b.endpoint)
    a.hello("worker", slots=1, credit=1)
    (ta,) = recv_tasks(a, 1)
    assert (ta.item_id, ta.attempt) == (r.item_id, 1)
    a.close()  # the link is cut before A's COMPLETE goes out
    wb = h.peer("wB", b.endpoint)
    wb.hello("worker", slots=1, credit=1)
    (tb,) = recv_tasks(wb, 1)  # after A's lease expired
    assert (tb.item_id, tb.attempt) == (ta.item_id, 2) and tb.token > ta.token

    a.connect()
    welcome = a.hello("worker", slots=1, credit=0, leases=[protocol.LeaseRef(ta.item_id, ta.token)])
    assert welcome.released == [protocol.LeaseRef(ta.item_id, ta.token)] and welcome.resumed == []
    a.send(protocol.Complete([result_of(ta, b"from A")]))
    assert a.recv_type(protocol.CompleteAck).outcomes == [protocol.ItemOutcome(ta.item_id, ta.token, "fenced")]
    wb.send(protocol.Complete([result_of(tb, b"from B")]))
    assert wb.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
    wb.send(protocol.Complete([result_of(tb, b"from B")]))  # replay: idempotent
    assert wb.recv_type(protocol.CompleteAck).outcomes[0].outcome == "duplicate"

    comp = h.peer("comp", b.endpoint)
    comp.hello("completion", credit=10)
    (d,) = comp.recv_type(protocol.Result).deliveries
    assert (d.item_id, d.result, d.attempt, d.redelivery) == (r.item_id, blob(b"from B"), 2, False)
    comp.send(protocol.Ack([d.item_id]))
    assert comp.recv_type(protocol.AckOk).item_ids == [d.item_id]
    with pytest.raises(TimeoutError):
        comp.recv_type(protocol.Result, 0.5)
    rep = h.report()
    counts = rep["counters"]
    assert (counts["completed"], counts["acknowledged"], counts["fenced_completions"], counts["retried"]) == (1, 1, 1, 1)
    windows = {w["id"]: w for w in rep["windows"]}
    assert windows["G4"]["count"] == 1 and windows["G4"]["recent"][0]["item_id"] == r.item_id
    assert windows["G2"]["count"] == 1
    assert rep["balanced"] and "BALANCED" in render_text(rep)


def _lease_twice(h, b, *, expire_second: bool) -> tuple[ScriptedPeer, ScriptedPeer, protocol.SubmitResult, protocol.Task, protocol.Task]:
    """One item leased to wA, its lease left to expire (wA stays connected, silent about
    it), then wA heartbeats without it (a silent peer gets no DISPATCH until it speaks
    again) and the item is leased to wA again; ``expire_second``: that lease expires too
    (wA has no credit left, so the item stays ready with the second token)."""
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("again", max_attempts=5)])
    wa = h.peer("wA", b.endpoint)
    wa.hello("worker", slots=2, credit=2)
    (t1,) = recv_tasks(wa, 1)
    wait_for(lambda: prod.status([r.item_id])[0].state == "ready", 10, what="the first lease to expire")
    wa.heartbeat([])  # wA speaks again, not listing t1's lease
    (t2,) = recv_tasks(wa, 1)  # the same worker gets the next attempt
    assert (t2.item_id, t2.attempt) == (t1.item_id, 2) and t2.token > t1.token
    if expire_second:
        wait_for(lambda: prod.status([r.item_id])[0].state == "ready", 10, what="the second lease to expire")
        assert prod.status([r.item_id])[0].attempt == 2
    return prod, wa, r, t1, t2


def test_a_stale_fail_from_the_same_worker_is_fenced_by_the_broker(h):
    """Against the real broker: wA's first lease expires, wA gets the item again and then
    sends a FAIL (fatal) quoting its first token. It is fenced: the new attempt is not
    killed nor dead-lettered, and wA's COMPLETE with the new token is accepted."""
    b = h.start(lease_ttl_s=0.5)
    prod, wa, r, t1, t2 = _lease_twice(h, b, expire_second=False)
    wa.heartbeat([protocol.LeaseRef(t2.item_id, t2.token)])
    wa.send(protocol.Fail([protocol.TaskFailure(t1.item_id, t1.token, "fatal", False, "late report of attempt 1")]))
    assert wa.recv_type(protocol.FailAck).outcomes == [protocol.ItemOutcome(t1.item_id, t1.token, "fenced")]
    st = prod.status([r.item_id])[0]
    assert (st.state, st.attempt, st.error) == ("leased", 2, "")
    wa.send(protocol.Complete([result_of(t2, b"attempt 2")]))
    assert wa.recv_type(protocol.CompleteAck).outcomes == [protocol.ItemOutcome(t2.item_id, t2.token, "accepted")]
    rep = h.report()
    counts = rep["counters"]
    assert (counts["completed"], counts["dead"], counts["failed"], counts["fenced_failures"]) == (1, 0, 0, 1)
    assert rep["balanced"]


def test_a_late_complete_with_an_older_token_is_fenced_by_the_broker(h):
    """Against the real broker: lease, expire, lease, expire (both to wA), then wA's
    COMPLETE with the first token: fenced (G4) although the item is ready again; its
    COMPLETE with the second token is the late result accepted (G8) and delivered."""
    b = h.start(lease_ttl_s=0.5)
    prod, wa, r, t1, t2 = _lease_twice(h, b, expire_second=True)
    wa.send(protocol.Complete([result_of(t1, b"attempt 1")]))
    assert wa.recv_type(protocol.CompleteAck).outcomes == [protocol.ItemOutcome(t1.item_id, t1.token, "fenced")]
    assert prod.status([r.item_id])[0].state == "ready"
    wa.send(protocol.Complete([result_of(t2, b"attempt 2")]))
    assert wa.recv_type(protocol.CompleteAck).outcomes == [protocol.ItemOutcome(t2.item_id, t2.token, "accepted")]
    comp = h.peer("comp", b.endpoint)
    comp.hello("completion", credit=10)
    (d,) = comp.recv_type(protocol.Result).deliveries
    assert (d.item_id, d.result, d.attempt) == (r.item_id, blob(b"attempt 2"), 2)
    rep = h.report()
    assert (rep["counters"]["completed"], rep["counters"]["fenced_completions"], rep["counters"]["late_results_accepted"]) == (1, 1, 1)
    windows = {w["id"]: w for w in rep["windows"]}
    assert windows["G4"]["count"] == 1 and windows["G8"]["count"] == 1
    assert rep["balanced"]


def test_a_job_lost_running_is_expired_though_an_older_token_of_its_item_is_listed(h):
    """Found by the simulation (tests/sim): wA's first lease of an item expires with its
    report unconfirmed, wA gets the item again (second token) and its process dies running
    it. Its restart HELLO lists the first token (the report it still holds) and names the
    second lost: the second lease expires at once, counting the attempt (G2). The broker
    used to match the listed leases by item id only, kept the lost lease, and released it
    uncounted at a later HELLO: a duplicate execution without its gap event, and a poison
    job that never reaches its dead letter."""
    b = h.start(lease_ttl_s=1.5)  # long enough that t2 cannot run out on its own before the check
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("again", max_attempts=5)])
    wa = h.peer("wA", b.endpoint)
    wa.hello("worker", slots=1, credit=1)
    (t1,) = recv_tasks(wa, 1)
    wait_for(lambda: prod.status([r.item_id])[0].state == "ready", 10, what="the first lease to expire")
    wa.connect()  # the link returns: its HELLO lists the first token (the report it holds)
    welcome = wa.hello("worker", slots=1, credit=1, leases=[protocol.LeaseRef(t1.item_id, t1.token)])
    assert welcome.released == [protocol.LeaseRef(t1.item_id, t1.token)]
    (t2,) = recv_tasks(wa, 1)
    assert (t2.item_id, t2.attempt) == (t1.item_id, 2) and t2.token > t1.token
    wa.connect()  # the process died running t2; restarted, it lists t1 and names t2 lost
    wa.hello("worker", slots=1, credit=0, leases=[protocol.LeaseRef(t1.item_id, t1.token)],
             info={protocol.LOST_INFO: protocol.lost_info([(t2.item_id, t2.token)])})
    st = prod.status([r.item_id])[0]
    assert (st.state, st.attempt) == ("ready", 2), st
    windows = {w["id"]: w["count"] for w in h.report()["windows"]}
    assert windows["G2"] == 2


@pytest.mark.parametrize("replayed", ["accepted", "signed_earlier"])
def test_a_hello_replayed_after_a_broker_restart_is_refused_and_the_lease_stays(h, replayed):
    """Found by the simulation (tests/sim, seed 2 of a million items): a stranger replays a
    worker's signed HELLO within max_clock_skew_s of its signing, after a broker restart.
    The restarted broker's replay memory began empty, so it opened a session for wA on the
    stranger's socket and applied that HELLO's lease list: wA's lease, not listed, was
    released uncounted and the item leased again (a duplicate run without its gap event).
    The replayed HELLO is either the one that opened wA's session (``accepted``) or one wA
    signed before it and that never reached the broker (``signed_earlier``, e.g. lost in a
    cut). Either is REPLAY now (the ledger keeps the newest HELLO per peer id); the lease
    stays wA's, and wA's own reconnect resumes it."""
    b = h.start(lease_ttl_s=30.0)
    h.pin_endpoint(b.endpoint)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("once")])
    wa = h.peer("wA", b.endpoint)
    instance = {protocol.INSTANCE_INFO: f"harness/wA/{id(wa):x}"}
    earlier = wa.codec.encode(protocol.Hello(role="worker", slots=1, credit=1, info=instance))  # signed, never sent
    t0_ms = msgpack.unpackb(earlier[0], raw=False)[5]
    wait_for(lambda: time.time() * 1000 > t0_ms + 2, 1, what="the clock to pass the first HELLO's timestamp")
    wa.connect()
    accepted = wa.codec.encode(protocol.Hello(role="worker", slots=1, credit=1, info=instance))
    wa.send_raw(accepted)
    wa.recv_type(protocol.Welcome)
    (t,) = recv_tasks(wa, 1)
    lease = protocol.LeaseRef(t.item_id, t.token)
    b.kill()
    b = h.start()
    stranger = h.peer("wB", b.endpoint)  # any socket: the replayed frames are wA's, signed by wA
    stranger.send_raw(accepted if replayed == "accepted" else earlier)
    env = stranger.recv(5.0)  # (the old broker: a WELCOME, and wA's lease released uncounted)
    prod.connect()
    prod.hello("producer")
    st = prod.status([r.item_id])[0]
    assert (st.state, st.attempt) == ("leased", 1), st
    assert env is not None and isinstance(env.message, protocol.Error), env
    assert env.message.code == protocol.REJECT_REPLAY, env.message
    wa.connect()
    welcome = wa.hello("worker", slots=1, credit=0, leases=[lease])
    assert welcome.resumed == [lease] and welcome.released == []
    wa.send(protocol.Complete([result_of(t)]))
    assert wa.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
    rep = h.report()
    assert (rep["counters"]["released"], rep["counters"]["retried"]) == (0, 0) and rep["balanced"]
    assert rep["rejects"].get(protocol.REJECT_REPLAY) == 1


# --- C07b ------------------------------------------------------------------------------
def test_poison_job_dead_lettered_attempts_survive_restart(h):
    """C07b: a job that kills every worker that runs it is dead-lettered with
    reason worker_lost after max_attempts, across a broker SIGKILL + restart;
    the 20 normal jobs behind it all complete."""
    b = h.start(lease_ttl_s=5.0, retry_backoff_base_s=0.05, retry_backoff_max_s=0.2)
    h.pin_endpoint(b.endpoint)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (poison,) = prod.submit([item("poison", kind="poison", priority=9, max_attempts=3)])
    normal = prod.submit([item(f"n{i}") for i in range(20)])
    wb = h.peer("wB", b.endpoint)
    wb.hello("worker", slots=4, credit=20, kinds=["echo"])
    tasks = recv_tasks(wb, 20)
    wb.send(protocol.Complete([result_of(t) for t in tasks]))
    assert {o.outcome for o in wb.recv_type(protocol.CompleteAck).outcomes} == {"accepted"}

    k = h.peer("wA", b.endpoint)
    attempts = []
    for n in (1, 2, 3):
        if n == 3:  # the broker is SIGKILLed while attempt 2 is leased, then restarted
            b.kill()
            b = h.start()
        k.connect()
        k.hello("worker", slots=1, credit=1, kinds=["poison"])  # a fresh worker process: holds nothing
        (t,) = recv_tasks(k, 1)
        attempts.append(t.attempt)
        k.close()  # the job kills the worker
    assert attempts == [1, 2, 3]
    k.connect()
    k.hello("worker", slots=1, credit=1, kinds=["poison"])
    prod.connect()
    prod.hello("producer")
    st = wait_for(lambda: (s := prod.status([poison.item_id])[0]).state == "dead" and s, 10, what="dead letter")
    assert (st.error, st.attempt) == ("worker_lost", 3)
    assert {s.state for s in prod.status([r.item_id for r in normal])} == {"completed"}
    rep = h.report()
    assert rep["counters"]["dead"] == 1 and rep["counters"]["completed"] == 20 and rep["balanced"] and rep["epoch"] == 2
    windows = {w["id"]: w["count"] for w in rep["windows"]}
    assert windows["G2"] == 2 and windows["G7"] == 1


# --- C08 -------------------------------------------------------------------------------
def test_ledger_full_refuses_submit_then_recovers(h):
    """C08: with a tiny map, SUBMIT is refused with a typed retryable QUEUE_FULL
    (no crash, no partial item); in-flight items still complete and acknowledge;
    after the acknowledged items are purged, submits succeed again. Map usage is
    exported by admin status."""
    b = h.start(map_size_bytes=1 << 20, max_map_size_bytes=1 << 20, retention_s=0.0, max_batch_items=8)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=1, credit=4)
    accepted, refused = [], []
    for batch in range(60):
        res = prod.submit([item(f"b{batch}-{i}", data=os.urandom(6000)) for i in range(20)], timeout_s=10)
        accepted += [r for r in res if not r.error]
        refused += [r for r in res if r.error]
        if refused:
            break
    assert refused and accepted
    assert {r.error for r in refused} == {"QUEUE_FULL"} and all(r.item_id == "" for r in refused)
    assert b.proc.poll() is None
    tasks = recv_tasks(w, 4)
    w.send(protocol.Complete([result_of(t) for t in tasks]))
    assert {o.outcome for o in w.recv_type(protocol.CompleteAck).outcomes} == {"accepted"}
    comp = h.peer("comp", b.endpoint)
    comp.hello("completion", credit=10)
    ids = [d.item_id for d in comp.recv_type(protocol.Result).deliveries]
    comp.send(protocol.Ack(ids))
    assert sorted(comp.recv_type(protocol.AckOk).item_ids) == sorted(t.item_id for t in tasks)

    def submit_ok():
        (r,) = prod.submit([item(f"again-{time.monotonic()}", data=b"small")])
        return not r.error

    wait_for(submit_ok, 10, interval_s=0.2, what="submit accepted after purge")
    adm = h.peer("adm", b.endpoint)
    adm.hello("admin")
    st = adm.admin_status()
    assert st["ledger"]["map_size_bytes"] == 1 << 20 and 0 < st["ledger"]["used_bytes"] <= 1 << 20
    rep = h.report()
    assert rep["counters"]["received"] == len(accepted) + 1 and rep["counters"]["acknowledged"] == 4 and rep["balanced"]


def test_ledger_full_inline_results_of_accepted_work_still_land_and_ack(h):
    """C08 (tester's scenario): map 1 MiB growing to 2 MiB, 12 KB payloads submitted
    until QUEUE_FULL. Every accepted item must still be leased, completed with a
    12 KB inline result, delivered and acknowledged: admission control keeps room
    for the results of work already accepted (no ``ledger_full_batch_dropped``)."""
    b = h.start(map_size_bytes=1 << 20, max_map_size_bytes=2 << 20, max_batch_items=16)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    accepted, refused = [], []
    for batch in range(100):
        res = prod.submit([item(f"f{batch}-{i}", data=os.urandom(12_000)) for i in range(10)], timeout_s=10)
        accepted += [r for r in res if not r.error]
        refused += [r for r in res if r.error]
        if refused:
            break
    assert refused and len(accepted) >= 10, (len(accepted), len(refused))
    assert {r.error for r in refused} == {"QUEUE_FULL"}
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=len(accepted), credit=len(accepted))
    tasks = recv_tasks(w, len(accepted), timeout_s=30)
    for i in range(0, len(tasks), 8):
        chunk = tasks[i:i + 8]
        w.send(protocol.Complete([result_of(t, os.urandom(12_000)) for t in chunk]))
        ack = w.recv_type(protocol.CompleteAck, timeout_s=10)  # TimeoutError: dropped (ledger full)
        assert {o.outcome for o in ack.outcomes} == {"accepted"}
    comp = h.peer("comp", b.endpoint)
    comp.hello("completion", credit=len(accepted))
    acked: set[str] = set()
    deadline = time.monotonic() + 30
    while len(acked) < len(accepted) and time.monotonic() < deadline:
        env = comp.recv(timeout_s=1)  # RESULT and ACK_OK frames interleave: take both kinds
        if env is not None and isinstance(env.message, protocol.Result):
            comp.send(protocol.Ack([d.item_id for d in env.message.deliveries]))
        elif env is not None and isinstance(env.message, protocol.AckOk):
            acked |= set(env.message.item_ids)
    assert acked == {r.item_id for r in accepted}
    assert not b.events("ledger_full_batch_dropped")
    assert b.proc.poll() is None


def test_ledger_full_at_max_size_still_commits_acks_and_says_how_to_fix(h):
    """C08 fallback: results far larger than the admission reserve fill the map at its
    maximum; the COMPLETE that does not fit is left unanswered (its worker resends),
    but an ACK in the same state still commits, and status names the fix."""
    b = h.start(map_size_bytes=1 << 20, max_map_size_bytes=1 << 20)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    accepted = [r for r in prod.submit([item(f"x{i}", data=b"x") for i in range(6)]) if not r.error]
    assert len(accepted) == 6
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=6, credit=6)
    tasks = recv_tasks(w, 6)
    w.send(protocol.Complete([result_of(tasks[0])]))
    assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
    comp = h.peer("comp", b.endpoint)
    comp.hello("completion", credit=1)
    (first,) = comp.recv_type(protocol.Result).deliveries
    for t in tasks[1:]:  # 300 KB inline each: the map (1 MiB, no growth) runs out
        w.send(protocol.Complete([result_of(t, os.urandom(300_000))]))
        try:
            w.recv_type(protocol.CompleteAck, timeout_s=3)
        except TimeoutError:
            break
    else:
        pytest.fail("the map never filled")
    wait_for(lambda: b.events("ledger_full_batch_dropped"), 10, what="ledger_full_batch_dropped logged")
    assert "max_map_size_bytes" in b.events("ledger_full_batch_dropped")[0]["advice"]
    comp.send(protocol.Ack([first.item_id]))
    assert comp.recv_type(protocol.AckOk, timeout_s=10).item_ids == [first.item_id]
    adm = h.peer("adm", b.endpoint)
    adm.hello("admin")
    led = adm.admin_status()["ledger"]
    assert led["full_since_ms"] > 0 and "raise max_map_size_bytes" in led["full_advice"]
    assert b.proc.poll() is None


def test_ledger_full_at_max_size_purges_acknowledged_items_and_goes_on(h):
    """C08 (tester's wedge): with the map full at its maximum, the turns that fall back
    to "acks" skip background work, so acknowledged items past ``retention_s`` must be
    purged in a transaction of their own; the room they free lets the COMPLETE that did
    not fit commit on its resend (before: ``purged`` stayed 0 and it never did)."""
    b = h.start(map_size_bytes=1 << 20, max_map_size_bytes=1 << 20, retention_s=3.0, result_reserve_bytes=1024,
                lease_ttl_s=120.0)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    accepted = [r for r in prod.submit([item(f"x{i}", data=b"x") for i in range(6)]) if not r.error]
    assert len(accepted) == 6
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=6, credit=6)
    tasks = recv_tasks(w, 6)
    comp = h.peer("comp", b.endpoint)
    comp.hello("completion", credit=100)
    for t in tasks[:2]:  # two 300 KB results, delivered and acknowledged
        w.send(protocol.Complete([result_of(t, os.urandom(300_000))]))
        assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
        (d,) = comp.recv_type(protocol.Result).deliveries
        comp.send(protocol.Ack([d.item_id]))
        assert comp.recv_type(protocol.AckOk).item_ids == [d.item_id]
    stuck = None
    for t in tasks[2:]:  # 300 KB more each: the map (1 MiB, no growth) runs out
        res = result_of(t, os.urandom(300_000))
        w.send(protocol.Complete([res]))
        try:
            w.recv_type(protocol.CompleteAck, timeout_s=3)
        except TimeoutError:
            stuck = res
            break
    else:
        pytest.fail("the map never filled")
    wait_for(lambda: b.events("ledger_full_batch_dropped"), 10, what="ledger_full_batch_dropped logged")

    def resent_fits():
        w.send(protocol.Complete([stuck]))
        try:
            return w.recv_type(protocol.CompleteAck, timeout_s=1).outcomes[0].outcome == "accepted"
        except TimeoutError:
            return False

    wait_for(resent_fits, 20, interval_s=0.5, what="the stuck COMPLETE committed after the purge")
    assert b.events("ledger_full_purged")
    assert b.proc.poll() is None
    rep = h.report()
    assert rep["counters"]["purged"] >= 2 and rep["counters"]["acknowledged"] == 2 and rep["balanced"]


# --- C01 -------------------------------------------------------------------------------
@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="ccsq-")  # short path: ipc endpoints are limited to ~100 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_full_producer_channel_delays_never_drops(h, ipc_dir):
    """C01: a producer stops reading (as if SIGSTOPped) with a tiny receive HWM while
    the broker (SNDHWM 2) has 50 SUBMIT_ACKs for it: the broker parks them
    (EAGAIN counted, peer kept) and, once the producer reads again, all 50 arrive."""
    b = h.start(sndhwm=2, endpoint=f"ipc://{ipc_dir}/b.sock")
    prod = h.peer("prod", b.endpoint, rcvhwm=2)
    prod.hello("producer")
    adm = h.peer("adm", b.endpoint)
    adm.hello("admin")
    for req in range(1, 51):
        prod.send(protocol.Submit(req, [item(f"r{req}-{i}-" + "k" * 100) for i in range(200)]))

    def parked():
        st = adm.admin_status()
        pend = {x["peer_id"]: x["pending_sends"] for x in st["peers"]}
        return st["counters"]["received"] == 10_000 and pend.get("prod", 0) > 0 and st

    st = wait_for(parked, 20, interval_s=0.05, what="acks parked for the stopped producer")
    assert st["send"]["again"] > 0
    acks = {}
    while len(acks) < 50:  # the producer resumes reading
        ack = prod.recv_type(protocol.SubmitAck, 10)
        acks[ack.req] = ack
    assert sorted(acks) == list(range(1, 51))
    assert all(r.item_id and not r.error for a in acks.values() for r in a.results)
    st = adm.admin_status()
    assert "prod" in {x["peer_id"] for x in st["peers"]} and st["states"]["ready"] == 10_000


#: A producer process for C01: sends 50 SUBMITs of 200 items over a DEALER with RCVHWM 2,
#: says "sent" and reads no reply until a line arrives on stdin (the test SIGSTOPs it
#: meanwhile), then reads the 50 SUBMIT_ACKs and writes {req: items accepted} to argv[3].
STOPPED_PRODUCER = r"""
import hashlib, json, sys
from pathlib import Path
from tests.broker_harness import ScriptedPeer
from ccsq.common.wire import protocol

root, endpoint, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
peer = ScriptedPeer(root, "prod", endpoint, rcvhwm=2)
peer.hello("producer")
for req in range(1, 51):
    keys = [f"r{req}-{i}-" + "k" * 100 for i in range(200)]
    peer.send(protocol.Submit(req, [protocol.SubmitItem(k, "echo",
                                                        protocol.Blob(hashlib.sha256(k.encode()).hexdigest(), len(k), k.encode()))
                                    for k in keys]))
print("sent", flush=True)
sys.stdin.readline()
acks = {}
while len(acks) < 50:
    ack = peer.recv_type(protocol.SubmitAck, 30)
    acks[ack.req] = sum(1 for r in ack.results if r.item_id and not r.error)
out.write_text(json.dumps(acks))
"""


def _process_state(pid: int) -> str:
    """The one-letter state of process ``pid`` from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_sigstopped_producer_process_gets_every_reply_after_sigcont(h, ipc_dir, tmp_path):
    """C01 with a real SIGSTOPped process: the producer stops (SIGSTOP) with 50 replies
    due and RCVHWM 2, the broker's SNDHWM is 2. The broker parks the replies (EAGAIN
    counted, session kept, other peers served); after SIGCONT the process receives all
    50 SUBMIT_ACKs, every item accepted once."""
    b = h.start(sndhwm=2, endpoint=f"ipc://{ipc_dir}/b.sock", heartbeat_interval_s=0.5, liveness=40)
    adm = h.peer("adm", b.endpoint)
    adm.hello("admin")
    out = tmp_path / "acks.json"
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_PRODUCER, str(h.root), b.endpoint, str(out)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # tests.broker_harness
    try:
        assert proc.stdout.readline().strip() == "sent"
        # every SUBMIT has left the process (ZeroMQ's I/O thread stops with it): then stop it
        wait_for(lambda: adm.admin_status()["counters"]["received"] == 10_000, 30, interval_s=0.05,
                 what="all 50 SUBMITs at the broker")
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: _process_state(proc.pid) == "T", 10, interval_s=0.02, what="the producer stopped")

        def parked():
            st = adm.admin_status()
            return {x["peer_id"]: x["pending_sends"] for x in st["peers"]}.get("prod", 0) > 0 and st

        st = wait_for(parked, 30, interval_s=0.05, what="replies parked for the stopped producer")
        assert st["send"]["again"] > 0
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    acks = {int(k): v for k, v in json.loads(out.read_text()).items()}
    assert sorted(acks) == list(range(1, 51)) and set(acks.values()) == {200}
    st = adm.admin_status()
    assert st["counters"]["received"] == 10_000 and st["states"]["ready"] == 10_000
    assert st["counters"]["duplicate_submits"] == 0  # nothing was re-sent: every reply was delivered


def test_dispatch_to_departed_worker_goes_back_to_ready(h, ipc_dir):
    """C01: DISPATCHes parked for a worker whose pipe is full are released (never
    sent: attempt not counted) when that worker turns out to be gone; every item
    reaches a live worker; nothing is lost."""
    b = h.start(sndhwm=1, endpoint=f"ipc://{ipc_dir}/b.sock", lease_ttl_s=1.0, max_batch_items=1)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    gone = h.peer("wA", b.endpoint, rcvhwm=1)
    gone.hello("worker", slots=1, credit=40)
    res = prod.submit([item(f"big{i}", data=os.urandom(16000)) for i in range(40)])
    adm = h.peer("adm", b.endpoint)
    adm.hello("admin")
    wait_for(lambda: next(x for x in adm.admin_status()["peers"] if x["peer_id"] == "wA")["pending_sends"] > 0, 10)
    gone.close()  # the worker departs with DISPATCHes still queued for it
    live = h.peer("wB", b.endpoint)
    live.hello("worker", slots=1, credit=40)
    tasks: list[protocol.Task] = []  # wB heartbeats its leases as a worker does (lease_ttl_s is 1 s)
    deadline = time.monotonic() + 20
    while len(tasks) < 40 and time.monotonic() < deadline:
        live.heartbeat(leases=[protocol.LeaseRef(t.item_id, t.token) for t in tasks])
        try:
            tasks += live.recv_type(protocol.Dispatch, 0.2).tasks
        except TimeoutError:
            pass
    assert sorted(t.item_id for t in tasks) == sorted(r.item_id for r in res)
    assert any(t.attempt == 1 for t in tasks)  # released, never sent: no attempt counted
    live.send(protocol.Complete([result_of(t) for t in tasks]))
    assert {o.outcome for o in live.recv_type(protocol.CompleteAck, 10).outcomes} == {"accepted"}
    st = adm.admin_status()
    assert st["counters"]["released"] > 0 and st["counters"]["completed"] == 40 and st["balanced"]
    assert "wA" not in {x["peer_id"] for x in st["peers"]}


# --- bounded turns --------------------------------------------------------------------
def test_a_burst_over_the_turn_budget_is_carried_in_order(h):
    """40 SUBMIT frames of 200 items arrive at once (8,000 item operations, 31x the
    per-turn budget): the broker spreads them over many turns, carrying the rest in
    arrival order, so the 40 SUBMIT_ACKs come back in request order, every item
    accepted once, and a worker's COMPLETE queued behind them is still accepted;
    ``ccsq_turn_seconds`` counts the many turns."""
    import urllib.request

    from ccsq.brokerd.actor import TURN_ITEM_BUDGET
    from ccsq.tools.procs import free_tcp_port

    port = free_tcp_port()
    b = h.start(metrics_port=port)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    work = h.peer("wA", b.endpoint)
    work.hello("worker", slots=1, credit=1)
    (lease,) = prod.submit([item("first")])
    (task,) = recv_tasks(work, 1)

    def turns() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("ccsq_turn_seconds_count")))

    frames = 40
    encoded = [prod.codec.encode(protocol.Submit(req, [item(f"burst-{req}-{i}") for i in range(200)]))
               for req in range(100, 100 + frames)]  # signed first, so that they arrive together
    before = turns()
    for raw in encoded:
        prod.send_raw(raw)
    work.send(protocol.Complete([result_of(task)]))  # queued behind 8,000 item operations
    acks = [prod.recv_type(protocol.SubmitAck, 30) for _ in range(frames)]
    assert [a.req for a in acks] == list(range(100, 100 + frames))
    assert all(r.item_id and not r.error and not r.duplicate for a in acks for r in a.results)
    assert work.recv_type(protocol.CompleteAck, 10).outcomes[0].outcome == "accepted"
    # whole frames up to 256 item operations a turn: at most 2 of these frames per turn, so
    # >= 20 turns (idle turns come on top); read in one go they would take a handful
    # (a turn's duration is observed after its replies went out: wait for the last ones)
    assert TURN_ITEM_BUDGET < 2 * 200
    wait_for(lambda: turns() - before >= frames / 2, 10, what=f">= {frames // 2} turns for {frames} frames")
    assert h.report()["counters"]["received"] == 1 + frames * 200 and lease.item_id


# --- C09 + invalid frames ---------------------------------------------------------------
def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _submit_of_size(sp: ScriptedPeer, size: int) -> list[bytes]:
    # padded over 8 items: each fits a DISPATCH (an item that fills a whole frame alone never
    # could, and is refused at SUBMIT: common/wire/frames.py)
    share = size // 8
    pad = share - 300
    for _ in range(10):
        items = [protocol.SubmitItem(f"pad{i}", "echo", blob(b"x"), params={"pad": "p" * (share - 300)}) for i in range(7)]
        frames = sp.codec.encode(protocol.Submit(1, [*items, protocol.SubmitItem("pad", "echo", blob(b"x"), params={"pad": "p" * pad})]))
        if len(frames[0]) == size:
            return frames
        pad += size - len(frames[0])
    raise AssertionError("could not hit the exact size")


def test_hostile_msgpack_and_invalid_frames(h):
    """C09: (a) a header claiming a 4 GiB binary and (b) a body one byte over
    max_frame_bytes are rejected with a typed error and a counter, the sender's
    session is dropped (one disconnect rule), RSS stays flat, other peers are
    unaffected; (c) a frame exactly at the limit is accepted."""
    limit = 65536
    b = h.start(max_frame_bytes=limit)
    adm = h.peer("adm", b.endpoint)
    adm.hello("admin")
    bad = h.peer("prod", b.endpoint)
    bad.hello("producer")
    rss0 = _rss_kib(b.proc.pid)
    # (a) msgpack array header, then a bin32 header field that claims 4 GiB in a handful of bytes
    bad.send_raw([b"\x97\x01\x0a\xc6\xff\xff\xff\xff" + b"xx", b"\0" * 64])  # the sender field claims 4 GiB
    err = bad.recv_type(protocol.Error)
    assert err.code == protocol.REJECT_MALFORMED
    bad.send(protocol.Status(1, []))  # the session is gone
    assert bad.recv_type(protocol.Error).code == protocol.REJECT_NO_SESSION
    # (b) one byte over the limit, properly signed
    bad.connect()
    bad.hello("producer")
    bad.send_raw(_submit_of_size(bad, limit + 1))
    assert bad.recv_type(protocol.Error).code == protocol.REJECT_OVERSIZE
    # (c) exactly at the limit
    bad.connect()
    bad.hello("producer")
    bad.send_raw(_submit_of_size(bad, limit))
    results = bad.recv_type(protocol.SubmitAck).results
    assert len(results) == 8 and all(res.item_id and not res.error for res in results)
    st = adm.admin_status()
    assert st["rejects"][protocol.REJECT_MALFORMED] == 1 and st["rejects"][protocol.REJECT_OVERSIZE] == 1
    assert _rss_kib(b.proc.pid) - rss0 < 8 * 1024
    wait_for(lambda: h.report()["rejects"].get(protocol.REJECT_OVERSIZE) == 1, 5, what="rejects persisted")
    reasons = [e["reason"] for e in b.events("peer_disconnected")]
    assert "invalid envelope: MALFORMED" in reasons and "invalid envelope: OVERSIZE" in reasons


# --- resume across disconnect and broker restart (C02/C03/C05 at the broker) -----------
def test_heartbeats_extend_leases_and_resume_after_broker_restart(h):
    """C02/C03/C05: heartbeats listing a lease keep it alive far past lease_ttl_s;
    after a broker SIGKILL + restart the worker's HELLO resumes the lease and its
    COMPLETE is accepted: completed once, no retry."""
    b = h.start(lease_ttl_s=0.4)
    h.pin_endpoint(b.endpoint)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("long-job")])
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=1, credit=1)
    (t,) = recv_tasks(w, 1)
    lease = protocol.LeaseRef(t.item_id, t.token)
    end = time.monotonic() + 6 * 0.4
    while time.monotonic() < end:  # a job 6 x lease_ttl long, heartbeating every 0.1 s
        w.heartbeat([lease], busy=1)
        time.sleep(0.1)
    assert prod.status([r.item_id])[0].state == "leased"
    b.kill()
    b = h.start()
    w.connect()
    welcome = w.hello("worker", slots=1, credit=0, leases=[lease])
    assert welcome.resumed == [lease] and welcome.broker_epoch == 2
    w.send(protocol.Complete([result_of(t)]))
    assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
    rep = h.report()
    assert (rep["counters"]["completed"], rep["counters"]["retried"], rep["counters"]["routed"]) == (1, 0, 1) and rep["balanced"]


# --- G3 redelivery, ACK idempotence ---------------------------------------------------
def test_unacknowledged_results_are_redelivered_to_a_new_session(h):
    """G3: results delivered to a completion session that ends before ACK are sent
    again with redelivery=true (counted, gap event); ACK is idempotent."""
    b = h.start()
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    res = prod.submit([item("x1"), item("x2")])
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=2, credit=2)
    tasks = recv_tasks(w, 2)
    w.send(protocol.Complete([result_of(t) for t in tasks]))
    w.recv_type(protocol.CompleteAck)
    comp = h.peer("comp", b.endpoint)
    comp.hello("completion", credit=10)
    first = comp.recv_type(protocol.Result).deliveries
    assert sorted(d.item_id for d in first) == sorted(r.item_id for r in res) and not any(d.redelivery for d in first)
    comp.connect()  # a new session before any ACK
    comp.hello("completion", credit=10)
    again = comp.recv_type(protocol.Result).deliveries
    assert sorted(d.item_id for d in again) == sorted(r.item_id for r in res) and all(d.redelivery for d in again)
    ids = [d.item_id for d in again]
    comp.send(protocol.Ack(ids + ["nope"]))
    ok = comp.recv_type(protocol.AckOk)
    assert sorted(ok.item_ids) == sorted(ids) and ok.unknown == ["nope"]
    comp.send(protocol.Ack(ids))
    assert sorted(comp.recv_type(protocol.AckOk).item_ids) == sorted(ids)
    rep = h.report()
    assert (rep["counters"]["acknowledged"], rep["counters"]["redelivered"]) == (2, 2) and rep["balanced"]


# --- crash point: SUBMIT committed, ack never sent --------------------------------------
def test_crash_after_submit_commit_then_duplicate_on_retry(h):
    """G9: the broker dies right after committing a SUBMIT (before SUBMIT_ACK);
    the producer's retry with the same key gets duplicate=true and the same item.
    No SUBMIT_ACK reached the producer before the kill (an ACK sent before its commit
    would: the crash point is after the commit)."""
    b = h.start(env=env_for("broker.after_submit_commit"))
    h.pin_endpoint(b.endpoint)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    prod.send(protocol.Submit(1, [item("once")]))
    assert b.wait(10) == -signal.SIGKILL
    before_kill = []  # everything the producer's socket holds from the dead broker
    while (env := prod.recv(0.2)) is not None:
        before_kill.append(type(env.message).__name__)
    assert "SubmitAck" not in before_kill, before_kill
    b = h.start()
    prod.connect()
    prod.hello("producer")
    (r,) = prod.submit([item("once")])
    assert r.duplicate and r.item_id
    assert prod.status([r.item_id])[0].state == "ready"
    assert h.report()["counters"]["received"] == 1


# --- admin -------------------------------------------------------------------------------
def test_admin_status_and_dlq_replay(h):
    """Admin: status lists peers and backlog; a dead letter can be replayed."""
    b = h.start()
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("fatal-one", kind="ocr")])
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=1, credit=1, kinds=["ocr"], info={"provider": "cuda", "cpu_fallback": False})
    (t,) = recv_tasks(w, 1)
    w.send(protocol.Fail([protocol.TaskFailure(t.item_id, t.token, "fatal", False, "bad input")]))
    assert w.recv_type(protocol.FailAck).outcomes[0].outcome == "accepted"
    adm = h.peer("adm", b.endpoint)
    adm.hello("admin")
    st = adm.admin_status()
    wa = next(x for x in st["peers"] if x["peer_id"] == "wA")
    assert wa["info"]["provider"] == "cuda" and wa["kinds"] == ["ocr"]
    assert st["backlog"]["ocr"] == {"dead": 1} and st["balanced"]
    adm.send(protocol.Admin(7, "dlq_replay", {"item_id": r.item_id}))
    reply = adm.recv_type(protocol.AdminReply)
    assert reply.ok and msgpack.unpackb(reply.body)["replayed"] == [r.item_id]
    w.send(protocol.Credit(1))
    (t2,) = recv_tasks(w, 1)
    assert (t2.item_id, t2.attempt) == (r.item_id, 1)
    adm.send(protocol.Admin(8, "no_such_command"))
    assert not adm.recv_type(protocol.AdminReply).ok


# --- lifecycle and exit codes ---------------------------------------------------------------
def test_sigterm_says_bye_and_exits_zero(h):
    """SIGTERM: stop accepting, commit, send BYE to peers, exit 0 within seconds."""
    b = h.start()
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    prod.submit([item("kept")])
    t0 = time.monotonic()
    b.signal(signal.SIGTERM)
    assert prod.recv_type(protocol.Bye, 5).reason
    assert b.wait(5) == 0 and time.monotonic() - t0 < 5
    assert b.events("broker_stopped")
    assert h.report()["states"]["ready"] == 1


def test_second_broker_exits_ledger_locked(h):
    """C11: a second broker on a locked ledger, or on a taken endpoint, exits with
    the transient TEMPFAIL code and a one-line reason."""
    b = h.start()
    second = BrokerProcess(h.config).start(wait=False)
    assert second.wait(20) == ExitCode.TEMPFAIL
    assert "lock" in "".join(second.lines)
    other = h.root / "other"
    other.mkdir()
    cfg = tomllib.loads(h.config.read_text())
    cfg.update(endpoint=b.endpoint, data_dir=str(other / "data"), private_key=str(h.root / "keys/broker.key"),
               authorized_keys=str(h.root / "authorized_keys.toml"))
    (other / "brokerd.toml").write_text(tomli_w.dumps(cfg))
    third = BrokerProcess(other / "brokerd.toml").start(wait=False)
    assert third.wait(20) == ExitCode.TEMPFAIL
    assert "in use" in "".join(third.lines)


@pytest.mark.parametrize("problem", ["bad_toml", "unknown_key", "key_mode", "missing_key"])
def test_bad_config_exits_config(h, problem):
    """C11: config errors exit with ExitCode.CONFIG and a one-line reason on stderr."""
    cfg_path = make_swarm(h.root, {"prod": "producer"})
    text = cfg_path.read_text()
    if problem == "bad_toml":
        cfg_path.write_text(text + "\nthis is = = not toml\n")
    elif problem == "unknown_key":
        cfg_path.write_text(text + "\nlease_tll_s = 3\n")
    elif problem == "key_mode":
        os.chmod(h.root / "keys" / "broker.key", 0o644)
    else:
        (h.root / "keys" / "broker.key").unlink()
    bp = BrokerProcess(cfg_path).start(wait=False)
    assert bp.wait(20) == ExitCode.CONFIG
    lines = [line for line in bp.lines if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ccsq-brokerd: config error:")


def test_frozen_broker_keeps_sessions_and_leases(h):
    """C02: the broker is frozen (SIGSTOP) longer than the silence window and the
    lease while a worker keeps heartbeating its lease; after SIGCONT the session
    and the lease survive (no requeue), and the COMPLETE is accepted once."""
    b = h.start(lease_ttl_s=1.0, heartbeat_interval_s=0.25, liveness=4)
    prod = h.peer("prod", b.endpoint)
    prod.hello("producer")
    (r,) = prod.submit([item("held")])
    w = h.peer("wA", b.endpoint)
    w.hello("worker", slots=1, credit=1)
    (t,) = recv_tasks(w, 1)
    lease = protocol.LeaseRef(t.item_id, t.token)
    b.signal(signal.SIGSTOP)
    try:
        end = time.monotonic() + 2.5
        while time.monotonic() < end:  # the worker heartbeats into the frozen broker's socket
            w.heartbeat([lease], busy=1)
            time.sleep(0.2)
    finally:
        b.signal(signal.SIGCONT)
    w.heartbeat([lease], busy=1)
    w.send(protocol.Complete([result_of(t)]))
    assert w.recv_type(protocol.CompleteAck).outcomes[0].outcome == "accepted"
    wait_for(lambda: b.events("broker_stalled"), 5, what="stall logged")
    assert not [e for e in b.events("peer_disconnected") if e["peer"] == "wA"]
    rep = h.report()
    assert (rep["counters"]["completed"], rep["counters"]["retried"]) == (1, 0) and rep["balanced"]


def test_sighup_reloads_authorized_keys(h):
    """SIGHUP re-reads authorized_keys: a peer added afterwards can connect."""
    from ccsq.common.wire.keys import write_keypair

    b = h.start()
    _priv, pub = write_keypair(h.root / "keys", "late")
    ak = h.root / "authorized_keys.toml"
    ak.write_text(ak.read_text() + f'\n[peers.late]\nrole = "producer"\npublic_key = "{pub.read_text().strip()}"\n')
    late = h.peer("late", b.endpoint)
    late.send(protocol.Hello(role="producer"))
    assert late.recv_type(protocol.Error).code == protocol.REJECT_UNKNOWN_SENDER  # unknown sender: told why (docs/security.md)
    b.signal(signal.SIGHUP)
    wait_for(lambda: b.events("authorized_keys_reloaded"), 5)
    late.connect()
    assert late.hello("producer").broker_epoch == 1
