"""``make bench`` / ``python -m bench.run``: ccsq against Redis and RabbitMQ, side by side, in one run.

Benchmarks (see docs/benchmarks.md for what each measures and the latest figures):

1. pipeline throughput (ccsq, Redis Streams AOF always, RabbitMQ quorum queue,
   Celery on Redis, dramatiq on RabbitMQ), then submit -> acknowledged latency
   of each at 50% of ccsq's max rate (systems that cannot sustain it are
   skipped), a kill run of each (SIGKILL one worker: lost and doubled results),
   CPU per job of every process; every ccsq daemon is profiled with py-spy in a
   separate run (6: the broker's fdatasync calls are traced with strace);
5. worker overhead on real OCR inference (broker + worker vs a bare loop);
4, 2, 3. ledger growth, heartbeat lag under backlog, restart recovery (one fill);
federation: a backlog of --fed-n items spilled through a relay to an idle swarm,
items/s across the link vs inside one swarm, relay CPU per item (bench/federation.py).
ha_sync: the pipeline against one broker and against a primary with a sync standby
(etcd started here), jobs/s ratio, CPU per job and process, paced latency (bench/ha_sync.py).

Each prints a rich table and writes ``bench/out/<name>.json``. Peers are started
privately on loopback; when missing they are installed (root) or the command to
install them is printed. ``--only`` picks benchmarks, ``--n`` etc. resize them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import backlog, ccsq_pipeline, ocr_overhead, peer_pipeline, servers
from bench.common import OUT_DIR, console, dist, machine, print_table, verdict, write_json
from bench.profile import top

#: scratch directory of the runs (``CCSQ_BENCH_WORK``: another one, so that two checkouts can bench at once)
WORK = Path(os.environ.get("CCSQ_BENCH_WORK", "/tmp/ccsq-bench"))


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


#: The targets (docs/benchmarks.md): CPU per job of each ccsq process (µs), end-to-end ratios, paced latency.
CPU_TARGET_US = {"broker": 50, "worker": 25, "completion": 20, "producer": 15}
RATIO_TARGET = {"redis": 1.0, "celery": 20.0, "dramatiq": 6.0, "rabbit": None}  # ratios against the strongest peers
LATENCY_TARGET_MS = {"p50": 20.0, "p99": 60.0}  # at 50 % of the max rate, N = 100,000
SERVER_OF = {"redis": "redis-server", "celery": "redis-server", "rabbit": "rabbitmq-server", "dramatiq": "rabbitmq-server"}


def _cpu_role(name: str) -> str:
    return ("broker" if name in ("broker", "server") else "producer" if name.startswith("producer")
            else "worker" if name.startswith("worker") else name)


def cpu_per_job(cpu: dict[str, float], n: int) -> dict[str, int]:
    """Per-process CPU µs per job from a run's ``cpu_s`` (``{"broker"|"server", "producer", "worker-1",
    "worker-2", "completion", "total"}``)."""
    out: dict[str, int] = {}
    for name, secs in cpu.items():
        key = "broker" if name in ("broker", "server") else "producer" if name.startswith("producer") else name
        out[key] = round(1e6 * secs / n)
    out["total"] = round(1e6 * sum(cpu.values()) / n)
    return out


def bench_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    n = args.n
    systems = ["ccsq"] + [s for s in peer_pipeline.SYSTEMS if s in args.peers]
    results: dict[str, Any] = {"n": n, "batch": args.batch, "window": args.window,
                               "ccsq_worker": {"slots": ccsq_pipeline.WORKER_SLOTS, "prefetch": ccsq_pipeline.WORKER_PREFETCH,
                                               "max_batch": ccsq_pipeline.WORKER_MAX_BATCH,
                                               "max_wait_ms": ccsq_pipeline.WORKER_MAX_WAIT_MS},
                               "runs": {}}
    servers.ensure_installed(sorted({SERVER_OF[s] for s in systems if s != "ccsq"}))

    def one(system: str, rate: float | None, profile: bool = False, kill_at: float | None = None,
            jobs: int = n) -> dict[str, Any]:
        what = f" paced at {rate:,.0f}/s" if rate else " as fast as confirms come back"
        if kill_at:
            what += f", SIGKILL worker-1 at {kill_at:.0%} landed"
        console.print(f"  {system}: {jobs} jobs" + what)
        if system == "ccsq":
            return ccsq_pipeline.run(WORK / "ccsq", jobs, batch=args.batch, window=args.window, rate_per_s=rate,
                                     profile_out=OUT_DIR / "broker-profile.txt" if profile else None,
                                     fsync_trace=WORK / "broker-fsync.strace" if profile else None,
                                     profile_all=OUT_DIR / "profiles" if profile else None, kill_at=kill_at)
        if SERVER_OF[system] == "redis-server":
            with servers.RedisServer(WORK / "redis") as srv:
                return peer_pipeline.run(system, f"redis://127.0.0.1:{srv.port}/0", WORK / f"{system}-run", jobs,
                                         batch=args.batch, window=args.window, rate_per_s=rate, server_pid=srv.pid,
                                         kill_at=kill_at)
        with servers.RabbitServer(WORK / "rabbit") as srv:
            return peer_pipeline.run(system, srv.url, WORK / f"{system}-run", jobs, batch=args.batch, window=args.window,
                                     rate_per_s=rate, server_pid=srv.beam_pid(), kill_at=kill_at)

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for system in systems:
        results["runs"][system] = {"max": one(system, None)}
    ccsq_max = results["runs"]["ccsq"]["max"]["jobs_per_s"]
    rate = round(ccsq_max * 0.5, 1)
    results["paced_rate_per_s"] = rate
    for system in systems:
        if results["runs"][system]["max"]["jobs_per_s"] < rate:  # it cannot keep up: its latency would be its backlog
            results["runs"][system]["paced"] = None
            continue
        results["runs"][system]["paced"] = one(system, rate)
    if args.kill_n:
        for system in systems:
            results["runs"][system]["kill"] = one(system, None, kill_at=0.3, jobs=args.kill_n)
    # the profilers slow the processes: a separate run, never the one the ratios come from
    if not args.no_profile:
        console.print("  ccsq again under py-spy (every daemon) and strace (profiles, fsync trace; its rate is not compared)")
        results["runs"]["ccsq"]["profiled"] = one("ccsq", None, profile=True)
    for peer in systems[1:]:
        ratio = ccsq_max / results["runs"][peer]["max"]["jobs_per_s"]
        target = RATIO_TARGET[peer]
        results[f"ccsq_over_{peer}"] = {"ratio": round(ratio, 3), "target": target,
                                        "met": None if target is None else ratio >= target}
    prof = OUT_DIR / "broker-profile.txt"
    if prof.exists() and not args.no_profile:
        results["broker_profile"] = top(prof, 12)
        results["profiles"] = {f.stem: top(f, 12) for f in sorted((OUT_DIR / "profiles").glob("*.txt"))}
    results["fsync"] = _fsync_stats(WORK / "broker-fsync.strace", n)
    rows = []
    for system in systems:
        mx, pc = results["runs"][system]["max"], results["runs"][system]["paced"]
        kl = results["runs"][system].get("kill", {}).get("kill", {})
        rows.append([system, mx["jobs_per_s"], round(ccsq_max / mx["jobs_per_s"], 2),
                     pc["latency_ms"]["p50"] if pc else "-", pc["latency_ms"]["p99"] if pc else "-",
                     mx["producer"]["confirm_p50_ms"], kl.get("lost", "-"), kl.get("doubled", "-")])
    print_table(f"1. pipeline, {n} jobs (1 producer, 2 workers, 1 completion -> SQLite); paced latency at {rate:,.0f} jobs/s;"
                f" kill run: {args.kill_n} jobs, worker-1 SIGKILLed at 30 % landed",
                ["system", "jobs/s", "ccsq / system", "paced p50 ms", "paced p99 ms", "confirm p50 ms", "kill: lost",
                 "kill: doubled"], rows)
    for peer in systems[1:]:
        r = results[f"ccsq_over_{peer}"]
        tgt = f"target >= {r['target']}x" if r["target"] else "no target"
        console.print(f"  ccsq / {peer}: {r['ratio']}x ({tgt}): {verdict(r['met'])}")
    pc = results["runs"]["ccsq"]["paced"]
    if pc:
        ok = pc["latency_ms"]["p50"] <= LATENCY_TARGET_MS["p50"] and pc["latency_ms"]["p99"] <= LATENCY_TARGET_MS["p99"]
        results["latency_target"] = {**LATENCY_TARGET_MS, "met": ok}
        console.print(f"  ccsq paced latency p50 <= {LATENCY_TARGET_MS['p50']:g} ms, p99 <= {LATENCY_TARGET_MS['p99']:g} ms: {verdict(ok)}")
    if "kill" in results["runs"]["ccsq"]:
        kl = results["runs"]["ccsq"]["kill"]["kill"]
        console.print(f"  ccsq kill run: lost {kl['lost']}, results delivered twice {kl['doubled']}, "
                      f"items run twice (lease given to another worker) {kl['rerun']}")
    cpu_rows = []
    cols = ["broker", "producer", "worker-1", "worker-2", "completion", "total"]
    for system in systems:
        per = cpu_per_job(results["runs"][system]["max"].get("cpu_s", {}), n)
        results["runs"][system]["max"]["cpu_us_per_job"] = per
        cpu_rows.append([system, *[per.get(c, "-") for c in cols]])
    cpu_rows.append(["target (ccsq)", CPU_TARGET_US["broker"], CPU_TARGET_US["producer"], CPU_TARGET_US["worker"],
                     CPU_TARGET_US["worker"], CPU_TARGET_US["completion"], sum(CPU_TARGET_US.values()) + CPU_TARGET_US["worker"]])
    print_table("CPU per job and process during the unpaced runs (µs, /proc user + system; broker = the server for peers;"
                " ccsq producer includes the harness's polling)", ["system", *cols], cpu_rows)
    per = results["runs"]["ccsq"]["max"]["cpu_us_per_job"]
    results["cpu_targets"] = {c: {"us": per.get(c), "target": CPU_TARGET_US[_cpu_role(c)],
                                  "met": per.get(c, 1e9) <= CPU_TARGET_US[_cpu_role(c)]}
                              for c in cols[:-1]}
    console.print("  ccsq CPU per job vs targets: " + ", ".join(
        f"{c} {v['us']} <= {v['target']}: {verdict(v['met'])}" for c, v in results["cpu_targets"].items()))
    gc = results["runs"]["ccsq"]["max"].get("group_commit", {})
    if gc.get("commits"):
        rpc, cms = gc["records_per_commit"], gc["commit_ms"]
        print_table("6. broker group commits during the unpaced run (its /metrics histograms)",
                    ["commits", "records/commit mean", "p50 <=", "p99 <=", "commit+fsync ms mean", "p50 <=", "p99 <=", "max <="],
                    [[gc["commits"], rpc["mean"], rpc["p50_le"], rpc["p99_le"], cms["mean"], cms["p50_le"], cms["p99_le"],
                      cms["max_le"]]])
    f = results["fsync"]
    if f["syncs"]:
        print_table("6. broker fsync syscalls during the profiled run (strace -T)",
                    ["syncs", "jobs per sync", "p50 ms", "p99 ms", "max ms"],
                    [[f["syncs"], f["jobs_per_sync"], f["sync_ms"]["p50"], f["sync_ms"]["p99"], f["sync_ms"]["max"]]])
    for name, prof_top in results.get("profiles", {}).items():
        print_table(f"profile of {name} (py-spy, self time)", ["function", "% samples"], prof_top["self"][:8])
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
    """A backlog of --fed-n items spilled through a relay to an idle swarm (bench/federation.py)."""
    from bench import federation

    res = federation.run(args.fed_n, 2)
    res["link_vs_one_swarm"] = round(res["across_link_items_per_s"] / max(res["one_swarm_items_per_s"], 1e-9), 2)
    print_table(f"federation: {args.fed_n:,} items, 2 workers", ["one swarm items/s", "across a link items/s",
                "link / one swarm", "spill time s", "relay CPU ms/item"],
                [[res["one_swarm_items_per_s"], res["across_link_items_per_s"], res["link_vs_one_swarm"],
                  res["spill_time_s"], res["relay_cpu_ms_per_item"]]])
    return res


BENCHES["federation"] = bench_federation  # in the default run with --fed-n (docs/federation.md, "Measured")


def bench_failover(args: argparse.Namespace) -> dict[str, Any]:
    """A broker pair on network namespaces with etcd: --failovers SIGKILLs / cable pulls of the
    primary, time to the first DISPATCH by the new primary (bench/failover.py, docs/ha.md)."""
    from bench import failover

    res = failover.run(args.failovers)
    if "skipped" in res:
        console.print(f"  skipped: {res['skipped']}")
        return res
    print_table(f"failover: {res['failovers']} failovers, etcd lease {res['lease_ttl_s']} s",
                ["median s", "max s", "target s", "met", "items", "lost"],
                [[res["median_s"], res["max_s"], res["target_s"], verdict(res["met"]), res["items"], res["lost"]]])
    return res


BENCHES["failover"] = bench_failover  # needs root (network namespaces) and etcd; skipped with the reason otherwise


def bench_ha_sync(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline at --ha-n against one broker and a sync pair (bench/ha_sync.py; docs/ha.md, "Figures")."""
    from bench import ha_sync

    res = ha_sync.run(WORK / "ha", args.ha_n, batch=args.batch, window=args.window)
    cols = ["broker", "standby", "workers", "completion", "producer", "etcd", "total"]
    rows, cpu_rows = [], []
    for kind in ("single", "pair"):
        mx, pc = res["runs"][kind]["max"], res["runs"][kind]["paced"]
        lt = res["runs"][kind]["light"]["latency_ms"]
        rows.append([kind, mx["jobs_per_s"], mx["producer"]["confirm_p50_ms"], pc["latency_ms"]["p50"], pc["latency_ms"]["p99"],
                     lt["p50"], lt["p99"]])
        cpu_rows.append([kind, *[mx["cpu_us_per_job"].get(c, "-") for c in cols]])
    print_table(f"ha_sync: {args.ha_n:,} jobs, one broker vs a primary with one sync standby; paced at "
                f"{res['paced_rate_per_s']:,.0f} jobs/s (50 % of one broker's max); light: {res['light']['n']:,} jobs at "
                f"{res['light']['rate_per_s']:,.0f} jobs/s", ["brokers", "jobs/s", "confirm p50 ms", "paced p50 ms", "paced p99 ms",
                                                             "light p50 ms", "light p99 ms"], rows)
    print_table("ha_sync: CPU µs per job and process (unpaced runs; workers = both)", ["brokers", *cols], cpu_rows)
    r, a = res["ratio"], res["p50_added_ms"]
    console.print(f"  pair / single jobs/s {r['pair_over_single']} (target >= {r['target']}): {verdict(r['met'])}; "
                  f"paced p50 added {a['ms']} ms (target <= {a['target']:g}): {verdict(a['met'])}; "
                  f"load average before {res['load_avg_before']} on {res['cores']} cores; light load: p50 added "
                  f"{res['light']['p50_added_ms']} ms")
    console.print(f"  not acknowledged: {res['not_acknowledged']}; acknowledged items missing on the standby: "
                  f"{res['standby_missing_acknowledged']}")
    return res


