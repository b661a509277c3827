"""Ledger replication, storage half (brokerd/ledger/replication.py, docs/ha.md): a primary's
write sets applied on a standby's LMDB give the same ledger, key for key; gaps, older
epochs, foreign ledgers and a deposed primary's tail are refused. Real LMDB files."""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import lmdb
import pytest

from ccsq.brokerd.ledger import maintenance, replication
from ccsq.brokerd.ledger.store import Ledger, Policy
from ccsq.common.wire import protocol

S = protocol.ItemState


def blob(data: bytes = b"x") -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def open_ledger(path: Path) -> Ledger:
    return Ledger(path, map_size_bytes=1 << 20, max_map_size_bytes=64 << 20,
                  policy=Policy(retry_backoff_base_s=0.0, max_attempts=2, retention_s=1.0, dedup_window_s=5.0),
                  rng=random.Random(7))


def turn(led: Ledger, fn) -> object:
    txn = led.begin()
    out = fn(txn)
    txn.commit()
    return out


def lifecycle(led: Ledger, base_ms: int = 1_000, n: int = 12) -> None:
    """Submit, lease, complete, ack, lease expiry, fatal failure (dead letter), dead after
    max attempts, replay, purge of a dead item, deadline expiry, purges, samples, history."""
    t0 = base_ms
    ids = turn(led, lambda t: [t.submit(protocol.SubmitItem(f"k{base_ms}-{i}", "echo", blob(b"%d" % i), priority=i % 3,
                                               deadline_ts=(t0 + 50_000) / 1000 if i == 0 else None), t0)
                         for i in range(n)])
    ids = [r.item_id for r in ids]
    turn(led, lambda t: t.note_kinds_served({"echo"}, t0))
    turn(led, lambda t: t.note_hellos({"w1": (12345, t0 + 5), "w2": (678, t0 + 6)}, t0 + 7))  # HELLO replay memory
    tasks = turn(led, lambda t: [x for x in (t.lease(i, "w1", t0 + 10, 5_000) for i in ids) if x])
    assert len(tasks) == n
    done = tasks[1:5]
    turn(led, lambda t: [t.complete(protocol.TaskResult(x.item_id, x.token, blob(b"r" * 3000), "echo", "1"), t0 + 20, "w1")
                         for x in done])
    turn(led, lambda t: [t.ack(x.item_id, t0 + 30) for x in done[:3]])
    turn(led, lambda t: t.fail(protocol.TaskFailure(tasks[5].item_id, tasks[5].token, "fatal", False, "boom"), t0 + 40, "w1"))
    turn(led, lambda t: [t.expire_lease(x.item_id, x.token, t0 + 6_000) for x in tasks[6:9]])  # back to ready
    again = turn(led, lambda t: [t.lease(x.item_id, "w2", t0 + 6_100, 5_000) for x in tasks[6:9]])
    turn(led, lambda t: [t.expire_lease(x.item_id, x.token, t0 + 12_000) for x in again])  # dead: max attempts
    turn(led, lambda t: t.replay_dead(tasks[6].item_id, t0 + 12_100))
    turn(led, lambda t: t.purge_dead(tasks[7].item_id, t0 + 12_200))
    turn(led, lambda t: t.dead_letter(tasks[9].item_id, tasks[9].token, "payload_missing", "gone", t0 + 12_300))
    turn(led, lambda t: t.set_draining("w1", True))
    turn(led, lambda t: (t.release(tasks[0].item_id, tasks[0].token, t0 + 12_400),
                         maintenance.expire_deadlines(t, t0 + 60_000, 100)))  # item 0 expires (G6)
    turn(led, lambda t: maintenance.purge(t, t0 + 70_000, 100))
    turn(led, lambda t: maintenance.append_sample(t, t0 + 70_000, 1.0))
    turn(led, lambda t: t.note_history(t0 + 70_000, 10))
    turn(led, lambda t: t.set_draining("w1", False))


