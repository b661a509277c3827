"""Worker metrics (``metrics_listen`` in workerd-N.toml), served by :mod:`ccsq.common.runtime.metrics_exporter`.

Nothing here runs per item unless noted: histograms are observed once per
batch (handler) and once per journal group commit; gauges are read from the
worker's own counters when Prometheus scrapes. Label ``worker`` = peer id.

- ``ccsq_worker_batch_items`` (histogram): items per handler call (batch size).
- ``ccsq_worker_handler_seconds`` (histogram): wall time of one handler call
  (``run`` or ``run_batch``). GPU busy fraction of a worker =
  ``rate(ccsq_worker_handler_seconds_sum[5m]) / ccsq_worker_gpu_slots``.
- ``ccsq_worker_journal_commit_seconds`` (histogram): one journal group
  commit (SQLite transaction with its fsync, plus the hop to the journal thread).
- ``ccsq_worker_store_errors_total{op,error}``: claim-store calls that raised
  (``op`` get|put, ``error`` missing|error). Counted by a thin wrapper around
  the store, installed only when metrics are on (one call frame per blob call).
- gauges: ``ccsq_worker_gpu_slots``, ``ccsq_worker_gpu_busy_slots`` (handler
  calls running now), ``ccsq_worker_gpu_lost_slots`` (slots held by a stuck
  inference thread), ``ccsq_worker_jobs`` (leases held), ``ccsq_worker_unconfirmed_reports``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from ccsq.common.wire.errors import PayloadMissing
from ccsq.common.runtime.metrics_exporter import start_exporter

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.common.storage.claimstore import ClaimStore
    from ccsq.workerd.worker import Worker

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
HANDLER_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
COMMIT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class WorkerStats:
    """The worker's instruments, in their own registry."""

    def __init__(self, worker_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.worker_id = worker_id
        self.batch_items = Histogram("ccsq_worker_batch_items", "items per handler call", ["worker"],
                                     buckets=BATCH_BUCKETS, registry=self.registry).labels(worker_id)
        self.handler_seconds = Histogram("ccsq_worker_handler_seconds", "wall time of one handler call (run / run_batch)",
                                         ["worker"], buckets=HANDLER_BUCKETS_S, registry=self.registry).labels(worker_id)
        self.journal_commit_seconds = Histogram(
            "ccsq_worker_journal_commit_seconds", "one journal group commit including its fsync", ["worker"],
            buckets=COMMIT_BUCKETS_S, registry=self.registry).labels(worker_id)
        self.store_errors = Counter("ccsq_worker_store_errors", "claim-store calls that raised", ["worker", "op", "error"],
                                    registry=self.registry)
        for op in ("get", "put"):
            for error in ("missing", "error"):
                self.store_errors.labels(worker_id, op, error)  # exported as 0 from the start

    def batch(self, items: int, runtime_s: float) -> None:
        """One handler call finished (called once per batch)."""
        self.batch_items.observe(items)
        self.handler_seconds.observe(runtime_s)

    def journal_commit(self, ops: int, seconds: float) -> None:
        """One journal group commit finished."""
        self.journal_commit_seconds.observe(seconds)

    def store_error(self, op: str, exc: BaseException) -> None:
        self.store_errors.labels(self.worker_id, op, "missing" if isinstance(exc, PayloadMissing) else "error").inc()


class CountingStore:
    """The worker's claim store with its errors counted (everything else passes through)."""

    def __init__(self, store: Any, stats: WorkerStats) -> None:
        self._store = store
        self._stats = stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def get_blob(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._store.get_blob(*args, **kwargs)
        except Exception as exc:
            self._stats.store_error("get", exc)
            raise

    def put_blob(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._store.put_blob(*args, **kwargs)
        except Exception as exc:
            self._stats.store_error("put", exc)
            raise


class _WorkerCollector:
    """Gauges read from the worker when Prometheus scrapes (no cost per item)."""

    def __init__(self, worker: Worker, worker_id: str) -> None:
        self.worker = worker
        self.worker_id = worker_id

    def collect(self) -> Any:
        w, wid = self.worker, [self.worker_id]
        gate = w.gate
        for name, help_, value in (
            ("ccsq_worker_gpu_slots", "concurrent handler calls allowed (slots)", gate.slots),
            ("ccsq_worker_gpu_busy_slots", "handler calls running now", gate.busy),
            ("ccsq_worker_gpu_lost_slots", "slots held by an inference thread that overran its limit", gate.lost),
            ("ccsq_worker_jobs", "leases this worker holds (fetching, queued, running, reporting)", len(w.jobs)),
            ("ccsq_worker_unconfirmed_reports", "results/failures the broker has not confirmed yet", len(w.reports.unconfirmed)),
        ):
            g = GaugeMetricFamily(name, help_, labels=["worker"])
            g.add_metric(wid, float(value))
            yield g


def start_worker_metrics(worker: Worker, listen: str, *, where: str) -> Any:
    """Install the per-batch hooks on ``worker`` and serve its metrics at ``listen``
    (``metrics_listen``); returns the server or None when ``listen`` is empty.
    Raises ConfigError (bad address / cannot bind)."""
    if not listen:
        return None
    stats = WorkerStats(worker.cfg.peer_id)
    stats.registry.register(_WorkerCollector(worker, worker.cfg.peer_id))
    server = start_exporter(stats.registry, listen, process="workerd", where=where)
    worker.lanes.observe_batch = stats.batch
    worker.journal_writer.observe_commit = stats.journal_commit  # the journal's group commit (once per commit)
    worker.store = cast("ClaimStore", CountingStore(worker.store, stats))  # a pass-through wrapper, duck-typed
    worker.metrics_stats = stats  # type: ignore[attr-defined]
    return server
