"""Benchmark 1, ccsq side: producer -> ccsq-brokerd -> 2 x ccsq-workerd (echo) -> ccsq completion (SQLite).

Real daemons, as ``make demo`` runs them (``ccsq init`` layout, separate
processes). The producer is the real :class:`~ccsq.producer.client.AsyncClient`
in this process: each batch is one ``submit_many`` call, which returns after the
broker's SUBMIT_ACK (sent after its fsynced commit). Each job carries a 1 KiB
claim reference inline and its submit wall time in ``params["t"]``.

Done means acknowledged: the run ends when the ledger counts ``n`` acknowledged
items. Latency of a job = its ``acked_ms`` in the ledger - ``params["t"]``.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import lmdb

from bench.common import claim_ref, cpu_s, disk_bytes, hist_summary, pipeline_record, rss_bytes, scrape_histograms
from bench.driver import produce
from ccsq.brokerd.ledger import schema
from ccsq.brokerd.ledger.store import Ledger, data_paths
from ccsq.tools.init import init_swarm
from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port, wait_until

#: Worker/completion tuning used by the benchmark (stated in docs/benchmarks.md).
WORKER_SLOTS = 4
WORKER_PREFETCH = 64
#: Jobs per handler call: the peers' workers take up to 64 jobs per read
#: (``peer_pipeline.WORKER_BATCH``); ccsq's dynamic batching does the same.
WORKER_MAX_BATCH = 64
#: The peers' reads return at once with what has arrived (``XREADGROUP ... BLOCK`` waits only while
#: nothing is there; AMQP prefetch pushes what is there): no wait for a fuller batch, as here.
WORKER_MAX_WAIT_MS = 0.0
#: One log line per batch and per report frame, not two per job (the peers log nothing per job;
#: ``log_each_job`` in docs/benchmarks.md). The default config logs each job.
WORKER_LOG_EACH_JOB = False
COMPLETION_CREDIT = 512
#: The pair's etcd namespace (``ha_swarm_id``) and node ids (bench/ha_sync.py; docs/ha.md).
HA_SWARM = "bench-pair"
HA_NODES = ("broker-1", "broker-2")


def _pair_configs(root: Path, configs: dict[str, Path], etcd_url: str) -> Path:
    """Make ``root``'s single-broker swarm a replicated pair (docs/ha.md, "Running a pair"):
    node keys broker-1/broker-2 (role ``standby`` in authorized_keys.toml), ``brokerd.toml`` the
    primary (broker-1, ledger in ``broker-data/``), ``brokerd-2.toml`` the standby (broker-2,
    ``broker-data-2/``, its own peer and replication ports), both with ``ha_etcd_endpoints`` =
    ``etcd_url`` and ``ha_mode = "sync"``; every peer's ``broker_endpoint`` lists the primary first,
    then the standby. Returns the standby's config path."""
    import tomllib

    import tomli_w

    from ccsq.common.wire.keys import load_private_key, public_key_b64, write_keypair

    auth_path = root / "authorized_keys.toml"
    auth = tomllib.loads(auth_path.read_text())
    for node in HA_NODES:
        priv, _ = write_keypair(root / "keys", node)
        auth["peers"][node] = {"role": "standby", "public_key": public_key_b64(load_private_key(priv))}
    auth_path.write_text(tomli_w.dumps(auth))
    primary = tomllib.loads(configs["brokerd"].read_text())
    ha = {"ha_etcd_endpoints": etcd_url, "ha_swarm_id": HA_SWARM, "ha_mode": "sync"}
    primary.update(ha, ha_node_id=HA_NODES[0], ha_node_key=f"keys/{HA_NODES[0]}.key",
                   ha_repl_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}")
    standby = {**primary, "data_dir": "broker-data-2", "endpoint": f"tcp://127.0.0.1:{free_tcp_port()}",
               "ha_node_id": HA_NODES[1], "ha_node_key": f"keys/{HA_NODES[1]}.key",
               "ha_repl_endpoint": f"tcp://127.0.0.1:{free_tcp_port()}"}
    standby.pop("metrics_port", None)
    configs["brokerd"].write_text(tomli_w.dumps(primary))
    standby_path = root / "brokerd-2.toml"
    standby_path.write_text(tomli_w.dumps(standby))
    for name, path in configs.items():
        if name == "brokerd":
            continue
        doc = tomllib.loads(path.read_text())
        if "broker_endpoint" in doc:
            doc["broker_endpoint"] = f"{primary['endpoint']},{standby['endpoint']}"
            path.write_text(tomli_w.dumps(doc))
    return standby_path


