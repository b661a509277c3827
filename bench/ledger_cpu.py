"""The ledger's CPU per job with a queue of ``queued`` items waiting (is the cost
flat with the queue?). No broker process, no sockets: one :class:`~ccsq.brokerd.ledger.store.Ledger`
(fsynced commits, the record cache on as the broker sets it), first filled with ``queued``
ready items (benchmark 1's 1 KiB claim reference, a random key as the producer library
derives), then ``n`` jobs cycled
through it the way the broker's turns move them, ``frame`` per transaction: each transaction
submits ``frame`` new items, leases ``frame`` from the head of the queue (``scan_ready`` +
``lease``, as the dispatcher does), completes the ones leased the transaction before,
delivers (``completed_ids`` + ``delivery``) and acknowledges the ones delivered the
transaction before. The queue stays ``queued`` deep all along, so the leases read items
submitted long before (out of the record cache when the queue is deeper than it).

With ``--replicate`` the cycled part runs as a primary's (docs/ha.md): the ledger records every
turn's write set (``Ledger.replicate``) and a sink does per turn what the replication server
does for one standby short of the socket (its lag count, ``Shipper.messages``, the REPL_TURNS
body packed as the envelope packs it): ``--replicate off,on`` measures both in one process.
``--standby`` adds the standby's side to each turn: a :class:`ReplicaLedger` seeded from the
ledger after the fill unpacks and applies it (one fsynced transaction per turn, as a standby
that drained one turn per batch); its CPU (thread time) is reported apart (``standby_cpu_us_per_job``)
and not counted in ``cpu_us_per_job``.

Prints process CPU (user + system: the fsyncs' writes count) per job of the cycled part.

    python -m bench.ledger_cpu [--queued 10000,100000] [--n 20000] [--replicate off,on [--standby]] [--profile FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import msgpack

from bench.common import claim_ref
from ccsq.brokerd import replica as replica_link
from ccsq.brokerd.ledger import replication
from ccsq.brokerd.ledger.store import Ledger
from ccsq.common.wire import protocol

#: what brokerd/actor.py sets (RECORD_CACHE_ITEMS)
CACHE_ITEMS = 8192
FILL_PER_TXN = 5000


def _item(i: int) -> protocol.SubmitItem:
    ref = claim_ref(i)
    digest = hashlib.sha256(ref).hexdigest()
    # the key the producer library derives (producer/items.py derive_key: a SHA-256 hex, so
    # keys arrive in random order, not bench-<i>'s)
    key = hashlib.sha256(digest.encode() + b"\0echo\0" + str(i).encode()).hexdigest()
    return protocol.SubmitItem(key=key, kind="echo", payload=protocol.Blob(digest, len(ref), ref), params={"t": 0.0})


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _sys() -> float:
    return os.times().system


def _written() -> int:
    """Bytes this process passed to write calls (``wchar`` in /proc/self/io: the pages LMDB writes)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(queued: int, n: int, frame: int, root: Path, *, cache_items: int = CACHE_ITEMS,
            profile: Path | None = None, replicate: bool = False, standby: bool = False) -> dict:
    ledger = Ledger(root / "ledger", map_size_bytes=4 << 30)
    ledger.cache_records(cache_items)
    result = protocol.Blob(hashlib.sha256(b"ok").hexdigest(), 2, b"ok")
    now_ms = int(time.time() * 1000)
    nxt = 0
    try:
        t0 = time.monotonic()
        while nxt < queued:
            txn = ledger.begin()
            for i in range(nxt, min(queued, nxt + FILL_PER_TXN)):
                txn.submit(_item(i), now_ms)
            txn.commit()
            nxt = min(queued, nxt + FILL_PER_TXN)
        fill_s = time.monotonic() - t0
        standby_cpu = [0.0]
        if replicate:
            _ship_each_turn(ledger, root / "standby" if standby else None, standby_cpu)
        leased: list[protocol.Task] = []
        delivered: list[str] = []
        sent: set[str] = set()
        floor = 0
        acked = 0
        prof = None
        if profile is not None:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        cpu0, sys0, wr0, w0 = _cpu(), _sys(), _written(), time.monotonic()
        while acked < n:
            now_ms += 2
            txn = ledger.begin()
            for i in range(nxt, nxt + frame):
                txn.submit(_item(i), now_ms)
            nxt += frame
            for task in leased:
                txn.complete(protocol.TaskResult(task.item_id, task.token, result, "echo", "1"), now_ms, "w1")
            for item_id in delivered:
                txn.ack(item_id, now_ms)
                sent.discard(item_id)
            acked += len(delivered)
            ids, _hint = txn.scan_ready(["echo"], frame, now_ms)
            leased = [t for t in (txn.lease(i, "w1", now_ms, 60_000) for i in ids) if t is not None]
            got, floor = txn.completed_ids(sent.__contains__, frame, floor)
            delivered = []
            for item_id in got:
                txn.delivery(item_id, False, txn.record(item_id))
                delivered.append(item_id)
            txn.commit()
            sent.update(delivered)
        cpu, sys_s, wrote, wall = _cpu() - cpu0 - standby_cpu[0], _sys() - sys0, _written() - wr0, time.monotonic() - w0
        if prof is not None:
            prof.disable()
            prof.dump_stats(str(profile))
        return {"queued": queued, "n": acked, "frame": frame, "cache_items": cache_items, "replicate": replicate,
                "cpu_us_per_job": round(cpu / acked * 1e6, 1), "sys_us_per_job": round(sys_s / acked * 1e6, 1),
                "written_bytes_per_job": round(wrote / acked),
                "standby_cpu_us_per_job": round(standby_cpu[0] / acked * 1e6, 1) if standby else None,
                "wall_us_per_job": round(wall / acked * 1e6, 1),
                "fill_s": round(fill_s, 1)}
    finally:
        ledger.close()


