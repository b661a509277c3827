"""Pure protocol layer: message codec and signed envelopes (no sockets)."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccsq.common.wire import protocol as p
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import AuthError, ConfigError, DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair

BLOB = p.Blob(sha256="ab" * 32, size=3, inline=b"abc")


@pytest.fixture
def pki(tmp_path: Path):
    """Keys for a broker, a worker, a producer and an intruder not in authorized_keys."""
    ids = {"broker": "broker", "worker-1": "worker", "producer-1": "producer", "intruder": None}
    keys = {}
    for peer_id in ids:
        priv, _ = write_keypair(tmp_path / "keys", peer_id)
        keys[peer_id] = load_private_key(priv)
    write_authorized_keys(
        tmp_path / "ak.toml", {pid: (role, public_key_b64(keys[pid])) for pid, role in ids.items() if role}
    )
    ak = AuthorizedKeys(tmp_path / "ak.toml")

    def codec(peer_id: str, **kw) -> EnvelopeCodec:
        return EnvelopeCodec(peer_id, keys[peer_id], ak, **kw)

    return codec


def sample_messages() -> list[p.Message]:
    return [
        p.Hello(role="worker", slots=2, credit=3, kinds=["ocr"], leases=[p.LeaseRef("i1", 7)], info={"provider": "cpu", "cpu_fallback": False}),
        p.Heartbeat(leases=[p.LeaseRef("i1", 7)], busy=1, done=4, healthy=True, info={"gpu_mem_free_bytes": 123}),
        p.Submit(req=1, items=[p.SubmitItem(key="k", kind="ocr", payload=BLOB, params={"name": "x.png"}, priority=3, deadline_ts=time.time() + 60)]),
        p.Credit(credit=2),
        p.Complete(results=[p.TaskResult("i1", 7, BLOB, "ocr", "1.0", 0.5)]),
        p.Fail(failures=[p.TaskFailure("i1", 7, p.FailReason.HANDLER_ERROR.value, True, "boom")]),
        p.Ack(item_ids=["i1", "i2"]),
        p.Ack(item_ids=["i1", "i2"], quarantined=[p.Quarantined("i2", "CheckViolation: operator_rule")]),
    ]


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_body_round_trip(msg: p.Message) -> None:
    assert p.decode_body(msg.TYPE, msgpack.unpackb(msgpack.packb(p.encode_body(msg)))) == msg


def test_every_message_class_round_trips_with_defaults() -> None:
    broker_side = [
        p.Welcome(1.0, 5, 3, resumed=[p.LeaseRef("a", 1)]),
        p.SubmitAck(1, [p.SubmitResult("k", "i1", duplicate=True)]),
        p.StatusReply(2, [p.ItemStatus("i1", "completed", 1, "ocr", "", BLOB)]),
        p.Dispatch([p.Task("i1", 9, "ocr", BLOB, {}, 1)]),
        p.CompleteAck([p.ItemOutcome("i1", 9, "fenced")]),
        p.FailAck([p.ItemOutcome("i1", 9, "accepted")]),
        p.Result([p.Delivery("i1", "k", "ocr", BLOB, {}, 1, "ocr", "1", 1.5, True)]),
        p.AckOk(["i1"], ["i9"]),
        p.Error("QUEUE_FULL", "full", 3),
        p.Bye("bye"),
        p.Status(3, ["i1"]),
        p.Cancel(5, ["i1"]),
        p.Admin(4, "status", {}),
        p.AdminReply(4, True, b"\x80"),
        p.ReplTurns(3, [b"\x94"], partial=True),
        p.ReplAck(3, 41),
    ]
    assert {type(m) for m in broker_side + sample_messages()} == set(p.MESSAGE_CLASSES.values())
    for msg in broker_side:
        assert p.decode_body(msg.TYPE, p.encode_body(msg)) == msg


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"credit": "2"}, "expected integer"),
        ({"credit": True}, "expected integer"),
        ({}, "missing field 'credit'"),
        ({"credit": 1, "extra": 1}, "unknown field"),
        ([1], "expected map"),
    ],
)
def test_malformed_body_is_typed_error(body, fragment: str) -> None:
    with pytest.raises(DecodeError) as exc:
        p.decode_body(p.MsgType.CREDIT, body)
    assert exc.value.code == p.REJECT_MALFORMED
    assert fragment in str(exc.value)


def test_nested_record_validation() -> None:
    good = p.encode_body(sample_messages()[2])
    bad = {**good, "items": [{**good["items"][0], "payload": {"sha256": "zz", "size": 1}}]}
    with pytest.raises(DecodeError, match="sha256"):
        p.decode_body(p.MsgType.SUBMIT, bad)
    bad = {**good, "items": [{**good["items"][0], "params": {"nested": {"a": 1}}}]}
    with pytest.raises(DecodeError, match="scalars"):
        p.decode_body(p.MsgType.SUBMIT, bad)
    with pytest.raises(DecodeError) as exc:
        p.decode_body(999, {})
    assert exc.value.code == p.REJECT_UNKNOWN_TYPE


def test_envelope_round_trip(pki) -> None:
    worker, broker = pki("worker-1"), pki("broker")
    frames = worker.encode(sample_messages()[0])
    env = broker.decode(frames)
    assert (env.sender, env.role, env.seq) == ("worker-1", p.Role.WORKER, 1)
    assert env.message == sample_messages()[0]
    env2 = broker.decode(worker.encode(p.Credit(1)), bound_sender="worker-1")
    assert env2.seq == 2 and env2.message == p.Credit(1)


def test_flipped_byte_is_bad_signature(pki) -> None:
    worker, broker = pki("worker-1"), pki("broker")
    payload, sig = worker.encode(p.Hello(role="worker", info={"note": "hello"}))
    for i in (0, len(payload) // 2, len(payload) - 1):
        tampered = bytearray(payload)
        tampered[i] ^= 0x01
        with pytest.raises(DecodeError) as exc:
            broker.decode([bytes(tampered), sig])
        assert exc.value.code in (p.REJECT_BAD_SIGNATURE, p.REJECT_MALFORMED, p.REJECT_UNKNOWN_SENDER, p.REJECT_VERSION, p.REJECT_UNKNOWN_TYPE)
    # a flip in the body (last byte) can only be caught by the signature
    tampered = bytearray(payload)
    tampered[-1] ^= 0x01
    with pytest.raises(AuthError) as exc:
        broker.decode([bytes(tampered), sig])
    assert exc.value.code == p.REJECT_BAD_SIGNATURE


def test_wrong_key_is_bad_signature(pki, tmp_path: Path) -> None:
    """A frame claiming to be worker-1 but signed with the producer's key."""
    broker = pki("broker")
    impostor = EnvelopeCodec("worker-1", pki("producer-1")._key, broker.authorized)
    with pytest.raises(AuthError) as exc:
        broker.decode(impostor.encode(p.Hello(role="worker")))
    assert exc.value.code == p.REJECT_BAD_SIGNATURE


