"""Federation figures: items/s across a link vs inside one swarm, relay CPU per item, and
the time to spill a backlog to an idle swarm (docs/federation.md, "Measured").

    .venv/bin/python -m bench.federation [--items N] [--workers W] [--json]

Real processes on loopback (the test harness: ``tests.fedswarm``), echo handler,
workers with ``slots=4 prefetch=4``. Two runs on fresh directories:

1. *one swarm*: N items submitted to swarm b, drained by b's W workers;
2. *across a link*: N items submitted to swarm a (no worker running), drained by b's W
   workers through one relay; the clock runs from the first SUBMIT until a's ledger
   counts N acknowledged (the results are in a's database). The relay's CPU time
   (utime + stime from /proc) is divided by N.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tests.fedswarm import FedPair
from tests.swarm import wait_until

WORKER = {"slots": 4, "prefetch": 4}
BROKER = {"lease_ttl_s": 30.0}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _submit(swarm, n: int) -> float:
    t0 = time.perf_counter()
    with swarm.client() as client:
        for start in range(0, n, 500):
            client.submit_many([{"payload": f"bench-{i}".encode(), "kind": "echo"} for i in range(start, min(n, start + 500))])
    return t0


def run(items: int, workers: int) -> dict:
    out: dict = {"items": items, "workers": workers}
    with tempfile.TemporaryDirectory(prefix="ccsq-fedbench-") as tmp:
        root = Path(tmp)
        with FedPair(root / "one", b_workers=workers, broker=BROKER) as pair:
            pair.b.start_broker()
            pair.b.start_completion()
            for n in range(1, workers + 1):
                pair.b.start_worker(n)
            t0 = _submit(pair.b, items)
            pair.b.wait_acknowledged(items, timeout_s=600)
            out["one_swarm_items_per_s"] = round(items / (time.perf_counter() - t0), 1)
        with FedPair(root / "fed", b_workers=workers, broker=BROKER, relay={"result_credit": 256},
                     link={"max_in_flight": 1024}) as pair:
            pair.a.start_broker()
            pair.a.start_completion()
            pair.b.start_broker()
            pair.b.start_completion()
            for n in range(1, workers + 1):
                pair.b.start_worker(n)
            relay = pair.start_relay()
            pair.wait_connected()
            cpu0 = _cpu_s(relay.popen.pid)
            t0 = _submit(pair.a, items)
            pair.a.wait_acknowledged(items, timeout_s=1200)
            elapsed = time.perf_counter() - t0
            wait_until(lambda: pair.report()["links"][0]["in_flight"] == 0, 120, "link drained")
            cpu = _cpu_s(relay.popen.pid) - cpu0
            out["across_link_items_per_s"] = round(items / elapsed, 1)
            out["spill_time_s"] = round(elapsed, 2)
            out["relay_cpu_ms_per_item"] = round(cpu * 1000 / items, 3)
            out["link_balanced"] = pair.report()["balanced"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.items, args.workers)
    print(json.dumps(res) if args.json else "\n".join(f"{k}: {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
