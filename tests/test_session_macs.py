"""Session MACs (issue 15, docs/security.md "Session MACs"): after a signed HELLO/WELCOME
that exchanged ephemeral X25519 keys, frames carry a 32-byte HMAC-SHA256 tag instead of
the Ed25519 signature. Real ZeroMQ sockets and a real ``ccsq-brokerd`` (or the worker
tests' scripted broker in front of a real ``ccsq-workerd``); peers without the feature
keep signing in both directions."""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path

import pytest

from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import MAC_BYTES, MAC_OFFER_INFO, EnvelopeCodec
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key
from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm, wait_for
from tests.test_security_broker import LIMIT, _rss_kib, submit_of_size
from tests.worker_harness import WorkerBroker, Workers, task

PEERS = {"producer-1": "producer", "worker-1": "worker", "completion-1": "completion"}


def _raw(sp: ScriptedPeer, timeout_s: float = 10.0, *, want: type | None = None) -> tuple[list[bytes], protocol.Message]:
    """The next frames the broker sent to ``sp`` (of type ``want``, skipping heartbeats), decoded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sp.sock.poll(100):
            continue
        frames = sp.sock.recv_multipart()
        msg = sp.codec.decode(frames, bound_sender="broker").message
        if want is None or isinstance(msg, want):
            return frames, msg
    raise TimeoutError(f"{sp.peer_id}: nothing of {want} within {timeout_s}s")


def _item(i: int) -> protocol.SubmitItem:
    data = f"payload {i}".encode()
    return protocol.SubmitItem(key=f"k{i}", kind="echo", payload=protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data))


def _rejects(sp: ScriptedPeer) -> dict:
    """Refusals and reconnect noise (NO_SESSION counts apart since issue 22, defect 8)."""
    st = sp.admin_status()
    return {**st.get("rejects", {}), **st.get("reconnect_noise", {})}


def _tag(sp: ScriptedPeer, payload: bytes) -> bytes:
    """The 32-byte tag of ``sp``'s current MAC session over ``payload``, as its codec computes it."""
    return hmac.digest(sp.codec._tx[None].tx, payload, "sha256")


@pytest.fixture
def broker(tmp_path: Path):
    cfg = make_swarm(tmp_path, {**PEERS, "admin": "admin"})
    b = BrokerProcess(cfg).start()
    yield b
    b.stop()


