"""A partition between the relay and the downstream must not pin work there (issue 22,
defect 7; docs/federation.md, "Partitions"): after ``downstream_hold_max_s`` of the
downstream being unreachable, the relay gives the leases of items already submitted
there back to the upstream (released, no attempt counted: ``partition_released``), the
upstream's own worker runs them, and once the downstream is reachable the relay cancels
each copy that has not started there (``cancelled_down``; one that ran comes back as an
orphan result, acknowledged and discarded). Real processes; the partition is the
downstream broker frozen (SIGSTOP).

Fails on a relay that held submitted items for the whole partition (it kept their
upstream leases alive with its heartbeats while a's worker sat idle).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.fedswarm import FedPair
from tests.swarm import wait_until

pytestmark = pytest.mark.timeout(180)


def test_partition_gives_submitted_items_back_and_cancels_their_copies(tmp_path: Path) -> None:
    with FedPair(tmp_path, handler="sleep", kinds=("sleep",), link={"policy": "deadline"}, a_workers=4,
                 relay={"downstream_hold_max_s": 2.0}) as pair:
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)  # credit 2: two of a's 8-s items run or wait in the worker, the rest wait in b
        pair.start_relay()
        pair.wait_connected()
        n = 4
        with pair.a.client() as client:  # a has no worker: its deadline forecast stalls, the relay spills all
            ids = [client.submit(f"pin-{i}".encode(), "sleep", params={"seconds": 8.0}, deadline_ts=time.time() + 300).item_id
                   for i in range(n)]
        wait_until(lambda: pair.counters()["submitted"] == n, 30, "all items submitted downstream")
        pair.b.procs.signal("broker", signal.SIGSTOP)  # the partition
        t0 = time.monotonic()
        try:
            wait_until(lambda: pair.counters()["partition_released"] >= 1
                       and pair.report()["links"][0]["states"].get("submitted", 0) == 0, 30, "the submitted items given back")
            released_after_s = time.monotonic() - t0
            for w in range(1, 5):  # a's own GPUs
                pair.a.start_worker(w)
            pair.a.wait_acknowledged(n, timeout_s=60)  # all home while b is still unreachable
            pair.b.procs.signal("worker-1", signal.SIGSTOP)  # b's worker takes nothing more when b is back
        finally:
            pair.b.procs.signal("broker", signal.SIGCONT)
        try:
            c = wait_until(lambda: c if (c := pair.counters())["cancelled_down"] >= 1 else None, 30,
                           "the copies still waiting in b cancelled")
        finally:
            pair.b.procs.signal("worker-1", signal.SIGCONT)
        assert 2.0 <= released_after_s < 15.0, released_after_s
        assert sorted(r["item_id"] for r in pair.a.results()) == sorted(ids)  # each once, in a
        fed = wait_until(lambda: r if (r := pair.report())["links"][0]["in_flight"] == 0 else None, 60, "link drained")
        assert fed["balanced"] is True, fed
        c = fed["links"][0]["counters"]
        assert c["partition_released"] + c["returned"] == n and c["ended_failed"] == c["partition_released"] >= 3, c
        rep_a = pair.a.report()
        assert rep_a["balanced"] and rep_a["counters"]["acknowledged"] == n and rep_a["counters"]["dead"] == 0, rep_a
        rep_b = wait_until(lambda: r if (r := pair.b.report())["balanced"] else None, 30, "b balanced")
        assert rep_b["counters"]["dead"] >= c["cancelled_down"], rep_b  # a cancelled copy is a dead letter (cancelled) in b