def _ship_each_turn(ledger: Ledger, standby_dir: Path | None, standby_cpu: list[float]) -> None:
    """Replication on, with a sink doing what ReplicationServer.sink does for one streaming
    standby but the send: the lag's byte count, the Shipper's REPL_TURNS, each body packed;
    with ``standby_dir``, a standby there applies each turn (its thread CPU added to ``standby_cpu[0]``)."""
    log = ledger.replicate(1)
    replica = None
    if standby_dir is not None:
        replication.take_copy(ledger, standby_dir)
        replica = replication.ReplicaLedger(standby_dir, map_size_bytes=4 << 30)
    hello = protocol.Hello(role=protocol.Role.STANDBY.value, info={
        replica_link.INFO_LEDGER_ID: ledger.ledger_id, replica_link.INFO_EPOCH: log.position[0],
        replica_link.INFO_SEQ: log.position[1]})
    shipper = replica_link.Shipper(log, ledger.ledger_id, hello)
    total = [0]

    def sink(ws) -> None:
        total[0] += ws.nbytes()
        for msg in shipper.messages([ws]):
            body = msgpack.packb([int(msg.TYPE), protocol.encode_body(msg)], use_bin_type=True)
            if replica is not None:
                t0 = time.thread_time()
                got = protocol.decode_body(msg.TYPE, msgpack.unpackb(body, raw=False)[1])
                replica.apply_many([replication.WriteSet.unpack(raw) for raw in got.turns])
                standby_cpu[0] += time.thread_time() - t0

    log.sink = sink


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queued", default="10000,100000", help="comma-separated queue depths")
    ap.add_argument("--n", type=int, default=20000, help="jobs cycled at each depth")
    ap.add_argument("--frame", type=int, default=100, help="jobs per transition per transaction")
    ap.add_argument("--cache-items", type=int, default=CACHE_ITEMS)
    ap.add_argument("--profile", type=Path, default=None, help="cProfile the cycled part into FILE.<queued>")
    ap.add_argument("--replicate", default="off", help="off, on, or off,on: replication (a primary's recording and shipping)")
    ap.add_argument("--standby", action="store_true", help="with replication on: a standby applies each turn too")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    modes = [m.strip() == "on" for m in args.replicate.split(",")]
    for q in (int(x) for x in args.queued.split(",")):
        for rep in modes:
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                tag = f"{q}{'.repl' if rep else ''}"
                prof = args.profile.with_name(f"{args.profile.name}.{tag}") if args.profile else None
                print(json.dumps(measure(q, args.n, args.frame, Path(d), cache_items=args.cache_items, profile=prof,
                                         replicate=rep, standby=args.standby and rep)), flush=True)


if __name__ == "__main__":
    main()