@pytest.mark.timeout(90)
def test_mac_session_against_the_real_broker(tmp_path: Path, broker: BrokerProcess) -> None:
    """A producer and a worker that offer MACs get WELCOME.mac_x25519; every later frame
    either way carries a 32-byte tag; the worker completes the items over MACs; a
    tampered tag and a replayed frame are refused (BAD_SIGNATURE, REPLAY) and end the
    session; a frame tagged with the key of the peer's previous session is refused; a
    tagged frame after the session ended gets NO_SESSION and changes nothing."""
    ep = broker.endpoint
    prod = ScriptedPeer(tmp_path, "producer-1", ep, session_macs=True)
    work = ScriptedPeer(tmp_path, "worker-1", ep, session_macs=True)
    admin = ScriptedPeer(tmp_path, "admin", ep)  # signing, as an older peer
    assert admin.hello("admin").mac_x25519 == b""
    for sp, role, kw in ((prod, "producer", {}), (work, "worker", {"slots": 1, "credit": 4, "kinds": ["echo"]})):
        welcome = sp.hello(role, **kw)
        assert len(welcome.mac_x25519) == 32 and sp.codec.mac_active
    connected = wait_for(lambda: len(ev := broker.events("peer_connected")) == 3 and ev, what="3 peer_connected lines")
    assert {e["peer"]: e["session_mac"] for e in connected} == {"admin": False, "producer-1": True, "worker-1": True}
    assert all(MAC_OFFER_INFO not in e["info"] for e in connected)

    # producer -> broker tagged; broker -> producer tagged
    frames = prod.codec.encode(protocol.Submit(prod.next_req(), [_item(i) for i in range(3)]))
    assert len(frames[1]) == MAC_BYTES
    prod.send_raw(frames)
    ack_frames, ack = _raw(prod, want=protocol.SubmitAck)
    assert len(ack_frames[1]) == MAC_BYTES and not any(r.duplicate or r.error for r in ack.results)
    ids = [r.item_id for r in ack.results]

    # the worker runs them over MACs: DISPATCH tagged, COMPLETE tagged, COMPLETE_ACK tagged
    done: list[str] = []
    while len(done) < 3:
        d_frames, dispatch = _raw(work, want=protocol.Dispatch)
        assert len(d_frames[1]) == MAC_BYTES
        res = [protocol.TaskResult(t.item_id, t.token, protocol.Blob(hashlib.sha256(b"ok").hexdigest(), 2, b"ok"), "echo", "1")
               for t in dispatch.tasks]
        work.send(protocol.Complete(results=res))
        a_frames, cack = _raw(work, want=protocol.CompleteAck)
        assert len(a_frames[1]) == MAC_BYTES
        assert [o.outcome for o in cack.outcomes] == ["accepted"] * len(res)
        done += [t.item_id for t in dispatch.tasks]
    assert sorted(done) == sorted(ids)
    assert {s.state for s in prod.status(ids)} == {protocol.ItemState.COMPLETED.value}

    # a tampered tag: refused as a bad signature, the session ends (the next frame: NO_SESSION)
    bad = prod.codec.encode(protocol.Status(prod.next_req(), ids))
    prod.send_raw([bad[0], bytes([bad[1][0] ^ 1]) + bad[1][1:]])
    err = prod.recv_type(protocol.Error)
    assert err.code == protocol.REJECT_BAD_SIGNATURE and "MAC" in err.message
    prod.send(protocol.Heartbeat())
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_NO_SESSION

    # a replayed tagged frame: REPLAY
    prod.connect()  # a new session (new socket, new keys)
    prod.hello("producer")
    frames = prod.codec.encode(protocol.Status(prod.next_req(), ids))
    prod.send_raw(frames)
    _raw(prod, want=protocol.StatusReply)
    prod.send_raw(frames)
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_REPLAY

    # a frame tagged with the key of the peer's previous session: refused, never applied
    old_key = prod.codec._tx[None].tx
    prod.connect()
    prod.hello("producer")
    payload = prod.codec.encode(protocol.Submit(prod.next_req(), [_item(99)]))[0]
    prod.send_raw([payload, hmac.digest(old_key, payload, "sha256")])
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_BAD_SIGNATURE

    # a tagged frame of a session that ended (BYE): NO_SESSION, nothing applied
    work.send(protocol.Bye(reason="test"))
    ok = protocol.Blob(hashlib.sha256(b"ok").hexdigest(), 2, b"ok")
    frames = work.codec.encode(protocol.Complete(results=[protocol.TaskResult(ids[0], 1, ok, "echo", "1")]))
    assert len(frames[1]) == MAC_BYTES
    work.send_raw(frames)
    assert work.recv_type(protocol.Error).code == protocol.REJECT_NO_SESSION
    rejects = _rejects(admin)
    assert rejects.get(protocol.REJECT_BAD_SIGNATURE) == 2 and rejects.get(protocol.REJECT_REPLAY) == 1, rejects
    for sp in (prod, work, admin):
        sp.close()


@pytest.mark.timeout(60)
def test_tagged_frame_without_a_mac_session_is_refused(tmp_path: Path, broker: BrokerProcess) -> None:
    """A tagged frame for a session the broker never keyed (a stranger's guess, or a peer
    whose broker restarted) is refused before its body is read, answered NO_SESSION (the
    peer reconnects) at most once per claimed id per 2 s, and changes nothing; a signing
    peer's frames keep working next to it."""
    sp = ScriptedPeer(tmp_path, "producer-1", broker.endpoint)
    sp.hello("producer")
    forged = EnvelopeCodec("producer-1", load_private_key(tmp_path / "keys" / "producer-1.key"),
                           AuthorizedKeys(tmp_path / "authorized_keys.toml"), require_hello=False)
    intruder = ScriptedPeer(tmp_path, "producer-1", broker.endpoint)
    payload = forged.encode(protocol.Submit(1, [_item(1)]))[0]
    intruder.send_raw([payload, b"\0" * MAC_BYTES])
    assert intruder.recv_type(protocol.Error).code == protocol.REJECT_NO_SESSION
    intruder.send_raw([payload, b"\1" * MAC_BYTES])
    assert intruder.recv(0.5) is None  # rate-limited: one answer per claimed id per 2 s
    # the live signing session is untouched, and the refused SUBMIT of k1 was never applied
    assert [r.duplicate for r in sp.submit([_item(1), _item(2)])] == [False, False]
    admin = ScriptedPeer(tmp_path, "admin", broker.endpoint)
    admin.hello("admin")
    assert _rejects(admin).get(protocol.REJECT_NO_SESSION) == 2
    admin.close()
    sp.close()
    intruder.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("broker_macs", [True, False])
