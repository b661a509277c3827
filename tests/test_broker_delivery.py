"""The broker's delivery tracker (brokerd/delivery.py) on a real LMDB ledger, without a
broker process: what is in flight, what is owed a redelivery (G3), and the scan floor."""

from __future__ import annotations

import hashlib
import random

import pytest

from ccsq.brokerd.actor import Batch
from ccsq.brokerd.delivery import DeliveryTracker
from ccsq.brokerd.ledger import Ledger, Policy
from ccsq.brokerd.peers import PeerStatus, Session
from ccsq.brokerd.relaying import Federation
from ccsq.common.wire import protocol


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "l", map_size_bytes=1 << 20, max_map_size_bytes=8 << 20, policy=Policy(), rng=random.Random(7))
    txn = led.begin()
    for n in range(5):
        txn.submit(protocol.SubmitItem(f"k{n}", "echo", blob(b"x%d" % n)), 1_000)
    ids, _ = txn.scan_ready(None, 10, 2_000)
    for t in [txn.lease(i, "w1", 2_000, 5_000) for i in ids]:
        txn.complete(protocol.TaskResult(t.item_id, t.token, blob(b"r"), "echo", "1"), 3_000, "w1")
    txn.commit()
    yield led
    led.close()


def tracker(ledger: Ledger) -> DeliveryTracker:
    with ledger.read() as view:
        epoch = view.epoch()
    return DeliveryTracker(epoch, Federation("", "swarm", None), max_batch_items=64, reply_budget=lambda: 1 << 20)


def completion(peer: str = "c1", credit: int = 3) -> Session:
    return Session(peer_id=peer, role=protocol.Role.COMPLETION, routing_id=peer.encode(), session=1, credit=credit)


def plan(ledger: Ledger, tr: DeliveryTracker, *takers: Session) -> tuple[Batch, bool]:
    """One planning pass in its own transaction, committed, effects applied (as the actor does)."""
    batch = Batch()
    txn = ledger.begin()
    more = tr.plan(txn, batch, list(takers), lambda s, ds: tr.sent(s, ds), 4_000)
    txn.commit()
    for fn in batch.effects:
        fn()
    return batch, more


def delivered(batch: Batch) -> list[protocol.Delivery]:
    return [d for _, msg in batch.replies for d in msg.deliveries]


def test_in_flight_until_acknowledged_and_a_lost_session_owes_redeliveries(ledger):
    tr = tracker(ledger)
    c1 = completion(credit=3)
    first, more = plan(ledger, tr, c1)
    assert len(delivered(first)) == 3 and more and not any(d.redelivery for d in delivered(first))
    assert tr.count() == 3 and tr.count("c1") == 3
    txn = ledger.begin()
    assert txn.ack(delivered(first)[0].item_id, 5_000)
    txn.commit()
    tr.acknowledged(delivered(first)[0].item_id)
    assert tr.count("c1") == 2
    second, _ = plan(ledger, tr, completion("c2", credit=10))  # only the two never sent
    assert len(delivered(second)) == 2 and not {d.item_id for d in delivered(second)} & {d.item_id for d in delivered(first)}
    tr.session_ended("c1")  # its two unacknowledged deliveries are deliverable again, as redeliveries
    assert tr.count("c1") == 0 and tr.possible
    third, _ = plan(ledger, tr, completion("c3", credit=10))
    assert sorted(d.item_id for d in delivered(third)) == sorted(d.item_id for d in delivered(first)[1:])
    assert all(d.redelivery for d in delivered(third))
    with ledger.read() as view:
        assert view.counters()["redelivered"] == 2


def test_a_session_gone_before_commit_gets_nothing_in_flight_and_a_stale_scan_keeps_the_floor(ledger):
    tr = tracker(ledger)
    gone = completion(credit=5)
    batch = Batch()
    txn = ledger.begin()
    tr.plan(txn, batch, [gone], lambda s, ds: tr.sent(s, ds), 4_000)
    txn.commit()
    gone.status = PeerStatus.GONE  # the session ended between the scan and the commit
    for fn in batch.effects:  # the floor raise planned by this (stale) scan comes last
        fn()
    assert tr.count() == 0 and tr.possible
    again, _ = plan(ledger, tr, completion("c2", credit=10))  # the floor was not raised past them
    assert len(delivered(again)) == 5 and all(d.redelivery for d in delivered(again))


def test_a_result_owed_to_a_relay_goes_to_no_completion_service_and_its_route_is_rebuilt_at_start(ledger):
    """The tracker owns the routes too (results owed to the downstream relay that submitted
    them): a routed item is skipped by completion deliveries until acknowledged, and a new
    tracker (a broker restart) rebuilds the routes from the records' ``reply_to``."""
    txn = ledger.begin()
    relayed = txn.submit(protocol.SubmitItem("origin:a:1", "echo", blob(b"r1")), 1_000,
                         origin={"swarm": "a", "item_id": "1", "hops": 1}, reply_to="relay-down").item_id
    ids, _ = txn.scan_ready(None, 10, 2_000)
    (task,) = [t for t in (txn.lease(i, "w1", 2_000, 5_000) for i in ids) if t and t.item_id == relayed]
    assert txn.complete(protocol.TaskResult(relayed, task.token, blob(b"r"), "echo", "1"), 3_000, "w1") == protocol.Outcome.ACCEPTED.value
    txn.commit()
    tr = tracker(ledger)
    with ledger.read() as view:
        assert tr.recover_routes(view) == 1
    assert tr.routed_all == {relayed}
    batch, _ = plan(ledger, tr, completion(credit=10))
    assert len(delivered(batch)) == 5 and relayed not in {d.item_id for d in delivered(batch)}
    tr.acknowledged(relayed)  # nothing more is owed for it: no delivery, no route
    assert not tr.routed_all
