"""Broker metrics: live instruments the actor updates, and a Prometheus exporter.

Two sources, neither of which lets the exporter thread touch the ledger (a map
resize must not race a reader):

- :class:`BrokerStats`: histograms and counters the actor updates as things
  happen (heartbeat handling lag, commit time and group-commit size, lease
  expiries). prometheus_client instruments are thread-safe.
- :attr:`Broker.snapshot`: a plain dict the actor replaces once per background
  interval (about 1 s) with :func:`build_snapshot` (ledger counters, per-state
  and per-kind counts, gap counts, map usage, peer table).

Names (all prefixed ``ccsq_``; units in the name; see docs/grafana-dashboard.json):
``items_total{counter}`` the ledger's flow counters (received, routed,
completed, acknowledged, retried, dead, expired, duplicate_submits,
fenced_completions, ...); ``items_in_state{state}``; ``backlog_items{kind,state}``;
``gap_events_total{window}``; ``frames_rejected_total{reason}``;
``lease_expiries_total{outcome}``; ``heartbeat_lag_seconds`` (histogram);
``commit_seconds`` and ``commit_records`` (histograms: fsync time and item
records per group commit); ``turn_seconds`` (histogram: one actor turn, the
longest a frame arriving meanwhile waits to be handled); ``map_size_bytes``, ``map_used_bytes``,
``max_map_size_bytes``, ``map_used_ratio``; ``peers{role}``; ``leases``;
``oldest_ready_age_seconds``; per worker ``worker_slots``, ``worker_busy``,
``worker_items_done``, ``worker_leases``, ``worker_draining`` (label ``worker``);
``snapshot_age_seconds``; the ledger's readers (docs/ledger.md, "Readers and disk use"):
``ledger_reader_slots`` (owned), ``ledger_max_readers``, ``ledger_reader_snapshots``,
``ledger_oldest_reader_age_seconds``, ``ledger_oldest_reader_lag_txns``,
``ledger_pinned_bytes``, ``ledger_file_bytes``, ``ledger_live_bytes``, ``ledger_free_bytes``,
``ledger_stale_readers_cleared_total``; high availability (docs/ha.md): ``ha_role{role}`` (1 for
``single`` or ``primary``), ``ha_epoch``, ``ha_confirming`` (0/1), ``ha_degraded`` (0/1),
``ha_degraded_total``, ``ha_held_replies`` (confirms held for the standbys or the lease),
``ha_oldest_held_seconds``, per standby ``ha_standby_lag_turns``, ``ha_standby_lag_bytes``,
``ha_standby_lag_seconds``, ``ha_standby_in_sync`` (label ``node``), ``ha_held_seconds`` (histogram, a
primary only: each confirm's hold from its turn's commit until it left, i.e. the standbys'
round trip as the peers see it);
``build_info{version,process,python,libzmq}``
(every process, :mod:`ccsq.common.runtime.metrics_exporter`); ``zap_refused_total`` (CURVE
handshakes the ZAP allow-list refused; with ``curve = true``); ``handshake_failed_total{reason}``
(connections whose ZeroMQ handshake failed: ``plain_client``, ``curve_client``, ``protocol``,
``auth``, ``no_detail``); ``reconnect_noise_frames_total{code}`` (frames of sessions that had
ended here, e.g. after a broker restart: not refusals).
Workers and the completion service export their own (``workerd/worker_metrics.py``,
``completiond/completion_metrics.py``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ccsq.common.wire import protocol

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.actor import Broker

LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COMMIT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TURN_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 5.0)
RECORD_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class BrokerStats:
    """Instruments updated by the broker actor, in their own registry.

    ``heartbeat_lag_seconds``: broker wall clock at handling minus the HEARTBEAT
    envelope's timestamp (sender clock; on one host the queueing delay, across
    hosts it includes clock skew; clamped at 0). ``commit_seconds``: one ledger
    commit including its fsync. ``commit_records``: item records written by that
    commit (how many state changes share one fsync). ``turn_seconds``: one turn
    of the actor (decode, transaction and fsync, replies, timers): a frame that
    arrives during a turn waits at most that long. ``lease_expiries_total``:
    leases that ran out, by the state the item went to (ready, dead, expired).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.heartbeat_lag = Histogram(
            "ccsq_heartbeat_lag_seconds", "HEARTBEAT handling lag (now - envelope timestamp)",
            buckets=LAG_BUCKETS_S, registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "ccsq_commit_seconds", "ledger commit time including fsync", buckets=COMMIT_BUCKETS_S, registry=self.registry
        )
        self.commit_records = Histogram(
            "ccsq_commit_records", "item records written per group commit", buckets=RECORD_BUCKETS, registry=self.registry
        )
        self.turn_seconds = Histogram(
            "ccsq_turn_seconds", "one actor turn (decode, commit with fsync, replies, timers)", buckets=TURN_BUCKETS_S,
            registry=self.registry,
        )
        self._held: Histogram | None = None
        self.lease_expiries = Counter(
            "ccsq_lease_expiries", "leases that ran out, by the item's next state", ["outcome"], registry=self.registry
        )

    def held_histogram(self) -> Histogram:
        """``ccsq_ha_held_seconds``, registered on first use (a primary's; a single broker has none):
        observe each confirm's hold (seconds from its turn's commit until it left)."""
        if self._held is None:
            self._held = Histogram("ccsq_ha_held_seconds", "a primary's confirm: its turn's commit until it left "
                                   "(the standbys' acknowledgement and the lease)", buckets=TURN_BUCKETS_S,
                                   registry=self.registry)
        return self._held

    def heartbeat(self, ts_ms: int) -> None:
        self.heartbeat_lag.observe(max(0.0, time.time() - ts_ms / 1000.0))

    def committed(self, records: int, seconds: float) -> None:
        self.commit_seconds.observe(seconds)
        self.commit_records.observe(records)

    def turned(self, seconds: float) -> None:
        self.turn_seconds.observe(seconds)

    def lease_expired(self, outcome: str) -> None:
        self.lease_expiries.labels(outcome).inc()


