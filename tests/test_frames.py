"""The one frame budget and splitter (common/wire/frames.py): byte budget, item cap, order,
too-large; sizes measured on the encoded records; a frame over the limit once encoded split
in halves (the codec, the broker's Outbound over a real ROUTER); the broker's SUBMIT-time
refusal of an item no DISPATCH could carry (issue 22 defect 3, issue 26)."""

import hashlib
import random
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from ccsq.brokerd.outbound import Outbound, delivery_size, delivery_size_bound, dispatch_refusal, task_size, task_size_bound
from ccsq.brokerd.peers import PeerTable, Session
from ccsq.brokerd.transport import Transport
from ccsq.common.wire import federation as fed
from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.frames import (FRAME_SLACK_BYTES, FrameBudget, encode_fitting, encoded_size, halves, split_bounded,
                                     split_frames)
from ccsq.workerd.reports import Unconfirmed, _report_bound, _report_size
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair


def test_budget_and_cap_split_in_order() -> None:
    frames = split_frames(list(range(10)), size_of=lambda i: 30, budget_bytes=100, max_items=2)
    assert frames == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    frames = split_frames(list(range(7)), size_of=lambda i: 30, budget_bytes=100, max_items=10)
    assert frames == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_frames([], size_of=len, budget_bytes=10, max_items=3) == []
    assert split_frames("abcde", max_items=2) == [["a", "b"], ["c", "d"], ["e"]]