BENCHES["ha_sync"] = bench_ha_sync  # in the default run; alone: --only ha_sync --ha-n N (docs/ha.md, "Figures")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="pipeline,ocr,backlog,federation,failover,ha_sync",
                    help="comma list of: " + ", ".join(BENCHES))
    ap.add_argument("--n", type=int, default=20_000, help="jobs per pipeline run (issue: 100,000)")
    ap.add_argument("--batch", type=int, default=100, help="jobs per producer batch (one durable confirm)")
    ap.add_argument("--window", type=int, default=8, help="producer batches in flight")
    ap.add_argument("--peers", default="redis,rabbit,celery,dramatiq",
                    help="peers to run against (redis, rabbit, celery, dramatiq; '' for ccsq only)")
    ap.add_argument("--kill-n", type=int, default=10_000, help="jobs per kill run (0: no kill runs)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled ccsq run")
    ap.add_argument("--pages", type=int, default=6, help="OCR pages timed (plus one warm-up)")
    ap.add_argument("--handler-threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = default)")
    ap.add_argument("--sizes", default="10000,100000,1000000", help="backlog checkpoints (issue: 10k, 100k, 1M, 5M)")
    ap.add_argument("--lag-s", type=float, default=10.0, help="seconds of heartbeat probing while draining")
    ap.add_argument("--fed-n", type=int, default=2_000, help="items spilled through a relay (issue: 10,000)")
    ap.add_argument("--failovers", type=int, default=20, help="failovers of a broker pair timed")


    ap.add_argument("--ha-n", type=int, default=20_000, help="jobs per ha_sync run (the target's size: 20,000)")
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
