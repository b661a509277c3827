"""Envelope security properties at the codec level (no sockets): the order of
checks (no signature or body work on unbounded or unauthenticated input) and
replay protection across sessions."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest

from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec, ReplayGuard
from ccsq.common.wire.errors import AuthError, DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, PeerKey, load_private_key, public_key_b64, write_authorized_keys, write_keypair

LIMIT = 64 * 1024


class CountingKey:
    """Wraps a real Ed25519 public key and counts verify() calls."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def verify(self, signature: bytes, data: bytes) -> None:
        self.calls += 1
        self.real.verify(signature, data)


@pytest.fixture
def pair(tmp_path: Path):
    keys = {}
    for pid in ("broker", "w"):
        priv, _ = write_keypair(tmp_path / "keys", pid)
        keys[pid] = load_private_key(priv)
    write_authorized_keys(tmp_path / "ak.toml", {"broker": ("broker", public_key_b64(keys["broker"])),
                                                 "w": ("worker", public_key_b64(keys["w"]))})
    ak = AuthorizedKeys(tmp_path / "ak.toml")
    counting = CountingKey(ak.get("w").public_key)
    ak._peers["w"] = PeerKey("w", protocol.Role.WORKER, counting)
    broker = EnvelopeCodec("broker", keys["broker"], ak, max_frame_bytes=LIMIT)
    worker = EnvelopeCodec("w", keys["w"], ak, max_frame_bytes=4 * LIMIT)
    return broker, worker, counting


def frame(worker: EnvelopeCodec, body: bytes, *, mtype: int = int(protocol.MsgType.HELLO), sign: bool = True) -> list[bytes]:
    """An envelope whose body is the raw msgpack ``body`` bytes (possibly hostile)."""
    head = msgpack.packb([protocol.PROTOCOL_VERSION, mtype, "w", worker.session, 1, int(time.time() * 1000)])
    payload = b"\x97" + head[1:] + body  # same 6 header fields in a 7-element array
    return [payload, worker._key.sign(payload) if sign else b"\0" * 64]


def test_no_signature_or_body_work_on_unbounded_or_unauthenticated_input(pair):
    """C09 at the codec: an oversize frame and a header field claiming 4 GiB are
    refused before any signature check; a body that claims 4 GiB or is a bomb of
    empty arrays is never parsed unless the signature holds (then MALFORMED);
    a frame exactly at the limit is verified once and accepted."""
    broker, worker, counting = pair
    with pytest.raises(DecodeError) as exc:  # over the limit: refused on its length
        broker.decode([b"\x97" + b"x" * LIMIT, b"\0" * 64])
    assert exc.value.code == protocol.REJECT_OVERSIZE
    with pytest.raises(DecodeError) as exc:  # the sender field claims a 4 GiB str
        broker.decode([b"\x97\x01\x01\xdb\xff\xff\xff\xff" + b"w", b"\0" * 64])
    assert exc.value.code == protocol.REJECT_MALFORMED
    assert counting.calls == 0
    bomb = b"\xdd\x00\x00\xff\xff" + b"\x90" * 65535  # array32 of 65535 empty arrays (slow to parse)
    for body in (b"\xc6\xff\xff\xff\xff", bomb[: LIMIT - 100]):
        with pytest.raises(AuthError) as exc:  # unsigned: refused before the body is parsed
            broker.decode(frame(worker, body, sign=False))
        assert exc.value.code == protocol.REJECT_BAD_SIGNATURE
    t0 = time.perf_counter()
    for _ in range(50):
        with pytest.raises(AuthError):
            broker.decode(frame(worker, bomb[: LIMIT - 100], sign=False))
    assert time.perf_counter() - t0 < 0.5  # parsing the bomb 50 times would take ~1 s
    with pytest.raises(DecodeError) as exc:  # signed, but the body claims 4 GiB
        broker.decode(frame(worker, b"\xc6\xff\xff\xff\xff"))
    assert exc.value.code == protocol.REJECT_MALFORMED
    with pytest.raises(DecodeError) as exc:  # signed, trailing bytes after the envelope
        broker.decode(frame(worker, msgpack.packb({"role": "worker"}) + b"\x00"))
    assert exc.value.code == protocol.REJECT_MALFORMED and "trailing" in str(exc.value)
    calls = counting.calls
    pad = LIMIT
    for _ in range(10):
        frames = worker.encode(protocol.Hello(role="worker", info={"pad": "x" * pad}))
        if len(frames[0]) == LIMIT:
            break
        pad -= len(frames[0]) - LIMIT
    assert broker.decode(frames).message.role == "worker" and counting.calls == calls + 1


def test_old_session_hello_cannot_be_replayed_within_the_window():
    """A HELLO of any session retired within 2 x max_clock_skew is refused
    (REPLAY), however many sessions the peer opened since; forgetting the oldest
    (over RETIRED_PER_SENDER) raises a floor instead of opening a hole."""
    guard = ReplayGuard(window_ms=120_000)
    guard.RETIRED_PER_SENDER = 4
    t = 1_000_000
    for session in range(1, 11):
        guard.check("w", session, 1, True, t + session)
        guard.accept("w", session, 1, t + session)
    for session in range(1, 10):  # every old session, remembered or forgotten
        with pytest.raises(AuthError) as exc:
            guard.check("w", session, 1, True, t + session)
        assert exc.value.code == protocol.REJECT_REPLAY
    guard.check("w", 11, 1, True, t + 11)  # a genuinely new session is fine
    with pytest.raises(AuthError) as exc:  # the current session's seq 1 again
        guard.check("w", 10, 1, False, t + 12)
    assert exc.value.code == protocol.REJECT_REPLAY
    # sessions older than the window are dropped from memory (STALE covers them)
    guard.accept("w", 99, 1, t + 500_000)
    assert len(guard._retired["w"]) <= 1
