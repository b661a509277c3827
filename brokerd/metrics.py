"""Prometheus metrics on 127.0.0.1:``metrics_port`` (off when 0).

The exporter thread never touches the ledger (a map resize must not race a
reader): it renders :attr:`Broker.snapshot`, a plain dict the actor replaces
once per background interval (counters, per-state counts, map usage, peers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.actor import Broker


class _Collector:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self) -> Any:
        snap = self.broker.snapshot
        c = CounterMetricFamily("ccsq_items", "item flow counters", labels=["counter"])
        for name, v in snap.get("counters", {}).items():
            c.add_metric([name], v)
        yield c
        g = GaugeMetricFamily("ccsq_items_in_state", "items per state", labels=["state"])
        for name, v in snap.get("states", {}).items():
            g.add_metric([name], v)
        yield g
        r = CounterMetricFamily("ccsq_frames_rejected", "rejected frames per reason", labels=["reason"])
        for name, v in snap.get("rejects", {}).items():
            r.add_metric([name], v)
        yield r
        for key, help_ in (
            ("map_size_bytes", "LMDB map size"),
            ("map_used_bytes", "LMDB pages in use"),
            ("max_map_size_bytes", "LMDB map size limit"),
            ("peers", "connected peers"),
            ("leases", "leases held in memory"),
        ):
            yield GaugeMetricFamily(f"ccsq_{key}", help_, value=snap.get(key, 0))


def start_metrics(broker: Broker, port: int) -> Any:
    """Serve /metrics on 127.0.0.1:port; returns the server (call ``shutdown()``)."""
    registry = CollectorRegistry()
    registry.register(_Collector(broker))  # type: ignore[arg-type]
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server
