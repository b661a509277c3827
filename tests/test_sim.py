"""The deterministic simulation (tests/sim, docs/simulation.md) in CI: three short seeds of the
real broker actor under faults hold every invariant and replay identically; planted defects
are found. ``make sim`` runs the long version."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def sim(*args: str, timeout_s: float = 300) -> tuple[int, str]:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    r = subprocess.run([sys.executable, "-m", "tests.sim", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout_s)
    return r.returncode, r.stdout + r.stderr


def summary(out: str) -> dict[str, str]:
    line = [x for x in out.splitlines() if x.startswith("items=")][-1]
    return dict(kv.split("=", 1) for kv in line.split())


@pytest.mark.parametrize("seed", [11, 12, 13])  # by seed: 4, 1 and 2 workers
def test_a_short_seed_holds_every_invariant(seed):
    rc, out = sim("--seed", str(seed), "--items", "3000")
    assert rc == 0, out[-3000:]
    s = summary(out)
    assert s["violations"] == "0" and s["lost"] == "0" and int(s["landed"]) + int(s["dead"]) == 3000
    assert int(s["faults"]) == 300 and s["seed"] == str(seed)


def test_a_seed_replays_identically():
    a = summary(sim("--seed", "5", "--items", "1500")[1])
    b = summary(sim("--seed", "5", "--items", "1500")[1])
    assert a["trace"] == b["trace"] and a["turns"] == b["turns"] and a["sim_s"] == b["sim_s"]


@pytest.mark.parametrize("plant", ["count_attempt_twice", "ledger_no_sync"])
def test_a_planted_defect_is_found_shrunk_and_replayed(plant):
    rc, out = sim("--seed", "1", "--items", "3000", "--plant", plant, "--shrink-runs", "8")
    assert rc == 1, out[-3000:]
    assert "VIOLATION" in out and "replay: python -m tests.sim --seed 1" in out, out[-3000:]
    replay = re.search(r"replay: python -m tests.sim (.*)", out).group(1).split()
    rc2, out2 = sim(*replay, "--no-shrink")
    assert rc2 == 1 and "VIOLATION" in out2, out2[-3000:]


def test_a_late_complete_with_an_older_token_is_found():
    # issue 25's blind spot: lease, expire, lease to the same worker, expire, the first
    # token's COMPLETE accepted while the item is ready again (seed 3: 1 worker, 300 open;
    # fault flap_then_die, the process dying at its first DISPATCH after the heal)
    rc, out = sim("--seed", "3", "--items", "3000", "--plant", "late_old_token", "--no-shrink")
    assert rc == 1 and "VIOLATION fenced_result_accepted" in out, out[-3000:]


def test_a_duplicate_execution_without_its_gap_event_is_found():
    rc, out = sim("--seed", "1", "--items", "3000", "--plant", "no_gap_event", "--no-shrink")
    assert rc == 1 and "VIOLATION duplicate_without_gap" in out, out[-3000:]


def test_help_lists_at_least_eight_plants():
    rc, out = sim("--help")
    listed = out.split("planted defects (--plant NAME):")[1].split("exit status")[0]
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    assert rc == 0 and len(names) >= 8, out
    for name in ("skip_fencing", "confirm_before_fsync", "forget_redelivery", "count_attempt_twice", "lose_lease_timers",
                 "stale_fail", "late_old_token", "ledger_no_sync"):
        assert name in names


def _listed_plants() -> list[str]:
    from tests.sim.plants import PLANTS

    return list(PLANTS)


@pytest.mark.soak
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("plant", _listed_plants())
def test_every_plant_is_found_by_its_default_budget(plant):
    # `python -m tests.sim --plant NAME` alone: seeds 1, 2, 3 of 30,000 items in turn until one
    # finds it (--no-shrink only skips the shrinking that follows the finding)
    rc, out = sim("--plant", plant, "--no-shrink", timeout_s=900)
    assert rc == 1 and "VIOLATION" in out, out[-3000:]


def test_a_federated_seed_holds_every_invariant_and_replays():
    # seed 4: two swarms and a relay (the workers downstream only), faults on both brokers, the
    # relay (crashes at relayd's crash points, forged origins) and both links
    runs = [sim("--seed", "4", "--items", "1500") for _ in range(2)]
    for rc, out in runs:
        assert rc == 0, out[-3000:]
    a, b = (summary(out) for _, out in runs)
    assert a["swarms"] == "2" and a["violations"] == "0" and int(a["landed"]) + int(a["dead"]) == 1500
    assert int(a["relayed"]) > 1000 and int(a["relay_crashes"]) > 0, a
    assert a["trace"] == b["trace"] and a["turns"] == b["turns"]


@pytest.mark.parametrize("plant, violation", [("relay_ack_before_confirm", "relay_acked_before_confirm"),
                                              ("origin_unchecked", "forged_origin_accepted"),
                                              ("no_f1_event", "federation_gap_missing")])
def test_a_planted_relay_defect_is_found(plant, violation):
    rc, out = sim("--seed", "4", "--items", "3000", "--plant", plant, "--no-shrink")
    assert rc == 1 and f"VIOLATION {violation}" in out, out[-3000:]
