"""The chaos run's producer: a subprocess that submits items 0..count-1 through the outbox.

``python -m tests.chaos.producer --config DIR/producer.toml --progress FILE --count N --rate R --seed S``

Item ``i`` has the idempotency key ``chaos-<seed>-<i>`` and the payload
:func:`payload_for` (unique per item, some over the producer's inline limit so
they go through the claim store, a few over the worker's inline result limit).
After each confirmed (or durably spooled) batch it appends ``"<i> <item_id or ->"``
lines to ``--progress``, so the harness knows what was *accepted*, and a
restarted producer resumes after the last logged index (the keys make any
overlap a broker-side dedup hit). When all are accepted it flushes the outbox
and exits 0. Any unexpected exception exits 1 (the harness counts it as a crash).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import structlog

from ccsq.common.runtime import log as logsetup
from ccsq.common.wire.errors import RetryableError
from ccsq.producer.client import Client

BATCH_ITEMS = 10
RETRY_PAUSE_S = 0.2

log = structlog.get_logger("ccsq.chaos.producer")


def key_for(seed: int, i: int) -> str:
    return f"chaos-{seed}-{i:08d}"


def payload_for(seed: int, i: int) -> bytes:
    """Deterministic, unique payload of item ``i``: mostly 40 B..2 KiB, 1 in 40 is 20 KiB."""
    h = hashlib.sha256(f"{seed}:{i}".encode()).digest()
    size = 20_000 if h[0] < 7 else 40 + int.from_bytes(h[1:3], "big") % 2000
    head = f"chaos seed={seed} item={i}|".encode()
    body = (h * (size // len(h) + 1))[: max(0, size - len(head))]
    return head + body


def params_for(seed: int, i: int, kind: str, sleep_max_s: float) -> dict:
    if kind != "sleep":
        return {"i": i}
    h = hashlib.sha256(f"sleep:{seed}:{i}".encode()).digest()
    return {"i": i, "seconds": round(sleep_max_s * h[0] / 255.0, 3)}


def read_progress(path: Path) -> dict[int, str]:
    """``{index: item_id or ""}`` from a progress file (a torn last line is ignored)."""
    out: dict[int, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        i, item_id = int(parts[0]), parts[1]
        if item_id != "-" or i not in out:
            out[i] = "" if item_id == "-" else item_id
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos-producer")
    ap.add_argument("--config", required=True)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--rate", type=float, required=True, help="items per second")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--kind", default="echo", help="echo, or sleep (then each item sleeps up to --sleep-max-s)")
    ap.add_argument("--sleep-max-s", type=float, default=0.0)
    args = ap.parse_args(argv)
    logsetup.configure("json")
    progress = Path(args.progress)
    done = read_progress(progress)
    start = max(done) + 1 if done else 0
    log.info("chaos_producer_started", start=start, count=args.count)
    with Client.from_config_file(args.config) as client, open(progress, "a") as out:
        t0 = time.monotonic()
        i = start
        while i < args.count:
            batch = list(range(i, min(i + BATCH_ITEMS, args.count)))
            due = t0 + (i - start) / args.rate
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)  # pacing the load, not waiting for a condition
            specs = [{"payload": payload_for(args.seed, j), "kind": args.kind, "key": key_for(args.seed, j),
                      "params": params_for(args.seed, j, args.kind, args.sleep_max_s)} for j in batch]
            try:
                receipts = client.submit_many(specs, timeout_s=30.0)
            except (OSError, RetryableError) as exc:  # claim store outage, broker refusing: try again
                log.warning("chaos_submit_retry", first=i, error=f"{type(exc).__name__}: {exc}"[:300])
                time.sleep(RETRY_PAUSE_S)
                continue
            out.write("".join(f"{j} {r.item_id or '-'}\n" for j, r in zip(batch, receipts)))
            out.flush()
            i = batch[-1] + 1
        while True:
            try:
                client.flush(timeout_s=30.0)
                break
            except RetryableError as exc:
                log.warning("chaos_flush_retry", error=str(exc)[:300], left=client.outbox_count())
        rejected = client.outbox_rejected()
    log.info("chaos_producer_done", count=args.count, rejected=len(rejected))
    for key, code, message in rejected:
        print(f"REJECTED {key} {code} {message}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
