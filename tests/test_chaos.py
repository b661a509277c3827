"""Issue 9, short version of ``make chaos``: ~20 s of random faults on a real swarm, then the books.

Broker, 3 echo workers, the completion service on SQLite and a producer with
an outbox, every peer behind a fault-injecting TCP proxy, a hostile peer
sending bad frames throughout; faults: SIGKILL and restart of any process
(also at every named crash point), SIGSTOP/SIGCONT shorter and longer than the
liveness window, delays / blackholes / RST / FIN on links, DISK_FULL and
QUEUE_FULL episodes, claim-store outages and deleted payload blobs. Covers the
common invariant of CASES.md (C01-C09 under random interleavings): every
accepted item ends in exactly one terminal state, none is lost, one results
row per acknowledged item, every duplicate execution and redelivery matched by
a gap-register event, balanced ledger.

Seed: ``CCSQ_CHAOS_SEED`` (default fixed); on failure the run directory is kept
and the seed printed. Replay: ``python -m tests.chaos --seed N --duration-s 20``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosOptions, run_chaos

DURATION_S = 20.0


@pytest.mark.timeout(300)
def test_chaos_short_run(tmp_path: Path) -> None:
    seed = int(os.environ.get("CCSQ_CHAOS_SEED", "9"))
    result = run_chaos(ChaosOptions(root=tmp_path / "chaos", seed=seed, duration_s=DURATION_S, rate=25.0,
                                    fault_interval_s=0.3, settle_timeout_s=120.0, verbose=False))
    s = result.verdict.summary
    detail = f"{result.line()}\nviolations: {result.verdict.violations}\ncrashes: {result.crashes}\ndir: {tmp_path}"
    assert result.verdict.violations == [], detail
    assert result.crashes == [], detail
    assert s["lost"] == 0 and s["stuck"] == 0 and s["balanced"], detail
    assert s["quarantined"] >= 1, detail  # the results table's rule refused some (gap G12), under faults
    assert s["items"] >= 0.9 * 25.0 * DURATION_S, detail  # the producer got everything accepted
    # a fault every ~1.5 s at least (kills and stops wait for the restart; ~1 s a fault on a quiet box)
    assert sum(result.faults.values()) >= 0.65 * DURATION_S, detail
    assert len(result.faults) >= 8, f"too few fault kinds exercised: {dict(result.faults)}"
    assert sum(s["rejects"].values()) >= 0.5 * result.hostile_frames, detail  # hostile frames were refused and counted