def test_real_worker_over_macs_or_signatures(tmp_path: Path, broker_macs: bool) -> None:
    """The real ccsq-workerd (BrokerLink) offers MACs: against a broker codec that answers,
    every frame after its HELLO is tagged and the items complete; against one that does not
    (an older broker: WELCOME without mac_x25519) it keeps signing, both ways."""
    broker = WorkerBroker(tmp_path, session_macs=broker_macs)
    lengths: list[int] = []
    decode = broker.codec.decode

    def spy(frames: list[bytes], **kw):
        lengths.append(len(frames[1]))
        return decode(frames, **kw)

    broker.codec.decode = spy  # type: ignore[method-assign]
    workers = Workers(tmp_path, broker)
    try:
        workers.start(slots=1, prefetch=1)
        (hello,) = broker.wait_for(protocol.Hello)
        assert MAC_OFFER_INFO in hello.msg.info
        for k in range(3):
            broker.dispatch(task(f"m{k}", "echo", token=k + 1))
            broker.wait_for(protocol.Complete, n=k + 1)
        broker.wait_for(protocol.Heartbeat)
        want = MAC_BYTES if broker_macs else protocol.SIGNATURE_BYTES
        assert lengths[0] == protocol.SIGNATURE_BYTES and set(lengths[1:]) == {want}, lengths
        ready = [e for e in workers.log_events(1) if e["event"] == "broker_link_ready"]
        assert ready and ready[0]["session_mac"] is broker_macs
    finally:
        workers.kill_all()
        broker.close()


def test_codec_refuses_what_a_mac_session_does_not_allow(tmp_path: Path) -> None:
    """HELLO/WELCOME are always signed (a tagged one is FRAMING); an invalid offer leaves
    the session signed; a peer's tag does not verify as the broker's (one key per
    direction); a re-keyed peer (authorized_keys reloaded) is refused."""
    from ccsq.common.wire.keys import public_key_b64, write_authorized_keys, write_keypair

    keys = {}
    for pid in ("broker", "w"):
        priv, _ = write_keypair(tmp_path / "keys", pid)
        keys[pid] = load_private_key(priv)
    ak_path = tmp_path / "ak.toml"
    write_authorized_keys(ak_path, {"broker": ("broker", public_key_b64(keys["broker"])),
                                    "w": ("worker", public_key_b64(keys["w"]))})
    b = EnvelopeCodec("broker", keys["broker"], AuthorizedKeys(ak_path), session_macs=True)
    w = EnvelopeCodec("w", keys["w"], AuthorizedKeys(ak_path), require_hello=False, session_macs=True)
    older = EnvelopeCodec("w", keys["w"], AuthorizedKeys(ak_path), require_hello=False)  # offers nothing itself
    bad = b.decode(older.encode(protocol.Hello(role="worker", info={MAC_OFFER_INFO: "not base64!"})))
    assert b.open_session_mac(bad, "other") == b""
    env = b.decode(w.encode(protocol.Hello(role="worker")))
    mac = b.open_session_mac(env, "rid")
    w.decode(b.encode(protocol.Welcome(1.0, 5, 1, mac_x25519=mac), channel="rid"), bound_sender="broker")
    assert w.mac_active
    hb = w.encode(protocol.Heartbeat())
    assert len(hb[1]) == MAC_BYTES and isinstance(b.decode(hb).message, protocol.Heartbeat)
    assert len(b.encode(protocol.Heartbeat(), channel="other")[1]) == protocol.SIGNATURE_BYTES  # no MAC session there
    tagged_hello = w.encode(protocol.Hello(role="worker"))[0]
    with pytest.raises(DecodeError) as exc:
        b.decode([tagged_hello, hb[1]])
    assert exc.value.code == protocol.REJECT_FRAMING
    up = w.encode(protocol.Heartbeat())[0]
    with pytest.raises(DecodeError) as exc:  # tagged with the broker -> peer key: one key per direction
        b.decode([up, hmac.digest(b._tx["rid"].tx, up, "sha256")])
    assert exc.value.code == protocol.REJECT_BAD_SIGNATURE
    priv, _ = write_keypair(tmp_path / "keys2", "w")
    write_authorized_keys(ak_path, {"broker": ("broker", public_key_b64(keys["broker"])),
                                    "w": ("worker", public_key_b64(load_private_key(priv)))})
    b.authorized.reload()
    with pytest.raises(DecodeError) as exc:
        b.decode(w.encode(protocol.Heartbeat()))
    assert exc.value.code == protocol.REJECT_BAD_SIGNATURE and "changed" in str(exc.value)


