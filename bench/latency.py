"""Submit -> acknowledged latency of the ccsq pipeline at a paced rate, for an A/B of the
completion service's ``batch_wait_ms`` (docs/benchmarks.md, "Latency").

    python -m bench.latency --n 10000 --rate 1800 --batch-wait-ms 0 20

One real swarm per value (``bench.ccsq_pipeline.run``: producer, broker, 2 echo workers,
completion on SQLite), runs interleaved; prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import bench.ccsq_pipeline as pipeline


def run_once(batch_wait_ms: float, n: int, rate_per_s: float) -> dict:
    original = pipeline.start_swarm

    def with_wait(root, *args, completion=None, **kwargs):
        return original(root, *args, completion={"batch_wait_ms": batch_wait_ms, **(completion or {})}, **kwargs)

    pipeline.start_swarm = with_wait
    try:
        with tempfile.TemporaryDirectory(prefix="ccsq-latency-") as tmp:
            res = pipeline.run(Path(tmp) / "run", n, rate_per_s=rate_per_s or None)
    finally:
        pipeline.start_swarm = original
    return {"batch_wait_ms": batch_wait_ms, "rate_per_s": rate_per_s, "jobs_per_s": res.get("jobs_per_s"),
            "latency_ms": res.get("latency_ms")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=1800.0, help="jobs/s (0 = as fast as it goes)")
    ap.add_argument("--batch-wait-ms", type=float, nargs="+", default=[0.0, 20.0])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    for _ in range(args.repeat):
        for wait in args.batch_wait_ms:
            print(json.dumps(run_once(wait, args.n, args.rate)), flush=True)


if __name__ == "__main__":
    main()
