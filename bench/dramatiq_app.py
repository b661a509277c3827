"""The dramatiq peer of benchmark 1 (``bench.peer_pipeline``, system ``dramatiq``).

Settings (stated in docs/benchmarks.md): RabbitMQ broker with
``confirm_delivery=True`` (every send waits for the publisher confirm),
persistent messages (dramatiq publishes with ``delivery_mode=2`` to durable
classic queues), the default middleware. The ``job`` actor echoes its claim
reference by sending a message to the ``result`` actor's queue ``results``
(confirmed as well) and returns; dramatiq acknowledges the job after that.
Nobody runs ``result``: the batching completion consumer reads ``results``
with aio-pika (the same consumer and SQLite code as the hand-written RabbitMQ
pipeline) and acknowledges after its SQLite commit.

The broker URL comes from ``CCSQ_BENCH_URL``.
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker

URL = os.environ.get("CCSQ_BENCH_URL", "amqp://guest:guest@127.0.0.1:5672/")

broker = RabbitmqBroker(url=URL, confirm_delivery=True)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="results", max_retries=0)
def result(ref: str, i: int, t: str) -> None:  # consumed by the completion consumer, never run
    raise RuntimeError("results are read by the benchmark's completion consumer")


@dramatiq.actor(queue_name="jobs", max_retries=3)
def job(ref: str, i: int, t: str) -> None:
    """Echo: send the result (the claim reference) durably to ``results``."""
    result.send(ref, i, t)
