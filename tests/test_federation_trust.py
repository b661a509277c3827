"""Federation trust at the brokers, with a real ``ccsq-brokerd`` and scripted peers that
misbehave on purpose (docs/federation.md, "Trust"): forged origins, tampered params,
swapped payloads, replayed frames, forged result proofs, a fenced late result, max_hops.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import pytest
import tomli_w

from ccsq.common.wire import federation as fed
from ccsq.brokerd.gap_report import load_report
from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm
from ccsq.common.wire import protocol
from ccsq.common.wire.keys import load_private_key, write_keypair

pytestmark = pytest.mark.timeout(120)


def _blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def _trust(path: Path, swarms: dict[str, Path]) -> Path:
    path.write_text(tomli_w.dumps({"swarms": {s: {"public_key": pub.read_text().strip()} for s, pub in swarms.items()}}))
    return path


def _genuine(key, item_id: str = "a0000000000001", params: dict | None = None) -> protocol.SubmitItem:
    """A relayed item as swarm ``a``'s broker would have signed it."""
    params = {"n": 1} if params is None else params
    payload = _blob(b"hello")
    rec = {"id": item_id, "kind": "echo", "params": params, "deadline_ms": None, "priority": 3, "max_runtime_s": 0.0}
    record = fed.origin_record("a", rec, payload, 5)
    return protocol.SubmitItem(key=fed.origin_key("a", item_id), kind="echo", payload=payload, params=params, priority=3,
                        max_attempts=5, origin=record, origin_sig=key.sign(record))


