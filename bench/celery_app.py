"""The Celery peer of benchmark 1 (``bench.peer_pipeline``, system ``celery``).

Settings (stated in docs/benchmarks.md): Redis broker (the harness's private
``redis-server`` with AOF ``appendfsync always``), ``task_acks_late`` (the job is
acknowledged after the task returned), ``task_reject_on_worker_lost``,
``worker_prefetch_multiplier = 64``, JSON serializer, no result backend: the task
writes its result itself with ``XADD results`` (the reply follows the AOF fsync),
the stream the batching completion consumer reads (the same consumer and SQLite
code as the hand-written Redis pipeline). ``visibility_timeout`` 20 s with a
restore sweep every 5 s, so that a killed worker's unacknowledged jobs come back
within the kill run (default: 1 hour).

The broker URL comes from ``CCSQ_BENCH_URL``; a started worker touches the file
named by ``CCSQ_BENCH_READY``.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis
from celery import Celery
from celery.signals import worker_ready

URL = os.environ.get("CCSQ_BENCH_URL", "redis://127.0.0.1:6379/0")
VISIBILITY_TIMEOUT_S = 20
RESTORE_INTERVAL_S = 5

app = Celery("ccsq_bench", broker=URL)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=64,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue="jobs",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S,
                              "unacked_restore_interval": RESTORE_INTERVAL_S, "unacked_restore_throttle": 1},
)

_results: redis.Redis | None = None


@app.task(name="bench.job")
def job(ref: str, i: int, t: str) -> None:
    """Echo: write the result (the claim reference) durably to the results stream."""
    global _results
    if _results is None:
        _results = redis.Redis.from_url(URL)
    _results.xadd("results", {"ref": ref, "t": t, "result": ref, "i": i})


@worker_ready.connect
def _ready(**_kw) -> None:
    path = os.environ.get("CCSQ_BENCH_READY")
    if path:
        Path(path).touch()
