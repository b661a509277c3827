"""Benchmark 1, peer side: the same pipeline on Redis Streams, on a RabbitMQ quorum queue,
on Celery (Redis broker) and on dramatiq (RabbitMQ broker).

Same shape and durability as ccsq (the path of one item in docs/architecture.md, minus the claim store):

- producer (this process): each batch of jobs (a 1 KiB claim reference + submit
  wall time) returns only after the server's durable confirm: Redis replies
  after its AOF fsync (``appendfsync always``); RabbitMQ sends publisher
  confirms after the quorum queue's log is fsynced.
- 2 worker processes: receive (Redis: XREADGROUP into the group's pending list,
  itself AOF-logged; RabbitMQ: manual-ack consumer with prefetch), do no work,
  publish each result durably (Redis: XADD results + XACK job in one MULTI/EXEC;
  RabbitMQ: publish to the ``results`` quorum queue and wait for the confirms,
  *then* ack the jobs).
- 1 completion process: receive results, land them in SQLite with ccsq's own
  :class:`~ccsq.completiond.resultsdb.SqliteResults` (one transaction per batch),
  *then* acknowledge them (Redis XACK, fsynced; RabbitMQ basic.ack), and record
  submit -> acknowledged per job. It exits after ``n`` jobs and writes a JSON file.

Celery and dramatiq run their own workers (``bench/celery_app.py``,
``bench/dramatiq_app.py``, settings there and in docs/benchmarks.md); their
results go through the same batching completion consumers (Celery: the Redis
stream consumer; dramatiq: the AMQP consumer) into the same SQLite code. Their
producers run in a process of their own (the frameworks read their broker URL
at import), sending one job per call as their users do.

A *kill run* (``kill_at``) SIGKILLs worker 1 once that share of the jobs has
landed, restarts it a second later (as systemd would), and counts lost jobs
(never landed within ``settle_s`` after the last submit) and doubled results
(landed more than once).

Run roles as ``python -m bench.peer_pipeline SYSTEM {worker|completion|producer|setup} ...``.
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
from ccsq.tools.procs import wait_until

SYSTEMS = ("redis", "rabbit", "celery", "dramatiq")

JOBS, RESULTS = "jobs", "results"
WORKER_BATCH = 64  # jobs taken per read (Redis COUNT / RabbitMQ prefetch)
COMPLETION_BATCH = 256  # results per SQLite transaction (ccsq completion: batch_max 256)
COMPLETION_WAIT_MS = 0.0  # gather what has arrived (ccsq completion: batch_wait_ms 0, its default since 2026-12-01)
#: redis-py 8 gives up on a reply after 5 s by default; Redis with appendfsync always on a loaded
#: machine can stall longer (a kill run ended with "Timeout reading"): the harness waits, like the peers do
REDIS_SOCKET_TIMEOUT_S = 60.0


# --- Redis Streams ------------------------------------------------------------------
async def redis_setup(url: str, streams: tuple[tuple[str, str], ...] = ((JOBS, "workers"), (RESULTS, "completion"))) -> None:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    for stream, group in streams:
        try:
            await r.xgroup_create(stream, group, id="$", mkstream=True)
        except Exception as exc:  # BUSYGROUP: already there
            if "BUSYGROUP" not in str(exc):
                raise
    await r.aclose()


async def redis_produce(url: str, n: int, batch: int, window: int, rate_per_s: float | None) -> dict[str, float]:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url, socket_timeout=REDIS_SOCKET_TIMEOUT_S)

    async def submit_batch(start: int, count: int) -> None:
        t = repr(time.time())
        pipe = r.pipeline(transaction=False)
        for i in range(start, start + count):
            pipe.xadd(JOBS, {"ref": claim_ref(i), "t": t, "i": i})
        await pipe.execute()  # replies come after the AOF fsync

    try:
        return await produce(submit_batch, n, batch=batch, window=window, rate_per_s=rate_per_s)
    finally:
        await r.aclose()


async def redis_worker(url: str, name: str, ready: Path) -> None:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    await r.ping()
    ready.touch()
    start = "0"  # first the jobs this consumer read before a crash (its pending entries), then new ones
    while True:
        got = await r.xreadgroup("workers", name, {JOBS: start}, count=WORKER_BATCH, block=1000)
        if start == "0" and (not got or not got[0][1]):
            start = ">"
            continue
        if not got:
            continue
        entries = got[0][1]
        pipe = r.pipeline(transaction=True)  # MULTI/EXEC: results and acks land together
        for _id, fields in entries:
            pipe.xadd(RESULTS, {"ref": fields[b"ref"], "t": fields[b"t"], "result": fields[b"ref"], "i": fields[b"i"]})
        pipe.xack(JOBS, "workers", *[e[0] for e in entries])
        await pipe.execute()


class Landing:
    """What the completion consumer saw: per job index how often its result landed,
    latency of the first landing; ``done`` once all ``n`` jobs landed or a stop was asked."""

    def __init__(self, n: int, mark_at: int, mark: Path | None) -> None:
        self.n, self.mark_at, self.mark = n, mark_at, mark
        self.count: dict[int, int] = {}
        self.lat_ms: list[float] = []
        self.landed = 0
        self.stop = asyncio.Event()
        self.cpu0 = time.process_time()  # CPU of the run only, like the ccsq side (not imports and connecting)

    def add(self, jobs: list[tuple[int, float]]) -> None:
        now = time.time()
        for i, t in jobs:
            if i < 0:  # the framework producers' connecting job
                continue
            self.landed += 1
            if i in self.count:
                self.count[i] += 1
            else:
                self.count[i] = 1
                self.lat_ms.append((now - t) * 1000)
        if self.mark is not None and len(self.count) >= self.mark_at and not self.mark.exists():
            self.mark.touch()

    @property
    def done(self) -> bool:
        return len(self.count) >= self.n or self.stop.is_set()

    def result(self) -> dict[str, Any]:
        return {"latencies_ms": self.lat_ms, "t_done": time.time(), "cpu_s": time.process_time() - self.cpu0,
                "landed": self.landed, "distinct": len(self.count),
                "doubled": sum(c - 1 for c in self.count.values())}


def _stop_on_sigterm(land: Landing) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, land.stop.set)


async def redis_completion(url: str, land: Landing, db_path: Path, ready: Path) -> dict[str, Any]:
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(url, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    db = _open_db(db_path)
    await r.ping()
    _stop_on_sigterm(land)
    ready.touch()
    land.cpu0 = time.process_time()
    while not land.done:
        got = await r.xreadgroup("completion", "c1", {RESULTS: ">"}, count=COMPLETION_BATCH, block=int(COMPLETION_WAIT_MS))
        if not got:
            continue
        entries = got[0][1]
        jobs = [(int(f[b"i"]), float(f[b"t"])) for _e, f in entries]
        rows = [_row(f"job-{i}", f[b"result"], t) for (i, t), (_e, f) in zip(jobs, entries)]
        await asyncio.to_thread(db.land, rows)
        await r.xack(RESULTS, "completion", *[e[0] for e in entries])
        land.add(jobs)
    await r.aclose()
    db.close()
    return land.result()


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
            ex.publish(aio_pika.Message(claim_ref(i), delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers={"t": t, "i": i}),
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


def _rabbit_job(m) -> tuple[int, float, bytes]:
    return int(m.headers["i"]), float(m.headers["t"]), m.body


def _dramatiq_job(m) -> tuple[int, float, bytes]:
    ref, i, t = json.loads(m.body)["args"]
    return int(i), float(t), ref.encode()


async def rabbit_completion(url: str, land: Landing, db_path: Path, ready: Path, *, dramatiq: bool = False) -> dict[str, Any]:
    import aio_pika

    conn = await aio_pika.connect(url)
    ch = await conn.channel()
    await ch.set_qos(prefetch_count=2 * COMPLETION_BATCH)
    if dramatiq:  # declared by dramatiq (durable classic queue with its dead-letter arguments)
        results = await ch.declare_queue(RESULTS, passive=True)
    else:
        results = await ch.declare_queue(RESULTS, durable=True, arguments=QUORUM)
    decode = _dramatiq_job if dramatiq else _rabbit_job
    inbox: asyncio.Queue = asyncio.Queue()
    await results.consume(inbox.put, no_ack=False)
    db = _open_db(db_path)
    _stop_on_sigterm(land)
    ready.touch()
    land.cpu0 = time.process_time()
    while not land.done:
        try:
            msgs = [await asyncio.wait_for(inbox.get(), 0.5)]
        except asyncio.TimeoutError:
            continue
        # what has arrived (delivered while the last batch's transaction committed) joins this
        # batch at once, as ccsq's completion service gathers (batch_max 256, batch_wait_ms 0);
        # only then wait up to COMPLETION_WAIT_MS for more (0: not at all)
        while len(msgs) < COMPLETION_BATCH and not inbox.empty():
            msgs.append(inbox.get_nowait())
        deadline = time.monotonic() + COMPLETION_WAIT_MS / 1000
        while len(msgs) < COMPLETION_BATCH:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                msgs.append(await asyncio.wait_for(inbox.get(), left))
            except asyncio.TimeoutError:
                break
        decoded = [decode(m) for m in msgs]
        rows = [_row(f"job-{i}", body, t) for i, t, body in decoded]
        await asyncio.to_thread(db.land, rows)
        await msgs[-1].ack(multiple=True)
        land.add([(i, t) for i, t, _b in decoded])
    await conn.close()
    db.close()
    return land.result()


# --- Celery (Redis broker) and dramatiq (RabbitMQ broker) --------------------------------
def framework_produce(system: str, n: int, batch: int, window: int, rate_per_s: float | None) -> dict[str, Any]:
    """Producer of the Celery / dramatiq runs (its own process): one framework send per job,
    ``window`` threads each sending one batch (each send returns after the broker's durable
    confirm: Redis' reply after the AOF fsync; RabbitMQ's publisher confirm)."""
    from concurrent.futures import ThreadPoolExecutor

    if system == "celery":
        from bench.celery_app import job

        def send(i: int, t: str) -> None:
            job.apply_async((claim_ref(i).decode(), i, t))
    else:
        from bench.dramatiq_app import job

        def send(i: int, t: str) -> None:
            job.send(claim_ref(i).decode(), i, t)

    pool = ThreadPoolExecutor(window)
    send(-1, repr(time.time()))  # connect (untimed); job -1 is ignored by the count
    loop_cpu0, t0_wall = time.process_time(), time.time()

    def batch_sync(start: int, count: int) -> None:
        t = repr(time.time())
        for i in range(start, start + count):
            send(i, t)

    async def submit_batch(start: int, count: int) -> None:
        await asyncio.get_running_loop().run_in_executor(pool, batch_sync, start, count)

    prod = asyncio.run(produce(submit_batch, n, batch=batch, window=window, rate_per_s=rate_per_s))
    pool.shutdown()
    return {"producer": prod, "t0_wall": t0_wall, "cpu_s": time.process_time() - loop_cpu0}


def dramatiq_setup() -> None:
    from bench.dramatiq_app import broker

    for q in (JOBS, RESULTS):
        broker.declare_queue(q, ensure=True)
    broker.close()


def dramatiq_worker(ready: Path) -> None:
    """One dramatiq worker process: the default 8 worker threads, queue prefetch 64 (like the other peers)."""
    import threading

    import dramatiq

    from bench.dramatiq_app import broker

    worker = dramatiq.Worker(broker, queues={JOBS}, worker_threads=8)
    worker.queue_prefetch = WORKER_BATCH
    worker.start()
    ready.touch()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    worker.stop()


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
FRAMEWORKS = ("celery", "dramatiq")


def _env(url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "CCSQ_BENCH_URL": url, **extra}


def _spawn(system: str, role: str, url: str, log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "bench.peer_pipeline", system, role, "--url", url, *extra],
                                cwd=ROOT, env=_env(url), stdout=f, stderr=subprocess.STDOUT)


def _spawn_worker(system: str, url: str, workdir: Path, k: int) -> subprocess.Popen:
    ready = workdir / f"w{k}.ready"
    ready.unlink(missing_ok=True)
    log = workdir / f"{system}-w{k}.log"
    if system != "celery":
        return _spawn(system, "worker", url, log, "--name", f"w{k}", "--ready", str(ready))
    # a solo-pool Celery worker is one process: the one a SIGKILL takes down
    argv = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "--pool=solo", "-Q", JOBS,
            "-n", f"w{k}@bench", "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel=WARNING"]
    with open(log, "ab") as f:
        return subprocess.Popen(argv, cwd=ROOT, env=_env(url, CCSQ_BENCH_READY=str(ready)), stdout=f,
                                stderr=subprocess.STDOUT)


def _setup(system: str, url: str, workdir: Path) -> None:
    if system == "celery":
        asyncio.run(redis_setup(url, ((RESULTS, "completion"),)))
    elif system == "dramatiq":
        subprocess.run([sys.executable, "-m", "bench.peer_pipeline", system, "setup", "--url", url], cwd=ROOT,
                       env=_env(url), check=True, timeout=120)
    else:
        asyncio.run(SETUP[system](url))


def run(system: str, url: str, workdir: Path, n: int, *, batch: int = 100, window: int = 8,
        rate_per_s: float | None = None, timeout_s: float = 900.0, server_pid: int = 0,
        kill_at: float | None = None, settle_s: float = 60.0) -> dict[str, Any]:
    """One pipeline run of ``n`` jobs on ``system`` (one of :data:`SYSTEMS`) at ``url`` (a fresh server
    whose process is ``server_pid``, for its CPU seconds; 0 = not counted).

    ``kill_at``: a kill run: SIGKILL worker 1 once that share of the jobs has landed, restart it 1 s
    later; jobs not landed ``settle_s`` after the last submit are lost (``"kill"`` in the result)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{system}-completion.json"
    prod_out = workdir / f"{system}-producer.json"
    mark = workdir / "kill.mark"
    db = workdir / f"{system}-results.db"
    for f in (out, prod_out, mark, db, Path(f"{db}-wal"), Path(f"{db}-shm"), *workdir.glob("*.ready")):
        f.unlink(missing_ok=True)
    _setup(system, url, workdir)
    workers = [_spawn_worker(system, url, workdir, k) for k in (1, 2)]
    mark_args = ["--mark-at", str(max(1, int(n * kill_at))), "--mark", str(mark)] if kill_at else []
    completion = _spawn(system, "completion", url, workdir / f"{system}-completion.log",
                        "--n", str(n), "--db", str(db), "--out", str(out), "--ready", str(workdir / "completion.ready"),
                        *mark_args)
    ready = [workdir / f"w{k}.ready" for k in (1, 2)] + [workdir / "completion.ready"]
    wait_until(lambda: all(f.exists() for f in ready) or any(p.poll() is not None for p in (*workers, completion)),
               120, f"{system} workers and completion ready")
    dead = [p.args[3:6] for p in (*workers, completion) if p.poll() is not None]
    if dead:
        raise RuntimeError(f"{system} roles exited early: {dead}; see the logs in {workdir}")
    cpu: dict[str, float] = {}
    kill: dict[str, Any] = {}
    killer = None
    if kill_at:
        import threading

        def kill_and_restart() -> None:
            try:
                wait_until(lambda: mark.exists() or completion.poll() is not None, timeout_s, "kill mark")
            except TimeoutError:
                return
            if completion.poll() is not None:
                return
            workers[0].kill()
            workers[0].wait()
            kill["killed_at_landed"] = int(n * kill_at)
            time.sleep(1.0)
            workers[0] = _spawn_worker(system, url, workdir, 1)

        killer = threading.Thread(target=kill_and_restart, daemon=True)
        killer.start()
    try:
        server_cpu0 = cpu_s(server_pid) if server_pid else 0.0
        workers_cpu0 = [cpu_s(w.pid) for w in workers]
        t0_wall, cpu0 = time.time(), time.process_time()
        if system in FRAMEWORKS:
            args = ["--n", str(n), "--batch", str(batch), "--window", str(window), "--out", str(prod_out)]
            if rate_per_s:
                args += ["--rate", str(rate_per_s)]
            producer = _spawn(system, "producer", url, workdir / f"{system}-producer.log", *args)
            if producer.wait(timeout=timeout_s) != 0:
                raise RuntimeError(f"{system} producer exited {producer.returncode}; see {workdir}")
            p_res = json.loads(prod_out.read_text())
            prod, t0_wall = p_res["producer"], p_res["t0_wall"]
            cpu["producer"] = round(p_res["cpu_s"], 2)
        else:
            prod = asyncio.run(PRODUCE[system](url, n, batch, window, rate_per_s))
            cpu["producer"] = round(time.process_time() - cpu0, 2)
        try:
            completion.wait(timeout=settle_s if kill_at else timeout_s)
        except subprocess.TimeoutExpired:
            if not kill_at:
                raise
            completion.send_signal(signal.SIGTERM)  # what has not landed by now is lost
            completion.wait(timeout=60)
        if server_pid:
            cpu["server"] = round(cpu_s(server_pid) - server_cpu0, 2)
        if not kill_at:
            for k, (w, c0) in enumerate(zip(workers, workers_cpu0), 1):
                cpu[f"worker-{k}"] = round(cpu_s(w.pid) - c0, 2)
        if completion.returncode != 0:
            raise RuntimeError(f"{system} completion exited {completion.returncode}")
        res = json.loads(out.read_text())
        elapsed_s = res["t_done"] - t0_wall
        cpu["completion"] = round(res["cpu_s"], 2)
    finally:
        if killer is not None:
            killer.join(timeout=5)
        for p in (*workers, completion):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (*workers, completion):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    record = {**pipeline_record(system, n=n, batch=batch, window=window, rate_per_s=rate_per_s, elapsed_s=elapsed_s,
                                producer=prod, latencies_ms=res["latencies_ms"]),
              "cpu_s": cpu}
    if kill_at:
        record["kill"] = {**kill, "worker_killed": "worker-1" if kill else None, "lost": n - res["distinct"],
                          "doubled": res["doubled"], "landed": res["landed"], "settle_s": settle_s}
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.peer_pipeline")
    ap.add_argument("system", choices=SYSTEMS)
    ap.add_argument("role", choices=["worker", "completion", "producer", "setup"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", default="w1")
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--db", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--ready", default="", help="file to create once connected")
    ap.add_argument("--mark-at", type=int, default=0, help="completion: touch --mark once this many jobs landed")
    ap.add_argument("--mark", default="")
    args = ap.parse_args(argv)
    if args.role == "setup":
        dramatiq_setup()
        return 0
    if args.role == "producer":
        res = framework_produce(args.system, args.n, args.batch, args.window, args.rate or None)
        Path(args.out).write_text(json.dumps(res))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.role == "worker":
        if args.system == "dramatiq":
            dramatiq_worker(Path(args.ready))
        else:
            asyncio.run(ROLES[(args.system, "worker")](args.url, args.name, Path(args.ready)))
        return 0
    land = Landing(args.n, args.mark_at, Path(args.mark) if args.mark else None)
    if args.system in ("redis", "celery"):
        res = asyncio.run(redis_completion(args.url, land, Path(args.db), Path(args.ready)))
    else:
        res = asyncio.run(rabbit_completion(args.url, land, Path(args.db), Path(args.ready),
                                            dramatiq=args.system == "dramatiq"))
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