@pytest.fixture
def primary(tmp_path):
    led = open_ledger(tmp_path / "primary")
    yield led
    led.close()


def seeded(primary: Ledger, dest: Path) -> tuple[replication.ReplicaLedger, tuple[int, int]]:
    out = replication.take_copy(primary, dest)
    return replication.ReplicaLedger(dest, map_size_bytes=1 << 16, max_map_size_bytes=64 << 20), out["position"]


def test_replica_is_identical_after_every_kind_of_transition(primary, tmp_path):
    shipped: list[replication.WriteSet] = []
    primary.replicate(1, sink=shipped.append)
    standby, pos = seeded(primary, tmp_path / "standby")  # seeded empty: the map grows as it applies
    assert pos == (0, 0)
    lifecycle(primary)
    assert [ws.seq for ws in shipped] == list(range(1, len(shipped) + 1)) and {ws.epoch for ws in shipped} == {1}
    kinds = {name for ws in shipped for name, _, v in ws.named_ops() if v is None}
    assert {"ready", "leased", "completed", "acked", "items", "payloads", "keys", "meta", "deadline"} <= kinds
    for ws in shipped:
        assert standby.apply(replication.WriteSet.unpack(ws.pack())) is True  # what a link carries
    assert standby.position == (1, len(shipped))
    assert standby.env.info()["map_size"] > 1 << 16
    assert replication.dump(standby.env) == replication.dump(primary.env)
    with primary.read() as v:
        states = v.states()
        assert v.balanced() and states[S.DEAD.value] >= 2 and states[S.ACKNOWLEDGED.value] == 3
    standby.close()
    # the standby's directory is a ledger: a broker opens it when promoted, same ids, no new prefix
    promoted = open_ledger(tmp_path / "standby")
    assert (promoted.ledger_id, promoted.id_prefix, promoted.restored_from) == (primary.ledger_id, primary.id_prefix, "")
    with promoted.read() as v:
        assert v.states() == states and v.balanced()
        # a promoted standby refuses the HELLOs its primary accepted (and older ones): the memory came along
        assert v.last_hellos() == {"w1": (12345, 1_005), "w2": (678, 1_006)}
    promoted.close()
    primary.backup(tmp_path / "copy")  # and so does a broker started on a `ccsq backup` copy
    restored = open_ledger(tmp_path / "copy")
    with restored.read() as v:
        assert v.last_hellos() == {"w1": (12345, 1_005), "w2": (678, 1_006)}
    restored.close()


def test_apply_is_fsynced_and_one_transaction(primary, tmp_path):
    primary.replicate(1)
    standby, _ = seeded(primary, tmp_path / "standby")
    flags = standby.env.flags()
    assert flags["sync"] and flags["metasync"]
    lifecycle(primary)
    ws = primary.replication.backlog[0]
    absent = (replication.DB_INDEX["items"], b"nope", None)
    broken = replication.WriteSet(ws.ledger_id, ws.epoch, ws.seq, ws.ops[:2] + (absent,) + ws.ops[2:])
    with pytest.raises(replication.Diverged, match="absent"):
        standby.apply(broken)
    assert replication.dump(standby.env)["items"] == {} and standby.position == (0, 0)  # nothing half-applied
    with pytest.raises(replication.ReplicationError, match="own position"):
        standby.apply(replication.WriteSet(ws.ledger_id, ws.epoch, ws.seq, ws.ops[:-1]))


