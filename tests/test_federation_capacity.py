"""Federation flow control with real processes (docs/federation.md, "Capacity"): work
moves only while the downstream has free worker capacity, credit it no longer backs is
withdrawn, and the upstream's own idle workers come before a relay.

Each test fails on a relay that refilled its credit on every result without counting
what it had already submitted (b's ready queue then held dozens of relayed items behind
4 worker slots) and never took credit back (idle, a's credit for the relay stayed
where it was; b's own backlog then queued a's items behind it).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from ccsq.tools.procs import bin_path
from tests.fedswarm import FedPair
from tests.swarm import wait_until

pytestmark = pytest.mark.timeout(240)

RELAY_UP = "relay-a-to-b-up"


def relay_credit_at(swarm) -> int | None:
    """The credit the relay's upstream session holds at ``swarm``'s broker (``ccsq status``)."""
    out = subprocess.run([bin_path("ccsq"), "status", "--json", "--config", str(swarm.configs["admin"])],
                         capture_output=True, text=True, timeout=30).stdout
    if not out.strip():
        return None
    return next((peer["credit"] for peer in json.loads(out).get("peers", []) if peer["peer_id"] == RELAY_UP), None)


def test_relayed_items_waiting_downstream_stay_within_its_capacity(tmp_path: Path) -> None:
    """a (no worker) has 60 items; b has 2 workers (slots 1 + prefetch 1: capacity 4).
    While they drain through the relay, b's ready queue (every item in it came by relay)
    never holds more than b's free capacity plus one heartbeat's results."""
    n = 60
    with FedPair(tmp_path, handler="sleep", kinds=("sleep",), b_workers=2) as pair:
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        pair.b.start_worker(2)
        pair.start_relay()
        pair.wait_connected()
        with pair.a.client() as client:
            for i in range(n):
                client.submit(f"flow-{i}".encode(), "sleep", params={"seconds": 0.1})
        samples = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rep_b, rep_a = pair.b.report(), pair.a.report()
            samples.append(rep_b["states"]["ready"])
            if rep_a["counters"]["acknowledged"] >= n:
                break
            time.sleep(0.05)
        assert pair.a.report()["counters"]["acknowledged"] == n, "the backlog did not drain through the relay"
        # capacity 4 (idle), one heartbeat (0.2 s) of 2 workers running 0.1 s items: <= 4 results
        assert max(samples) <= 4, f"b's ready queue held up to {max(samples)} relayed items: {samples}"
        assert len(samples) >= 10  # sampled through the drain, not once
        c = pair.counters()
        assert c["leased"] == c["returned"] == n, c


def test_credit_withdrawn_when_the_downstream_gets_busy_and_home_workers_come_first(tmp_path: Path) -> None:
    """b idle: the relay holds credit at a (nothing to lease yet). b's own backlog arrives:
    the relay withdraws that credit. Then a's items arrive while a's own worker is idle:
    a runs them all itself (none waits behind b's work)."""
    with FedPair(tmp_path, handler="sleep", kinds=("sleep",), b_workers=2) as pair:
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        pair.b.start_worker(2)
        pair.start_relay()
        pair.wait_connected()
        wait_until(lambda: (relay_credit_at(pair.a) or 0) >= 1, 30, "the relay granted credit at a (b idle)")
        with pair.b.client() as client:
            for i in range(16):  # 16 s of work for b's two workers: still busy when a's 10 are done, under load too
                client.submit(f"b-own-{i}".encode(), "sleep", params={"seconds": 2.0})
        wait_until(lambda: relay_credit_at(pair.a) == 0, 15, "the relay withdrew its credit at a (b busy)")
        pair.a.start_worker(1)
        t0 = time.monotonic()
        with pair.a.client() as client:
            for i in range(10):
                client.submit(f"a-{i}".encode(), "sleep", params={"seconds": 0.1})
        pair.a.wait_acknowledged(10, timeout_s=60)
        took_s = time.monotonic() - t0
        assert pair.b.report()["states"]["ready"] > 0  # b was busy all along (its own backlog still waits) ...
        assert pair.counters()["leased"] == 0, pair.counters()  # ... and none of a's items went to its queue
        assert took_s < 8.0, took_s
