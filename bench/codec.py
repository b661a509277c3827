"""CPU cost of the message body codec (``common/wire/codec.py``, through ``protocol``): encode and decode
microseconds per item for the messages on the hot path, with and without msgpack.

    python -m bench.codec [--repeat 7] [--json out.json]

Rows: SUBMIT (100 items, 1 KiB inline payload like bench.broker_cpu's), DISPATCH (100
tasks), COMPLETE (100 results), RESULT (100 deliveries), ACK (100 ids), HEARTBEAT (one
message, 8 leases; per message). ``enc`` is ``encode_body``; ``dec`` is ``decode_body``;
``enc+pack`` / ``unpack+dec`` add msgpack's own cost (what a process pays per frame).
Each figure is the fastest of ``--repeat`` timed loops (per-item µs, process CPU time; the
fastest, because neighbours on a shared machine only ever add time).
Self-contained (imports only ``ccsq``), so it runs against any tree's install:
``cd /work/wt/base && .venv/bin/python /work/wt/codec/bench/codec.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import msgpack

from ccsq.common.wire import protocol


def _ref(i: int, size_bytes: int = 1024) -> bytes:
    head = f"s3://bench-bucket/payloads/{i:012d}.png#".encode()
    return head + b"x" * max(0, size_bytes - len(head))


def _blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def messages(n: int = 100) -> dict[str, tuple[protocol.Message, int]]:
    """name -> (message, items it carries)."""
    ok = _blob(b"ok")
    items = [protocol.SubmitItem(key=f"bench-{i}", kind="echo", payload=_blob(_ref(i)), params={"t": 0.0}) for i in range(n)]
    tasks = [protocol.Task(item_id=f"{i:032x}", token=i + 1, kind="echo", payload=it.payload, params=it.params, attempt=1,
                    max_runtime_s=30.0) for i, it in enumerate(items)]
    results = [protocol.TaskResult(item_id=t.item_id, token=t.token, result=ok, handler="echo", handler_version="1",
                            runtime_s=0.001) for t in tasks]
    deliveries = [protocol.Delivery(item_id=t.item_id, key=f"bench-{i}", kind="echo", result=ok, params={"t": 0.0},
                             attempt=1, handler="echo", handler_version="1", completed_ts=1.7e9 + i)
                  for i, t in enumerate(tasks)]
    leases = [protocol.LeaseRef(f"{i:032x}", i + 1) for i in range(8)]
    return {
        "SUBMIT": (protocol.Submit(req=1, items=items), n),
        "DISPATCH": (protocol.Dispatch(tasks=tasks), n),
        "COMPLETE": (protocol.Complete(results=results), n),
        "RESULT": (protocol.Result(deliveries=deliveries), n),
        "ACK": (protocol.Ack(item_ids=[t.item_id for t in tasks]), n),
        "HEARTBEAT": (protocol.Heartbeat(leases=leases, busy=2, done=100, info={"gpu_mem_free_bytes": 1 << 30}), 1),
    }


def _per_item_us(fn, items: int, repeat: int, budget_s: float = 0.05) -> float:
    loops = 1
    while True:  # size the loop to ~budget_s
        t0 = time.process_time()
        for _ in range(loops):
            fn()
        if time.process_time() - t0 >= budget_s / 4 or loops >= 1 << 16:
            break
        loops *= 2
    runs = []
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(loops):
            fn()
        runs.append((time.process_time() - t0) / loops / items * 1e6)
    return min(runs)  # the least disturbed loop: the machine is shared


def run(repeat: int = 7) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (msg, items) in messages().items():
        body = protocol.encode_body(msg)
        raw = msgpack.packb(body, use_bin_type=True)
        mtype = int(msg.TYPE)
        assert protocol.decode_body(mtype, body) == msg
        out[name] = {
            "enc": _per_item_us(lambda: protocol.encode_body(msg), items, repeat),
            "dec": _per_item_us(lambda: protocol.decode_body(mtype, body), items, repeat),
            "enc+pack": _per_item_us(lambda: msgpack.packb(protocol.encode_body(msg), use_bin_type=True), items, repeat),
            "unpack+dec": _per_item_us(lambda: protocol.decode_body(mtype, msgpack.unpackb(raw, raw=False)), items, repeat),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    res = run(args.repeat)
    cols = ["enc", "dec", "enc+pack", "unpack+dec"]
    print(f"{'msg':<10}" + "".join(f"{c:>12}" for c in cols) + "   (us per item)")
    for name, row in res.items():
        print(f"{name:<10}" + "".join(f"{row[c]:>12.2f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
