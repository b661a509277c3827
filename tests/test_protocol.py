"""Pure protocol layer: message codec and signed envelopes (no sockets)."""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from pathlib import Path

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import AuthError, ConfigError, DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair

BLOB = protocol.Blob(sha256="ab" * 32, size=3, inline=b"abc")


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


def sample_messages() -> list[protocol.Message]:
    return [
        protocol.Hello(role="worker", slots=2, credit=3, kinds=["ocr"], leases=[protocol.LeaseRef("i1", 7)],
                       info={"provider": "cpu", "cpu_fallback": False}),
        protocol.Heartbeat(leases=[protocol.LeaseRef("i1", 7)], busy=1, done=4, healthy=True, info={"gpu_mem_free_bytes": 123}),
        protocol.Submit(req=1, items=[protocol.SubmitItem(key="k", kind="ocr", payload=BLOB, params={"name": "x.png"}, priority=3,
                                                          deadline_ts=time.time() + 60)]),
        protocol.Credit(credit=2),
        protocol.Complete(results=[protocol.TaskResult("i1", 7, BLOB, "ocr", "1.0", 0.5)]),
        protocol.Fail(failures=[protocol.TaskFailure("i1", 7, protocol.FailReason.HANDLER_ERROR.value, True, "boom")]),
        protocol.Ack(item_ids=["i1", "i2"]),
        protocol.Ack(item_ids=["i1", "i2"], quarantined=[protocol.Quarantined("i2", "CheckViolation: operator_rule")]),
    ]


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_body_round_trip(msg: protocol.Message) -> None:
    assert protocol.decode_body(msg.TYPE, msgpack.unpackb(msgpack.packb(protocol.encode_body(msg)))) == msg


def test_every_message_class_round_trips_with_defaults() -> None:
    broker_side = [
        protocol.Welcome(1.0, 5, 3, resumed=[protocol.LeaseRef("a", 1)]),
        protocol.SubmitAck(1, [protocol.SubmitResult("k", "i1", duplicate=True)]),
        protocol.StatusReply(2, [protocol.ItemStatus("i1", "completed", 1, "ocr", "", BLOB)]),
        protocol.Dispatch([protocol.Task("i1", 9, "ocr", BLOB, {}, 1)]),
        protocol.CompleteAck([protocol.ItemOutcome("i1", 9, "fenced")]),
        protocol.FailAck([protocol.ItemOutcome("i1", 9, "accepted")]),
        protocol.Result([protocol.Delivery("i1", "k", "ocr", BLOB, {}, 1, "ocr", "1", 1.5, True)]),
        protocol.AckOk(["i1"], ["i9"]),
        protocol.Error("QUEUE_FULL", "full", 3),
        protocol.Bye("bye"),
        protocol.Status(3, ["i1"]),
        protocol.Cancel(5, ["i1"]),
        protocol.Admin(4, "status", {}),
        protocol.AdminReply(4, True, b"\x80"),
        protocol.ReplTurns(3, [b"\x94"], partial=True),
        protocol.ReplAck(3, 41),
        protocol.ReplCopyChunk(3, 41, 1 << 20, 5 << 20, b"\x00" * 64),
        protocol.ReplCopyAck(2 << 20),
    ]
    assert {type(m) for m in broker_side + sample_messages()} == set(protocol.MESSAGE_CLASSES.values())
    for msg in broker_side:
        assert protocol.decode_body(msg.TYPE, protocol.encode_body(msg)) == msg


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
        protocol.decode_body(protocol.MsgType.CREDIT, body)
    assert exc.value.code == protocol.REJECT_MALFORMED
    assert fragment in str(exc.value)


def test_nested_record_validation() -> None:
    good = protocol.encode_body(sample_messages()[2])
    bad = {**good, "items": [{**good["items"][0], "payload": {"sha256": "zz", "size": 1}}]}
    with pytest.raises(DecodeError, match="sha256"):
        protocol.decode_body(protocol.MsgType.SUBMIT, bad)
    bad = {**good, "items": [{**good["items"][0], "params": {"nested": {"a": 1}}}]}
    with pytest.raises(DecodeError, match="scalars"):
        protocol.decode_body(protocol.MsgType.SUBMIT, bad)
    with pytest.raises(DecodeError) as exc:
        protocol.decode_body(999, {})
    assert exc.value.code == protocol.REJECT_UNKNOWN_TYPE


