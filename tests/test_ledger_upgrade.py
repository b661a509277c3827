"""Item records of older brokers under this one (issue 15, record format 3): a ledger whose
records were written by a format-2 broker (and one by a format-1 broker) is read, served to
a real worker and completion service, and balanced by a real ``ccsq-brokerd``; every record
it changes is rewritten in format 3."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack

from ccsq.brokerd.ledger import schema
from ccsq.brokerd.ledger.store import Ledger
from ccsq.common.wire import protocol
from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm

# Format 2 as the brokers before record format 3 wrote it (their ``schema.pack_item``): the
# array of these 15 fields, then a map of the other fields; no ``id``.
FORMAT2_CORE = ("key", "kind", "params", "priority", "deadline_ms", "max_attempts", "max_runtime_s", "state",
                "attempt", "token", "worker", "nb_ms", "seq", "created_ms", "error")


def pack_format2(rec: dict) -> bytes:
    extra = {k: v for k, v in rec.items() if k not in FORMAT2_CORE and k != "id"}
    return msgpack.packb((*(rec[f] for f in FORMAT2_CORE), extra), use_bin_type=True)


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def _old_ledger(ledger_dir: Path) -> dict[str, tuple[str, int]]:
    """Four items as an older broker left them: a ready, b leased to worker-1, c and d
    completed (d as format 1). Returns {name: (item_id, token)}."""
    led = Ledger(ledger_dir)
    try:
        txn = led.begin()
        ids = {n: txn.submit(protocol.SubmitItem(f"key-{n}", "echo", blob(n.encode()), params={"n": n}), 1_000).item_id
               for n in "abcd"}
        tokens = {}
        for n in "bcd":
            tokens[n] = txn.lease(ids[n], "worker-1", 2_000, 60_000).token
        for n in "cd":
            assert txn.complete(protocol.TaskResult(ids[n], tokens[n], blob(b"r-" + n.encode()), "echo", "1"), 3_000,
                                "worker-1") == protocol.Outcome.ACCEPTED.value
        txn.commit()
        with led.env.begin(write=True) as raw:
            for n, iid in ids.items():
                rec = schema.unpack_item(raw.get(iid.encode(), db=led.db["items"]), iid)
                old = msgpack.packb(dict(rec), use_bin_type=True) if n == "d" else pack_format2(rec)
                raw.put(iid.encode(), old, db=led.db["items"])
        with led.read() as v:
            for n, iid in ids.items():
                assert v.txn.get(iid.encode(), db=led.db["items"])[0] != schema.FORMAT3
                assert v.get(iid)["params"] == {"n": n}
    finally:
        led.close()
    return {n: (iid, tokens.get(n, 0)) for n, iid in ids.items()}


def test_a_ledger_of_format_2_records_is_served_and_balanced_then_rewritten_in_format_3(tmp_path):
    cfg = make_swarm(tmp_path, {"worker-1": "worker", "completion-1": "completion"})
    items = _old_ledger(tmp_path / "broker-data" / "ledger")
    (a, _), (b, tb), (c, _), (d, _) = (items[n] for n in "abcd")
    broker = BrokerProcess(cfg).start()
    worker = comp = None
    try:
        worker = ScriptedPeer(tmp_path, "worker-1", broker.endpoint)
        worker.hello("worker", slots=4, credit=4, kinds=["echo"], leases=[protocol.LeaseRef(b, tb)])
        dispatch = worker.recv_type(protocol.Dispatch, 10.0)
        (task,) = dispatch.tasks
        assert task.item_id == a and task.payload == blob(b"a") and task.params == {"n": "a"}
        worker.send(protocol.Complete([protocol.TaskResult(a, task.token, blob(b"r-a"), "echo", "1"),
                                protocol.TaskResult(b, tb, blob(b"r-b"), "echo", "1")]))
        outcomes = {o.item_id: o.outcome for o in worker.recv_type(protocol.CompleteAck, 10.0).outcomes}
        assert outcomes == {a: protocol.Outcome.ACCEPTED.value, b: protocol.Outcome.ACCEPTED.value}
        comp = ScriptedPeer(tmp_path, "completion-1", broker.endpoint)
        comp.hello("completion", credit=10)
        got: dict[str, protocol.Delivery] = {}
        while len(got) < 4:
            for dl in comp.recv_type(protocol.Result, 10.0).deliveries:
                got[dl.item_id] = dl
        assert {i: dl.result.inline for i, dl in got.items()} == {a: b"r-a", b: b"r-b", c: b"r-c", d: b"r-d"}
        assert got[c].key == "key-c" and got[d].params == {"n": "d"} and got[c].redelivery  # (completed before a restart)
        comp.send(protocol.Ack(list(got)))
        assert sorted(comp.recv_type(protocol.AckOk, 10.0).item_ids) == sorted(got)
    finally:
        for peer in (worker, comp):
            if peer is not None:
                peer.close()
        assert broker.stop() == 0
    led = Ledger(tmp_path / "broker-data" / "ledger", readonly=True)
    try:
        with led.read() as v:
            assert v.balanced() and v.counter("received") == 4 and v.states()["acknowledged"] == 4
            for n, (iid, _) in items.items():
                assert v.txn.get(iid.encode(), db=led.db["items"])[0] == schema.FORMAT3  # rewritten on change
                rec = v.get(iid)
                assert rec["state"] == "acknowledged" and rec["key"] == f"key-{n}" and rec["params"] == {"n": n}
                assert rec["worker_done"] == "worker-1" and rec["attempt"] == 1
    finally:
        led.close()
