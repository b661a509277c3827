"""The one frame budget through a relay, with real processes (issue 22 defect 3, issue 26):
items whose payload and result sit at ``inline_max_bytes`` make frames that only fit when
every sender measures what it sends. The upstream broker's DISPATCH to the relay carries
each item's origin record and signature; the relay's SUBMIT downstream carries them too,
and its COMPLETE upstream carries the downstream's proofs. None of them may come out over
``max_frame_bytes``: no item is dead-lettered for the frame it shared, and the relay does
not die (and crash-loop) on a frame of its own, also when it restarts with hundreds of
rows in its journal and resends them all at once."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.fedswarm import FedPair
from tests.swarm import wait_until

pytestmark = pytest.mark.timeout(300)

INLINE_MAX = 16384  # the producer default: payloads up to it travel inline, in the frame


def _payload(tag: str, i: int) -> bytes:
    head = f"{tag}-{i}-".encode()
    return head + b"p" * (INLINE_MAX - len(head))  # exactly inline_max_bytes: still inline


def _submit(pair: FedPair, tag: str, n: int) -> list[str]:
    with pair.a.client() as client:
        return [r.item_id for r in client.submit_many([(_payload(tag, i), "echo") for i in range(n)])]


def _landed(pair: FedPair, n: int) -> None:
    rows = wait_until(lambda: r if len(r := pair.a.results()) >= n else None, 180, f"{n} rows in a's results")
    assert len(rows) == n and len({r["item_id"] for r in rows}) == n
    rep = wait_until(lambda: r if (r := pair.a.report())["counters"]["acknowledged"] >= n else None, 60, f"{n} acknowledged in a")
    assert rep["counters"]["dead"] == 0, rep  # not one item dead-lettered as payload_too_large
    assert rep["counters"]["received"] == rep["counters"]["acknowledged"] == n and rep["balanced"] is True


def test_items_at_inline_max_through_a_relay_and_its_restart(tmp_path: Path) -> None:
    """Phase 1: a backlog of 150 items of inline_max_bytes in a is leased to the relay at
    once (DISPATCH frames full of origin records), runs through b's GPU and lands once in a.
    Phase 2: with b's broker frozen, a leases 300 more to the relay, which journals
    them and cannot submit; the relay is SIGKILLed, b thaws, the relay restarts and resends
    every row at once: all land once, nothing dead, the relay started exactly twice."""
    with FedPair(tmp_path, worker={"prefetch": 600}, link={"max_in_flight": 600},
                 relay={"resend_interval_s": 3.0}) as pair:
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        _submit(pair, "one", 150)  # a backlog: a's first pass leases all of it to the relay at once
        pair.start_relay()
        pair.wait_connected()
        _landed(pair, 150)
        relay = pair.procs.procs["relay"]
        assert relay.starts == 1 and relay.running  # it never died on a frame of its own

        # phase 2: hundreds of rows in the journal when the relay restarts
        wait_until(lambda: pair.report()["links"][0]["in_flight"] == 0, 60, "the link drained")
        pair.b.procs.signal("broker", signal.SIGSTOP)
        try:
            _submit(pair, "two", 300)
            wait_until(lambda: pair.report()["links"][0]["in_flight"] >= 200, 60, "hundreds of rows leased to the relay")
            pair.procs.kill("relay")
            rows = pair.report()["links"][0]["in_flight"]
            assert rows >= 200, rows
        finally:
            pair.b.procs.signal("broker", signal.SIGCONT)
        pair.start_relay()
        _landed(pair, 450)
        assert pair.procs.procs["relay"].starts == 2 and pair.procs.procs["relay"].running  # no crash loop
        def drained() -> dict | None:
            r = pair.report()
            return r if all(k["in_flight"] == 0 for k in r["links"]) else None

        fed = wait_until(drained, 60, "the link drained")
        assert fed["balanced"] is True, fed