def test_gap_older_epoch_duplicate_and_foreign_ledger_are_refused(primary, tmp_path):
    log = primary.replicate(3)
    standby, _ = seeded(primary, tmp_path / "standby")
    lifecycle(primary)
    turns = list(log.backlog)
    assert standby.apply(turns[0]) and standby.apply(turns[1])
    before = replication.dump(standby.env)
    with pytest.raises(replication.ReplicationGap) as gap:
        standby.apply(turns[3])
    assert (gap.value.expected, gap.value.got) == (3, 4)
    assert standby.apply(turns[1]) is False  # a resend: already applied, nothing written
    old = replication.WriteSet(turns[2].ledger_id, 2, turns[2].seq, turns[2].ops)
    with pytest.raises(replication.StaleEpoch):
        standby.apply(old)
    with pytest.raises(replication.Diverged, match="ledger"):
        standby.apply(replication.WriteSet("deadbeef", 3, 3, turns[2].ops))
    assert replication.dump(standby.env) == before and standby.position == (3, 2)
    with pytest.raises(replication.ReplicationError, match="malformed"):
        replication.WriteSet.unpack(b"\x93\x01\x02")
    with pytest.raises(replication.StaleEpoch):
        primary.replicate(2)  # a primary never numbers turns under an older epoch than its ledger's


def test_standby_needs_a_seed_and_refuses_a_restore_copy(primary, tmp_path):
    with pytest.raises(replication.NotSeeded, match="empty"):
        replication.ReplicaLedger(tmp_path / "empty")
    primary.backup(tmp_path / "restore-copy")  # `ccsq backup`: marked for a new id prefix
    with pytest.raises(replication.Diverged, match="take_copy"):
        replication.ReplicaLedger(tmp_path / "restore-copy")


def test_lagging_standby_catches_up_from_a_copy_taken_while_the_primary_writes(primary, tmp_path):
    log = primary.replicate(1)
    lifecycle(primary, base_ms=1_000)
    first = log.position[1]
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        k = 0
        try:
            while not stop.is_set() or k < 5:
                turn(primary, lambda t, k=k: t.submit(protocol.SubmitItem(f"bg{k}", "echo", blob(b"%d" % k)), 200_000 + k))
                k += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=writer)
    th.start()
    try:
        standby, pos = seeded(primary, tmp_path / "standby")
    finally:
        stop.set()
        th.join(30)
    assert not errors
    assert first <= pos[1] <= log.position[1]  # one snapshot somewhere in the writer's run
    lifecycle(primary, base_ms=300_000)
    for ws in log.since(pos):
        assert standby.apply(ws)
    assert standby.position == log.position
    assert replication.dump(standby.env) == replication.dump(primary.env)
    assert log.since(log.position) == []
    with pytest.raises(replication.Diverged):
        log.since((1, log.position[1] + 1))


def test_backlog_truncated_means_a_new_copy(primary):
    log = primary.replicate(1, backlog_turns=4)
    lifecycle(primary)
    assert len(log.backlog) == 4
    with pytest.raises(replication.BacklogTruncated, match="new copy"):
        log.since((1, 1))
    assert [ws.seq for ws in log.since((1, log.position[1] - 2))] == [log.position[1] - 1, log.position[1]]


def test_failover_new_epoch_continues_and_deposed_tail_is_refused(primary, tmp_path):
    log = primary.replicate(1)
    standby, _ = seeded(primary, tmp_path / "standby")
    lifecycle(primary)
    acked = list(log.backlog)
    for ws in acked[:-2]:  # the last two turns never reached the standby: the deposed tail
        standby.apply(ws)
    standby.close()
    new = open_ledger(tmp_path / "standby")  # promoted with a higher epoch
    new_log = new.replicate(2)
    assert new_log.next_seq() == acked[-2].seq
    assert new.bump_epoch() >= 1  # with replication on, a turn like any other
    lifecycle(new, base_ms=500_000)
    first = new_log.backlog[0]
    assert (first.epoch, first.seq) == (2, acked[-2].seq)
    # the deposed primary, as a standby of the new one, holds turns the new one never had:
    # the new primary tells so from its position alone, whichever of its seqs it names
    for ws in acked[-2:]:
        with pytest.raises(replication.Diverged, match="deposed"):
            new_log.since((ws.epoch, ws.seq))
    assert new_log.since((1, acked[-3].seq))[0] is first  # the last turn both hold: stream on
    primary.close()
    deposed = replication.ReplicaLedger(tmp_path / "primary")
    with pytest.raises(replication.Diverged, match="never confirmed"):
        deposed.apply(first)
    deposed.close()
    # it rejoins from the new primary's copy, its tail discarded
    rejoin, pos = seeded(new, tmp_path / "rejoined")
    for ws in new_log.since(pos):
        rejoin.apply(ws)
    assert replication.dump(rejoin.env) == replication.dump(new.env)
    rejoin.close()
    new.close()
    primary.__init__(tmp_path / "primary")  # the fixture closes it


