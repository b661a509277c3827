"""The broker's lease timers (brokerd/peers.py ``LeaseTimers``): ended leases do not pile up."""

from __future__ import annotations

from ccsq.brokerd.peers import HEAP_COMPACT_MIN, LeaseTimers


def test_ended_leases_leave_the_heap_without_waiting_for_their_expiry():
    """Issue 24: a lease that ended (COMPLETE) left its heap entry until its expiry time, so
    a run longer than lease_ttl_s paid one heap pop per job (and the heap held every lease
    of the last lease_ttl_s). The heap is rebuilt once ended entries outnumber live ones;
    live leases still come due in order, an extended one at its new expiry."""
    timers = LeaseTimers(ttl_s=30.0)
    for i in range(10 * HEAP_COMPACT_MIN):
        timers.add(f"i{i}", i + 1, "w1", 100.0 + i)
        if i % 100:  # 1 in 100 stays leased
            timers.discard(f"i{i}", i + 1)
    live = len(range(0, 10 * HEAP_COMPACT_MIN, 100))
    assert len(timers) == live
    assert len(timers._heap) <= 2 * live + HEAP_COMPACT_MIN + 1
    assert timers.extend("i0", 1, "w1", 1e9)
    timers.add("i100", 999, "w2", 50.0)  # a new lease (new token) of an item: its old entry is stale
    due = timers.pop_due(1e6, 10_000)
    assert [lease.item_id for lease in due] == ["i100"] + [f"i{i}" for i in range(200, 10 * HEAP_COMPACT_MIN, 100)]
    assert [lease.item_id for lease in timers.pop_due(2e9, 10)] == ["i0"]