def wait_in_sync(etcd_url: str, node: str, timeout_s: float) -> None:
    """Wait until etcd's ``/ccsq/<HA_SWARM>/sync`` lists ``node`` (the primary counts it in sync)."""
    from ccsq.brokerd.election import Election

    observer = Election([etcd_url], HA_SWARM, "bench-observer", request_timeout_s=5.0)
    wait_until(lambda: (s := observer.read_sync()) is not None and node in s.members, timeout_s,
               f"{node} in /ccsq/{HA_SWARM}/sync", interval_s=0.1)


def start_swarm(root: Path, *, workers: int = 2, handler: str = "echo", broker: dict | None = None,
                worker: dict | None = None, completion: dict | None = None,
                start_completion: bool = True, start_workers: int | None = None,
                ha_etcd: str | None = None) -> tuple[ProcessGroup, dict[str, Path]]:
    """A fresh swarm under ``root`` (deleted first) with broker, ``workers`` workers
    (configured; the first ``start_workers`` started, default all) and the completion
    service started and ready; returns (process group, config paths).

    ``ha_etcd``: an etcd client URL: the broker is the primary of a pair (:func:`_pair_configs`)
    and a second ``ccsq-brokerd``, process ``standby``, runs as its sync standby; the peers start
    once etcd's sync set lists the standby."""
    shutil.rmtree(root, ignore_errors=True)
    configs = init_swarm(
        root,
        endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
        workers=workers,
        handler=handler,
        broker={"min_free_disk_bytes": 0, **(broker or {})},
        worker={"slots": WORKER_SLOTS, "prefetch": WORKER_PREFETCH, "max_batch": WORKER_MAX_BATCH,
                "max_wait_ms": WORKER_MAX_WAIT_MS, "log_each_job": WORKER_LOG_EACH_JOB, **(worker or {})},
        completion={"credit": COMPLETION_CREDIT, **(completion or {})},
    )
    standby_cfg = _pair_configs(root, configs, ha_etcd) if ha_etcd else None
    procs = ProcessGroup(root / "logs")
    try:
        procs.start("broker", [bin_path("ccsq-brokerd"), "--config", str(configs["brokerd"])], ready_event="broker_started")
        if standby_cfg is not None:
            configs["brokerd-2"] = standby_cfg
            procs.start("standby", [bin_path("ccsq-brokerd"), "--config", str(standby_cfg)], ready_event="ha_standby")
            wait_in_sync(ha_etcd, HA_NODES[1], 120)
        for n in range(1, (workers if start_workers is None else start_workers) + 1):
            procs.start(f"worker-{n}", [bin_path("ccsq-workerd"), "--config", str(configs[f"workerd-{n - 1}"])],
                        ready_event="broker_link_ready", ready_timeout_s=120)
        if start_completion:
            procs.start("completion", [bin_path("ccsq"), "completion", "--config", str(configs["completion"])],
                        ready_event="broker_link_ready")
    except BaseException:
        procs.stop_all()
        raise
    return procs, configs


def check_alive(procs: ProcessGroup) -> None:
    """Raise RuntimeError (with the log tail) if a started daemon has exited."""
    for name, proc in procs.procs.items():
        if proc.popen is not None and not proc.running:
            raise RuntimeError(f"{name} exited {proc.popen.returncode}; log tail:\n{procs.tail(name, 10)}")


class AckCounter:
    """The ledger's acknowledged counter, read while the broker writes: one read-only
    LMDB environment kept open (each :meth:`__call__` is one cheap read transaction),
    so polling it does not steal the CPU the measured pipeline runs on."""

    def __init__(self, root: Path) -> None:
        self.path = data_paths(root / "broker-data")[0]
        self.ledger = Ledger(self.path, readonly=True)

    def __call__(self) -> int:
        try:
            with self.ledger.read() as view:
                return view.counter("acknowledged")
        except lmdb.MapResizedError:  # the broker grew the map: open it again at the new size
            self.ledger.close()
            self.ledger = Ledger(self.path, readonly=True)
            return self()

    def close(self) -> None:
        self.ledger.close()

    def __enter__(self) -> AckCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def acknowledged(root: Path) -> int:
    """The ledger's acknowledged counter (a fresh read-only open: safe while the broker writes)."""
    with AckCounter(root) as count:
        return count()