def build_snapshot(broker: Broker) -> dict[str, Any]:
    """What the exporter renders: one read snapshot of the ledger plus the peer
    table, as plain data (called by the actor, between transactions)."""
    b = broker
    with b.ledger.read() as view:
        counters, states = view.counters(), view.states()
        kinds, gap_counts, oldest = view.kind_states(), view.gap_counts(), view.oldest_ready_created_ms()
    workers = []
    for s in b.peers.sessions(protocol.Role.WORKER):
        workers.append(
            {
                "worker": s.peer_id,
                "slots": s.slots,
                "busy": s.busy,
                "done": s.done,
                "leases": len(b.leases.held_by(s.peer_id)),
                "draining": s.peer_id in b.peers.draining,
                "healthy": s.healthy,
                "store_ok": b.peers.store_health(s)["store_ok"],
            }
        )
    # every connected worker from 0 (rate()/increase() need the first sample), plus those seen since start
    store_failures = {w["worker"]: 0 for w in workers} | dict(b.peers.store_failures)
    roles: dict[str, int] = {}
    for s in b.peers.sessions():
        roles[s.role.value] = roles.get(s.role.value, 0) + 1
    map_size, used = b.ledger.map_size_bytes(), b._used_bytes  # noqa: SLF001 - measured in a turn's txn
    return {
        "taken_mono": time.monotonic(),
        "counters": counters,
        "states": states,
        "kinds": kinds,
        "gaps": gap_counts,
        "rejects": dict(b.rejects),
        "map_size_bytes": map_size,
        "map_used_bytes": used,
        "max_map_size_bytes": b.ledger.max_map_size_bytes,
        "map_used_ratio": used / b.ledger.max_map_size_bytes if b.ledger.max_map_size_bytes else 0.0,
        "peers": len(b.peers),
        "roles": roles,
        "leases": len(b.leases),
        "oldest_ready_age_s": 0.0 if oldest is None else max(0.0, time.time() - oldest / 1000.0),
        "workers": workers,
        "store_failures": store_failures,
        "readers": dict(b.readers_doc),
        "ha": b.ha_status(),
    }