def test_replication_off_records_nothing(primary, tmp_path):
    txn = primary.begin()
    assert type(txn.txn) is lmdb.Transaction  # no wrapper: zero cost for a single broker
    txn.abort()
    lifecycle(primary)
    primary.bump_epoch()
    assert primary.replication is None
    with primary.read() as v:
        assert v.txn.get(replication.REPL_POS, db=primary.db["meta"]) is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_turns_stay_identical_turn_by_turn(primary, tmp_path, seed):
    """Seeded random turns of mixed transitions (several per turn, some aborted, some
    read-only); after every turn the standby equals the primary."""
    rng = random.Random(seed)
    log = primary.replicate(seed)
    standby, _ = seeded(primary, tmp_path / "standby")
    now, n = 10_000, 0
    for _ in range(60):
        now += rng.randint(1, 4000)
        txn = primary.begin()
        for _ in range(rng.randint(0, 6)):
            op = rng.random()
            if op < 0.3:
                n += 1
                txn.submit(protocol.SubmitItem(f"r{seed}-{n % 40}", rng.choice(["a", "b"]), blob(rng.randbytes(rng.randint(1, 3000))),
                                        priority=rng.randint(0, 3)), now)
            elif op < 0.5:
                for i in txn.scan_ready(None, rng.randint(1, 4), now)[0]:
                    txn.lease(i, rng.choice(["w1", "w2"]), now, rng.randint(100, 3000))
            else:
                leased = [(k.decode(), sc_unpack(v)) for k, v in txn.txn.cursor(db=primary.db["leased"])]
                if not leased:
                    continue
                iid, (token, worker) = rng.choice(leased)
                if op < 0.65:
                    txn.complete(protocol.TaskResult(iid, token, blob(b"r"), "h", "1"), now, worker)
                elif op < 0.75:
                    txn.fail(protocol.TaskFailure(iid, token, rng.choice(["handler_error", "fatal", "released"]), True, "x"),
                             now, worker)
                elif op < 0.85:
                    txn.expire_lease(iid, token, now)
                else:
                    done = [k for k, _ in txn.txn.cursor(db=primary.db["completed"])]
                    for k in done[:2]:
                        txn.ack(txn.txn.get(k, db=primary.db["completed"]).decode(), now)
        if rng.random() < 0.3:
            maintenance.purge(txn, now, 20)
        if rng.random() < 0.1:
            txn.abort()  # an aborted turn is no turn
        else:
            txn.commit()
        while standby.position[1] < log.position[1]:
            standby.apply(replication.WriteSet.unpack(log.backlog[standby.position[1] - log.backlog[0].seq + 1].pack()))
        assert replication.dump(standby.env) == replication.dump(primary.env)
    assert log.position[1] > 20
    standby.close()


def sc_unpack(raw: bytes):
    from ccsq.brokerd.ledger import schema

    return schema.unpack(raw)


def test_adopted_epoch_is_a_turn_and_never_goes_back(primary, tmp_path):
    log = primary.replicate(9)
    standby, _ = seeded(primary, tmp_path / "standby")
    assert primary.adopt_epoch(9) == 9
    with pytest.raises(replication.StaleEpoch):
        primary.adopt_epoch(8)
    for ws in log.since((0, 0)):
        standby.apply(ws)
    with primary.read() as v:
        assert v.epoch() == 9
    assert replication.dump(standby.env)["meta"][b"m:epoch"] == replication.dump(primary.env)["meta"][b"m:epoch"]
    standby.close()