def _random_records(rng: random.Random) -> tuple[protocol.Task, protocol.Delivery]:
    letters = rng.choice([["a", "Z", "9", "-"], ["a", "Z", "9", "\u00e9", "\u6f22", "\U0001f600", "-"]])  # ASCII: counted exactly

    def text(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    def scalar() -> protocol.Scalar:
        return rng.choice([None, True, False, rng.randint(-(1 << 63), (1 << 64) - 1), rng.random() * 1e300, -0.0,
                           text(rng.choice([0, 5, 31, 32, 300])), bytes(rng.choice([0, 3, 255, 256, 70000]))])

    def blob() -> protocol.Blob:
        inline = rng.choice([None, b"", b"x" * rng.choice([1, 255, 256, 65535, 65536, 200_000])])
        return protocol.Blob("c" * 64, rng.randint(0, 1 << 40) if inline is None else len(inline), inline)

    def params() -> dict:
        return {text(rng.choice([1, 40, 300])): scalar() for _ in range(rng.randint(0, 20))}

    big = rng.choice([0, 1, 127, 128, 1 << 31, (1 << 63) - 1])
    task = protocol.Task(text(rng.randint(1, 80)), big, text(rng.randint(1, 128)), blob(), params(), big,
                         rng.choice([0.0, 3.5]), rng.choice([None, 1e9, -1.5]),
                         rng.choice([b"", b"o" * 300]), rng.choice([b"", b"s" * 64]))
    delivery = protocol.Delivery(text(rng.randint(1, 80)), text(rng.randint(1, 400)), text(rng.randint(1, 128)), blob(),
                                 params(), big, text(rng.choice([0, 7, 200])), text(rng.choice([0, 5, 100])),
                                 rng.random() * 2e9, rng.choice([False, True]),
                                 rng.choice([b"", b"p" * 300]), rng.choice([b"", b"s" * 64]))
    return task, delivery


def test_task_delivery_and_result_size_bounds_are_never_below_the_packed_size() -> None:
    """The broker's DISPATCH and RESULT and the worker's COMPLETE skip exact sizing when the bounds' sum fits a frame
    (``split_bounded``): a bound below the real size would let a frame out over the budget."""
    rng = random.Random(24)
    for _ in range(400):
        task, delivery = _random_records(rng)
        assert task_size(task) <= task_size_bound(task) <= task_size(task) + 400 + 4 * len(task.params) + \
            3 * sum(len(k) + (len(v) if isinstance(v, str) else 0) for k, v in task.params.items()) + 4 * len(task.kind)
        assert delivery_size(delivery) <= delivery_size_bound(delivery)
        # the worker's COMPLETE records (workerd/reports.py), with the delivery's strings
        result = protocol.TaskResult(task.item_id, task.token, delivery.result, delivery.handler, delivery.handler_version,
                                     rng.random() * 1e300, delivery.proof, delivery.proof_sig)
        assert _report_size(Unconfirmed(result)) <= _report_bound(Unconfirmed(result))


def test_split_bounded_is_one_frame_only_when_the_bounds_fit() -> None:
    sized: list[int] = []

    def size(i: int) -> int:
        sized.append(i)
        return 10

    assert split_bounded(list(range(5)), size_of=size, bound_of=lambda i: 20, budget_bytes=100, max_items=5) == [list(range(5))]
    assert sized == []  # nothing sized exactly
    # the bounds' sum over the budget (or more records than the cap): the exact splitter decides
    assert split_bounded(list(range(6)), size_of=size, bound_of=lambda i: 20, budget_bytes=100, max_items=9) == [list(range(6))]
    assert sized == list(range(6))
    assert split_bounded(list(range(6)), size_of=size, bound_of=lambda i: 1, budget_bytes=100, max_items=4) == [
        [0, 1, 2, 3], [4, 5]]
    assert split_bounded([], size_of=size, bound_of=size, budget_bytes=100, max_items=4) == []


def test_an_oversized_record_travels_alone_or_is_refused() -> None:
    assert split_frames([1, 500, 2], size_of=lambda i: i, budget_bytes=100, max_items=9) == [[1], [500], [2]]

    def refuse(item: int, n: int) -> Exception:
        return OverflowError(f"{item} is {n} bytes")

    with pytest.raises(OverflowError, match="500 is 500 bytes"):
        split_frames([1, 500], size_of=lambda i: i, budget_bytes=100, max_items=9, too_large=refuse)
    with pytest.raises(ValueError):
        split_frames([1], max_items=0)


# --- the one frame budget, measured on what is sent (issue 22 defect 3, issue 26) ---
MiB = 1 << 20
INLINE_MAX = 16384


def _codecs(tmp_path: Path, max_frame_bytes: int = MiB) -> tuple[EnvelopeCodec, EnvelopeCodec]:
    keys = {}
    for pid in ("broker", "relay"):
        priv, _ = write_keypair(tmp_path / "keys", pid)
        keys[pid] = load_private_key(priv)
    write_authorized_keys(tmp_path / "ak.toml", {"broker": ("broker", public_key_b64(keys["broker"])),
                                                 "relay": ("relay", public_key_b64(keys["relay"]))})
    ak = AuthorizedKeys(tmp_path / "ak.toml")
    return (EnvelopeCodec("broker", keys["broker"], ak, max_frame_bytes=max_frame_bytes),
            EnvelopeCodec("relay", keys["relay"], ak, max_frame_bytes=max_frame_bytes, require_hello=False))


def _relay_task(i: int, payload_bytes: int = INLINE_MAX, params: dict | None = None) -> protocol.Task:
    """A DISPATCH record to a relay: an inline payload at inline_max_bytes, the origin
    record and its signature (what the upstream broker's DISPATCH carries)."""
    data = f"{i:08d}".encode() + b"x" * (payload_bytes - 8)
    blob = protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)
    params = params if params is not None else {"lang": "en", "page": i}
    item_id = f"01JABCDEFGHJKMNPQ{i:012x}"
    rec = {"id": item_id, "kind": "ocr", "params": params, "deadline_ms": None, "priority": 0, "max_runtime_s": 0.0}
    origin = fed.origin_record("swarm-a", rec, blob, 3)
    return protocol.Task(item_id, 10_000 + i, "ocr", blob, params, 1, 0.0, None, origin, b"s" * protocol.SIGNATURE_BYTES)


