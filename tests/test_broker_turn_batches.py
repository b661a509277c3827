"""The broker turn's per-frame forms of per-record work (brokerd/outbound.py, peers.py,
delivery.py, ledger/view.py): each must give what the per-record form gives (or, for a
size bound, never less than the packed size), on generated records."""

from __future__ import annotations

import hashlib
import random

from ccsq.brokerd.delivery import DeliveryTracker
from ccsq.brokerd.outbound import (deliveries_bound, delivery_size, delivery_size_bound, dispatch_refusal, dispatch_refusals,
                                   task_size, task_size_bound, tasks_bound)
from ccsq.brokerd.peers import HEAP_COMPACT_MIN, LeaseTimers, PeerStatus, Session
from ccsq.brokerd.relaying import Federation
from ccsq.common.wire import protocol
from ccsq.common.wire.frames import FrameBudget, encoded_size, split_bounded

from tests.test_frames import _random_records


def test_list_bounds_are_never_below_the_packed_list_and_equal_the_record_bounds_when_ascii() -> None:
    """``tasks_bound`` / ``deliveries_bound`` (one pass over a DISPATCH's or RESULT's records,
    one ASCII check for all their strings) are what ``split_bounded`` skips exact sizing on: never
    below the packed records' sum; with ASCII strings exactly the per-record bounds' sum."""
    rng = random.Random(2403)
    for _ in range(300):
        pairs = [_random_records(rng) for _ in range(rng.randint(1, 6))]
        tasks, deliveries = [p[0] for p in pairs], [p[1] for p in pairs]
        assert tasks_bound(tasks) >= sum(map(task_size, tasks))
        assert deliveries_bound(deliveries) >= sum(map(delivery_size, deliveries))
        assert tasks_bound(tasks) >= sum(map(task_size_bound, tasks))
        assert deliveries_bound(deliveries) >= sum(map(delivery_size_bound, deliveries))
        ascii_t = all(t.item_id.isascii() and t.kind.isascii() and all(
            k.isascii() and (not isinstance(v, str) or v.isascii()) for k, v in t.params.items()) for t in tasks)
        if ascii_t:
            assert tasks_bound(tasks) == sum(map(task_size_bound, tasks))
        ascii_d = all(all(s.isascii() for s in (d.item_id, d.key, d.kind, d.handler, d.handler_version)) and all(
            k.isascii() and (not isinstance(v, str) or v.isascii()) for k, v in d.params.items()) for d in deliveries)
        if ascii_d:
            assert deliveries_bound(deliveries) == sum(map(delivery_size_bound, deliveries))
    assert tasks_bound([]) == 0 and deliveries_bound([]) == 0


def test_split_bounded_takes_a_list_bound() -> None:
    """One call for the whole list; exactly one of the two bounds."""
    sized: list[int] = []

    def size(i: int) -> int:
        sized.append(i)
        return 10

    assert split_bounded(list(range(5)), size_of=size, bound=lambda xs: 20 * len(xs), budget_bytes=100, max_items=5) == [
        list(range(5))]
    assert sized == []
    assert split_bounded(list(range(6)), size_of=size, bound=lambda xs: 20 * len(xs), budget_bytes=100, max_items=9) == [
        list(range(6))]
    assert sized == list(range(6))
    for kwargs in ({}, {"bound_of": len, "bound": len}):
        try:
            split_bounded([1], size_of=size, budget_bytes=100, max_items=5, **kwargs)  # type: ignore[arg-type]
        except TypeError:
            continue
        raise AssertionError(f"accepted {kwargs}")


def _item(rng: random.Random, budget: FrameBudget) -> protocol.SubmitItem:
    letters = rng.choice(["abc", "a\u00e9\u6f22\U0001f600"])
    inline = b"x" * rng.choice([0, 10, 1000, budget.room_bytes // 2, budget.room_bytes - 900, budget.room_bytes - 300,
                                budget.room_bytes])
    params: dict = {}
    for _ in range(rng.choice([0, 1, 3, 40])):
        v = rng.choice([1.5, 7, None, True, "v" * rng.choice([1, 100, 4000]), rng.choice(letters) * rng.choice([1, 3000]),
                        b"b" * rng.choice([1, 5000, 20000])])
        params["".join(rng.choice(letters) for _ in range(rng.choice([1, 20])))] = v
    kind = "".join(rng.choice(letters) for _ in range(rng.choice([1, 30, 128])))
    return protocol.SubmitItem("k" * 64, kind, protocol.Blob(hashlib.sha256(inline).hexdigest(), len(inline), inline), params)


