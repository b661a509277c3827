"""``make bench`` / ``python -m bench.run``: ccsq against Redis and RabbitMQ, side by side, in one run.

Benchmarks (see docs/benchmarks.md for what each measures and the latest figures):

1. pipeline throughput (ccsq, Redis Streams AOF always, RabbitMQ quorum queue),
   then submit -> acknowledged latency of each at 50% of ccsq's max rate;
   the broker is profiled with py-spy during ccsq's throughput run (6: its
   fdatasync calls are traced with strace at the same time);
5. worker overhead on real OCR inference (broker + worker vs a bare loop);
4, 2, 3. ledger growth, heartbeat lag under backlog, restart recovery (one fill).

Each prints a rich table and writes ``bench/out/<name>.json``. Peers are started
privately on loopback; when missing they are installed (root) or the command to
install them is printed. ``--only`` picks benchmarks, ``--n`` etc. resize them.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import backlog, ccsq_pipeline, ocr_overhead, peer_pipeline, servers
from bench.common import OUT_DIR, console, dist, machine, print_table, verdict, write_json
from bench.profile import top

WORK = Path("/tmp/ccsq-bench")


def _fsync_stats(trace: Path, jobs: int) -> dict[str, Any]:
    """fdatasync/fsync/msync durations from ``strace -T`` output."""
    durs_ms: list[float] = []
    if trace.exists():
        for line in trace.read_text(errors="replace").splitlines():
            m = re.search(r"(fdatasync|fsync|msync)\(.*<([\d.]+)>$", line)
            if m:
                durs_ms.append(float(m.group(2)) * 1000)
    return {"syncs": len(durs_ms), "sync_ms": dist(durs_ms, 3),
            "syncs_per_job": round(len(durs_ms) / jobs, 2) if jobs else 0.0,
            "jobs_per_sync": round(jobs / len(durs_ms), 2) if durs_ms else 0.0,
            "note": "LMDB issues one fdatasync per commit (its meta page goes through an O_DSYNC descriptor), so "
                    "jobs_per_sync ~ jobs per commit; a job writes its record 4 times (submit, lease, complete, ack)"}


def bench_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    n = args.n
    systems = ["ccsq"] + [s for s in ("redis", "rabbit") if s in args.peers]
    results: dict[str, Any] = {"n": n, "batch": args.batch, "window": args.window,
                               "ccsq_worker": {"slots": ccsq_pipeline.WORKER_SLOTS, "prefetch": ccsq_pipeline.WORKER_PREFETCH,
                                               "max_batch": ccsq_pipeline.WORKER_MAX_BATCH,
                                               "max_wait_ms": ccsq_pipeline.WORKER_MAX_WAIT_MS},
                               "runs": {}}
    needed = [{"redis": "redis-server", "rabbit": "rabbitmq-server"}[s] for s in systems if s != "ccsq"]
    servers.ensure_installed(needed)

    def one(system: str, rate: float | None, profile: bool = False) -> dict[str, Any]:
        console.print(f"  {system}: {n} jobs" + (f" paced at {rate:,.0f}/s" if rate else " as fast as confirms come back"))
        if system == "ccsq":
            return ccsq_pipeline.run(WORK / "ccsq", n, batch=args.batch, window=args.window, rate_per_s=rate,
                                     profile_out=OUT_DIR / "broker-profile.txt" if profile else None,
                                     fsync_trace=WORK / "broker-fsync.strace" if profile else None)
        if system == "redis":
            with servers.RedisServer(WORK / "redis") as srv:
                return peer_pipeline.run("redis", f"redis://127.0.0.1:{srv.port}/0", WORK / "redis-run", n,
                                         batch=args.batch, window=args.window, rate_per_s=rate, server_pid=srv.pid)
        with servers.RabbitServer(WORK / "rabbit") as srv:
            return peer_pipeline.run("rabbit", srv.url, WORK / "rabbit-run", n, batch=args.batch, window=args.window,
                                     rate_per_s=rate, server_pid=srv.beam_pid())

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for system in systems:
        results["runs"][system] = {"max": one(system, None)}
    ccsq_max = results["runs"]["ccsq"]["max"]["jobs_per_s"]
    rate = round(ccsq_max * 0.5, 1)
    results["paced_rate_per_s"] = rate
    for system in systems:
        results["runs"][system]["paced"] = one(system, rate)
    # the profilers slow the broker: a separate run, never the one the ratios come from
    console.print("  ccsq again under py-spy and strace (profile and fsync trace; its rate is not compared)")
    results["runs"]["ccsq"]["profiled"] = one("ccsq", None, profile=True)
    for peer, target in (("redis", 2.0), ("rabbit", 5.0)):
        if peer in results["runs"]:
            ratio = ccsq_max / results["runs"][peer]["max"]["jobs_per_s"]
            results[f"ccsq_over_{peer}"] = {"ratio": round(ratio, 3), "target": target, "met": ratio >= target}
    prof = OUT_DIR / "broker-profile.txt"
    if prof.exists():
        results["broker_profile"] = top(prof, 12)
    results["fsync"] = _fsync_stats(WORK / "broker-fsync.strace", n)
    rows = []
    for system in systems:
        mx, pc = results["runs"][system]["max"], results["runs"][system]["paced"]
        rows.append([system, mx["jobs_per_s"], round(ccsq_max / mx["jobs_per_s"], 2), pc["latency_ms"]["p50"],
                     pc["latency_ms"]["p99"], mx["latency_ms"]["p50"], mx["producer"]["confirm_p50_ms"]])
    print_table(f"1. pipeline, {n} jobs (1 producer, 2 workers, 1 completion -> SQLite); paced latency at {rate:,.0f} jobs/s",
                ["system", "jobs/s", "ccsq / system", "paced p50 ms", "paced p99 ms", "max-rate p50 ms", "confirm p50 ms"],
                rows)
    for peer in ("redis", "rabbit"):
        if f"ccsq_over_{peer}" in results:
            r = results[f"ccsq_over_{peer}"]
            console.print(f"  ccsq / {peer}: {r['ratio']}x (target >= {r['target']}x): {verdict(r['met'])}")
    cpu_rows = []
    for system in systems:
        c = results["runs"][system]["max"].get("cpu_s", {})
        broker = c.get("broker", c.get("server", 0.0))
        clients = sum(v for k, v in c.items() if k not in ("broker", "server"))
        cpu_rows.append([system, round(1e6 * broker / n), round(1e6 * clients / n), round(1e6 * (broker + clients) / n)])
    print_table("CPU per job during the unpaced runs (µs; clients = producer + 2 workers + completion)",
                ["system", "broker / server", "clients", "total"], cpu_rows)
    gc = results["runs"]["ccsq"]["max"].get("group_commit", {})
    if gc.get("commits"):
        rpc, cms = gc["records_per_commit"], gc["commit_ms"]
        print_table("6. broker group commits during the unpaced run (its /metrics histograms)",
                    ["commits", "records/commit mean", "p50 <=", "p99 <=", "commit+fsync ms mean", "p50 <=", "p99 <=", "max <="],
                    [[gc["commits"], rpc["mean"], rpc["p50_le"], rpc["p99_le"], cms["mean"], cms["p50_le"], cms["p99_le"],
                      cms["max_le"]]])
    f = results["fsync"]
    print_table("6. broker fsync syscalls during the profiled run (strace -T)",
                ["syncs", "jobs per sync", "p50 ms", "p99 ms", "max ms"],
                [[f["syncs"], f["jobs_per_sync"], f["sync_ms"]["p50"], f["sync_ms"]["p99"], f["sync_ms"]["max"]]])
    if "broker_profile" in results:
        print_table("broker profile (py-spy, self time)", ["function", "% samples"], results["broker_profile"]["self"][:10])
    return results


def bench_ocr(args: argparse.Namespace) -> dict[str, Any]:
    res = ocr_overhead.run(WORK / "ocr", args.pages, args.handler_threads)
    print_table(f"5. OCR worker overhead ({res['pages']} pages, handler_threads={res['handler_threads']})",
                ["path", "pages/s", "s"],
                [["bare loop", res["bare"]["pages_per_s"], res["bare"]["elapsed_s"]],
                 ["broker + worker + completion", res["ccsq"]["pages_per_s"], res["ccsq"]["elapsed_s"]],
                 [f"the same, max_batch = {res['ccsq_batched']['max_batch']}", res["ccsq_batched"]["pages_per_s"],
                  res["ccsq_batched"]["elapsed_s"]]])
    console.print(f"  ratio {res['ratio']} (target >= 0.95): {verdict(res['met'])}; "
                  f"dynamic batching gain {res['batching_gain']}x")
    return res


def bench_backlog(args: argparse.Namespace) -> dict[str, Any]:
    res = backlog.run(WORK / "backlog", args.sizes, lag_s=args.lag_s)
    print_table("4. broker memory and ledger size vs queued items",
                ["queued", "broker RSS MiB", "of which heap (anon)", "of which LMDB mmap (file)", "ledger MiB", "fill jobs/s"],
                [[g["queued"], round(g["broker_rss_bytes"] / 2**20, 1), round(g["rss_split"]["anon"] / 2**20, 1),
                  round(g["rss_split"]["file"] / 2**20, 1), round(g["ledger_disk_bytes"] / 2**20, 1),
                  g.get("submit_per_s", 0)] for g in res["growth"]])
    console.print(f"  ledger bytes per queued item: {res['ledger_bytes_per_item']}")
    hb = res["heartbeat_lag_ms"]
    print_table(f"2. heartbeat lag with {args.sizes[-1]:,} queued (probe round trip, ms)",
                ["phase", "n", "p50", "p99", "max"],
                [[k, v["n"], v["p50"], v["p99"], v["max"]] for k, v in hb.items() if isinstance(v, dict)])
    d = hb["draining"]
    res["heartbeat_targets"] = {"p99_ms": 50, "max_ms": 200, "met": d["p99"] <= 50 and d["max"] <= 200}
    console.print(f"  draining at {hb['drain_jobs_per_s']} jobs/s; targets p99 <= 50 ms, max <= 200 ms: "
                  f"{verdict(res['heartbeat_targets']['met'])}")
    r = res["restart"]
    print_table(f"3. restart recovery ({r['queued']:,} queued, {r['leased']} leased; seconds from restart)",
                ["broker_started", "first dispatch", "all leases resumed", "leases resumed"],
                [[r.get("started_s"), r["first_dispatch_s"], r["all_leases_resumed_s"], r["leases_resumed"]]])
    ok = r["first_dispatch_s"] is not None and r["first_dispatch_s"] <= 1.0
    res["restart"]["target_first_dispatch_s"] = 1.0
    res["restart"]["met"] = ok
    console.print(f"  first dispatch <= 1 s: {verdict(ok)}")
    return res


BENCHES = {"pipeline": bench_pipeline, "ocr": bench_ocr, "backlog": bench_backlog}


def bench_federation(args: argparse.Namespace) -> dict[str, Any]:
    """Opt-in (``--only federation``): a backlog of --n items spilled through a relay (bench/federation.py)."""
    from bench import federation

    res = federation.run(args.n, 2)
    print_table(f"federation: {args.n:,} items, 2 workers", ["one swarm items/s", "across a link items/s",
                "spill time s", "relay CPU ms/item"],
                [[res["one_swarm_items_per_s"], res["across_link_items_per_s"], res["spill_time_s"],
                  res["relay_cpu_ms_per_item"]]])
    return res


BENCHES["federation"] = bench_federation  # not in the default --only list (docs/federation.md, "Measured")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="pipeline,ocr,backlog", help="comma list of: " + ", ".join(BENCHES))
    ap.add_argument("--n", type=int, default=20_000, help="jobs per pipeline run (issue: 100,000)")
    ap.add_argument("--batch", type=int, default=100, help="jobs per producer batch (one durable confirm)")
    ap.add_argument("--window", type=int, default=8, help="producer batches in flight")
    ap.add_argument("--peers", default="redis,rabbit", help="peers to run against (redis, rabbit; '' for ccsq only)")
    ap.add_argument("--pages", type=int, default=6, help="OCR pages timed (plus one warm-up)")
    ap.add_argument("--handler-threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = default)")
    ap.add_argument("--sizes", default="10000,100000,1000000", help="backlog checkpoints (issue: 10k, 100k, 1M, 5M)")
    ap.add_argument("--lag-s", type=float, default=10.0, help="seconds of heartbeat probing while draining")
    args = ap.parse_args(argv)
    args.peers = [s for s in args.peers.split(",") if s]
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    WORK.mkdir(parents=True, exist_ok=True)
    info = machine()
    console.print(f"[bold]ccsq bench[/bold] on {info['cpu']} x{info['cores']}, {info['mem_gib']} GiB, Python {info['python']}")
    failed = []
    for name in [s for s in args.only.split(",") if s]:
        console.rule(name)
        t0 = time.monotonic()
        try:
            res = BENCHES[name](args)
        except servers.PeerMissing as exc:
            console.print(f"[red]{exc}[/red]")
            failed.append(name)
            continue
        res["machine"] = info
        res["command"] = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
        res["bench_s"] = round(time.monotonic() - t0, 1)
        console.print(f"  wrote {write_json(name, res)} ({res['bench_s']} s)")
    shutil.rmtree(WORK / "ccsq", ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
