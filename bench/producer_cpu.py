"""CPU per job of ONE producer (``AsyncClient``), without the other processes' noise: a real
``ccsq-brokerd`` and one echo worker (so the broker does not flag the kind as unserved) run as
subprocesses; this process is the producer alone, driving benchmark 1's load (1 KiB claim
reference per job, ``submit_many`` per 100-job batch, 8 batches in flight, each awaiting its
SUBMIT_ACK). CPU is this process's user + system time (``resource.getrusage``, every thread:
the event loop and ZeroMQ's I/O thread) around the submits, after one warm-up window. Used to
A/B producer changes on a shared machine.

    python -m bench.producer_cpu [--n 20000] [--repeat 3] [--outbox] [--profile FILE.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from bench.common import claim_ref
from bench.driver import produce

ROOT = Path(__file__).resolve().parent.parent


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


async def _measure(producer_toml: Path, n: int, repeat: int, batch: int, window: int,
                   profile: Path | None) -> list[dict[str, float]]:
    from ccsq.producer.client import AsyncClient

    runs: list[dict[str, float]] = []
    async with AsyncClient.from_config_file(producer_toml) as client:
        if not await client.wait_connected(60):
            raise RuntimeError("producer did not connect to the broker")
        base = 0

        async def submit_batch(start: int, count: int) -> None:
            t = time.time()
            await client.submit_many([(claim_ref(base + i), "echo", {"t": t}) for i in range(start, start + count)],
                                     timeout_s=120)

        await produce(submit_batch, batch * window * 2, batch=batch, window=window)  # warm-up, not counted
        base += batch * window * 2
        prof = None
        if profile is not None:
            import cProfile

            prof = cProfile.Profile()
        for _ in range(repeat):
            cpu0, sys0, t0 = _cpu_s(), _sys_s(), time.monotonic()
            if prof is not None:
                prof.enable()
            facts = await produce(submit_batch, n, batch=batch, window=window)
            if prof is not None:
                prof.disable()
            cpu, sys_s, el = _cpu_s() - cpu0, _sys_s() - sys0, time.monotonic() - t0
            base += n
            runs.append({"jobs": n, "cpu_s": round(cpu, 3), "cpu_us_per_job": round(1e6 * cpu / n, 1),
                         "sys_us_per_job": round(1e6 * sys_s / n, 1),
                         "jobs_per_s": round(n / el, 1), "confirm_p50_ms": facts["confirm_p50_ms"]})
        if prof is not None:
            prof.dump_stats(str(profile))
    return runs


def run(n: int = 20000, repeat: int = 3, batch: int = 100, window: int = 8,
        profile: Path | None = None, outbox: bool = False) -> dict[str, object]:
    """Start broker + 1 worker, then measure ``repeat`` producer runs of ``n`` jobs each
    (``outbox``: with ``outbox_dir`` set, as a producer that spools while the broker is away);
    returns every run's figures and the median CPU µs per job."""
    from bench.ccsq_pipeline import start_swarm

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "swarm"
        procs, configs = start_swarm(root, workers=1, start_completion=False)
        if outbox:
            with configs["producer"].open("a") as f:
                f.write(f'outbox_dir = "{root / "outbox"}"\n')
        try:
            runs = asyncio.run(_measure(configs["producer"], n, repeat, batch, window, profile))
        finally:
            procs.stop_all()
    per_job = sorted(r["cpu_us_per_job"] for r in runs)
    return {"runs": runs, "median_cpu_us_per_job": per_job[len(per_job) // 2], "of_which_job_specs_us": _specs_us(n)}


def _specs_us(n: int, batch: int = 100) -> float:
    """CPU µs per job of making the jobs alone (claim references, spec tuples: the caller's
    part of the figure, as in ``make bench``), min of 3."""
    best = float("inf")
    for _ in range(3):
        cpu0, t = _cpu_s(), time.time()
        for start in range(0, n, batch):
            [(claim_ref(i), "echo", {"t": t}) for i in range(start, start + batch)]
        best = min(best, _cpu_s() - cpu0)
    return round(1e6 * best / n, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.producer_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="jobs per measured run")
    ap.add_argument("--repeat", type=int, default=3, help="measured runs (the median is reported)")
    ap.add_argument("--outbox", action="store_true", help="the producer with outbox_dir set")
    ap.add_argument("--profile", type=Path, help="cProfile the measured runs into this file (slower: A/B without it)")
    args = ap.parse_args(argv)
    out = run(args.n, args.repeat, profile=args.profile, outbox=args.outbox)
    print(json.dumps(out))
    if args.profile:
        import pstats

        pstats.Stats(str(args.profile)).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