def test_dispatch_refusals_of_a_frame_are_each_items_dispatch_refusal() -> None:
    """The SUBMIT loop's one call per frame gives every item's ``dispatch_refusal`` (the same
    reason, the same "" for an item that fits), None only when every item fits; items near the
    frame's room on generated sizes, federated or not, relayed or not."""
    rng = random.Random(24)
    budget = FrameBudget(64 * 1024)
    seen_refused = seen_fit = 0
    for _ in range(300):
        items = [_item(rng, budget) for _ in range(rng.randint(1, 5))]
        kw = dict(id_len=rng.choice([20, 28]), swarm_id=rng.choice(["", "swarm-a", "\u00e9" * 30]), relayed=rng.random() < 0.3,
                  federated=rng.random() < 0.5)
        want = [dispatch_refusal(it, budget, **kw) for it in items]  # type: ignore[arg-type]
        got = dispatch_refusals(items, budget, **kw)  # type: ignore[arg-type]
        assert (got if got is not None else [""] * len(items)) == want
        assert (got is None) == (not any(want))
        seen_refused += sum(1 for w in want if w)
        seen_fit += sum(1 for w in want if not w)
    assert seen_refused > 50 and seen_fit > 50  # both sides of the room were generated


def test_lease_timers_batch_forms_equal_one_by_one() -> None:
    """``add_many`` / ``discard_many`` (one DISPATCH's leases, one COMPLETE's ended ones) leave
    the timers as ``add`` / ``discard`` one by one do: leases, per-worker sets, what comes due
    and when; a re-lease of an item under a new token replaces the old lease; an ended pair
    with a stale token leaves the live lease alone."""
    rng = random.Random(7)
    one, many = LeaseTimers(ttl_s=30.0), LeaseTimers(ttl_s=30.0)
    token = 0
    for step in range(3 * HEAP_COMPACT_MIN // 50):
        worker = rng.choice(["w1", "w2", "w3"])
        ids = [f"i{rng.randint(0, 3000)}" for _ in range(rng.randint(1, 64))]
        ids = list(dict.fromkeys(ids))
        tasks = []
        for i in ids:
            token += 1
            tasks.append(protocol.Task(i, token, "k", protocol.Blob("c" * 64, 0, b""), {}, 1, 0.0, None))
        expires = 100.0 + step
        for t in tasks:
            one.add(t.item_id, t.token, worker, expires)
        many.add_many(tasks, worker, expires)
        live = list(one.leases.values())
        ended = [(lease.item_id, lease.token if rng.random() < 0.8 else lease.token + 10**9)
                 for lease in rng.sample(live, min(len(live), rng.randint(0, 70)))]
        for item_id, tok in ended:
            one.discard(item_id, tok)
        many.discard_many(ended)
        assert {k: (v.token, v.worker, v.expires_mono) for k, v in one.leases.items()} == \
            {k: (v.token, v.worker, v.expires_mono) for k, v in many.leases.items()}
        assert one.by_worker == many.by_worker
    assert len(many._heap) <= 2 * len(many) + HEAP_COMPACT_MIN + 64  # rebuilt once ended entries pile up
    due = lambda t: [(x.item_id, x.token) for x in t.pop_due(1e9, 1 << 20)]  # noqa: E731
    assert due(one) == due(many) and len(one) > 0


def _tracker() -> DeliveryTracker:
    return DeliveryTracker(1, Federation("", "swarm", None), max_batch_items=64, reply_budget=lambda: 1 << 20)


def test_acknowledged_many_equals_acknowledged_one_by_one() -> None:
    """An ACK frame's ids through ``acknowledged_many`` leave the tracker as ``acknowledged``
    per id does: nothing in flight, owed or routed for them; the rest untouched."""
    rng = random.Random(5)
    one, many = _tracker(), _tracker()
    sessions = [Session(f"c{i}", protocol.Role.COMPLETION, b"r%d" % i, 1) for i in range(3)]
    for s in sessions:
        s.status = PeerStatus.CONNECTED
    res = protocol.Blob("c" * 64, 0, b"")
    for _ in range(200):
        sess = rng.choice(sessions)
        ids = list(dict.fromkeys(f"i{rng.randint(0, 500)}" for _ in range(rng.randint(1, 30))))
        ds = [protocol.Delivery(i, "k", "kind", res, {}, 1, "", "", 0.0, False, b"", b"") for i in ids]
        route = rng.random() < 0.2
        for t in (one, many):
            t.sent(sess, ds)
            if route:
                t.route("relay-1", ids[0])
        if rng.random() < 0.1:
            for t in (one, many):
                t.session_ended(sess.peer_id)
        acked = rng.sample(ids, rng.randint(0, len(ids))) + [f"unknown{rng.randint(0, 9)}"]
        for i in acked:
            one.acknowledged(i)
        many.acknowledged_many(acked)
        assert one._sent_to == many._sent_to and one._by_peer == many._by_peer
        assert one._redeliver == many._redeliver and one.routed_all == many.routed_all and one._routed == many._routed


def test_a_lone_item_fits_exactly_as_sized() -> None:
    """The bound of one task is what a lone DISPATCH of it packs to, at most (sanity of the fixed parts)."""
    task, delivery = _random_records(random.Random(1))
    assert encoded_size(task) <= tasks_bound([task]) and encoded_size(delivery) <= deliveries_bound([delivery])


def test_scan_ready_of_one_kind_is_the_merged_order(tmp_path) -> None:
    """``scan_ready`` of one kind returns its entries in key order without sorting: the same ids,
    in the same order (priority, then not-before, then arrival) and the same hint as a scan of
    that kind with another one beside it, which sorts; backing-off items and limits generated."""
    from tests.test_ledger import item, open_ledger, submit

    led = open_ledger(tmp_path / "l", retry_backoff_base_s=5.0, max_attempts=50)
    rng = random.Random(11)
    submit(led, *[item(f"k{i}", kind=rng.choice(["a", "b"]), priority=rng.choice([-3, 0, 0, 2, 9])) for i in range(300)])
    txn = led.begin()  # some back off: leased and expired (not-before in the future)
    ids, _ = txn.scan_ready(["a"], 80, 2_000)
    for i in rng.sample(ids, 40):
        task = txn.lease(i, "w1", 2_000, 5_000)
        assert task is not None and txn.expire_lease(i, task.token, 2_500) == "ready"
    txn.commit()
    with led.read() as view:
        for now_ms in (2_000, 3_000, 6_000, 20_000, 10**9):
            for limit in (1, 7, 64, 500):
                assert view.scan_ready(["a"], limit, now_ms) == view.scan_ready(["a", "none-such"], limit, now_ms)
    led.close()


def test_generated_decoders_usual_map_path_decides_as_the_reference() -> None:
    """The generated decoders read a record map with exactly the usual keys (every field but the
    empty extensions) by key; a map of that size with an extension key instead of a usual one,
    an unknown key beside the usual ones, or a usual key of the wrong type decodes (or is refused)
    exactly as the reference codec does."""
    from ccsq.common.wire import codec
    from ccsq.common.wire.errors import DecodeError

    blob = protocol.Blob(hashlib.sha256(b"x").hexdigest(), 1, b"x")
    sub = codec.encode_body(protocol.Submit(3, [protocol.SubmitItem("k1", "echo", blob, {"t": 1.0}, 2, 5.0, 3, 1.5)]))
    comp = codec.encode_body(protocol.Complete([protocol.TaskResult("i1", 7, blob, "h", "1", 0.25)]))

    def both(msg_type: protocol.MsgType, body: dict) -> tuple:
        out = []
        for decode in (codec.decode_body, codec._slow_decode_body):
            try:
                out.append(decode(int(msg_type), body))
            except DecodeError as exc:
                out.append((exc.code, str(exc)))
        return tuple(out)

    variants = []
    for msg_type, body, records in ((protocol.MsgType.SUBMIT, sub, "items"), (protocol.MsgType.COMPLETE, comp, "results")):
        rec = body[records][0]
        variants.append((msg_type, body))
        for usual_key in [k for k in rec if k not in ("key", "kind", "payload", "item_id", "token", "result")]:
            swapped = {k: v for k, v in rec.items() if k != usual_key}
            swapped["origin" if records == "items" else "proof"] = b"o"
            variants.append((msg_type, {**body, records: [swapped]}))
            variants.append((msg_type, {**body, records: [{**rec, usual_key: "wrong type"}]}))
        variants.append((msg_type, {**body, records: [{**rec, "unknown": 1}]}))
        blob_field = "payload" if records == "items" else "result"
        variants.append((msg_type, {**body, records: [{**rec, blob_field: {**codec.encode_body(blob), "extra": 1}}]}))
    for msg_type, body in variants:
        fast, slow = both(msg_type, body)
        assert fast == slow, (body, fast, slow)