def latencies_ms(root: Path, facts: dict[str, int] | None = None) -> list[float]:
    """submit -> acknowledged of every acknowledged item that carries ``params["t"]`` (ms).

    ``facts``, when given, receives ``rerun`` (items leased more than once), ``redelivered``
    (results delivered to the completion service again, gap G3) and ``acknowledged``."""
    ledger = Ledger(data_paths(root / "broker-data")[0], readonly=True)

    out: list[float] = []
    rerun = 0
    try:
        with ledger.read() as view:
            for k, raw in view.txn.cursor(db=view.db["items"]):
                rec = schema.unpack_item(raw, k.decode())  # any record format (1, 2 or 3)
                t = rec.get("params", {}).get("t")
                rerun += rec.get("attempt", 0) > 1
                if rec.get("acked_ms") and isinstance(t, float):
                    out.append(rec["acked_ms"] - t * 1000.0)
            if facts is not None:
                facts.update(rerun=rerun, redelivered=view.counter("redelivered"),
                             acknowledged=view.counter("acknowledged"))
    finally:
        ledger.close()
    return out


def commit_histograms(metrics_port: int) -> dict[str, Any]:
    """Benchmark 6 from the broker's own Prometheus histograms (``/metrics``):
    item records per group commit and commit time including the fsync.

    Returns ``{"commits", "records_per_commit": {...}, "commit_ms": {...}}`` (see
    :func:`bench.common.hist_summary`), or ``{"commits": 0}``."""
    hist = scrape_histograms(metrics_port, ("ccsq_commit_records", "ccsq_commit_seconds"))
    rec, sec = hist.get("ccsq_commit_records"), hist.get("ccsq_commit_seconds")
    if not rec or not sec or not rec["count"]:
        return {"commits": 0}
    return {"commits": int(rec["count"]), "records_per_commit": hist_summary(rec), "commit_ms": hist_summary(sec, 1000.0)}


async def _produce(producer_toml: Path, n: int, batch: int, window: int, rate_per_s: float | None) -> dict[str, float]:
    from ccsq.producer.client import AsyncClient

    async with AsyncClient.from_config_file(producer_toml) as client:
        async def submit_batch(start: int, count: int) -> None:
            t = time.time()
            await client.submit_many([(claim_ref(i), "echo", {"t": t}) for i in range(start, start + count)],
                                     timeout_s=120)

        return await produce(submit_batch, n, batch=batch, window=window, rate_per_s=rate_per_s)


