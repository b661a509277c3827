"""Relay metrics (``metrics_listen`` in relayd.toml), served by :mod:`ccsq.common.runtime.metrics_exporter`.

Nothing here runs per item: the link counters and the in-flight rows are read
from the relay's journal (one read-only SQLite connection, two grouped SELECTs,
the same books as ``ccsq federation report``) when Prometheus scrapes; credit and
capacity are read from each link's own fields; the commit histogram is observed
once per journal transaction. Label ``link`` = the ``[[links]]`` name.

- ``ccsq_relay_items_total{link,event}``: the federation report's counters
  (``event`` = leased, submitted, dedup_hits, completed, returned, fenced,
  duplicate, proof_rejected, forged_rejected, refused, failed_down, released,
  ended_acked, ended_failed, ended_released, orphan_results, blobs_copied, lost_leases,
  accepted_late, partition_released, cancelled_down; docs/federation.md says what each means).
- ``ccsq_relay_in_flight{link,state}``: journal rows by state (leased,
  submitted, resulted, returned, failing); ``ccsq_relay_lost_leases{link}``.
- ``ccsq_relay_balanced{link}``: 1 while leased == in flight + ended (the report's check).
- ``ccsq_relay_upstream_credit{link}``: credit granted upstream and not yet used
  (items the upstream may still DISPATCH to the link);
  ``ccsq_relay_downstream_capacity{link}``: free worker slots the downstream
  reports for the link's kinds; ``ccsq_relay_connected{link,side}`` (side
  upstream|downstream): 1 while that session is READY; ``ccsq_relay_link_broken{link}``:
  1 once a swarm refused the relay, the link's origins or its proofs (it stopped pulling).
- ``ccsq_relay_journal_commit_seconds`` (histogram): one journal transaction with its fsync.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ccsq.common.runtime.metrics_exporter import start_exporter
from ccsq.common.link.peer import LinkState
from ccsq.relayd.relay_journal import COUNTERS, FAILING, LEASED, RESULTED, RETURNED, SUBMITTED

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.relayd.relay import Relay

STATES = (LEASED, SUBMITTED, RESULTED, RETURNED, FAILING)
COMMIT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
ENDED = ("ended_acked", "ended_failed", "ended_released")


def read_books(db: sqlite3.Connection) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]], dict[str, int]]:
    """One consistent read of the journal: (counters by link, rows by link and state, lost leases by link)."""
    counters: dict[str, dict[str, int]] = {}
    states: dict[str, dict[str, int]] = {}
    lost: dict[str, int] = {}
    db.execute("BEGIN")
    try:
        for link, name, n in db.execute("SELECT link, name, n FROM counters"):
            counters.setdefault(link, {})[name] = n
        for link, state, n, n_lost in db.execute("SELECT link, state, COUNT(*), SUM(lost) FROM relayed GROUP BY link, state"):
            states.setdefault(link, {})[state] = n
            lost[link] = lost.get(link, 0) + int(n_lost or 0)
    finally:
        db.execute("COMMIT")
    return counters, states, lost


class _RelayCollector:
    """The relay's books and link state, read when Prometheus scrapes."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.path = Path(relay.journal.path)
        self._lock = threading.Lock()  # scrapes may overlap (one thread per request)
        self._db: sqlite3.Connection | None = None

    def _books(self) -> tuple[dict, dict, dict]:
        with self._lock:
            if self._db is None:
                self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5, isolation_level=None,
                                           check_same_thread=False)
            return read_books(self._db)

    def collect(self) -> Any:
        counters, states, lost = self._books()
        items = CounterMetricFamily("ccsq_relay_items", "the link's books (federation report counters)", labels=["link", "event"])
        in_flight = GaugeMetricFamily("ccsq_relay_in_flight", "journal rows (upstream leases held) by state",
                                      labels=["link", "state"])
        gauges = {name: GaugeMetricFamily(name, help_, labels=["link"]) for name, help_ in (
            ("ccsq_relay_lost_leases", "rows whose upstream lease was lost (their results are fenced or accepted late)"),
            ("ccsq_relay_balanced", "1 while leased == in flight + ended (the federation report's check)"),
            ("ccsq_relay_upstream_credit", "credit the upstream may still dispatch on (granted less withdrawn)"),
            ("ccsq_relay_downstream_capacity", "free downstream worker slots for the link's kinds (last heartbeat)"),
            ("ccsq_relay_link_broken", "1 once a swarm refused the relay, the link's origins or its proofs (the link stopped pulling)"),
        )}
        connected = GaugeMetricFamily("ccsq_relay_connected", "1 while the session to that broker is READY",
                                      labels=["link", "side"])
        for runner in self.relay.links:
            name = runner.name
            c = counters.get(name, {})
            for event in COUNTERS:
                items.add_metric([name, event], float(c.get(event, 0)))
            rows = states.get(name, {})
            for state in STATES:
                in_flight.add_metric([name, state], float(rows.get(state, 0)))
            balanced = c.get("leased", 0) == sum(rows.values()) + sum(c.get(k, 0) for k in ENDED)
            for metric, value in (("ccsq_relay_lost_leases", lost.get(name, 0)),
                                  ("ccsq_relay_balanced", int(balanced)),
                                  ("ccsq_relay_upstream_credit", max(0, runner.granted - runner.received)),
                                  ("ccsq_relay_downstream_capacity", max(0, runner.capacity)),
                                  ("ccsq_relay_link_broken", int(bool(runner.broken)))):
                gauges[metric].add_metric([name], float(value))
            connected.add_metric([name, "upstream"], float(runner.up.state is LinkState.READY))
            connected.add_metric([name, "downstream"], float(runner.down.state is LinkState.READY))
        yield items
        yield in_flight
        yield from gauges.values()
        yield connected


def start_relay_metrics(relay: Relay, listen: str, *, where: str) -> Any:
    """Serve ``relay``'s metrics at ``listen`` (``metrics_listen``); returns the server or
    None when ``listen`` is empty. Raises ConfigError / PortInUse (bad address / cannot bind)."""
    if not listen:
        return None
    registry = CollectorRegistry(auto_describe=True)
    commit = Histogram("ccsq_relay_journal_commit_seconds", "one relay journal transaction including its fsync",
                       buckets=COMMIT_BUCKETS_S, registry=registry)
    registry.register(_RelayCollector(relay))
    server = start_exporter(registry, listen, process="relayd", where=where)
    relay.journal.observe_commit = commit.observe
    return server