def _ha_metrics(ha: dict[str, Any]) -> Any:
    """The ``ha`` section of the snapshot (``Broker.ha_status``) as gauges."""
    if not ha:
        return
    role = GaugeMetricFamily("ccsq_ha_role", "this broker's role (1 for the role it has: single or primary)", labels=["role"])
    role.add_metric([str(ha.get("role", "single"))], 1)
    yield role
    yield GaugeMetricFamily("ccsq_ha_epoch", "broker epoch (a primary's: its election epoch)", value=ha.get("epoch", 0))
    if ha.get("role") != "primary":
        return
    yield GaugeMetricFamily("ccsq_ha_confirming", "1 while confirms may leave (standbys and lease allow)",
                            value=1 if ha.get("confirming") else 0)
    yield GaugeMetricFamily("ccsq_ha_degraded", "1 while a sync primary confirms alone (ha_on_standby_loss = degrade)",
                            value=1 if ha.get("mode") == "degraded" else 0)
    yield CounterMetricFamily("ccsq_ha_degraded", "times this primary degraded to confirming alone",
                              value=ha.get("degraded_count", 0))
    yield GaugeMetricFamily("ccsq_ha_held_replies", "confirms committed and held until durable on the standbys",
                            value=ha.get("held_replies", 0))
    yield GaugeMetricFamily("ccsq_ha_oldest_held_seconds", "age of the oldest held confirm (0: none)",
                            value=ha.get("oldest_held_s", 0.0))
    for key, help_ in (("lag_turns", "turns the standby has not acknowledged"), ("lag_bytes", "bytes of those turns"),
                       ("lag_s", "age of the oldest turn the standby has not acknowledged"), ("in_sync", "1 when in sync")):
        name = "ccsq_ha_standby_lag_seconds" if key == "lag_s" else f"ccsq_ha_standby_{key}"
        fam = GaugeMetricFamily(name, help_, labels=["node"])
        for sb in ha.get("standbys", []):
            v = sb.get(key, 0)
            fam.add_metric([str(sb.get("node", ""))], float(v) if not isinstance(v, bool) else float(v))
        yield fam


class _SnapshotCollector:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self) -> Any:
        snap = self.broker.snapshot
        yield _labelled(CounterMetricFamily, "ccsq_items", "item flow counters (ledger)", "counter", snap.get("counters", {}))
        yield _labelled(GaugeMetricFamily, "ccsq_items_in_state", "items per state now", "state", snap.get("states", {}))
        backlog = GaugeMetricFamily("ccsq_backlog_items", "items per queue (kind) and state", labels=["kind", "state"])
        for kind, per_state in snap.get("kinds", {}).items():
            for state, n in per_state.items():
                backlog.add_metric([kind, state], n)
        yield backlog
        yield _labelled(CounterMetricFamily, "ccsq_gap_events", "gap-register windows hit", "window", snap.get("gaps", {}))
        yield _labelled(
            CounterMetricFamily, "ccsq_frames_rejected", "rejected frames per reason (since start)", "reason", snap.get("rejects", {})
        )
        yield _labelled(GaugeMetricFamily, "ccsq_peers", "connected peers per role", "role", snap.get("roles", {}))
        for key, help_ in (
            ("map_size_bytes", "LMDB map size"),
            ("map_used_bytes", "LMDB pages in use"),
            ("max_map_size_bytes", "LMDB map size limit (then SUBMIT gets QUEUE_FULL)"),
            ("map_used_ratio", "map in use / max map size"),
            ("leases", "leases held in memory"),
        ):
            yield GaugeMetricFamily(f"ccsq_{key}", help_, value=snap.get(key, 0))
        yield GaugeMetricFamily(
            "ccsq_oldest_ready_age_seconds", "age of the oldest ready item (0: none)", value=snap.get("oldest_ready_age_s", 0.0)
        )
        yield from _reader_metrics(snap.get("readers") or {})
        yield from _ha_metrics(snap.get("ha") or {})
        auth = getattr(self.broker.transport, "auth", None)
        watch = getattr(self.broker.transport, "handshakes", None)
        yield _labelled(CounterMetricFamily, "ccsq_handshake_failed",
                        "connections whose ZeroMQ handshake failed, per reason (plain_client: no CURVE at a CURVE broker)",
                        "reason", dict(watch.failures) if watch is not None else {})
        yield _labelled(CounterMetricFamily, "ccsq_reconnect_noise_frames",
                        "frames of sessions that had ended here (the peer reconnects; not refusals), per code",
                        "code", dict(self.broker.intake.noise))
        yield CounterMetricFamily(
            "ccsq_zap_refused", "CURVE handshakes refused by the ZAP allow-list (keys not in authorized_keys.toml)",
            value=auth.allow_list.refused if auth is not None else 0,
        )
        taken = snap.get("taken_mono")
        yield GaugeMetricFamily(
            "ccsq_snapshot_age_seconds", "age of the snapshot these values come from",
            value=0.0 if taken is None else time.monotonic() - taken,
        )
        for key, help_ in (
            ("slots", "GPU slots the worker announced"),
            ("busy", "inferences running (last heartbeat)"),
            ("done", "items the worker finished since it started (last heartbeat)"),
            ("leases", "leases the broker holds for the worker"),
            ("draining", "1 when `ccsq drain` stopped dispatching to it"),
            ("healthy", "1 when its last heartbeat said healthy (0: no DISPATCH to it)"),
            ("store_ok", "0 while the worker reports its claim store failing (a blob missing there, I/O, backend)"),
        ):
            name = "ccsq_worker_items_done" if key == "done" else f"ccsq_worker_{key}"
            g = GaugeMetricFamily(name, help_, labels=["worker"])
            for w in snap.get("workers", []):
                g.add_metric([w["worker"]], float(w[key]))
            yield g
        yield _store_failures(snap)