def test_broker_dispatch_split_fits_when_encoded(tmp_path: Path) -> None:
    """The broker's DISPATCH to a relay, split as the dispatcher splits it (its task sizes,
    its reply budget): every frame, once encoded and signed, is within max_frame_bytes
    (the old estimate left out the origin record: a frame of 62 such tasks came out over,
    and every item in it was dead-lettered as payload_too_large)."""
    broker, _ = _codecs(tmp_path)
    tasks = [_relay_task(i) for i in range(400)]
    room = Outbound(None, PeerTable(), MiB, end_session=None, defer=None, unblocked=None).reply_budget()  # type: ignore[arg-type]
    chunks = split_frames(tasks, size_of=task_size, budget_bytes=room, max_items=256)
    assert [t for c in chunks for t in c] == tasks  # all, in order
    for chunk in chunks:
        payload, _sig = broker.encode(protocol.Dispatch(chunk))
        assert len(payload) <= MiB
    assert len(chunks) <= -(-sum(map(encoded_size, tasks)) // (MiB - FRAME_SLACK_BYTES)) + 1  # no frame wasted


def test_one_budget_for_every_sender_is_the_encoded_size(tmp_path: Path) -> None:
    """FrameBudget sizes records by their exact msgpack bytes; frames of SUBMIT, COMPLETE
    and RESULT records at inline_max_bytes all fit once encoded; the item cap holds."""
    broker, relay = _codecs(tmp_path)
    budget = FrameBudget(MiB)
    assert budget.room_bytes == MiB - FRAME_SLACK_BYTES and FrameBudget(4096).room_bytes == 2048
    tasks = [_relay_task(i) for i in range(300)]
    t = tasks[0]
    assert encoded_size(t) == len(msgpack.packb(protocol.encode_body(t), use_bin_type=True))
    items = [protocol.SubmitItem(f"origin:swarm-a:{t.item_id}", t.kind, t.payload, t.params, origin=t.origin, origin_sig=t.origin_sig)
             for t in tasks]
    results = [protocol.TaskResult(t.item_id, t.token, t.payload, "echo", "1", 0.1, b"p" * 200, b"s" * 64) for t in tasks]
    deliveries = [protocol.Delivery(t.item_id, "k" * 64, t.kind, t.payload, t.params, 1, "echo", "1", time.time(), False,
                             b"p" * 200, b"s" * 64) for t in tasks]
    for codec, cls, records in ((relay, protocol.Submit, items), (relay, protocol.Complete, results),
                                (broker, protocol.Result, deliveries)):
        chunks = budget.split(records)
        assert [r for c in chunks for r in c] == records
        assert len(chunks) >= 5  # 300 x 16 KiB: several frames
        for chunk in chunks:
            msg = cls(7, chunk) if cls is protocol.Submit else cls(chunk)
            assert len(codec.encode(msg)[0]) <= MiB, cls
    small = FrameBudget(MiB, max_items=3).split(list(range(10)))
    assert small == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(ValueError):
        FrameBudget(MiB, max_items=0)


def test_a_frame_over_the_limit_once_encoded_is_split_not_lost(tmp_path: Path) -> None:
    """encode_fitting: a DISPATCH that comes out over max_frame_bytes is sent as halves
    (recursively, order kept, every other field copied); only one record that alone
    cannot fit raises PAYLOAD_TOO_LARGE."""
    broker, _ = _codecs(tmp_path, max_frame_bytes=64 * 1024)
    tasks = [_relay_task(i) for i in range(11)]  # ~183 KiB: three times the limit
    parts = encode_fitting(protocol.Dispatch(tasks), broker.encode)
    assert len(parts) >= 4
    assert [t for msg, _ in parts for t in msg.tasks] == tasks
    assert all(len(frames[0]) <= 64 * 1024 for _, frames in parts)
    sub = halves(protocol.Submit(9, [1, 2, 3]))  # type: ignore[list-item]
    assert sub == (protocol.Submit(9, [1]), protocol.Submit(9, [2, 3]))  # type: ignore[list-item]
    assert halves(protocol.Heartbeat()) is None and halves(protocol.Dispatch(tasks[:1])) is None
    with pytest.raises(DecodeError) as exc:
        encode_fitting(protocol.Dispatch([_relay_task(0, payload_bytes=70 * 1024)]), broker.encode)
    assert exc.value.code == "PAYLOAD_TOO_LARGE"


def test_outbound_splits_a_dispatch_that_does_not_fit_instead_of_dead_lettering(tmp_path: Path) -> None:
    """The broker's Outbound, over a real ROUTER and a real DEALER: a DISPATCH over
    max_frame_bytes arrives as several frames holding every task in order; no lease is
    dead-lettered (the old code deferred every one of them as payload_too_large). A
    lone task that cannot fit any frame is the only one dead-lettered."""
    limit = 256 * 1024
    broker, relay = _codecs(tmp_path, max_frame_bytes=limit)
    transport = Transport(f"ipc://{tmp_path}/b.sock", broker, sndhwm=1000, max_frame_bytes=limit)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"relay-rid")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(transport.endpoint)
    deferred: list[tuple] = []
    try:
        peers = PeerTable()
        sess = Session("relay", protocol.Role.RELAY, b"relay-rid", 1)
        peers.add(sess)
        out = Outbound(transport, peers, limit, end_session=lambda s, why: None,
                       defer=lambda *a: deferred.append(a), unblocked=lambda: None)
        deadline = time.monotonic() + 10
        while transport.send(b"relay-rid", protocol.Heartbeat()) != "sent":  # the DEALER's connection is up
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tasks = [_relay_task(i) for i in range(40)]  # ~680 KiB for a 256 KiB limit
        out.send(b"relay-rid", protocol.Dispatch(tasks))
        out.flush()
        got: list[protocol.Task] = []
        while len(got) < len(tasks):
            assert dealer.poll(10_000), f"only {len(got)} of {len(tasks)} tasks arrived"
            frames = dealer.recv_multipart()
            assert len(frames[0]) <= limit
            msg = relay.decode(frames, bound_sender="broker").message
            if isinstance(msg, protocol.Dispatch):
                got += msg.tasks
        assert got == tasks and deferred == [] and not sess.unsent
        lone = _relay_task(99, payload_bytes=limit)
        out.send(b"relay-rid", protocol.Dispatch([lone]))
        assert deferred == [("dead", lone.item_id, lone.token, "payload_too_large")]
    finally:
        dealer.close(linger=0)
        transport.close()