def test_downstream_rejects_forged_items_dedups_replays_and_routes_results(tmp_path: Path) -> None:
    """At the downstream broker: a genuine relayed item is accepted once (its replay is a
    dedup hit), forged/tampered/swapped ones are refused with ORIGIN_REJECTED (counted,
    logged), the item is never leased to a relay again (max_hops), and its result goes
    to the relay that submitted it with a proof the upstream can check."""
    a_priv, _ = write_keypair(tmp_path / "a-keys", "broker-a")
    rogue_priv, _ = write_keypair(tmp_path / "a-keys", "rogue")
    a_key, rogue = load_private_key(a_priv), load_private_key(rogue_priv)
    root = tmp_path / "b"
    root.mkdir()
    trust = _trust(root / "trusted_swarms.toml", {"a": tmp_path / "a-keys" / "broker-a.pub"})
    cfg = make_swarm(root, {"relay-down": "relay", "relay-up": "relay", "worker-1": "worker", "producer-1": "producer"},
                     swarm_id="b", trusted_swarms=str(trust))
    broker = BrokerProcess(cfg).start()
    try:
        relay = ScriptedPeer(root, "relay-down", broker.endpoint)
        relay.hello("relay", credit=8, kinds=["echo"], info={fed.RELAY_SIDE: fed.DOWNSTREAM})
        item = _genuine(a_key)
        [ok] = relay.submit([item])
        assert ok.item_id and not ok.error and not ok.duplicate
        [again] = relay.submit([item])  # a replayed relayed frame (same signed item): deduped
        assert again.duplicate and again.item_id == ok.item_id

        forged = [
            dataclasses.replace(item, params={"n": 2}),  # tampered params
            dataclasses.replace(item, priority=9),  # tampered priority
            dataclasses.replace(item, payload=_blob(b"evil!")),  # swapped payload (digest and bytes)
            dataclasses.replace(item, payload=protocol.Blob(item.payload.sha256, 5, b"evil!")),  # swapped inline bytes
            dataclasses.replace(item, origin_sig=rogue.sign(item.origin)),  # signed by a rogue key
            dataclasses.replace(item, key="origin:a:a0000000000002"),  # another item's key
            dataclasses.replace(_genuine(a_key), origin=b"", origin_sig=b""),  # no origin at all
        ]
        results = relay.submit(forged)
        assert [r.error for r in results] == [fed.ORIGIN_REJECTED] * len(forged), results
        assert all(not r.item_id for r in results)
        rogue_item = _genuine(rogue, "a0000000000003")  # a whole item from a rogue "a"
        [r] = relay.submit([rogue_item])
        assert r.error == fed.ORIGIN_REJECTED and "does not verify" in r.message

        # a producer that takes an origin key first does not get its item handed to the relay
        producer = ScriptedPeer(root, "producer-1", broker.endpoint)
        producer.hello("producer")
        squat = _genuine(a_key, "a0000000000004")
        [mine] = producer.submit([dataclasses.replace(squat, origin=b"", origin_sig=b"")])
        assert mine.item_id and not mine.error
        [r] = relay.submit([squat])
        assert r.error == fed.ORIGIN_KEY_TAKEN and not r.item_id
        producer.send(protocol.Cancel(producer.next_req(), [mine.item_id]))  # (so the worker below gets the relayed item)
        producer.recv_type(protocol.StatusReply)

        # max_hops: a relay's upstream session never gets an item that came by relay
        up = ScriptedPeer(root, "relay-up", broker.endpoint)
        up.hello("relay", credit=4, kinds=["echo"], info={fed.RELAY_SIDE: fed.UPSTREAM})
        with pytest.raises(TimeoutError):
            up.recv_type(protocol.Dispatch, timeout_s=1.0)

        worker = ScriptedPeer(root, "worker-1", broker.endpoint)
        worker.hello("worker", credit=1, kinds=["echo"])
        [task] = worker.recv_type(protocol.Dispatch).tasks
        assert task.item_id == ok.item_id and not task.origin  # workers get no origin record
        result = _blob(b"HELLO")
        worker.send(protocol.Complete([protocol.TaskResult(task.item_id, task.token, result, "echo", "1")]))
        assert worker.recv_type(protocol.CompleteAck).outcomes[0].outcome == protocol.Outcome.ACCEPTED.value

        [d] = relay.recv_type(protocol.Result).deliveries  # routed to the submitting relay
        assert d.item_id == ok.item_id and d.result == result and d.key == item.key
        b_trust = fed.TrustedSwarms(_trust(tmp_path / "a-trusts.toml", {"b": root / "keys" / "broker.pub"}))
        back = protocol.TaskResult("a0000000000001", 7, d.result, d.handler, d.handler_version, 0.0, d.proof, d.proof_sig)
        assert fed.check_proof(back, b_trust, "a") == ""
        assert "tampered" in fed.check_proof(dataclasses.replace(back, result=_blob(b"WRONG")), b_trust, "a")
        assert "another item" in fed.check_proof(dataclasses.replace(back, item_id="a0000000000009"), b_trust, "a")
        relay.send(protocol.Ack([d.item_id]))
        assert relay.recv_type(protocol.AckOk).item_ids == [d.item_id]
        # the upstream leased the item again later (its first result was fenced there): the
        # resubmission is a dedup hit and the stored result is delivered once more
        [third] = relay.submit([item])
        assert third.duplicate and third.item_id == ok.item_id
        [d2] = relay.recv_type(protocol.Result).deliveries
        assert d2.item_id == ok.item_id and d2.redelivery and d2.result == result and d2.proof_sig
        relay.send(protocol.Ack([d2.item_id]))
        assert relay.recv_type(protocol.AckOk).item_ids == [d2.item_id]
        time.sleep(0.3)  # one more turn: the counters are in the ledger's last commit
    finally:
        broker.stop()
    rep = load_report(str(root / "broker-data"))
    assert rep["rejects"].get(fed.ORIGIN_REJECTED) == len(forged) + 1
    counts = rep["counters"]
    assert counts["received"] == 2 and counts["acknowledged"] == 1 and counts["dead"] == 1 and rep["balanced"] is True
    assert rep["rejects"].get(fed.ORIGIN_KEY_TAKEN) == 1
    assert rep["counters"]["duplicate_submits"] == 3  # the replay, the squatted key, the re-lease
    windows = {w["id"]: w["count"] for w in rep["windows"]}
    assert windows["F3"] == 2 and windows["F4"] == len(forged) + 1  # gap windows of federation
    assert windows["G3"] == 1  # the acknowledged result delivered again
    assert len(broker.events("relayed_rejected")) >= 1