def _store_failures(snap: dict[str, Any]) -> Any:
    fam = CounterMetricFamily("ccsq_worker_store_failures", "store_unavailable FAILs per worker since the broker started",
                              labels=["worker"])
    for worker, n in sorted(snap.get("store_failures", {}).items()):
        fam.add_metric([worker], n)
    return fam


def _reader_metrics(doc: dict[str, Any]) -> Any:
    """Gauges of the ledger's reader table and disk use (from ``reader_report``)."""
    old = doc.get("oldest") or {}
    for name, help_, value in (
        ("ledger_reader_slots", "LMDB reader slots owned by processes", doc.get("slots", 0)),
        ("ledger_max_readers", "LMDB reader table size", doc.get("max_readers", 0)),
        ("ledger_reader_snapshots", "reader slots holding a snapshot now", doc.get("snapshots", 0)),
        ("ledger_oldest_reader_age_seconds", "since the first commit the oldest snapshot does not see (0: none)", old.get("age_s", 0.0)),
        ("ledger_oldest_reader_lag_txns", "commits made since the oldest snapshot", old.get("lag_txns", 0)),
        ("ledger_pinned_bytes", "pages freed since the oldest snapshot, not reusable while it reads (estimate)",
         old.get("pinned_bytes", 0)),
        ("ledger_file_bytes", "data.mdb up to its highest page", doc.get("file_bytes", 0)),
        ("ledger_live_bytes", "pages of all trees (live data)", doc.get("live_bytes", 0)),
        ("ledger_free_bytes", "pages in the file that are not live (reusable, or pinned by a reader)", doc.get("free_bytes", 0)),
    ):
        yield GaugeMetricFamily(f"ccsq_{name}", help_, value=value)
    yield CounterMetricFamily("ccsq_ledger_stale_readers_cleared", "reader slots of dead processes cleared by the broker",
                              value=doc.get("stale_cleared", 0))


def _labelled(cls: type, name: str, help_: str, label: str, values: dict[str, Any]) -> Any:
    fam = cls(name, help_, labels=[label])
    for k, v in sorted(values.items()):
        fam.add_metric([k], v)
    return fam


def broker_listen(metrics_listen: str, metrics_port: int) -> str:
    """The broker's ``metrics_listen``, or ``127.0.0.1:metrics_port`` (the older key) when it is empty."""
    return metrics_listen or (f"127.0.0.1:{metrics_port}" if metrics_port else "")


def start_metrics(broker: Broker, listen: str | int, *, where: str = "brokerd.toml: metrics_listen") -> Any:
    """Serve /metrics at ``listen`` (``metrics_listen`` syntax, see
    :mod:`ccsq.common.runtime.metrics_exporter`; an int is a port on 127.0.0.1) from the broker's
    stats registry plus its snapshot and ``ccsq_build_info``; returns the server
    (call ``shutdown()``). Raises ConfigError if the address cannot be bound."""
    from ccsq.common.runtime.metrics_exporter import start_exporter

    registry = broker.stats.registry
    registry.register(_SnapshotCollector(broker))
    listen = f"127.0.0.1:{listen}" if isinstance(listen, int) else listen
    return start_exporter(registry, listen, process="brokerd", where=where)