def test_a_failing_sink_does_not_undo_a_committed_turn(primary):
    def sink(ws):
        raise RuntimeError("link down")

    log = primary.replicate(1, sink=sink)
    turn(primary, lambda t: t.submit(protocol.SubmitItem("k", "echo", blob()), 1_000))  # no exception
    assert log.position == (1, 1) and len(log.backlog) == 1
    with primary.read() as v:
        assert v.counter("received") == 1


def test_apply_many_is_one_transaction_and_all_or_nothing(primary, tmp_path):
    log = primary.replicate(3)
    standby, _ = seeded(primary, tmp_path / "standby")
    lifecycle(primary)
    turns = list(log.backlog)
    before = standby.env.info()["last_txnid"]
    bad = replication.WriteSet(turns[-1].ledger_id, 3, turns[-1].seq + 2, turns[-1].ops)  # a gap at the end
    with pytest.raises(replication.ReplicationGap):
        standby.apply_many(turns + [bad])
    assert standby.env.info()["last_txnid"] == before and standby.position[1] < turns[0].seq  # nothing written
    assert standby.apply_many(turns[:3] + turns) == len(turns)  # resends inside the batch are skipped
    assert standby.env.info()["last_txnid"] == before + 1  # one transaction, one fsync
    assert standby.position == log.position and replication.dump(standby.env) == replication.dump(primary.env)
    assert standby.apply_many(turns) == 0
    standby.close()


def test_a_result_completed_under_an_earlier_primarys_lease_is_marked_for_a_counted_redelivery(primary):
    """A replicated primary releases RESULT at its commit, before a standby has the COMPLETE
    (docs/ha.md): after a failover the same result may be delivered again. So a completion
    under a lease an earlier epoch granted (the worker resending its unconfirmed COMPLETE), or
    of an item an earlier epoch had leased (that lease expired and the item was leased anew),
    records ``completed_epoch`` = that older epoch, and the delivery tracker counts its next
    delivery as a redelivery (G3). A lease and its COMPLETE in one epoch: the current epoch."""
    from ccsq.brokerd.delivery import DeliveryTracker

    primary.replicate(1)
    primary.adopt_epoch(1)
    now = 1_000
    ids = [turn(primary, lambda t, n=n: t.submit(protocol.SubmitItem(f"k{n}", "echo", blob()), now)).item_id for n in range(3)]
    first = [turn(primary, lambda t, i=i: t.lease(i, "w1", now, 60_000)) for i in ids]
    primary.adopt_epoch(2)  # a failover: this ledger is the new primary's
    turn(primary, lambda t: t.complete(protocol.TaskResult(ids[0], first[0].token, blob(b"r"), "h", "1"), now, "w1"))
    turn(primary, lambda t: t.expire_lease(ids[1], first[1].token, now + 70_000))
    again = turn(primary, lambda t: t.lease(ids[1], "w2", now + 70_000, 60_000))
    turn(primary, lambda t: t.complete(protocol.TaskResult(ids[1], again.token, blob(b"r"), "h", "1"), now, "w2"))
    turn(primary, lambda t: t.expire_lease(ids[2], first[2].token, now + 70_000))
    fresh = turn(primary, lambda t: t.submit(protocol.SubmitItem("k-new", "echo", blob()), now)).item_id
    lease = turn(primary, lambda t: t.lease(fresh, "w2", now, 60_000))
    turn(primary, lambda t: t.complete(protocol.TaskResult(fresh, lease.token, blob(b"r"), "h", "1"), now, "w2"))
    with primary.read() as v:
        recs = {i: v.get(i) for i in (ids[0], ids[1], fresh)}
    assert [recs[i]["completed_epoch"] for i in (ids[0], ids[1], fresh)] == [1, 1, 2]
    tracker = DeliveryTracker(2, None, 100, lambda: 1 << 20)  # type: ignore[arg-type]
    assert [tracker.redelivery(i, recs[i], "")[0] for i in (ids[0], ids[1], fresh)] == [True, True, False]