def test_an_item_that_could_never_fit_a_dispatch_is_refused_at_submit() -> None:
    """dispatch_refusal: an item at inline_max_bytes fits; one whose params (counted twice
    with federation on: in the task and in the origin record a relay's DISPATCH carries)
    would make a lone DISPATCH over the frame is refused, with the sizes, the cause (params,
    not the 2 KB payload) and its fix named. Without federation no DISPATCH carries an origin
    record: the same item fits (the old code counted the origin record always, and advised
    lowering inline_max_bytes whatever the cause)."""
    budget = FrameBudget(MiB)
    ok = protocol.SubmitItem("k" * 64, "ocr", _relay_task(1).payload, {"lang": "en"})
    for federated in (True, False):
        assert dispatch_refusal(ok, budget, id_len=28, swarm_id="swarm-a", relayed=False, federated=federated) == ""
    params = {f"p{i:03d}": "v" * 2500 for i in range(250)}  # ~630 KB: the SUBMIT fits, a relay's DISPATCH does not
    big = protocol.SubmitItem("k" * 64, "ocr", ok.payload, params)
    assert encoded_size(big) < budget.room_bytes
    why = dispatch_refusal(big, budget, id_len=28, swarm_id="swarm-a", relayed=False, federated=True)
    assert "DISPATCH to a relay" in why and "max_frame_bytes=1048576" in why, why
    assert "params are too large" in why and "lower params" in why and "inline_max_bytes" not in why, why
    # no relay to hand it to: the task alone fits
    assert dispatch_refusal(big, budget, id_len=28, swarm_id="swarm-a", relayed=False, federated=False) == ""
    # an item that came by relay is never relayed on (max_hops): no origin record in its DISPATCH
    assert dispatch_refusal(big, budget, id_len=28, swarm_id="swarm-a", relayed=True, federated=True) == ""
    # a payload too large inline: named as the cause, with its fix (by reference)
    inline = b"x" * (MiB - 4096)
    fat = protocol.SubmitItem("k" * 64, "ocr", protocol.Blob(hashlib.sha256(inline).hexdigest(), len(inline), inline), {"lang": "en"})
    why = dispatch_refusal(fat, budget, id_len=28, swarm_id="swarm-a", relayed=False, federated=False)
    assert why.startswith("item would take") and "inline payload is too large" in why, why
    assert "by reference" in why and "inline_max_bytes" in why and "params are too large" not in why, why


@pytest.mark.parametrize("federated", [False, True])
def test_the_broker_refuses_at_submit_an_item_no_dispatch_could_carry(tmp_path: Path, federated: bool) -> None:
    """A real broker: an item whose lone DISPATCH would not fit max_frame_bytes is refused in
    its SUBMIT_ACK with PAYLOAD_TOO_LARGE, before it is accepted (the old broker accepted it,
    and it was dead-lettered once a relay leased it); the item next to it in the frame is
    accepted. ~630 KB params fit a DISPATCH to a worker, not one to a relay (params twice,
    the origin record, its signature): refused, params named, only with federation on
    (trusted_swarms set); without it the item is accepted (the old broker refused it)."""
    from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm

    overrides = {}
    if federated:
        (tmp_path / "trusted_swarms.toml").write_text("[swarms]\n")
        overrides = {"swarm_id": "a", "trusted_swarms": "trusted_swarms.toml"}
    cfg = make_swarm(tmp_path, {"p": "producer"}, **overrides)
    broker = BrokerProcess(cfg).start()
    peer = ScriptedPeer(tmp_path, "p", broker.endpoint)
    try:
        peer.hello("producer")
        payload = _relay_task(1).payload
        params = {f"p{i:03d}": "v" * 2500 for i in range(250)}
        big = protocol.SubmitItem("big" * 20, "ocr", payload, params)
        ok = protocol.SubmitItem("ok" * 30, "ocr", payload, {"lang": "en"})
        first, accepted = peer.submit([big, ok], timeout_s=20)
        assert accepted.error == "" and accepted.item_id
        if federated:
            assert first.error == "PAYLOAD_TOO_LARGE" and not first.item_id, first
            assert "DISPATCH to a relay" in first.message and "params are too large" in first.message, first
            assert [s.state for s in peer.status([accepted.item_id], timeout_s=20)] == ["ready"]
        else:
            assert first.error == "" and first.item_id, first
            states = peer.status([first.item_id, accepted.item_id], timeout_s=20)
            assert [s.state for s in states] == ["ready", "ready"]
    finally:
        peer.close()
        broker.stop()


