"""Benchmark 1, peer side: the same pipeline on Redis Streams and on a RabbitMQ quorum queue.

Same shape and durability as ccsq (DESIGN.md's six operations, minus the claim store):

- producer (this process): each batch of jobs (a 1 KiB claim reference + submit
  wall time) returns only after the server's durable confirm: Redis replies
  after its AOF fsync (``appendfsync always``); RabbitMQ sends publisher
  confirms after the quorum queue's log is fsynced.
- 2 worker processes: receive (Redis: XREADGROUP into the group's pending list,
  itself AOF-logged; RabbitMQ: manual-ack consumer with prefetch), do no work,
  publish each result durably (Redis: XADD results + XACK job in one MULTI/EXEC;
  RabbitMQ: publish to the ``results`` quorum queue and wait for the confirms,
  *then* ack the jobs).
- 1 completion process: receive results, upsert them into SQLite with ccsq's own
  :class:`~ccsq.completiond.resultsdb.SqliteResults` (one transaction per batch),
  *then* acknowledge them (Redis XACK, fsynced; RabbitMQ basic.ack), and record
  submit -> acknowledged per job. It exits after ``n`` jobs and writes a JSON file.

Run roles as ``python -m bench.peer_pipeline {redis|rabbit} {worker|completion} ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, claim_ref, cpu_s, pipeline_record
from bench.driver import produce
from ccsq.common.procs import wait_until

JOBS, RESULTS = "jobs", "results"
WORKER_BATCH = 64  # jobs taken per read (Redis COUNT / RabbitMQ prefetch)
COMPLETION_BATCH = 256  # results per SQLite transaction (ccsq completion: batch_max 256)
COMPLETION_WAIT_MS = 20.0  # gather a batch this long (ccsq completion: batch_wait_ms 20)


# --- Redis Streams ------------------------------------------------------------------
async def redis_setup(url: str) -> None:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url)
    for stream, group in ((JOBS, "workers"), (RESULTS, "completion")):
        try:
            await r.xgroup_create(stream, group, id="$", mkstream=True)
        except Exception as exc:  # BUSYGROUP: already there
            if "BUSYGROUP" not in str(exc):
                raise
    await r.aclose()


async def redis_produce(url: str, n: int, batch: int, window: int, rate_per_s: float | None) -> dict[str, float]:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url)

    async def submit_batch(start: int, count: int) -> None:
        t = repr(time.time())
        pipe = r.pipeline(transaction=False)
        for i in range(start, start + count):
            pipe.xadd(JOBS, {"ref": claim_ref(i), "t": t})
        await pipe.execute()  # replies come after the AOF fsync

    try:
        return await produce(submit_batch, n, batch=batch, window=window, rate_per_s=rate_per_s)
    finally:
        await r.aclose()


async def redis_worker(url: str, name: str, ready: Path) -> None:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url)
    await r.ping()
    ready.touch()
    while True:
        got = await r.xreadgroup("workers", name, {JOBS: ">"}, count=WORKER_BATCH, block=1000)
        if not got:
            continue
        entries = got[0][1]
        pipe = r.pipeline(transaction=True)  # MULTI/EXEC: results and acks land together
        for _id, fields in entries:
            pipe.xadd(RESULTS, {"ref": fields[b"ref"], "t": fields[b"t"], "result": fields[b"ref"]})
        pipe.xack(JOBS, "workers", *[e[0] for e in entries])
        await pipe.execute()


async def redis_completion(url: str, n: int, db_path: Path, ready: Path) -> dict[str, Any]:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url)
    db = _open_db(db_path)
    await r.ping()
    ready.touch()
    cpu0 = time.process_time()  # CPU of the run only, like the ccsq side (not imports and connecting)
    lat_ms: list[float] = []
    while len(lat_ms) < n:
        got = await r.xreadgroup("completion", "c1", {RESULTS: ">"}, count=COMPLETION_BATCH, block=int(COMPLETION_WAIT_MS))
        if not got:
            continue
        entries = got[0][1]
        rows = [_row(eid.decode(), f[b"result"], float(f[b"t"])) for eid, f in entries]
        await asyncio.to_thread(db.upsert, rows)
        await r.xack(RESULTS, "completion", *[e[0] for e in entries])
        now = time.time()
        lat_ms.extend((now - float(f[b"t"])) * 1000 for _e, f in entries)
    await r.aclose()
    db.close()
    return {"latencies_ms": lat_ms, "t_done": time.time(), "cpu_s": time.process_time() - cpu0}


# --- RabbitMQ quorum queues --------------------------------------------------------
QUORUM = {"x-queue-type": "quorum"}


async def rabbit_setup(url: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(url)
    ch = await conn.channel()
    for q in (JOBS, RESULTS):
        await ch.declare_queue(q, durable=True, arguments=QUORUM)
    await conn.close()


async def rabbit_produce(url: str, n: int, batch: int, window: int, rate_per_s: float | None) -> dict[str, float]:
    import aio_pika

    conn = await aio_pika.connect(url)
    ch = await conn.channel(publisher_confirms=True)
    ex = ch.default_exchange

    async def submit_batch(start: int, count: int) -> None:
        t = repr(time.time())
        await asyncio.gather(*(
            ex.publish(aio_pika.Message(claim_ref(i), delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers={"t": t}),
                       routing_key=JOBS)
            for i in range(start, start + count)
        ))  # each publish returns after its confirm

    try:
        return await produce(submit_batch, n, batch=batch, window=window, rate_per_s=rate_per_s)
    finally:
        await conn.close()


async def rabbit_worker(url: str, name: str, ready: Path) -> None:
    import aio_pika

    conn = await aio_pika.connect(url)
    ch = await conn.channel(publisher_confirms=True)
    await ch.set_qos(prefetch_count=WORKER_BATCH)
    jobs = await ch.declare_queue(JOBS, durable=True, arguments=QUORUM)
    inbox: asyncio.Queue = asyncio.Queue()
    await jobs.consume(inbox.put, no_ack=False)
    ready.touch()
    while True:
        msgs = [await inbox.get()]
        while not inbox.empty():
            msgs.append(inbox.get_nowait())
        await asyncio.gather(*(
            ch.default_exchange.publish(
                aio_pika.Message(m.body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers=dict(m.headers or {})),
                routing_key=RESULTS)
            for m in msgs
        ))  # results confirmed (durable) ...
        await msgs[-1].ack(multiple=True)  # ... before the jobs are acknowledged


async def rabbit_completion(url: str, n: int, db_path: Path, ready: Path) -> dict[str, Any]:
    import aio_pika

    conn = await aio_pika.connect(url)
    ch = await conn.channel()
    await ch.set_qos(prefetch_count=2 * COMPLETION_BATCH)
    results = await ch.declare_queue(RESULTS, durable=True, arguments=QUORUM)
    inbox: asyncio.Queue = asyncio.Queue()
    await results.consume(inbox.put, no_ack=False)
    db = _open_db(db_path)
    ready.touch()
    cpu0 = time.process_time()  # CPU of the run only, like the ccsq side (not imports and connecting)
    lat_ms: list[float] = []
    while len(lat_ms) < n:
        msgs = [await inbox.get()]
        deadline = time.monotonic() + COMPLETION_WAIT_MS / 1000
        while len(msgs) < COMPLETION_BATCH:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                msgs.append(await asyncio.wait_for(inbox.get(), left))
            except asyncio.TimeoutError:
                break
        rows = [_row(f"{m.delivery_tag}-{len(lat_ms) + k}", m.body, float(m.headers["t"])) for k, m in enumerate(msgs)]
        await asyncio.to_thread(db.upsert, rows)
        await msgs[-1].ack(multiple=True)
        now = time.time()
        lat_ms.extend((now - float(m.headers["t"])) * 1000 for m in msgs)
    await conn.close()
    db.close()
    return {"latencies_ms": lat_ms, "t_done": time.time(), "cpu_s": time.process_time() - cpu0}


# --- shared --------------------------------------------------------------------------
def _open_db(path: Path):
    from ccsq.completiond.resultsdb import open_results_db

    return open_results_db(f"sqlite:///{path.name}", path.parent)


def _row(item_id: str, result: bytes, t: float):
    import hashlib

    from ccsq.completiond.resultsdb import ResultRow

    now = time.time()
    return ResultRow(item_id=item_id, idem_key=item_id, kind="echo", params_json=json.dumps({"t": t}), result=result,
                     result_sha256=hashlib.sha256(result).hexdigest(), result_text=None, attempt=1, handler="echo",
                     handler_version="1", completed_ts=now, landed_ts=now)


ROLES = {
    ("redis", "worker"): redis_worker,
    ("rabbit", "worker"): rabbit_worker,
}
SETUP = {"redis": redis_setup, "rabbit": rabbit_setup}
PRODUCE = {"redis": redis_produce, "rabbit": rabbit_produce}
COMPLETION = {"redis": redis_completion, "rabbit": rabbit_completion}


def _spawn(system: str, role: str, url: str, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "bench.peer_pipeline", system, role, "--url", url, *extra],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def run(system: str, url: str, workdir: Path, n: int, *, batch: int = 100, window: int = 8,
        rate_per_s: float | None = None, timeout_s: float = 900.0, server_pid: int = 0) -> dict[str, Any]:
    """One pipeline run of ``n`` jobs on ``system`` ("redis" or "rabbit") at ``url`` (a fresh server
    whose process is ``server_pid``, for its CPU seconds; 0 = not counted)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{system}-completion.json"
    db = workdir / f"{system}-results.db"
    for f in (out, db, Path(f"{db}-wal"), Path(f"{db}-shm"), *workdir.glob("*.ready")):
        f.unlink(missing_ok=True)
    asyncio.run(SETUP[system](url))
    workers = [_spawn(system, "worker", url, workdir / f"{system}-w{k}.log", "--name", f"w{k}",
                      "--ready", str(workdir / f"w{k}.ready")) for k in (1, 2)]
    completion = _spawn(system, "completion", url, workdir / f"{system}-completion.log",
                        "--n", str(n), "--db", str(db), "--out", str(out), "--ready", str(workdir / "completion.ready"))
    ready = [workdir / f"w{k}.ready" for k in (1, 2)] + [workdir / "completion.ready"]
    wait_until(lambda: all(f.exists() for f in ready) or any(p.poll() is not None for p in (*workers, completion)),
               60, f"{system} workers and completion ready")
    dead = [p.args[4:6] for p in (*workers, completion) if p.poll() is not None]
    if dead:
        raise RuntimeError(f"{system} roles exited early: {dead}; see the logs in {workdir}")
    cpu: dict[str, float] = {}
    try:
        server_cpu0 = cpu_s(server_pid) if server_pid else 0.0
        workers_cpu0 = [cpu_s(w.pid) for w in workers]
        t0_wall, cpu0 = time.time(), time.process_time()
        prod = asyncio.run(PRODUCE[system](url, n, batch, window, rate_per_s))
        cpu["producer (this process)"] = round(time.process_time() - cpu0, 2)
        completion.wait(timeout=timeout_s)
        if server_pid:
            cpu["server"] = round(cpu_s(server_pid) - server_cpu0, 2)
        for k, (w, c0) in enumerate(zip(workers, workers_cpu0), 1):
            cpu[f"worker-{k}"] = round(cpu_s(w.pid) - c0, 2)
        if completion.returncode != 0:
            raise RuntimeError(f"{system} completion exited {completion.returncode}")
        res = json.loads(out.read_text())
        elapsed_s = res["t_done"] - t0_wall
        cpu["completion"] = round(res["cpu_s"], 2)
    finally:
        for p in (*workers, completion):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (*workers, completion):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return {**pipeline_record(system, n=n, batch=batch, window=window, rate_per_s=rate_per_s, elapsed_s=elapsed_s,
                              producer=prod, latencies_ms=res["latencies_ms"]),
            "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.peer_pipeline")
    ap.add_argument("system", choices=["redis", "rabbit"])
    ap.add_argument("role", choices=["worker", "completion"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", default="w1")
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--db", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--ready", default="", help="file to create once connected")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.role == "worker":
        asyncio.run(ROLES[(args.system, "worker")](args.url, args.name, Path(args.ready)))
        return 0
    res = asyncio.run(COMPLETION[args.system](args.url, args.n, Path(args.db), Path(args.ready)))
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