def test_a_relayed_item_submitted_again_after_its_copy_was_purged_runs_again(tmp_path: Path) -> None:
    # the upstream leased an item again long after its first result was fenced there, and the
    # downstream has purged its acknowledged copy (retention_s) while the origin key is still
    # remembered (dedup_window_s): the relay must get a new item, not ORIGIN_KEY_TAKEN (the
    # key is no producer's), which it FAILs retryably until the upstream dead-letters the item
    # (found by the simulation, tests/sim: seed 34, 91 items dead-lettered so)
    a_priv, _ = write_keypair(tmp_path / "a-keys", "broker-a")
    a_key = load_private_key(a_priv)
    root = tmp_path / "b"
    root.mkdir()
    trust = _trust(root / "trusted_swarms.toml", {"a": tmp_path / "a-keys" / "broker-a.pub"})
    cfg = make_swarm(root, {"relay-down": "relay", "worker-1": "worker"}, swarm_id="b", trusted_swarms=str(trust),
                     retention_s=0.2)
    broker = BrokerProcess(cfg).start()
    try:
        relay = ScriptedPeer(root, "relay-down", broker.endpoint)
        relay.hello("relay", credit=8, kinds=["echo"], info={fed.RELAY_SIDE: fed.DOWNSTREAM})
        item = _genuine(a_key)
        [first] = relay.submit([item])
        worker = ScriptedPeer(root, "worker-1", broker.endpoint)
        worker.hello("worker", credit=4, kinds=["echo"])
        [task] = worker.recv_type(protocol.Dispatch).tasks
        worker.send(protocol.Complete([protocol.TaskResult(task.item_id, task.token, _blob(b"HELLO"), "echo", "1")]))
        [d] = relay.recv_type(protocol.Result).deliveries
        relay.send(protocol.Ack([d.item_id]))
        assert relay.recv_type(protocol.AckOk).item_ids == [first.item_id]
        deadline = time.monotonic() + 20
        while True:  # purged once past retention_s (the broker's background slice, every second)
            relay.send(protocol.Status(relay.next_req(), [first.item_id]))
            if relay.recv_type(protocol.StatusReply).items[0].state == "unknown":
                break
            assert time.monotonic() < deadline, "the acknowledged copy was never purged"
            time.sleep(0.2)
        [again] = relay.submit([item])
        assert not again.error and again.item_id and again.item_id != first.item_id and not again.duplicate, again
        [task2] = worker.recv_type(protocol.Dispatch).tasks  # it runs again here
        assert task2.item_id == again.item_id
    finally:
        broker.stop()


def test_upstream_signs_dispatch_checks_proofs_and_fences_late_results(tmp_path: Path) -> None:
    """At the upstream broker: DISPATCH to a relay carries a valid origin signature; a
    COMPLETE with a forged or misdirected proof is rejected (counted, lease untouched);
    a late result for a lease that expired and moved to a local worker is fenced (G4):
    counted, not landed."""
    b_priv, _ = write_keypair(tmp_path / "b-keys", "broker-b")
    rogue_priv, _ = write_keypair(tmp_path / "b-keys", "rogue")
    b_key, rogue = load_private_key(b_priv), load_private_key(rogue_priv)
    root = tmp_path / "a"
    root.mkdir()
    trust = _trust(root / "trusted_swarms.toml", {"b": tmp_path / "b-keys" / "broker-b.pub"})
    cfg = make_swarm(root, {"relay-up": "relay", "producer-1": "producer", "worker-1": "worker"},
                     swarm_id="a", trusted_swarms=str(trust), lease_ttl_s=1.0)
    broker = BrokerProcess(cfg).start()
    try:
        producer = ScriptedPeer(root, "producer-1", broker.endpoint)
        producer.hello("producer")
        [sub] = producer.submit([protocol.SubmitItem("k1", "echo", _blob(b"page"), {"x": "y"}, priority=2)])
        relay = ScriptedPeer(root, "relay-up", broker.endpoint)
        relay.hello("relay", credit=1, kinds=["echo"], info={fed.RELAY_SIDE: fed.UPSTREAM})
        [task] = relay.recv_type(protocol.Dispatch).tasks
        assert task.item_id == sub.item_id and task.origin and task.origin_sig
        a_trust = fed.TrustedSwarms(_trust(tmp_path / "b-trusts.toml", {"a": root / "keys" / "broker.pub"}))
        item = protocol.SubmitItem(fed.origin_key("a", task.item_id), task.kind, task.payload, task.params, priority=2,
                            max_attempts=5, origin=task.origin, origin_sig=task.origin_sig)
        origin, why = fed.check_origin(item, a_trust, "b")
        assert why == "" and origin == {"swarm": "a", "item_id": task.item_id, "hops": 1}

        result = _blob(b"PAGE")
        good = fed.result_proof("b", origin, "b000001", result)

        def complete(proof: bytes, sig: bytes, token: int = task.token) -> str:
            relay.send(protocol.Complete([protocol.TaskResult(task.item_id, token, result, "echo", "1", 0.0, proof, sig)]))
            return relay.recv_type(protocol.CompleteAck).outcomes[0].outcome

        assert complete(good, rogue.sign(good)) == protocol.Outcome.REJECTED.value  # forged proof
        other = fed.result_proof("b", {"swarm": "a", "item_id": "a-other"}, "b000001", result)
        assert complete(other, b_key.sign(other)) == protocol.Outcome.REJECTED.value  # a proof for another item
        # no heartbeat from the relay: its lease expires (G2) and a local worker takes the item
        worker = ScriptedPeer(root, "worker-1", broker.endpoint)
        worker.hello("worker", credit=1, kinds=["echo"])
        [wtask] = worker.recv_type(protocol.Dispatch, timeout_s=10).tasks
        assert wtask.item_id == task.item_id and wtask.token != task.token and not wtask.origin
        assert complete(good, b_key.sign(good)) == protocol.Outcome.FENCED.value  # late: counted, not landed
        worker.send(protocol.Complete([protocol.TaskResult(wtask.item_id, wtask.token, _blob(b"LOCAL"), "echo", "1")]))
        assert worker.recv_type(protocol.CompleteAck).outcomes[0].outcome == protocol.Outcome.ACCEPTED.value
        [st] = producer.status([sub.item_id])
        assert st.state == "completed" and st.result == _blob(b"LOCAL")
        time.sleep(0.3)
    finally:
        broker.stop()
    rep = load_report(str(root / "broker-data"))
    assert rep["rejects"].get(fed.RESULT_REJECTED) == 2
    assert rep["counters"]["fenced_completions"] == 1 and rep["counters"]["completed"] == 1
    windows = {w["id"]: w["count"] for w in rep["windows"]}
    assert windows["G4"] == 1 and windows["F2"] == 1  # the late relayed result, fenced
    assert windows["G2"] == 1 and windows["F1"] == 1  # the relay's lease expired
    assert rep["balanced"] is True


