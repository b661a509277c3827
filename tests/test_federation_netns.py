"""Federation across real network links: each swarm and the relay on its own host, a
network namespace of ``tests/netns.py`` (one bridge, created and removed here; needs
root, iproute2 and, for the DROP cut, iptables, as in CI). The same cases run on
loopback in ``tests/test_federation.py``; without namespaces this file is skipped (under
``CI`` it fails instead: it must run there).

Two cuts longer than the lease (3 s), then restored; this kernel has no netem:

* the upstream host's cable pulled (veth down): the items the relay held run at home,
  their late results are fenced;
* ``iptables`` DROP rules inside the relay's host (both links silent, no carrier lost):
  the relay's leases expire upstream (F1) and, once restored, it takes them again and
  resubmits them downstream, where the origin key makes each a dedup hit, not a
  second item.

Either way every item lands once in a's results, each swarm's gap report and the
link's ``ccsq federation report`` balance.

The same hosts also carry items whose payload and result sit at ``inline_max_bytes``
(issue 22 defect 3): hundreds at a time in DISPATCH frames full of origin records, and
again after the relay is SIGKILLed with hundreds of rows in its journal and restarted
(it resends them all at once); none is dead-lettered for the frame it shared, the relay
never dies on a frame of its own. A refused link beside a working one and the
downstream's ready queue against its capacity (defects 1, 2) run here too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ccsq.tools.procs import bin_path
from tests.fedswarm import FedPair, submit_in
from tests.netns import NetNs, require_netns
from tests.swarm import wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    """Skip without root and iproute2; under ``CI`` (``.ci/run`` sets it and installs
    iproute2 and iptables) fail instead: these tests must run there, not skip."""
    require_netns()


def _windows(pair: FedPair) -> dict[str, int]:
    return {w["id"]: w["count"] for w in pair.a.report()["windows"]}


def _start(pair: FedPair) -> None:
    pair.a.start_broker()
    pair.a.start_completion()  # a runs no worker: its backlog can only drain through the relay
    pair.b.start_broker()
    pair.b.start_completion()
    pair.b.start_worker(1)
    pair.start_relay()
    pair.wait_connected()


def _books_balance(pair: FedPair, items: list[str]) -> dict:
    """The link drained and balanced (report and CLI), each item once in a's results,
    both swarms' gap reports balanced; returns the link's report."""

    def drained():
        r = pair.report()
        return r if r["links"][0]["in_flight"] == 0 else None

    fed = wait_until(drained, 60, "the link drained")
    assert fed["balanced"] is True, fed
    cli = subprocess.run([bin_path("ccsq"), "federation", "report", "--config", str(pair.relay_cfg), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stdout + cli.stderr  # exit 3 when the link does not balance
    assert json.loads(cli.stdout)["balanced"] is True
    rows = pair.a.results()
    assert sorted(r["item_id"] for r in rows) == sorted(items)  # each item landed once, in a
    rep_a, rep_b = pair.a.report(), pair.b.report()
    assert rep_a["balanced"] and rep_b["balanced"], (rep_a, rep_b)
    assert rep_a["counters"]["received"] == rep_a["counters"]["acknowledged"] == len(items)
    assert rep_b["counters"]["received"] == rep_b["counters"]["acknowledged"]  # the relay acknowledged every result it took
    return fed


def test_link_cut_longer_than_the_lease_across_namespaces(tmp_path: Path) -> None:
    with NetNs() as net, FedPair(tmp_path, handler="sleep", kinds=("sleep",), net=net) as pair:
        _start(pair)
        # 1. across the hosts, b's idle GPU drains a's backlog (a runs no worker)
        first = submit_in(pair.a, 4, 0.05, "drain")
        pair.a.wait_acknowledged(4, timeout_s=60)
        assert pair.counters()["returned"] == 4
        # 2. items running in b when a's cable is pulled for longer than the lease
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
        _books_balance(pair, first + second)
        w = _windows(pair)
        assert w["G4"] >= 1 and w["F2"] >= 1, w


def test_relay_host_dropped_by_iptables_longer_than_the_lease(tmp_path: Path) -> None:
    with NetNs() as net, FedPair(tmp_path, handler="sleep", kinds=("sleep",), net=net) as pair:
        if not net.net["r"].iptables_usable():
            reason = "iptables is missing or does not work in a namespace here"
            pytest.fail(f"{reason} (CI is set)") if os.environ.get("CI") else pytest.skip(reason)
        _start(pair)
        items = submit_in(pair.a, 3, 1.5, "drop")  # b's one worker runs them one after another
        wait_until(lambda: pair.counters()["submitted"] >= 1, 30, "an item submitted downstream")
        net.cut("r", how="iptables")  # the relay hears neither broker; nobody loses carrier
        try:
            wait_until(lambda: _windows(pair)["F1"] >= 1, 30, "the relay's lease to expire in a (F1)")
        finally:
            net.restore("r")
        pair.a.wait_acknowledged(3, timeout_s=90)  # a has no worker: everything came back through the relay
        fed = _books_balance(pair, items)
        assert fed["links"][0]["counters"]["returned"] >= 3, fed["links"][0]["counters"]
        assert _windows(pair)["F1"] >= 1


def test_refused_link_beside_a_working_one_and_capacity_across_namespaces(tmp_path: Path) -> None:
    """Two links through the relay's host (a -> b, b -> a), CURVE on: a's authorized keys
    lack the relay's b -> a downstream peer (its one CURVE key still passes a's ZAP
    allow-list: it is listed for a -> b), so that link is refused and stops, loudly,
    while a -> b drains a's backlog into b's two workers (capacity 4): b's ready queue
    of relayed items stays within it."""
    from tests.fedswarm import deauthorize

    n = 30
    with NetNs() as net, FedPair(tmp_path, handler="sleep", kinds=("sleep",), net=net, both_ways=True,
                                 b_workers=2) as pair:
        deauthorize(pair.a, "relay-b-to-a-down")
        pair.a.start_broker()
        pair.a.start_completion()  # a runs no worker: its backlog can only drain through the relay
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        pair.b.start_worker(2)
        relay = pair.start_relay()
        wait_until(lambda: relay.count("link_refused") >= 1, 60, "the b -> a link refused")
        items = submit_in(pair.a, n, 0.1, "cap")
        samples = []

        def drained() -> bool:
            samples.append(pair.b.report()["states"]["ready"])  # every item ready in b came by relay
            return pair.a.report()["counters"]["acknowledged"] >= n

        wait_until(drained, 120, "a's backlog drained through the a -> b link")
        assert relay.running  # the refused link did not stop the relay
        assert max(samples) <= 4, f"b's ready queue held up to {max(samples)} relayed items: {samples}"
        assert sorted(r["item_id"] for r in pair.a.results()) == sorted(items)
        fed = wait_until(lambda: r if (r := pair.report())["links"][0]["in_flight"] == 0 else None, 60, "drained")
        good, bad = fed["links"]
        assert fed["balanced"] is True and good["broken"] is None, fed
        assert good["counters"]["returned"] == n and bad["counters"]["leased"] == 0
        assert bad["broken"]["cause"] == "downstream_refused" and "relay-b-to-a-down" in bad["broken"]["fix"], bad
        cli = subprocess.run([bin_path("ccsq"), "federation", "report", "--config", str(pair.relay_cfg)],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 77 and "LINK BROKEN: b-to-a" in cli.stdout, cli.stdout + cli.stderr
        rep_a, rep_b = pair.a.report(), pair.b.report()
        assert rep_a["balanced"] and rep_b["balanced"], (rep_a, rep_b)


def test_relay_refused_by_curve_allow_list_exits_77_across_namespaces(tmp_path: Path) -> None:
    """b's CURVE allow-list lacks the relay's key (its entry has no curve_public_key): b
    refuses the handshake (CURVE_REFUSED); the relay's only link is refused, so it exits
    77 (not 0 after an info-level relay_stopped), and the report names the fix."""
    from tests.fedswarm import deauthorize

    with NetNs() as net, FedPair(tmp_path, handler="sleep", kinds=("sleep",), net=net) as pair:
        deauthorize(pair.b, "relay-a-to-b-down", curve_only=True)
        pair.a.start_broker()
        pair.b.start_broker()
        relay = pair.start_relay(wait=False)
        wait_until(lambda: not relay.running, 60, "the refused relay to exit")
        assert relay.popen.returncode == 77, relay.popen.returncode
        stopped = [e for e in relay.events() if e.get("event") == "relay_stopped"]
        assert stopped and stopped[-1]["level"] == "error", stopped
        broken = pair.report()["links"][0]["broken"]
        assert broken["cause"] == "downstream_refused" and "CURVE_REFUSED" in broken["reason"], broken
        assert "curve_public_key" in broken["fix"], broken


INLINE_MAX = 16384  # the producer's inline_max_bytes default (and the worker's inline result limit)

SUBMIT_AT_LIMIT = """
import sys
from ccsq.producer.client import Client
cfg, n, size, tag, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "go"
def payload(i):
    head = f"{tag}-{i}-".encode()
    return head + b"p" * (size - len(head))  # exactly inline_max_bytes: still inline
