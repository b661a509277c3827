"""CPU per job of ONE ccsq-workerd, without the broker's noise: the scripted broker of the
worker tests (``tests/worker_harness.py``: real ZeroMQ, real signed envelopes, confirms
every report at once) dispatches ``rounds`` x ``frames`` DISPATCH frames of 64 echo tasks
(1 KiB inline payload each, like benchmark 1), waits for every result, and reads the worker's
CPU seconds from /proc around the run. Used to A/B worker changes on a shared machine, where
the whole pipeline's figures move with the neighbours' load.

    python -m bench.worker_cpu [--rounds 40] [--log-each-job] [--signed]

The scripted broker answers the worker's session-MAC offer (``--signed``: it does not, so every
frame is signed, as against an older broker).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.common import claim_ref, cpu_s

ROOT = Path(__file__).resolve().parent.parent


def run(rounds: int = 40, frames: int = 5, log_each_job: bool = False, profile: Path | None = None,
        signed: bool = False) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from ccsq.common.wire import protocol
    from tests.worker_harness import WorkerBroker, Workers, task, wait_until

    with tempfile.TemporaryDirectory() as tmp:
        broker = WorkerBroker(Path(tmp), session_macs=not signed)
        workers = Workers(Path(tmp), broker)
        try:
            proc = workers.start(handler="echo", slots=4, prefetch=64, max_batch=64, max_wait_ms=1.0,
                                 log_each_job=log_each_job)
            broker.wait_for(protocol.Hello)
            time.sleep(0.5)
            spy = None
            if profile is not None:
                import subprocess

                from ccsq.tools.procs import bin_path

                spy = subprocess.Popen([bin_path("py-spy"), "record", "-p", str(proc.pid), "-r", "250", "--format", "raw",
                                        "-o", str(profile), "--nonblocking", "--gil"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            cpu0, t0 = cpu_s(proc.pid), time.monotonic()
            n = 0
            for r in range(rounds):
                for f in range(frames):
                    broker.dispatch(*[task(f"j{n + k:09d}", "echo", claim_ref(n + k), token=n + k + 1,
                                           params={"t": time.time()}) for k in range(64)])
                    n += 64
                wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) >= n, 60, f"{n} results")
            time.sleep(0.3)  # the last confirmations and journal forgets
            cpu = cpu_s(proc.pid) - cpu0
            el = time.monotonic() - t0
            frames_in = {cls.__name__: len(broker.of(cls)) for cls in (protocol.Complete, protocol.Credit, protocol.Heartbeat)}
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
        finally:
            workers.kill_all()
            broker.close()
    return {"jobs": n, "cpu_s": round(cpu, 2), "cpu_us_per_job": round(1e6 * cpu / n, 1),
            "jobs_per_s": round(n / el, 1), "frames_from_worker": frames_in}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.worker_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--log-each-job", action="store_true")
    ap.add_argument("--profile", type=Path, help="record the worker with py-spy (raw) into this file")
    ap.add_argument("--signed", action="store_true", help="the scripted broker does not answer session MACs (older broker)")
    args = ap.parse_args(argv)
    print(run(args.rounds, log_each_job=args.log_each_job, profile=args.profile, signed=args.signed))
    if args.profile:
        from bench.profile import print_top

        print_top(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