@pytest.mark.parametrize("seed", [4, 5])
def test_random_turns_applied_in_batches_stay_identical(primary, tmp_path, seed):
    """The standby writes a batch's net effect (each key once, as its last op in the batch left
    it): random turns applied in random batches of 1-12 turns (each unpacked from what the link
    carries) leave the standby equal to the primary after every batch."""
    rng = random.Random(seed)
    log = primary.replicate(seed)
    standby, _ = seeded(primary, tmp_path / "standby")
    now, n, ids = 10_000, 0, []
    for _ in range(12):
        for _ in range(rng.randint(1, 12)):
            now += rng.randint(1, 3000)
            txn = primary.begin()
            for _ in range(rng.randint(1, 5)):  # the same items move through several turns of one batch
                n += 1
                ids.append(txn.submit(protocol.SubmitItem(f"b{seed}-{n % 30}", "a", blob(rng.randbytes(rng.randint(1, 900)))),
                                      now).item_id)
            for i in txn.scan_ready(None, rng.randint(0, 4), now)[0]:
                txn.lease(i, "w1", now, rng.randint(100, 2000))
            leased = [(k.decode(), sc_unpack(v)) for k, v in txn.txn.cursor(db=primary.db["leased"])]
            for iid, (token, worker) in rng.sample(leased, min(len(leased), rng.randint(0, 3))):
                if rng.random() < 0.7:
                    txn.complete(protocol.TaskResult(iid, token, blob(b"r"), "h", "1"), now, worker)
                else:
                    txn.expire_lease(iid, token, now)
            for k in [k for k, _ in txn.txn.cursor(db=primary.db["completed"])][:rng.randint(0, 3)]:
                txn.ack(txn.txn.get(k, db=primary.db["completed"]).decode(), now)
            if rng.random() < 0.3:
                maintenance.purge(txn, now, 20)
            txn.commit()
        batch = [replication.WriteSet.unpack(ws.pack()) for ws in log.since(standby.position)]
        assert standby.apply_many(batch) == len(batch)
        assert standby.position == log.position
        assert replication.dump(standby.env) == replication.dump(primary.env)
    standby.close()


def _turn_of(standby: replication.ReplicaLedger, seq: int, ops: list) -> replication.WriteSet:
    idx = replication.DB_INDEX
    pos = (idx["meta"], replication.REPL_POS, replication.pack_pos(1, seq))
    return replication.WriteSet(standby.ledger_id, 1, seq, tuple((idx[d], k, v) for d, k, v in ops) + (pos,))