def test_envelope_round_trip(pki) -> None:
    worker, broker = pki("worker-1"), pki("broker")
    frames = worker.encode(sample_messages()[0])
    env = broker.decode(frames)
    assert (env.sender, env.role, env.seq) == ("worker-1", protocol.Role.WORKER, 1)
    assert env.message == sample_messages()[0]
    env2 = broker.decode(worker.encode(protocol.Credit(1)), bound_sender="worker-1")
    assert env2.seq == 2 and env2.message == protocol.Credit(1)


def test_flipped_byte_is_bad_signature(pki) -> None:
    worker, broker = pki("worker-1"), pki("broker")
    payload, sig = worker.encode(protocol.Hello(role="worker", info={"note": "hello"}))
    for i in (0, len(payload) // 2, len(payload) - 1):
        tampered = bytearray(payload)
        tampered[i] ^= 0x01
        with pytest.raises(DecodeError) as exc:
            broker.decode([bytes(tampered), sig])
        assert exc.value.code in (protocol.REJECT_BAD_SIGNATURE, protocol.REJECT_MALFORMED, protocol.REJECT_UNKNOWN_SENDER,
                                  protocol.REJECT_VERSION, protocol.REJECT_UNKNOWN_TYPE)
    # a flip in the body (last byte) can only be caught by the signature
    tampered = bytearray(payload)
    tampered[-1] ^= 0x01
    with pytest.raises(AuthError) as exc:
        broker.decode([bytes(tampered), sig])
    assert exc.value.code == protocol.REJECT_BAD_SIGNATURE


def test_wrong_key_is_bad_signature(pki, tmp_path: Path) -> None:
    """A frame claiming to be worker-1 but signed with the producer's key."""
    broker = pki("broker")
    impostor = EnvelopeCodec("worker-1", pki("producer-1")._key, broker.authorized)
    with pytest.raises(AuthError) as exc:
        broker.decode(impostor.encode(protocol.Hello(role="worker")))
    assert exc.value.code == protocol.REJECT_BAD_SIGNATURE


def test_unknown_sender(pki) -> None:
    with pytest.raises(AuthError) as exc:
        pki("broker").decode(pki("intruder").encode(protocol.Hello(role="worker")))
    assert exc.value.code == protocol.REJECT_UNKNOWN_SENDER


def test_forged_origin_and_role(pki) -> None:
    broker, worker, producer = pki("broker"), pki("worker-1"), pki("producer-1")
    broker.decode(worker.encode(protocol.Hello(role="worker")))
    with pytest.raises(AuthError) as exc:
        broker.decode(producer.encode(protocol.Hello(role="producer")), bound_sender="worker-1")
    assert exc.value.code == protocol.REJECT_FORGED_ORIGIN
    broker.decode(producer.encode(protocol.Hello(role="producer")))
    with pytest.raises(AuthError) as exc:  # a producer may not COMPLETE
        broker.decode(producer.encode(protocol.Complete(results=[])))
    assert exc.value.code == protocol.REJECT_ROLE


def test_replay_stale_and_session_rules(pki) -> None:
    broker, worker = pki("broker"), pki("worker-1")
    with pytest.raises(AuthError) as exc:
        broker.decode(worker.encode(protocol.Credit(1)))
    assert exc.value.code == protocol.REJECT_NO_SESSION
    hello = worker.encode(protocol.Hello(role="worker"))
    broker.decode(hello)
    with pytest.raises(AuthError) as exc:
        broker.decode(hello)
    assert exc.value.code == protocol.REJECT_REPLAY
    old_credit = worker.encode(protocol.Credit(1))
    worker.new_session()
    broker.decode(worker.encode(protocol.Hello(role="worker")))
    with pytest.raises(AuthError) as exc:  # message of the retired session
        broker.decode(old_credit)
    assert exc.value.code == protocol.REJECT_REPLAY
    skewed = pki("worker-1", max_clock_skew_s=1.0)
    strict_broker = pki("broker", max_clock_skew_s=1.0)
    payload = msgpack.unpackb(skewed.encode(protocol.Hello(role="worker"))[0])
    payload[5] -= 10_000
    raw = msgpack.packb(payload)
    with pytest.raises(AuthError) as exc:
        strict_broker.decode([raw, skewed._key.sign(raw)])
    assert exc.value.code == protocol.REJECT_STALE


def test_a_restarted_broker_refuses_hellos_up_to_the_last_one_accepted_before(pki) -> None:
    """A broker's replay memory across its restart (``restore_hellos``, from its ledger):
    the HELLO that opened the peer's last session and any HELLO signed before it are REPLAY,
    a frame of that session is NO_SESSION (the peer reconnects), a newer HELLO opens a
    session, and the restored session stays refused after it."""
    now_ms = [1_800_000_000_000]
    broker1 = pki("broker", wall_ms=lambda: now_ms[0])
    worker = pki("worker-1", require_hello=False, wall_ms=lambda: now_ms[0])
    earlier = worker.encode(protocol.Hello(role="worker"))  # signed, never delivered
    now_ms[0] += 10
    worker.new_session()
    accepted = worker.encode(protocol.Hello(role="worker"))
    env = broker1.decode(accepted)
    credit = worker.encode(protocol.Credit(1))
    broker2 = pki("broker", wall_ms=lambda: now_ms[0])  # the restart, with the ledger's memory
    broker2.restore_hellos({"worker-1": (env.session, env.ts_ms)})
    for replayed in (accepted, earlier):
        with pytest.raises(AuthError) as exc:
            broker2.decode(replayed)
        assert exc.value.code == protocol.REJECT_REPLAY
    with pytest.raises(AuthError) as exc:
        broker2.decode(credit)
    assert exc.value.code == protocol.REJECT_NO_SESSION
    now_ms[0] += 10
    worker.new_session()
    assert broker2.decode(worker.encode(protocol.Hello(role="worker"))).session == worker.session
    with pytest.raises(AuthError) as exc:
        broker2.decode(accepted)
    assert exc.value.code == protocol.REJECT_REPLAY
    fresh = pki("broker", wall_ms=lambda: now_ms[0])  # without the memory (the old broker): taken for new
    assert fresh.decode(accepted).message.role == "worker"


def test_a_peer_takes_a_restarted_broker_whose_clock_stepped_back(pki) -> None:
    """Found by the simulation (tests/sim, a clock_jump then a broker crash): a broker restarted
    after its wall clock was stepped back (NTP) answers from a new session whose timestamps are
    older than its previous session's first frame. A peer's codec refused every frame of it as
    REPLAY ("HELLO older than its current session's", a rule for the broker's side), so each
    reconnect failed until the broker's clock passed the old timestamp: the swarm stood still
    for up to the size of the step. After the peer's own new session (a new socket) the broker's
    new session is taken; its retired session and a frame of it replayed stay refused."""
    now_ms = [1_800_000_000_000]
    broker1 = pki("broker", wall_ms=lambda: now_ms[0])
    worker = pki("worker-1", require_hello=False, wall_ms=lambda: now_ms[0])
    broker1.decode(worker.encode(protocol.Hello(role="worker")))
    first = broker1.encode(protocol.Welcome(1.0, 5, 1))
    assert isinstance(worker.decode(first, bound_sender="broker").message, protocol.Welcome)
    now_ms[0] += 5_000
    late_old = broker1.encode(protocol.Heartbeat())
    now_ms[0] -= 30_000  # the broker's clock steps back 30 s; then it restarts (a new session)
    broker2 = pki("broker", wall_ms=lambda: now_ms[0])
    worker.new_session()  # the peer reconnects on a new socket
    broker2.decode(worker.encode(protocol.Hello(role="worker")))
    env = worker.decode(broker2.encode(protocol.Welcome(1.0, 5, 2)), bound_sender="broker")
    assert isinstance(env.message, protocol.Welcome) and env.session == broker2.session
    for replayed in (first, late_old):  # the retired session stays refused
        with pytest.raises(AuthError) as exc:
            worker.decode(replayed, bound_sender="broker")
        assert exc.value.code == protocol.REJECT_REPLAY
    # without a new socket of its own, a peer still refuses an older broker session
    broker3 = pki("broker", wall_ms=lambda: now_ms[0] - 60_000)
    with pytest.raises(AuthError) as exc:
        worker.decode(broker3.encode(protocol.Heartbeat()), bound_sender="broker")
    assert exc.value.code == protocol.REJECT_REPLAY


def test_c09_hostile_msgpack_limits(pki) -> None:
    """C09: (a) a header claiming a 4 GiB binary, (b) one byte over the limit, (c) exactly at it."""
    limit = 64 * 1024
    broker = pki("broker", max_frame_bytes=limit)
    worker = pki("worker-1", max_frame_bytes=limit * 2)
    # (a) bin32 header claiming 4 GiB inside a tiny frame: rejected by msgpack limits, no allocation
    claim = b"\x97\x01\x01\xc6\xff\xff\xff\xff" + b"x" * 10  # the sender field claims 4 GiB
    with pytest.raises(DecodeError) as exc:
        broker.decode([claim, b"s" * 64])
    assert exc.value.code == protocol.REJECT_MALFORMED
    # (b)/(c): a HELLO padded so the payload is exactly limit+1 / limit bytes
    def padded(total: int) -> list[bytes]:
        pad = total
        for _ in range(20):
            frames = worker.encode(protocol.Hello(role="worker", info={"pad": "x" * pad}))
            if len(frames[0]) == total:
                break
            pad -= len(frames[0]) - total
        assert len(frames[0]) == total
        return frames

    with pytest.raises(DecodeError) as exc:
        broker.decode(padded(limit + 1))
    assert exc.value.code == protocol.REJECT_OVERSIZE
    worker.new_session()
    assert broker.decode(padded(limit)).message.role == "worker"


def test_framing_errors(pki) -> None:
    broker = pki("broker")
    with pytest.raises(DecodeError) as exc:
        broker.decode([b"x"])
    assert exc.value.code == protocol.REJECT_FRAMING
    payload, _ = pki("worker-1").encode(protocol.Hello(role="worker"))
    with pytest.raises(DecodeError) as exc:
        broker.decode([payload, b"short"])
    assert exc.value.code == protocol.REJECT_FRAMING
    bad_version = msgpack.packb([99, 1, "worker-1", 1, 1, int(time.time() * 1000), {}])
    with pytest.raises(DecodeError) as exc:
        broker.decode([bad_version, b"s" * 64])
    assert exc.value.code == protocol.REJECT_VERSION


REJECT_CODES = frozenset(v for k, v in vars(protocol).items() if k.startswith("REJECT_") and type(v) is str)


def _fuzz_sources() -> list[tuple[str, protocol.Message]]:
    """(sender, message) pairs the fuzz mutates: each sample from a role that may send it."""
    out = []
    for msg in sample_messages():
        for sender, role in (("worker-1", protocol.Role.WORKER), ("producer-1", protocol.Role.PRODUCER)):
            if msg.TYPE in protocol.ROLE_MAY_SEND[role]:
                out.append((sender, msg))
                break
    return out


def test_random_frames_never_crash_decoder(pki) -> None:
    """Random and mutated frames only ever raise DecodeError with a REJECT_* code (never
    another exception). Mutated frames are signed again by their sender (an authenticated
    peer sending garbage: otherwise every mutation stops at BAD_SIGNATURE and the body
    decoder is never reached). A mutated frame that decodes must be what its bytes say
    and valid by the codec's own rules (:func:`assert_decoded_frame_is_sound`)."""
    sources = [(sender, pki(sender), *pki(sender).encode(msg)) for sender, msg in _fuzz_sources()]
    envelopes = [msgpack.unpackb(payload, raw=False) for _, _, payload, _ in sources]
    good_sig = sources[0][3]
    decoded = []

    def byte_edits(i: int):  # bytes rewritten in place, maybe some appended
        return st.tuples(st.just("bytes"), st.just(i), st.lists(
            st.tuples(st.integers(0, len(sources[i][2]) - 1), st.integers(0, 255)), min_size=1, max_size=8),
            st.binary(max_size=3))

    def value_edits(i: int):  # one value in the body replaced: well-formed msgpack, wrong content
        paths = _value_paths(envelopes[i][6])
        return st.integers(0, len(paths) - 1).flatmap(lambda n: st.tuples(
            st.just("value"), st.just(i), st.just(n), _near(_get_value(envelopes[i][6], paths[n]))))

    def at(i: int, *path) -> int:
        return _value_paths(envelopes[i][6]).index(path)

    types_ = [msg.TYPE for _, msg in _fuzz_sources()]
    submit, complete = types_.index(protocol.MsgType.SUBMIT), types_.index(protocol.MsgType.COMPLETE)

    @settings(max_examples=400, deadline=None)
    @given(st.one_of(
        st.tuples(st.just("random"), st.binary(max_size=512)),
        st.integers(0, len(sources) - 1).flatmap(byte_edits),
        st.integers(0, len(sources) - 1).flatmap(value_edits),
    ))
    # near misses, always tried: a digest in upper case, a negative size, a bool for an
    # integer, an integer for a float (converted), a NaN, a byte after the envelope
    @example(("value", submit, at(submit, "items", 0, "payload", "sha256"), "AB" * 32))
    @example(("value", submit, at(submit, "items", 0, "payload", "size"), -1))
    @example(("value", complete, at(complete, "results", 0, "token"), True))
    @example(("value", complete, at(complete, "results", 0, "runtime_s"), 1))
    @example(("value", complete, at(complete, "results", 0, "runtime_s"), float("nan")))
    @example(("bytes", 0, [(0, sources[0][2][0])], b"\x00"))
    def check(case) -> None:
        if case[0] == "random":
            frames = [case[1], good_sig]
        else:
            i = case[1]
            if case[0] == "bytes":
                payload = _mutate(sources[i][2], case[2]) + case[3]
            else:
                env = list(envelopes[i])
                env[6] = _replace_value(env[6], _value_paths(env[6])[case[2]], case[3])
                payload = msgpack.packb(env, use_bin_type=True)
            frames = [payload, sources[i][1]._key.sign(payload)]
        broker = pki("broker", require_hello=False)  # a fresh replay guard per frame
        try:
            env = broker.decode(frames)
        except DecodeError as exc:
            assert exc.code in REJECT_CODES, (type(exc).__name__, exc.code, str(exc))
            return
        assert_decoded_frame_is_sound(pki, frames[0], env)
        decoded.append(env)

    check()
    assert decoded


#: Values a buggy or hostile peer may put in any field: every msgpack type, near-miss
#: digests (64 chars, not all lowercase hex), nested containers.
WIRE_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=40) | st.text(alphabet="0123456789abcdefABCDEFg", min_size=64, max_size=64),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=4,
)


