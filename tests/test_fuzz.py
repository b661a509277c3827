"""Hypothesis fuzzing of untrusted input: the real decoder, and a running broker.

Bounded in CI (a few seconds each). A long run: ``CCSQ_FUZZ_EXAMPLES=20000
make soak`` (the ``soak`` variants), or set ``CCSQ_FUZZ_EXAMPLES`` for the CI
variants too.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm, wait_for
from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import Envelope, EnvelopeCodec
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair

CI_EXAMPLES = int(os.environ.get("CCSQ_FUZZ_EXAMPLES", "200"))
SOAK_EXAMPLES = int(os.environ.get("CCSQ_FUZZ_EXAMPLES", "20000"))
LIMIT = 16 * 1024

# msgpack-able values, nested (what a hostile but well-formed body can hold)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=6)),
                      max_leaves=16)


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    buf = bytearray(data)
    for pos, val in edits:
        buf[pos % len(buf)] = val
    return bytes(buf)


@pytest.fixture(scope="module")
def codecs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzkeys")
    keys = {}
    for pid in ("broker", "w"):
        priv, _ = write_keypair(root, pid)
        keys[pid] = load_private_key(priv)
    write_authorized_keys(root / "ak.toml", {pid: (pid if pid == "broker" else "worker", public_key_b64(k))
                                             for pid, k in keys.items()})
    ak = AuthorizedKeys(root / "ak.toml")
    return (EnvelopeCodec("broker", keys["broker"], ak, max_frame_bytes=LIMIT, require_hello=False),
            EnvelopeCodec("w", keys["w"], ak, max_frame_bytes=LIMIT))


def _decode_or_typed_error(codec: EnvelopeCodec, frames: list[bytes]) -> Envelope | None:
    try:
        return codec.decode(frames)
    except DecodeError as exc:
        assert exc.code in protocol.ALL_REJECT_REASONS, exc.code
        return None


def test_fuzz_decoder_signed_hostile_bodies_and_headers(codecs):
    """Correctly signed frames with arbitrary header fields and bodies: the
    decoder returns a message or raises a typed DecodeError, nothing else; an
    accepted message always has an authorized sender and an allowed type."""
    broker, worker = codecs
    seq = iter(range(1, 10**9))

    @settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mtype=st.one_of(st.sampled_from([int(t) for t in protocol.MsgType]), values),
           header=st.one_of(st.none(), st.tuples(values, values, values)), body=values)
    def check(mtype, header, body) -> None:
        fields = [protocol.PROTOCOL_VERSION, mtype, "w", worker.session, next(seq), int(time.time() * 1000)]
        if header is not None:
            fields[2], fields[3], fields[4] = header
        payload = msgpack.packb([*fields, body], use_bin_type=True)
        env = _decode_or_typed_error(broker, [payload, worker._key.sign(payload)])
        if env is not None:
            assert env.sender == "w" and env.message.TYPE in protocol.ROLE_MAY_SEND[protocol.Role.WORKER]

    check()


def test_fuzz_decoder_mutations_never_forge(codecs):
    """Mutated copies of a signed frame (payload or signature bytes, truncation,
    extension) are never accepted unless they are byte-identical to the original."""
    broker, worker = codecs
    worker.new_session()
    good = worker.encode(protocol.Hello(role="worker", info={"note": "original"}))

    @settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, 1), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
           cut=st.integers(-8, 8), extra=st.binary(max_size=8))
    def check(which, edits, cut, extra) -> None:
        frames = list(good)
        data = _mutate(frames[which], edits) if edits else frames[which]
        data = (data[:cut] if cut < 0 else data) + (extra if cut > 0 else b"")
        frames[which] = data
        fresh = EnvelopeCodec("broker", broker._key, broker.authorized, max_frame_bytes=LIMIT)
        env = _decode_or_typed_error(fresh, frames)
        if env is not None:
            assert frames == list(good)

    check()


# --- against a running broker ----------------------------------------------------------
def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fuzz_broker(root: Path, examples: int) -> None:
    config = make_swarm(root, {"prod": "producer", "wA": "worker", "adm": "admin"}, max_frame_bytes=LIMIT)
    write_keypair(root / "keys", "intruder")
    broker = BrokerProcess(config).start()
    peers: list[ScriptedPeer] = []
    try:
        adm = ScriptedPeer(root, "adm", broker.endpoint)
        peers.append(adm)
        adm.hello("admin")
        w = ScriptedPeer(root, "wA", broker.endpoint)
        peers.append(w)
        w.hello("worker", slots=1, credit=0)
        fuzz = ScriptedPeer(root, "prod", broker.endpoint)
        intruder = ScriptedPeer(root, "intruder", broker.endpoint)
        peers += [fuzz, intruder]
        fuzz.hello("producer")
        base = fuzz.codec.encode(protocol.Submit(1, [protocol.SubmitItem("base", "echo", blob(b"base"), params={"n": "x" * 40})]))
        fuzz.send_raw(base)
        assert fuzz.recv_type(protocol.SubmitAck).results[0].item_id  # the one legitimate item
        status_frames = fuzz.codec.encode(protocol.Status(2, ["x"]))
        fuzz.send_raw(status_frames)
        fuzz.recv_type(protocol.StatusReply)
        # every seed has been seen (a replay) or is from an unknown sender: each fuzz frame is a reject
        seeds = [base, status_frames, intruder.codec.encode(protocol.Hello(role="producer"))]
        rss0 = _rss_kib(broker.proc.pid)
        sent = 0
        alive_mono = [time.monotonic()]

        def keep_bystanders_alive() -> None:
            """A long run outlasts the broker's silence window (5 s) and the frames' clock-skew
            window (60 s): the admin and the bystander worker heartbeat, and what the broker sent
            them meanwhile is dropped unread (heartbeats; stale by the time the test would read)."""
            if time.monotonic() - alive_mono[0] < 1.0:
                return
            alive_mono[0] = time.monotonic()
            for peer in (adm, w):
                while peer.sock.poll(0):
                    peer.sock.recv_multipart()
                peer.heartbeat()

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(seed=st.sampled_from(range(len(seeds))), which=st.integers(0, 1),
               edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
               raw=st.one_of(st.none(), st.lists(st.binary(max_size=200), min_size=1, max_size=4)),
               via_intruder=st.booleans())
        def send(seed, which, edits, raw, via_intruder) -> None:
            nonlocal sent
            frames = list(seeds[seed])
            if raw is not None:
                frames = raw
            elif edits:
                frames[which] = _mutate(frames[which], edits)
            (intruder if via_intruder else fuzz).send_raw(frames)
            sent += 1
            assert broker.proc.poll() is None
            keep_bystanders_alive()

        send()
        for peer in (adm, w):  # what the broker sent the bystanders during the run, unread
            while peer.sock.poll(0):
                peer.sock.recv_multipart()

        def all_counted():
            st_ = adm.admin_status()
            return sum(st_["rejects"].values()) == sent and st_

        try:
            status = wait_for(all_counted, 10, interval_s=0.05, what=f"{sent} fuzz frames counted as rejects")
        except TimeoutError:
            raise AssertionError(f"sent {sent}, rejects {adm.admin_status()['rejects']}") from None
        assert status["counters"]["received"] == 1  # no forgery was ever accepted
        assert set(status["rejects"]) <= set(protocol.ALL_REJECT_REASONS)
        assert _rss_kib(broker.proc.pid) - rss0 < 16 * 1024
        assert "wA" in {x["peer_id"] for x in status["peers"]}  # the bystander kept its session
        w.heartbeat()
        assert isinstance(w.recv_type(protocol.Heartbeat, 2.0), protocol.Heartbeat)
    finally:
        for sp in peers:
            sp.close()
        broker.kill()


def test_fuzz_running_broker(tmp_path):
    """Mutated and random frames from an authorized peer and from an intruder to a
    running broker: no crash, every frame counted as a typed reject, no forgery
    accepted, RSS bounded, a bystander worker keeps its session and heartbeats."""
    _fuzz_broker(tmp_path, CI_EXAMPLES)


@pytest.mark.soak
@pytest.mark.timeout(1800)  # 20000 frames take minutes (the suite's 120 s would end it mid-run)
def test_fuzz_running_broker_long(tmp_path):
    """The same, long (CCSQ_FUZZ_EXAMPLES, default 20000); the bystanders heartbeat meanwhile."""
    _fuzz_broker(tmp_path, SOAK_EXAMPLES)
