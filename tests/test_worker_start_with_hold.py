"""The worker's "started journaled with the hold" (dispatch_intake._start_with_hold) under a crash.

A lease journaled "started" with its hold must be one the free lane really takes next: if a
crash comes while another job runs, a lease that never ran must not be charged an attempt
(it would be dead-lettered worker_lost without ever running, as case C07c forbids)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.swarm import Swarm
from tests.test_cases import events, ledger_record


@pytest.mark.timeout(120)
def test_large_inline_job_ahead_in_the_frame_does_not_charge_the_small_one_behind_it(tmp_path: Path) -> None:
    """One DISPATCH frame [L, S] to an idle worker (1 slot, max_batch 1): L's inline payload is
    above HASH_ON_LOOP_MAX_BYTES (64 KiB; a producer may send up to 1 MiB inline), so the
    intake skips it when choosing what to journal "started" and picks S, though the lane takes
    L first (frame order). L kills the worker. S never ran, so on restart it must be released
    uncounted and then run; it must not end dead with worker_lost."""
    with Swarm(tmp_path / "s", handler="fail", broker={"lease_ttl_s": 30.0},
               worker={"kinds": ["fail"], "slots": 1, "max_batch": 1, "prefetch": 4},
               producer={"inline_max_bytes": 200_000}) as swarm:
        swarm.start_broker()
        swarm.start_completion()
        with swarm.client() as client:
            big, small = client.submit_many([
                {"payload": b"L" * 100_000, "kind": "fail", "params": {"kill_worker": True}, "max_attempts": 1,
                 "priority": 9},
                {"payload": b"S", "kind": "fail", "params": {"permanent": True}, "max_attempts": 1},
            ])
            swarm.start_worker(1, wait=False)  # both leases go out in its first DISPATCH
            assert swarm.procs.wait_exit("worker-1", timeout_s=60) == -signal.SIGKILL
            first_run_small = events(swarm, "worker-1", "job_started", item_id=small.item_id)
            swarm.start_worker(1)
            st = client.wait([big.item_id, small.item_id], timeout_s=30)
        assert (st[big.item_id].state, st[big.item_id].error) == ("dead", "worker_lost")
        assert not first_run_small  # S never ran in the process L killed ...
        # ... so its attempt must not have been spent there: it runs (and fails as asked)
        assert st[small.item_id].error != "worker_lost", (st[small.item_id], ledger_record(swarm, small.item_id))
        assert events(swarm, "worker-1", "job_started", item_id=small.item_id)