def test_a_batch_is_applied_as_its_turns_in_order(primary, tmp_path):
    """Each key ends as its last op in the batch left it; a delete needs the key present at its
    place in the order (present before the batch, or put earlier in it): a delete of a key absent
    before the batch, or deleted before in it with no put between, is Diverged, nothing written."""
    primary.replicate(1)
    turn(primary, lambda t: t.txn.put(b"m:old", b"1", db=primary.db["meta"]))
    turn(primary, lambda t: t.txn.put(b"m:gone", b"1", db=primary.db["meta"]))
    standby, _ = seeded(primary, tmp_path / "standby")
    assert standby.position == (1, 2)
    txnid = standby.env.info()["last_txnid"]
    for bad in ([("meta", b"m:gone", None)], [("meta", b"m:new", b"x"), ("meta", b"m:new", None), ("meta", b"m:new", None)],
                [("meta", b"m:never", None), ("meta", b"m:never", b"v")]):
        batch = [_turn_of(standby, 3, [("meta", b"m:a", b"1"), ("meta", b"m:old", None)]), _turn_of(standby, 4, bad)]
        if bad[0][1] == b"m:gone":
            batch[0] = _turn_of(standby, 3, [("meta", b"m:gone", None)])  # deleted by the batch's first turn
        with pytest.raises(replication.Diverged, match="absent"):
            standby.apply_many(batch)
        assert standby.env.info()["last_txnid"] == txnid and standby.position == (1, 2)  # nothing written
    batch = [_turn_of(standby, 3, [("meta", b"m:old", None), ("meta", b"m:tmp", b"1"), ("ready", b"r1", b"i1")]),
             _turn_of(standby, 4, [("meta", b"m:old", b"2"), ("meta", b"m:tmp", None), ("ready", b"r1", None),
                                   ("ready", b"r1", b"i2"), ("meta", b"m:gone", None)]),
             _turn_of(standby, 5, [("meta", b"m:tmp", b"3"), ("meta", b"m:tmp", None), ("items", b"i", b"a"),
                                   ("items", b"i", b"b")])]
    assert standby.apply_many(batch) == 3
    got = replication.dump(standby.env)
    assert got["meta"][b"m:old"] == b"2" and b"m:tmp" not in got["meta"] and b"m:gone" not in got["meta"]
    assert got["ready"] == {b"r1": b"i2"} and got["items"] == {b"i": b"b"}
    assert replication.unpack_pos(got["meta"][replication.REPL_POS]) == (1, 5) == standby.position
    standby.close()


@pytest.mark.parametrize("op", [(99, b"k", b"v"), (-1, b"k", b"v"), (0, "k", b"v"), (0, b"k", "v"), (0, b"k"), (0, b"", b"v")])
def test_a_malformed_op_is_refused_and_writes_nothing(primary, tmp_path, op):
    primary.replicate(1)
    standby, _ = seeded(primary, tmp_path / "standby")
    good = _turn_of(standby, 1, [("items", b"i", b"a")])
    bad = replication.WriteSet(good.ledger_id, 1, 2, (op,) + _turn_of(standby, 2, []).ops)
    raw = replication.WriteSet.unpack(bad.pack())  # what a link would carry
    with pytest.raises(replication.ReplicationError, match="malformed"):
        standby.apply_many([good, raw])
    assert standby.position == (0, 0) and replication.dump(standby.env)["items"] == {}
    standby.close()


def test_only_effective_writes_are_recorded(primary, tmp_path):
    """A put that wrote nothing (overwrite=False on a present key, an append out of order) and a
    delete of an absent key are not in the write set; a memoryview key or value is copied."""
    log = primary.replicate(1)
    standby, _ = seeded(primary, tmp_path / "standby")
    meta, items = primary.db["meta"], primary.db["items"]

    def writes(t):
        assert t.txn.put(b"m:a", b"1", db=meta) is True
        assert t.txn.put(b"m:a", b"2", db=meta, overwrite=False) is False
        assert t.txn.put(b"z", b"1", db=items, append=True) is True
        assert t.txn.put(b"a", b"1", db=items, append=True) is False  # out of order
        assert t.txn.delete(b"m:absent", db=meta) is False
        buf = bytearray(b"m:b")
        assert t.txn.put(memoryview(buf), memoryview(bytearray(b"v")), db=meta) is True
        buf[:] = b"XXX"  # the recorded key is a copy
        assert t.txn.delete(b"z", db=items) is True

    turn(primary, writes)
    ws = log.backlog[-1]
    assert ws.named_ops()[:-1] == [("meta", b"m:a", b"1"), ("items", b"z", b"1"), ("meta", b"m:b", b"v"), ("items", b"z", None)]
    assert all(type(k) is bytes and (v is None or type(v) is bytes) for _, k, v in ws.ops)
    assert standby.apply(replication.WriteSet.unpack(ws.pack())) is True
    assert replication.dump(standby.env) == replication.dump(primary.env)
    standby.close()
