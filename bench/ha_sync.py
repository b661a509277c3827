"""The cost of synchronous replication (docs/ha.md, "Figures"): bench/ccsq_pipeline.py's
pipeline (producer, 2 echo workers, completion service on SQLite) in one run against

* ``single``: one ``ccsq-brokerd``, as benchmark 1 runs it, and
* ``pair``: a primary with one sync standby: two ``ccsq-brokerd`` processes, ``ha_mode = "sync"``,
  elected through a private one-member etcd started here (a fresh one per run); measured only once
  etcd's ``/ccsq/<swarm>/sync`` lists the standby, so every confirm waited for its fsync too.

Each first as fast as confirms come back (jobs/s; CPU per job and process from /proc), then paced at
50 % of the single broker's max rate (submit -> acknowledged p50/p99 from the primary's ledger),
and lightly loaded (a tenth of the jobs at 10 % of that max: one item's path without queueing).
At the end the standby's ledger must hold every acknowledged item (``standby_acknowledged``).

Targets (docs/ha.md, "Figures"): pair / single jobs/s >= 0.75; the pair adds <= 5 ms to the paced p50.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench import ccsq_pipeline, servers
from ccsq.brokerd.ledger.store import Ledger, data_paths

RATIO_TARGET = 0.75
P50_ADDED_TARGET_MS = 5.0


def cpu_us_per_job(cpu_s: dict[str, float], n: int) -> dict[str, int]:
    """``cpu_s`` of a run (broker, standby, worker-N, completion, producer (...), etcd) as µs per job,
    with ``workers`` (their sum) and ``total``."""
    out = {("producer" if k.startswith("producer") else k): round(1e6 * v / n) for k, v in cpu_s.items()}
    out["workers"] = sum(v for k, v in out.items() if k.startswith("worker-"))
    out["total"] = round(1e6 * sum(cpu_s.values()) / n)
    return out


def standby_acknowledged(root: Path) -> int:
    """The acknowledged counter of the standby's ledger (``broker-data-2``) after a pair run."""
    ledger = Ledger(data_paths(root / "broker-data-2")[0], readonly=True)
    try:
        with ledger.read() as view:
            return view.counter("acknowledged")
    finally:
        ledger.close()


def one(work: Path, kind: str, n: int, *, batch: int, window: int, rate_per_s: float | None) -> dict[str, Any]:
    """One pipeline run of ``n`` jobs against ``kind`` (``single`` or ``pair``)."""
    if kind == "single":
        res = ccsq_pipeline.run(work / "single", n, batch=batch, window=window, rate_per_s=rate_per_s)
    else:
        with servers.EtcdServer(work / "etcd") as etcd:
            res = ccsq_pipeline.run(work / "pair", n, batch=batch, window=window, rate_per_s=rate_per_s, ha_etcd=etcd.url,
                                    other_pids={"etcd": etcd.pid})  # etcd during the run: lease keep-alives
        res["standby_acknowledged"] = standby_acknowledged(work / "pair")
    res["cpu_us_per_job"] = cpu_us_per_job(res["cpu_s"], n)
    res["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    return res


def run(work: Path, n: int, *, batch: int = 100, window: int = 8) -> dict[str, Any]:
    """Single vs pair, unpaced then paced at 50 % of the single broker's max; returns the record
    written to ``bench/out/ha_sync.json`` (``runs.{single,pair}.{max,paced,light}``, ``ratio``,
    ``p50_added_ms``, the targets and whether they are met)."""
    servers.ensure_installed(["etcd"])
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, dict[str, Any]] = {"single": {}, "pair": {}}
    for kind in ("single", "pair"):
        runs[kind]["max"] = one(work, kind, n, batch=batch, window=window, rate_per_s=None)
    rate = round(runs["single"]["max"]["jobs_per_s"] * 0.5, 1)
    for kind in ("single", "pair"):
        runs[kind]["paced"] = one(work, kind, n, batch=batch, window=window, rate_per_s=rate)
    # light load: what one item's path costs without queueing (a tenth of the jobs at a tenth of the rate)
    light_n, light_rate = max(n // 10, 50), round(rate / 5, 1)
    for kind in ("single", "pair"):
        runs[kind]["light"] = one(work, kind, light_n, batch=batch, window=window, rate_per_s=light_rate)
    ratio = runs["pair"]["max"]["jobs_per_s"] / runs["single"]["max"]["jobs_per_s"]
    added = runs["pair"]["paced"]["latency_ms"]["p50"] - runs["single"]["paced"]["latency_ms"]["p50"]
    jobs = {"max": n, "paced": n, "light": light_n}
    lost = {f"{kind} {m}": jobs[m] - runs[kind][m]["latency_ms"]["n"] for kind in runs for m in jobs}
    standby_short = {m: jobs[m] - runs["pair"][m]["standby_acknowledged"] for m in jobs}
    return {
        "n": n, "batch": batch, "window": window, "paced_rate_per_s": rate,
        "ha": {"mode": "sync", "sync_standbys": 1, "swarm": ccsq_pipeline.HA_SWARM, "etcd": "one member, loopback"},
        "load_avg_before": load_before, "cores": os.cpu_count(),
        "runs": runs,
        "ratio": {"pair_over_single": round(ratio, 3), "target": RATIO_TARGET, "met": ratio >= RATIO_TARGET},
        "p50_added_ms": {"ms": round(added, 2), "target": P50_ADDED_TARGET_MS, "met": added <= P50_ADDED_TARGET_MS},
        "p99_added_ms": round(runs["pair"]["paced"]["latency_ms"]["p99"] - runs["single"]["paced"]["latency_ms"]["p99"], 2),
        "light": {"n": light_n, "rate_per_s": light_rate,
                  "p50_added_ms": round(runs["pair"]["light"]["latency_ms"]["p50"] - runs["single"]["light"]["latency_ms"]["p50"], 2),
                  "p99_added_ms": round(runs["pair"]["light"]["latency_ms"]["p99"] - runs["single"]["light"]["latency_ms"]["p99"], 2)},
        "not_acknowledged": lost, "standby_missing_acknowledged": standby_short,
    }