def run(root: Path, n: int, *, batch: int = 100, window: int = 8, rate_per_s: float | None = None,
        timeout_s: float = 900.0, profile_out: Path | None = None, fsync_trace: Path | None = None,
        profile_all: Path | None = None, kill_at: float | None = None, settle_s: float = 60.0,
        ha_etcd: str | None = None, other_pids: dict[str, int] | None = None) -> dict[str, Any]:
    """One pipeline run of ``n`` jobs; returns throughput, latency and broker facts.

    ``profile_out``: record the broker with py-spy (raw collapsed stacks) while it runs.
    ``fsync_trace``: also run ``strace -T`` on the broker's fdatasync/fsync calls.
    ``profile_all``: a directory: record every daemon (broker, workers, completion) with py-spy,
    ``<name>.txt`` each (the producer is this process: not recorded).
    ``kill_at``: a kill run: SIGKILL worker-1 once that share of the jobs is acknowledged, restart it
    1 s later; items not acknowledged ``settle_s`` after the last submit are lost (``"kill"``).
    ``ha_etcd``: run against a primary with a sync standby (:func:`start_swarm`); ``cpu_s`` then
    has ``standby`` too, and ``broker`` is the primary. ``other_pids``: more processes (name: pid,
    e.g. the pair's etcd) whose CPU during the run goes into ``cpu_s``."""
    metrics_port = free_tcp_port()
    procs, configs = start_swarm(root, broker={"metrics_port": metrics_port}, ha_etcd=ha_etcd)
    spy = strace = None
    spies: list[subprocess.Popen] = []
    kill: dict[str, Any] = {}
    killer = None
    try:
        broker_pid = procs.procs["broker"].popen.pid
        if profile_out is not None:
            spy = subprocess.Popen([bin_path("py-spy"), "record", "-p", str(broker_pid), "-r", "200", "--format", "raw",
                                    "-o", str(profile_out), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if profile_all is not None:
            profile_all.mkdir(parents=True, exist_ok=True)
            for name, proc in procs.procs.items():
                spies.append(subprocess.Popen([bin_path("py-spy"), "record", "-p", str(proc.popen.pid), "-r", "100",
                                               "--format", "raw", "-o", str(profile_all / f"{name}.txt"), "--nonblocking", "--gil"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if kill_at:
            import threading

            worker_argv = list(procs.procs["worker-1"].argv)
            counter, lock = AckCounter(root), threading.Lock()  # LMDB: one environment per process

            def acked_now() -> int:
                with lock:
                    return counter()

            def kill_and_restart() -> None:
                try:
                    wait_until(lambda: acked_now() >= int(n * kill_at), timeout_s, "kill point", interval_s=0.01)
                except TimeoutError:
                    return
                procs.kill("worker-1")
                kill.update(worker_killed="worker-1", killed_at_landed=int(n * kill_at))
                time.sleep(1.0)
                procs.start("worker-1", worker_argv, ready_event="broker_link_ready", ready_timeout_s=120)

            killer = threading.Thread(target=kill_and_restart, daemon=True)
            killer.start()
        if fsync_trace is not None and shutil.which("strace"):
            strace = subprocess.Popen(["strace", "-f", "-T", "-ttt", "-e", "trace=fdatasync,fsync,msync",
                                       "-o", str(fsync_trace), "-p", str(broker_pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # strace attaches asynchronously; nothing to poll for
        rss_before = rss_bytes(broker_pid)
        cpu_before = {name: cpu_s(proc.popen.pid) for name, proc in procs.procs.items()}
        other_before = {name: cpu_s(pid) for name, pid in (other_pids or {}).items()}
        t0, cpu0 = time.monotonic(), time.process_time()
        prod = asyncio.run(_produce(configs["producer"], n, batch, window, rate_per_s))
        if kill_at:  # worker-1 is down for a while on purpose; what is not acknowledged in time is lost
            try:
                wait_until(lambda: acked_now() >= n, settle_s, f"{n} acknowledged", interval_s=0.02)
            except TimeoutError:
                pass
            if killer is not None:
                killer.join(timeout=130)
            counter.close()
        else:
            with AckCounter(root) as acked:
                wait_until(lambda: check_alive(procs) or acked() >= n, timeout_s, f"{n} acknowledged", interval_s=0.02)
        elapsed_s = time.monotonic() - t0
        rss_after = rss_bytes(broker_pid)
        cpu = {name: round(cpu_s(proc.popen.pid) - cpu_before[name], 2) for name, proc in procs.procs.items()
               if not (kill_at and name == "worker-1")}
        cpu["producer (this process, incl. polling)"] = round(time.process_time() - cpu0, 2)
        cpu.update({name: round(cpu_s(pid) - other_before[name], 2) for name, pid in (other_pids or {}).items()})
        group_commit = commit_histograms(metrics_port)
    finally:
        for tool in (spy, strace, *spies):
            if tool is not None and tool.poll() is None:
                tool.send_signal(2)  # SIGINT: both tools write their output and exit
                try:
                    tool.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    tool.kill()
        procs.stop_all()
    facts: dict[str, int] = {}
    lat = latencies_ms(root, facts)
    if kill_at:
        kill.update(lost=n - facts["acknowledged"], doubled=facts["redelivered"], rerun=facts["rerun"],
                    settle_s=settle_s)
    return {
        **pipeline_record("ccsq", n=n, batch=batch, window=window, rate_per_s=rate_per_s, elapsed_s=elapsed_s,
                          producer=prod, latencies_ms=lat),
        "broker_rss_bytes": {"before": rss_before, "after": rss_after},
        "cpu_s": cpu,
        "group_commit": group_commit,
        "ledger_disk_bytes": disk_bytes(root / "broker-data"),
        **({"kill": kill} if kill_at else {}),
    }