@pytest.mark.timeout(120)
def test_real_swarm_runs_over_session_macs(tmp_path: Path) -> None:
    """The real daemons and the producer library against the real broker: the worker, the
    completion service and the producer all agree on session MACs (broker log
    ``peer_connected session_mac=true``, their own ``broker_link_ready``) and the items
    end acknowledged, each landed once."""
    import json

    from tests.swarm import Swarm

    with Swarm(tmp_path / "s") as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            for i in range(3):
                client.submit(f"mac-{i}".encode(), "echo")
        swarm.wait_acknowledged(3)
        assert len(swarm.results()) == 3
        logs = swarm.root / "logs"

        def events(name: str, event: str) -> list[dict]:
            return [json.loads(line) for line in (logs / f"{name}.log").read_text().splitlines()
                    if line.startswith("{") and f'"{event}"' in line]

        macs = {e["peer"]: e["session_mac"] for e in events("broker", "peer_connected")}
        assert set(macs.values()) == {True} and {"worker-1", "completion-1"} <= set(macs) and len(macs) >= 3, macs
        for name in ("worker-1", "completion"):
            assert [e["session_mac"] for e in events(name, "broker_link_ready")] == [True]


@pytest.mark.timeout(60)
def test_c09_hostile_frames_over_a_mac_session(tmp_path: Path) -> None:
    """Case C09 over session MACs (the signed variant: tests/test_broker.py and
    tests/test_security_broker.py): an authorized producer in a MAC session sends, each
    with a valid tag of its session, (a) a header whose sender field claims a 4 GiB
    binary, (b) a SUBMIT one byte over max_frame_bytes, (c) one exactly at it. (a) is
    MALFORMED and (b) OVERSIZE (typed ERROR, counted in admin status, the session
    ended); (c) is accepted; broker RSS grows by at most a few MiB; another producer's
    MAC session keeps submitting between every step."""
    cfg = make_swarm(tmp_path, {**PEERS, "producer-2": "producer", "admin": "admin"}, max_frame_bytes=LIMIT)
    broker = BrokerProcess(cfg).start()
    hostile = ScriptedPeer(tmp_path, "producer-1", broker.endpoint, session_macs=True)
    other = ScriptedPeer(tmp_path, "producer-2", broker.endpoint, session_macs=True)
    admin = ScriptedPeer(tmp_path, "admin", broker.endpoint)
    try:
        admin.hello("admin")
        other.hello("producer")
        assert other.codec.mac_active
        n_other = 0

        def other_still_works() -> None:
            nonlocal n_other
            n_other += 1
            t0 = time.monotonic()
            (r,) = other.submit([_item(1000 + n_other)], timeout_s=5.0)
            assert r.item_id and not r.error and not r.duplicate and time.monotonic() - t0 < 3.0

        def mac_session() -> None:
            hostile.connect()
            assert len(hostile.hello("producer").mac_x25519) == 32 and hostile.codec.mac_active

        rss0 = _rss_kib(broker.proc.pid)
        # (a) a 7-element envelope whose sender field (bin32) claims 4 GiB, in a handful of bytes
        mac_session()
        payload = b"\x97\x01\x0a\xc6\xff\xff\xff\xff" + b"xx"
        hostile.send_raw([payload, _tag(hostile, payload)])
        assert hostile.recv_type(protocol.Error).code == protocol.REJECT_MALFORMED
        frames = hostile.codec.encode(protocol.Status(hostile.next_req(), []))
        assert len(frames[1]) == MAC_BYTES
        hostile.send_raw(frames)  # the session was ended (one disconnect rule)
        assert hostile.recv_type(protocol.Error).code == protocol.REJECT_NO_SESSION
        other_still_works()
        # (b) one byte over the limit, tagged
        mac_session()
        frames = submit_of_size(hostile, LIMIT + 1)
        assert len(frames[1]) == MAC_BYTES
        hostile.send_raw(frames)
        assert hostile.recv_type(protocol.Error).code == protocol.REJECT_OVERSIZE
        other_still_works()
        # (c) exactly at the limit, tagged: accepted
        mac_session()
        frames = submit_of_size(hostile, LIMIT)
        assert len(frames[1]) == MAC_BYTES
        hostile.send_raw(frames)
        ack_frames, ack = _raw(hostile, want=protocol.SubmitAck)
        assert len(ack.results) == 8 and all(res.item_id and not res.error for res in ack.results)
        assert len(ack_frames[1]) == MAC_BYTES
        other_still_works()

        # the NO_SESSION answer after (a) is the session layer's, as for a signed frame: not a reject
        want = {protocol.REJECT_MALFORMED: 1, protocol.REJECT_OVERSIZE: 1}
        wait_for(lambda: _rejects(admin) == want, 10, what=f"rejects == {want}")
        assert _rss_kib(broker.proc.pid) - rss0 < 8 * 1024
        reasons = [e["reason"] for e in broker.events("peer_disconnected") if e.get("peer") == "producer-1"]
        assert "invalid envelope: MALFORMED" in reasons and "invalid envelope: OVERSIZE" in reasons, reasons
        assert broker.proc.poll() is None
    finally:
        for sp in (hostile, other, admin):
            sp.close()
        broker.stop()
