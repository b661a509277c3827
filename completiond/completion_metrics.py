"""Completion-service metrics (``metrics_listen`` in completion.toml), served by :mod:`ccsq.common.runtime.metrics_exporter`.

Label ``peer`` = the service's peer id. Observed once per landed batch (one
database transaction), the rest read from the service when Prometheus scrapes:

- ``ccsq_completion_db_write_seconds`` (histogram): one database transaction
  that landed a batch (including the time a slow write took before it committed).
- ``ccsq_completion_db_write_rows`` (histogram): results per landed transaction.
- ``ccsq_completion_db_healthy``: 1 when the last database write succeeded, 0
  while it backs off; ``ccsq_completion_db_backoff_seconds``: the current
  retry delay (0 when healthy); ``ccsq_completion_db_failures_total``: failed writes.
- ``ccsq_completion_results_landed_total``, ``ccsq_completion_results_acked_total``,
  ``ccsq_completion_results_quarantined_total`` (rows that went to
  ``results_quarantine``, gap G12), ``ccsq_completion_parked`` (deliveries
  whose result blob was missing, retried with backoff).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ccsq.common.runtime.metrics_exporter import start_exporter

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.completiond.completion import CompletionService

WRITE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class _CompletionCollector:
    def __init__(self, service: CompletionService, peer: str) -> None:
        self.service = service
        self.peer = [peer]

    def collect(self) -> Any:
        s = self.service
        for cls, name, help_, value in (
            (GaugeMetricFamily, "ccsq_completion_db_healthy", "1 = the last database write succeeded", 1.0 if s.healthy else 0.0),
            (GaugeMetricFamily, "ccsq_completion_db_backoff_seconds", "current database retry delay (0 = healthy)", s.db_retry_in_s),
            (CounterMetricFamily, "ccsq_completion_db_failures", "failed database writes", s.db_failures),
            (CounterMetricFamily, "ccsq_completion_results_landed", "results written to the database", s.landed),
            (CounterMetricFamily, "ccsq_completion_results_acked", "results acknowledged to the broker", s.acked),
            (CounterMetricFamily, "ccsq_completion_results_quarantined", "results written to results_quarantine (G12)",
             s.quarantined),
            (GaugeMetricFamily, "ccsq_completion_parked", "deliveries waiting for their result blob", len(s._parked)),
        ):
            fam = cls(name, help_, labels=["peer"])
            fam.add_metric(self.peer, float(value))
            yield fam


def start_completion_metrics(service: CompletionService, listen: str, *, where: str) -> Any:
    """Hook ``service`` and serve its metrics at ``listen`` (``metrics_listen``);
    returns the server or None when ``listen`` is empty. ConfigError when it cannot bind."""
    if not listen:
        return None
    peer = service.config.peer_id
    registry = CollectorRegistry(auto_describe=True)
    seconds = Histogram("ccsq_completion_db_write_seconds", "one database transaction that landed a batch", ["peer"],
                        buckets=WRITE_BUCKETS_S, registry=registry).labels(peer)
    rows = Histogram("ccsq_completion_db_write_rows", "results per landed database transaction", ["peer"],
                     buckets=ROW_BUCKETS, registry=registry).labels(peer)
    registry.register(_CompletionCollector(service, peer))
    server = start_exporter(registry, listen, process="completion", where=where)

    def observe(n: int, write_s: float) -> None:
        seconds.observe(write_s)
        rows.observe(n)

    service.observe_db_write = observe
    return server