def test_unknown_sender(pki) -> None:
    with pytest.raises(AuthError) as exc:
        pki("broker").decode(pki("intruder").encode(p.Hello(role="worker")))
    assert exc.value.code == p.REJECT_UNKNOWN_SENDER


def test_forged_origin_and_role(pki) -> None:
    broker, worker, producer = pki("broker"), pki("worker-1"), pki("producer-1")
    broker.decode(worker.encode(p.Hello(role="worker")))
    with pytest.raises(AuthError) as exc:
        broker.decode(producer.encode(p.Hello(role="producer")), bound_sender="worker-1")
    assert exc.value.code == p.REJECT_FORGED_ORIGIN
    broker.decode(producer.encode(p.Hello(role="producer")))
    with pytest.raises(AuthError) as exc:  # a producer may not COMPLETE
        broker.decode(producer.encode(p.Complete(results=[])))
    assert exc.value.code == p.REJECT_ROLE


def test_replay_stale_and_session_rules(pki) -> None:
    broker, worker = pki("broker"), pki("worker-1")
    with pytest.raises(AuthError) as exc:
        broker.decode(worker.encode(p.Credit(1)))
    assert exc.value.code == p.REJECT_NO_SESSION
    hello = worker.encode(p.Hello(role="worker"))
    broker.decode(hello)
    with pytest.raises(AuthError) as exc:
        broker.decode(hello)
    assert exc.value.code == p.REJECT_REPLAY
    old_credit = worker.encode(p.Credit(1))
    worker.new_session()
    broker.decode(worker.encode(p.Hello(role="worker")))
    with pytest.raises(AuthError) as exc:  # message of the retired session
        broker.decode(old_credit)
    assert exc.value.code == p.REJECT_REPLAY
    skewed = pki("worker-1", max_clock_skew_s=1.0)
    strict_broker = pki("broker", max_clock_skew_s=1.0)
    payload = msgpack.unpackb(skewed.encode(p.Hello(role="worker"))[0])
    payload[5] -= 10_000
    raw = msgpack.packb(payload)
    with pytest.raises(AuthError) as exc:
        strict_broker.decode([raw, skewed._key.sign(raw)])
    assert exc.value.code == p.REJECT_STALE