def test_a_broker_without_federation_hands_no_item_to_a_relay(tmp_path: Path) -> None:
    """Without trusted_swarms an item is sized at SUBMIT for a DISPATCH with no origin record
    (and a relay's results would be refused): an upstream relay session gets no DISPATCH (the
    old dispatcher leased to it, and a lone task over the frame was dead-lettered); a worker
    gets the item, whose ~630 KB params fit its DISPATCH."""
    from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm

    cfg = make_swarm(tmp_path, {"p": "producer", "r": "relay", "w": "worker"})
    broker = BrokerProcess(cfg).start()
    peers = []
    try:
        producer, relay, worker = (ScriptedPeer(tmp_path, n, broker.endpoint) for n in ("p", "r", "w"))
        peers = [producer, relay, worker]
        producer.hello("producer")
        relay.hello("relay", credit=4, kinds=["ocr"], info={fed.RELAY_SIDE: fed.UPSTREAM})
        params = {f"p{i:03d}": "v" * 2500 for i in range(250)}
        [r] = producer.submit([protocol.SubmitItem("big" * 20, "ocr", _relay_task(1).payload, params)], timeout_s=20)
        assert r.error == "" and r.item_id, r
        with pytest.raises(TimeoutError):
            relay.recv_type(protocol.Dispatch, timeout_s=1.5)
        worker.hello("worker", credit=1, kinds=["ocr"])
        [task] = worker.recv_type(protocol.Dispatch, timeout_s=20).tasks
        assert task.item_id == r.item_id and task.params == params and not task.origin
    finally:
        for peer in peers:
            peer.close()
        broker.stop()


def test_broker_link_sends_a_frame_over_the_limit_as_halves(tmp_path: Path) -> None:
    """BrokerLink's writer (every peer: producer, worker, relay): a message whose frame
    comes out over max_frame_bytes goes as several frames holding every record, and the
    link lives on (the old writer raised out of the session: the relay died and, restarted
    with the same rows, died again); a lone record that cannot fit is logged and dropped."""
    import asyncio

    from ccsq.common.link.peer import BrokerLink, LinkState
    from ccsq.tools.procs import free_tcp_port
    from ccsq.common.wire.config import ProducerConfig, load
    from tests.scripted_broker import ScriptedBroker, make_pki, write_config

    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    make_pki(tmp_path, {"broker": "broker", "p": "producer"})
    cfg = load(ProducerConfig, write_config(tmp_path, "producer", "p", endpoint, max_frame_bytes=256 * 1024))
    items = [protocol.SubmitItem(f"k{i:04d}", "echo", _relay_task(i).payload, {}) for i in range(40)]  # ~660 KiB

    async def run() -> BrokerLink:
        link = BrokerLink(cfg, hello=lambda: protocol.Hello(role="producer"), on_message=lambda env: None)
        task = asyncio.create_task(link.run())
        await asyncio.wait_for(link.ready.wait(), 20)
        assert link.send(protocol.Submit(1, items))
        assert link.send(protocol.Submit(2, [protocol.SubmitItem("lone", "echo", _relay_task(0, payload_bytes=300 * 1024).payload, {})]))
        assert link.send(protocol.Submit(3, items[:1]))
        deadline = time.monotonic() + 20
        while len(broker.submitted_keys) < len(items) + 1:  # the 40, then SUBMIT 3's one
            assert time.monotonic() < deadline and not task.done(), broker.submitted_keys[-3:]
            await asyncio.sleep(0.05)
        assert link.state is LinkState.READY and not task.done()
        await link.stop()
        await asyncio.wait_for(task, 10)
        return link

    with ScriptedBroker(tmp_path, endpoint) as broker:
        asyncio.run(run())
        assert broker.submitted_keys == [it.key for it in items] + ["k0000"]  # all, in order; the lone one never sent
        assert broker.submit_frames >= 4