def _near(value):
    """Values like ``value`` (its type mostly, with its neighbours: bool for int, int for
    float, bytes for str...), or anything."""
    t = type(value)
    like = {
        bool: st.booleans() | st.integers(0, 1),
        int: st.integers(-(2 ** 63), 2 ** 64 - 1) | st.booleans() | st.floats(),
        float: st.floats() | st.integers(-(2 ** 63), 2 ** 64 - 1),
        str: st.text(max_size=40) | st.text(alphabet="0123456789abcdefABCDEFg", min_size=64, max_size=64) | st.binary(max_size=40),
        bytes: st.binary(max_size=40) | st.text(max_size=40),
    }.get(t)
    return WIRE_VALUES if like is None else st.one_of(like, like, WIRE_VALUES)


def _get_value(body, path: tuple):
    for k in path:
        body = body[k]
    return body


def _value_paths(body, path: tuple = ()) -> list[tuple]:
    """Paths (keys / indexes) to every value inside ``body``, containers included."""
    out = [path] if path else []
    if type(body) is dict:
        for k, v in body.items():
            out += _value_paths(v, path + (k,))
    elif type(body) is list:
        for n, v in enumerate(body):
            out += _value_paths(v, path + (n,))
    return out


def _replace_value(body, path: tuple, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if type(body) is dict:
        return {**body, head: _replace_value(body[head], rest, value)}
    return [_replace_value(v, rest, value) if n == head else v for n, v in enumerate(body)]


def assert_decoded_frame_is_sound(pki, payload: bytes, env) -> None:
    """A frame the codec accepted: the whole payload is one msgpack envelope (nothing
    trailing) whose header is the envelope's; the message's fields hold exactly their
    declared types; the reference decoder agrees on the body (the same message, its
    ``__post_init__`` rules included); and the message re-encodes within the codec's
    limits and decodes back to itself."""
    msg = env.message
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)  # ExtraData: bytes after the envelope
    assert type(raw) is list and len(raw) == 7, raw
    assert raw[:6] == [protocol.PROTOCOL_VERSION, int(msg.TYPE), env.sender, env.session, env.seq, env.ts_ms], raw[:6]
    assert type(msg) is protocol.MESSAGE_CLASSES[protocol.MsgType(raw[1])]
    _assert_well_typed(msg, type(msg), type(msg).__name__)
    assert _same(protocol._slow_decode_body(int(msg.TYPE), raw[6]), msg)
    assert _same(protocol.decode_body(int(msg.TYPE), msgpack.unpackb(_packed(msg), raw=False)), msg)
    again = pki("broker", require_hello=False).decode(pki(env.sender).encode(msg))  # raises if over max_frame_bytes
    assert _same(again.message, msg)


