"""The replication link (brokerd/replica.py, docs/ha.md) over real ZeroMQ sockets and signed
envelopes: a primary's committed turns reach a standby's LMDB, which acknowledges them; the
sync tracker counts those acknowledgements. Not the broker: the pieces it will run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import zmq

from ccsq.brokerd import replica as replica_link
from ccsq.brokerd.ledger import replication
from ccsq.brokerd.ledger.store import Ledger, Policy
from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import AuthError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair
from tests.test_ledger_replication import blob, lifecycle

POLL_MS = 10_000


@pytest.fixture
def keys(tmp_path):
    kd = tmp_path / "keys"
    for pid in ("primary", "standby", "worker"):
        write_keypair(kd, pid)
    pub = {pid: public_key_b64(load_private_key(kd / f"{pid}.key")) for pid in ("primary", "standby", "worker")}
    write_authorized_keys(tmp_path / "at_primary.toml", {"standby": ("standby", pub["standby"]),
                                                          "worker": ("worker", pub["worker"])})
    write_authorized_keys(tmp_path / "at_standby.toml", {"primary": ("broker", pub["primary"]),
                                                          "worker": ("worker", pub["worker"])})
    return kd


def codec(tmp_path: Path, me: str, authorized: str, **kw) -> EnvelopeCodec:
    return EnvelopeCodec(me, load_private_key(tmp_path / "keys" / f"{me}.key"), AuthorizedKeys(tmp_path / authorized), **kw)


def open_ledger(path: Path) -> Ledger:
    return Ledger(path, map_size_bytes=1 << 20, max_map_size_bytes=64 << 20,
                  policy=Policy(retry_backoff_base_s=0.0, max_attempts=2, retention_s=1.0, dedup_window_s=5.0),
                  rng=random.Random(7))


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(POLL_MS), "nothing arrived"
    return sock.recv_multipart()


@pytest.fixture
def link(tmp_path, keys):
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.linger = dealer.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close()
    dealer.close()
    ctx.term()


def test_turns_reach_the_standby_over_signed_frames_and_acks_count(tmp_path, keys, link):
    router, dealer = link
    primary = open_ledger(tmp_path / "primary")
    log = primary.replicate(7)
    lifecycle(primary, base_ms=1_000)  # before the standby's copy
    replica_dir = tmp_path / "standby-ledger"
    pos = replication.take_copy(primary, replica_dir)["position"]
    lifecycle(primary, base_ms=100_000)  # after it: the standby catches up on these
    replica = replication.ReplicaLedger(replica_dir)
    assert replica.position == pos and pos[1] < log.position[1]
    pc, sc_ = codec(tmp_path, "primary", "at_primary.toml"), codec(tmp_path, "standby", "at_standby.toml",
                                                                   require_hello=False)
    dealer.send_multipart(sc_.encode(replica_link.standby_hello(replica)))
    ident, *frames = recv(router)
    env = pc.decode(frames)
    assert env.role is protocol.Role.STANDBY
    shipper = replica_link.Shipper(log, primary.ledger_id, env.message, max_frame_bytes=64 << 10)
    tracker = replica_link.SyncTracker(epoch=7, sync_standbys=1)
    router.send_multipart([ident, *pc.encode(protocol.Welcome(1.0, 3, broker_epoch=7))])
    standby = replica_link.Standby(replica, sc_.decode(recv(dealer)).message)

    sent: list[protocol.ReplTurns] = []

    def pump(turns=()) -> None:
        msgs = shipper.messages(turns)
        sent.extend(msgs)
        for m in msgs:
            router.send_multipart([ident, *pc.encode(m)])
        acks = 0
        for _ in msgs:
            ack = standby.on_turns(sc_.decode(recv(dealer)).message)
            if ack is not None:
                dealer.send_multipart(sc_.encode(ack))
                acks += 1
        for _ in range(acks):
            _, *f = recv(router)
            tracker.ack("standby", pc.decode(f).message)

    assert tracker.durable_seq() == 0  # nothing acknowledged: a sync primary confirms nothing
    pump()  # the catch-up from the copy's position
    assert replica.position == log.position and tracker.durable_seq() == log.position[1]
    shipped: list[replication.WriteSet] = []
    log.sink = shipped.append
    txn = primary.begin()  # one turn above the frame budget: it travels in pieces
    for i in range(40):
        txn.submit(protocol.SubmitItem(f"big{i}", "echo", blob(random.Random(i).randbytes(4000))), 200_000)
    txn.commit()
    assert len(shipped[0].pack()) > 64 << 10
    lifecycle(primary, base_ms=300_000)
    pump(shipped)
    assert sum(m.partial for m in sent) >= 2  # the big turn went in pieces
    assert replica.position == log.position and tracker.durable_seq() == log.position[1]
    assert replication.dump(replica.env) == replication.dump(primary.env)
    replica.close()
    primary.close()


def test_roles_and_epochs_are_enforced_on_the_link(tmp_path, keys):
    pc = codec(tmp_path, "primary", "at_primary.toml", require_hello=False)
    sc_ = codec(tmp_path, "standby", "at_standby.toml", require_hello=False)
    wc = codec(tmp_path, "worker", "at_standby.toml", require_hello=False)
    with pytest.raises(AuthError) as err:  # only a broker sends turns
        sc_.decode(wc.encode(protocol.ReplTurns(1, [b"x"])))
    assert err.value.code == protocol.REJECT_ROLE
    with pytest.raises(AuthError) as err:  # only a standby acknowledges them
        pc.decode(wc.encode(protocol.ReplAck(1, 1)))
    assert err.value.code == protocol.REJECT_ROLE
    with pytest.raises(AuthError) as err:  # only a broker ships a copy
        sc_.decode(wc.encode(protocol.ReplCopyChunk(1, 1, 0, 1, b"x")))
    assert err.value.code == protocol.REJECT_ROLE
    with pytest.raises(AuthError) as err:  # only a standby acknowledges its chunks
        pc.decode(wc.encode(protocol.ReplCopyAck(1)))
    assert err.value.code == protocol.REJECT_ROLE
    assert isinstance(sc_.decode(pc.encode(protocol.ReplCopyChunk(1, 1, 0, 1, b"x"))).message, protocol.ReplCopyChunk)
    assert pc.decode(sc_.encode(protocol.ReplCopyAck(1))).message == protocol.ReplCopyAck(1)
    frames = pc.encode(protocol.ReplTurns(1, [b"x"]))
    frames[0] = frames[0].replace(b"x", b"y")
    with pytest.raises(AuthError) as err:
        sc_.decode(frames)
    assert err.value.code == protocol.REJECT_BAD_SIGNATURE

    primary = open_ledger(tmp_path / "primary")
    log = primary.replicate(5)
    replica_dir = tmp_path / "r"
    replication.take_copy(primary, replica_dir)
    lifecycle(primary)
    replica = replication.ReplicaLedger(replica_dir)
    standby = replica_link.Standby(replica, protocol.Welcome(1.0, 3, broker_epoch=5))
    with pytest.raises(replication.StaleEpoch):  # turns of another primary than the one this session welcomed
        standby.on_turns(protocol.ReplTurns(4, [log.backlog[0].pack()]))
    msg = replica_link.Shipper(log, primary.ledger_id, replica_link.standby_hello(replica)).messages()[0]
    assert standby.on_turns(msg) == protocol.ReplAck(5, msg and replication.WriteSet.unpack(msg.turns[-1]).seq)
    assert standby.on_turns(msg) is None  # a resend: nothing new to acknowledge
    with pytest.raises(replication.Diverged):  # a standby of another ledger: NEED_COPY
        replica_link.Shipper(log, "other", replica_link.standby_hello(replica))
    small = primary.replicate(5, backlog_turns=2)
    lifecycle(primary, base_ms=900_000)
    with pytest.raises(replication.BacklogTruncated):
        replica_link.Shipper(small, primary.ledger_id, replica_link.standby_hello(replica))
    with pytest.raises(replication.ReplicationError, match="info"):
        replica_link.standby_position(protocol.Hello(role="standby"))
    replica.close()
    primary.close()


def test_sync_tracker_counts_the_slowest_of_the_needed_standbys():
    t = replica_link.SyncTracker(epoch=3, sync_standbys=2)
    t.ack("a", protocol.ReplAck(3, 10))
    assert t.durable_seq() == 0  # one standby of the two needed
    t.ack("b", protocol.ReplAck(3, 7))
    assert t.durable_seq() == 7
    t.ack("c", protocol.ReplAck(3, 9))
    assert t.durable_seq() == 9
    t.ack("a", protocol.ReplAck(3, 4))  # an old ack arriving late never moves a standby back
    assert t.acked["a"] == 10
    t.drop("a")
    assert t.durable_seq() == 7
    with pytest.raises(replication.StaleEpoch):
        t.ack("b", protocol.ReplAck(2, 100))
    assert replica_link.SyncTracker(epoch=1, sync_standbys=0).durable_seq() > 1 << 40  # async: nothing to wait for
