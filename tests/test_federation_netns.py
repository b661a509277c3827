"""Federation across real network links: each swarm and the relay in its own network
namespace (``tests/fed_netns.py``: veth pairs, created and removed here; needs root and
iproute2, as in CI). The same cases run on loopback in ``tests/test_federation.py``;
without namespaces this file is skipped.

The relay's link to the upstream is cut (veth down) for longer than the lease, then
restored: the items it held run at home, its late results are fenced, and every item
lands once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fedswarm import FedPair, submit_in
from tests.fed_netns import NetNs, netns_available
from tests.swarm import wait_until

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 for network namespaces")]


def _windows(pair: FedPair) -> dict[str, int]:
    return {w["id"]: w["count"] for w in pair.a.report()["windows"]}


def test_link_cut_longer_than_the_lease_across_namespaces(tmp_path: Path) -> None:
    with NetNs() as net, FedPair(tmp_path, handler="sleep", kinds=("sleep",), net=net) as pair:
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        pair.start_relay()
        pair.wait_connected()
        # 1. across the veths, b's idle GPU drains a's backlog (a runs no worker)
        first = submit_in(pair.a, 4, 0.05, "drain")
        pair.a.wait_acknowledged(4, timeout_s=60)
        assert pair.counters()["returned"] == 4
        # 2. items running in b when the relay's link to a goes down for longer than the lease
        second = submit_in(pair.a, 2, 2.0, "cut")
        wait_until(lambda: pair.counters()["submitted"] >= 5, 30, "a long item submitted downstream")
        net.cut("a")
        try:
            wait_until(lambda: _windows(pair)["F1"] >= 1, 30, "the relay's lease to expire in a (F1)")
            pair.a.start_worker(1)  # a's own GPU takes the items back
            pair.a.wait_acknowledged(6, timeout_s=60)
        finally:
            net.restore("a")
        fenced = wait_until(lambda: c if (c := pair.counters())["fenced"] >= 1 else None, 60, "a late result fenced")
        assert fenced["fenced"] >= 1

        def drained():
            r = pair.report()
            return r if r["links"][0]["in_flight"] == 0 else None

        fed = wait_until(drained, 60, "the link drained")
        assert fed["balanced"] is True, fed
        rows = pair.a.results()
        assert sorted(r["item_id"] for r in rows) == sorted(first + second)  # each item landed once, in a
        rep_a, rep_b = pair.a.report(), pair.b.report()
        assert rep_a["balanced"] and rep_b["balanced"]
        assert rep_a["received"] == rep_a["acknowledged"] == 6
        assert rep_b["received"] == rep_b["acknowledged"]  # the relay acknowledged every result it took
        w = _windows(pair)
        assert w["G4"] >= 1 and w["F2"] >= 1, w