# params travel twice in a DISPATCH to a relay (in the task and in its signed origin record)
items = [(payload(i), "echo", {"lang": "deu+eng", "source": f"s3://scans/{tag}/{i:06d}/" + "p" * 300}) for i in range(n)]
with Client.from_config_file(cfg) as client:
    assert client.wait_connected(60), client.connect_problem()
    if go:
        print("CONNECTED", flush=True)
        sys.stdin.readline()
    for r in client.submit_many(items):
        print("ITEM", r.item_id)
"""


def _submitter(swarm, n: int, tag: str, *, go: bool = False) -> subprocess.Popen:
    """A producer on the swarm's host that submits ``n`` echo items of exactly ``INLINE_MAX``
    bytes with ~330 bytes of params (few SUBMIT frames); with ``go`` it connects, prints CONNECTED and submits only
    once a line arrives on its stdin."""
    return subprocess.Popen([*swarm.wrap, sys.executable, "-c", SUBMIT_AT_LIMIT, str(swarm.configs["producer"]), str(n),
                             str(INLINE_MAX), tag, "go" if go else "now"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _item_ids(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return [line.split()[1] for line in out.splitlines() if line.startswith("ITEM ")]


def _settled(pair: FedPair, relay, n: int, timeout_s: float) -> dict:
    """Wait until ``n`` items of a are acknowledged or dead (failing at once if the relay
    died); every one acknowledged, none dead-lettered (``payload_too_large``)."""

    def settled():
        assert relay.running, f"the relay died (exit {relay.popen.returncode}):\n{pair.procs.tail('relay')}"
        r = pair.a.report()
        return r if r["counters"]["acknowledged"] + r["states"]["dead"] >= n else None

    rep = wait_until(settled, timeout_s, f"{n} items acknowledged (or dead) in a")
    assert rep["states"]["dead"] == 0, f"{rep['states']['dead']} items dead-lettered in a (payload_too_large?)"
    assert rep["counters"]["acknowledged"] == n, rep["counters"]
    return rep


def test_items_at_inline_max_through_the_relay_host_and_its_restart(tmp_path: Path) -> None:
    """Payloads and results (echo) at ``inline_max_bytes`` across the three hosts (issue 22
    defect 3). Phase 1: a backlog of 50 in a (no worker there) crosses through b's GPU
    and back. Phase 2: b's broker frozen (SIGSTOP), a leases 300 more to the relay at once
    (DISPATCH frames full of origin records and signatures: over ``max_frame_bytes``
    unless sized on what is sent), which journals them and cannot submit; the relay is
    SIGKILLed with hundreds of rows in its journal, b thaws, the relay restarts, resumes
    those leases (a's outlive it: lease_ttl_s 10) and resends every row at once. Every
    item is acknowledged once in a, none is dead-lettered (``payload_too_large``), both
    swarms' books and the link's balance, the relay started exactly twice (no crash loop)."""
    with NetNs() as net, FedPair(tmp_path, net=net, worker={"prefetch": 600}, link={"max_in_flight": 600},
                                 relay={"resend_interval_s": 3.0}, broker={"lease_ttl_s": 10.0},
                                 b_broker={"liveness": 15}) as pair:
        pair.a.start_broker()
        pair.a.start_completion()  # a runs no worker: everything runs in b
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        first = _item_ids(_submitter(pair.a, 50, "one"))  # a backlog: a's first pass leases all of it to the relay
        relay = pair.start_relay()
        pair.wait_connected()
        _settled(pair, relay, len(first), 90)
        wait_until(lambda: pair.report()["links"][0]["in_flight"] == 0, 60, "the link drained")

        producer = _submitter(pair.a, 300, "two", go=True)
        assert producer.stdout.readline().strip() == "CONNECTED", producer.communicate(timeout=60)
        pair.b.procs.signal("broker", signal.SIGSTOP)  # rows pile up in the relay's journal
        try:
            producer.stdin.write("go\n")  # within b's liveness window (3 s): the relay's credit still stands
            producer.stdin.flush()
            second = _item_ids(producer)

            def piled_up() -> bool:
                dead = pair.a.report()["states"]["dead"]  # a DISPATCH that came out too large dead-letters its items
                assert dead == 0, f"{dead} items dead-lettered in a (payload_too_large?)"
                return pair.report()["links"][0]["in_flight"] >= 200

            wait_until(piled_up, 60, "hundreds of rows leased to the relay")
            pair.procs.kill("relay")
            rows = pair.report()["links"][0]["in_flight"]
            assert rows >= 200, rows
        finally:
            pair.b.procs.signal("broker", signal.SIGCONT)
        pair.start_relay()
        # a's leases outlived the relay (lease_ttl_s 10): the new relay resumes every row and resends them at once

        def reconnected() -> bool:
            assert relay.running, f"the relay died (exit {relay.popen.returncode}):\n{pair.procs.tail('relay')}"
            return relay.count("upstream_connected") >= 2 and relay.count("downstream_connected") >= 2

        wait_until(reconnected, 60, "the restarted relay connected to both brokers")
        up, down = ([e for e in relay.events() if e.get("event") == name][1] for name in ("upstream_connected",
                                                                                        "downstream_connected"))
        assert up["resumed"] >= 200 and down["in_flight"] >= 200, (up, down)
        items = first + second
        _settled(pair, relay, len(items), 120)
        assert relay.starts == 2 and relay.running  # it never died on a frame of its own (no crash loop)
        _books_balance(pair, items)  # each item once in a's results, both gap reports and the link balanced
        rep_a, rep_b = pair.a.report(), pair.b.report()
        assert rep_a["counters"]["dead"] == 0 and rep_b["counters"]["dead"] == 0, (rep_a, rep_b)  # none payload_too_large
        assert not [e for e in relay.events() if e.get("event") in ("frame_unsendable", "submit_too_large")]
        for swarm in (pair.a, pair.b):  # every payload and result travelled inline, at the limit
            assert not [f for f in (swarm.root / "blobs").rglob("*") if f.is_file()], swarm.root