def _packed(msg: protocol.Message) -> bytes:
    return msgpack.packb(protocol.encode_body(msg), use_bin_type=True)


def _same(a: protocol.Message, b: protocol.Message) -> bool:
    """Equal messages (a NaN field, which never equals itself, compared by its encoding)."""
    return type(a) is type(b) and (a == b or _packed(a) == _packed(b))


def _assert_well_typed(value, tp, path: str) -> None:
    """``value`` holds exactly type ``tp`` (bool is not int, int is not float), all the way down."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            assert type(None) in args, f"{path}: None for {tp}"
            return
        for arg in args:
            if arg is not type(None):
                try:
                    _assert_well_typed(value, arg, path)
                    return
                except AssertionError:
                    pass
        raise AssertionError(f"{path}: {type(value).__name__} {value!r:.80} matches no variant of {tp}")
    if origin is list:
        assert type(value) is list, f"{path}: {type(value).__name__} is not a list"
        (elem,) = typing.get_args(tp)
        for n, x in enumerate(value):
            _assert_well_typed(x, elem, f"{path}[{n}]")
        return
    if origin is dict:
        assert type(value) is dict, f"{path}: {type(value).__name__} is not a dict"
        ktp, vtp = typing.get_args(tp)
        for k, x in value.items():
            _assert_well_typed(k, ktp, f"{path} key")
            _assert_well_typed(x, vtp, f"{path}.{k}")
        return
    if dataclasses.is_dataclass(tp):
        assert type(value) is tp, f"{path}: {type(value).__name__} is not {tp.__name__}"
        hints = typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            _assert_well_typed(getattr(value, f.name), hints[f.name], f"{path}.{f.name}")
        return
    if tp is typing.Any:
        return
    assert type(value) is tp, f"{path}: {type(value).__name__} {value!r:.80} is not {tp.__name__}"


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
    assert protocol.encode_body(protocol.Ack(item_ids=["i1"])) == {"item_ids": ["i1"]}
    body = protocol.encode_body(protocol.Ack(item_ids=["i1"], quarantined=[protocol.Quarantined("i1", "CheckViolation")]))
    assert body == {"item_ids": ["i1"], "quarantined": [{"item_id": "i1", "error": "CheckViolation"}]}
    assert protocol.encode_body(protocol.AckOk(item_ids=["i1"])) == {"item_ids": ["i1"], "unknown": []}  # plain defaults stay
