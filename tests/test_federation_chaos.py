"""Random faults on two swarms and a relay (soak: ``make soak``; not in CI): the run of
``python -m tests.chaos --federation`` (``tests/chaos/federation.py``) for
``CCSQ_FED_CHAOS_S`` seconds (default 60), seed ``CCSQ_CHAOS_SEED`` (default 17).

While a producer feeds swarm a (whose own worker comes and goes), the relay, both
brokers and b's worker are SIGKILLed and restarted, and the relay is frozen (SIGSTOP)
for shorter and longer than the lease, at random. Then the same invariants as
``make chaos``: every item accepted by a lands exactly once in a's results, every
duplicate execution (in a or b) has its gap event, both ledgers and the link balance.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.federation import run_federation_chaos

pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]


def test_federation_under_random_faults(tmp_path: Path) -> None:
    seed = int(os.environ.get("CCSQ_CHAOS_SEED", "17"))
    duration_s = float(os.environ.get("CCSQ_FED_CHAOS_S", "60"))
    result = run_federation_chaos(tmp_path, seed, duration_s, verbose=False)
    print(result.line(seed))
    assert result.ok, result.violations
    assert result.summary["lost"] == 0 and result.summary["items"] > 0
    assert result.summary["relayed"] > 0  # the link carried work, not only a's own worker