def test_local_workers_come_first_and_a_relay_withdraws_credit(tmp_path: Path) -> None:
    """At the upstream broker (issue 22, defect 1): with an idle local worker and a relay
    that both have credit, ready items go to the local worker first (the relay, connected
    first, gets only what the worker's credit leaves); a negative CREDIT from a relay
    withdraws its credit (reported back in the broker's heartbeats: credit, credit_msgs),
    so items submitted later stay home; from a worker it is refused as before."""
    write_keypair(tmp_path / "b-keys", "broker-b")
    root = tmp_path / "a"
    root.mkdir()
    trust = _trust(root / "trusted_swarms.toml", {"b": tmp_path / "b-keys" / "broker-b.pub"})
    cfg = make_swarm(root, {"relay-up": "relay", "producer-1": "producer", "worker-1": "worker"}, swarm_id="a",
                     trusted_swarms=str(trust))
    broker = BrokerProcess(cfg).start()

    def dispatched(peer: ScriptedPeer, within_s: float) -> list:
        tasks, deadline = [], time.monotonic() + within_s
        while (left := deadline - time.monotonic()) > 0:
            env = peer.recv(left)
            if env is not None and isinstance(env.message, protocol.Dispatch):
                tasks += env.message.tasks
        return tasks

    def credit_info(relay: ScriptedPeer, msgs: int) -> dict:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            relay.heartbeat()
            info = relay.recv_type(protocol.Heartbeat, skip=()).info
            if info.get(fed.CREDIT_MSGS_INFO) == msgs:
                return info
        raise TimeoutError(f"no heartbeat with credit_msgs == {msgs}")

    try:
        relay = ScriptedPeer(root, "relay-up", broker.endpoint)
        relay.hello("relay", credit=4, kinds=["echo"], info={fed.RELAY_SIDE: fed.UPSTREAM})
        worker = ScriptedPeer(root, "worker-1", broker.endpoint)
        worker.hello("worker", slots=1, credit=3, kinds=["echo"])
        producer = ScriptedPeer(root, "producer-1", broker.endpoint)
        producer.hello("producer")
        producer.submit([protocol.SubmitItem("k-first", "echo", _blob(b"page"), {})])
        assert len(dispatched(worker, 1.0)) == 1  # (one pass: the round-robin now starts at the relay)
        producer.submit([protocol.SubmitItem(f"k{i}", "echo", _blob(b"page"), {}) for i in range(2)])
        assert len(dispatched(worker, 1.0)) == 2  # both to the local worker with credit left ...
        assert dispatched(relay, 0.5) == []  # ... none to the relay, though its turn came first and it has more credit
        assert credit_info(relay, 0)[fed.CREDIT_INFO] == 4
        relay.send(protocol.Credit(-10))  # withdraw more than it holds: clamped at 0
        assert credit_info(relay, 1)[fed.CREDIT_INFO] == 0
        worker.heartbeat()
        producer.submit([protocol.SubmitItem("k-later", "echo", _blob(b"page"), {})])
        assert dispatched(relay, 1.0) == []  # no credit left: nothing relayed (the worker, full, holds 3)
        worker.send(protocol.Credit(-1))
        assert worker.recv_type(protocol.Error).code == protocol.REJECT_MALFORMED  # only a relay may withdraw
    finally:
        broker.kill()