def test_c09_hostile_msgpack_limits(pki) -> None:
    """C09: (a) a header claiming a 4 GiB binary, (b) one byte over the limit, (c) exactly at it."""
    limit = 64 * 1024
    broker = pki("broker", max_frame_bytes=limit)
    worker = pki("worker-1", max_frame_bytes=limit * 2)
    # (a) bin32 header claiming 4 GiB inside a tiny frame: rejected by msgpack limits, no allocation
    claim = b"\x97\x01\x01\xc6\xff\xff\xff\xff" + b"x" * 10  # the sender field claims 4 GiB
    with pytest.raises(DecodeError) as exc:
        broker.decode([claim, b"s" * 64])
    assert exc.value.code == p.REJECT_MALFORMED
    # (b)/(c): a HELLO padded so the payload is exactly limit+1 / limit bytes
    def padded(total: int) -> list[bytes]:
        pad = total
        for _ in range(20):
            frames = worker.encode(p.Hello(role="worker", info={"pad": "x" * pad}))
            if len(frames[0]) == total:
                break
            pad -= len(frames[0]) - total
        assert len(frames[0]) == total
        return frames

    with pytest.raises(DecodeError) as exc:
        broker.decode(padded(limit + 1))
    assert exc.value.code == p.REJECT_OVERSIZE
    worker.new_session()
    assert broker.decode(padded(limit)).message.role == "worker"


def test_framing_errors(pki) -> None:
    broker = pki("broker")
    with pytest.raises(DecodeError) as exc:
        broker.decode([b"x"])
    assert exc.value.code == p.REJECT_FRAMING
    payload, _ = pki("worker-1").encode(p.Hello(role="worker"))
    with pytest.raises(DecodeError) as exc:
        broker.decode([payload, b"short"])
    assert exc.value.code == p.REJECT_FRAMING
    bad_version = msgpack.packb([99, 1, "worker-1", 1, 1, int(time.time() * 1000), {}])
    with pytest.raises(DecodeError) as exc:
        broker.decode([bad_version, b"s" * 64])
    assert exc.value.code == p.REJECT_VERSION


def test_random_frames_never_crash_decoder(pki) -> None:
    """Random and mutated frames only ever raise DecodeError (never another exception)."""
    broker = pki("broker")
    good, good_sig = pki("worker-1").encode(sample_messages()[2])

    @settings(max_examples=400, deadline=None)
    @given(st.one_of(st.binary(max_size=512), st.builds(_mutate, st.just(good), st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), min_size=1, max_size=8))))
    def check(payload: bytes) -> None:
        try:
            broker.decode([payload, good_sig])
        except DecodeError:
            pass

    check()


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    buf = bytearray(data)
    for pos, val in edits:
        buf[pos] = val
    return bytes(buf)


def test_authorized_keys_rejects_typos(tmp_path: Path) -> None:
    (tmp_path / "ak.toml").write_text('[peers.w]\nrole = "wroker"\npublic_key = "AAAA"\n')
    with pytest.raises(ConfigError, match="role"):
        AuthorizedKeys(tmp_path / "ak.toml")


def test_private_key_permissions_enforced(tmp_path: Path) -> None:
    priv, _ = write_keypair(tmp_path, "w")
    priv.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_private_key(priv)


def test_extension_fields_are_omitted_when_empty_so_older_peers_still_decode() -> None:
    """ACK.quarantined (gap G12) came after version-1 brokers shipped, whose decoders
    reject unknown fields: an ACK without quarantined rows must encode exactly as before."""
    assert p.encode_body(p.Ack(item_ids=["i1"])) == {"item_ids": ["i1"]}
    body = p.encode_body(p.Ack(item_ids=["i1"], quarantined=[p.Quarantined("i1", "CheckViolation")]))
    assert body == {"item_ids": ["i1"], "quarantined": [{"item_id": "i1", "error": "CheckViolation"}]}
    assert p.encode_body(p.AckOk(item_ids=["i1"])) == {"item_ids": ["i1"], "unknown": []}  # plain defaults stay
