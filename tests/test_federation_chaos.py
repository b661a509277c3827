"""Random faults on two swarms and a relay (soak: ``make soak``; not in CI).

While a producer feeds swarm a (whose own worker comes and goes), the relay, both
brokers and b's worker are SIGKILLed and restarted, and the relay is frozen (SIGSTOP)
for shorter and longer than the lease, at random. Then the same invariants as
``make chaos``: every item accepted by a lands exactly once in a's results, both
ledgers and the link balance, and every relay lease a lost is matched by an F1 event.

Seed: ``CCSQ_CHAOS_SEED``; duration: ``CCSQ_FED_CHAOS_S`` (default 60).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.fedswarm import FedPair
from tests.swarm import wait_until

pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]


def test_federation_under_random_faults(tmp_path: Path) -> None:
    seed = int(os.environ.get("CCSQ_CHAOS_SEED", "17"))
    duration_s = float(os.environ.get("CCSQ_FED_CHAOS_S", "60"))
    rng = random.Random(seed)
    with FedPair(tmp_path, handler="sleep", kinds=("sleep",), b_workers=1, a_workers=1) as pair:
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        pair.start_relay()
        accepted: list[str] = []
        stop = threading.Event()

        def feed() -> None:
            with pair.a.client() as client:
                i = 0
                while not stop.is_set():
                    try:
                        r = client.submit(f"chaos-{i}".encode(), "sleep", params={"seconds": 0.05}, timeout_s=30)
                        accepted.append(r.item_id)
                    except Exception:  # noqa: BLE001 - the broker may be down: try the next one
                        time.sleep(0.2)
                    i += 1
                    time.sleep(0.05)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        faults: dict[str, int] = {}
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.5, 2.0))
            fault = rng.choice(["kill_relay", "kill_a", "kill_b", "kill_b_worker", "freeze_relay_short",
                                "freeze_relay_long", "a_worker"])
            faults[fault] = faults.get(fault, 0) + 1
            if fault == "kill_relay":
                pair.procs.kill("relay")
                pair.start_relay()
            elif fault == "kill_a":
                pair.a.procs.kill("broker")
                pair.a.start_broker()
            elif fault == "kill_b":
                pair.b.procs.kill("broker")
                pair.b.start_broker()
            elif fault == "kill_b_worker":
                pair.b.procs.kill("worker-1")
                pair.b.start_worker(1)
            elif fault.startswith("freeze_relay"):
                pair.procs.signal("relay", signal.SIGSTOP)
                time.sleep(0.5 if fault.endswith("short") else 4.0)  # the lease is 3 s
                pair.procs.signal("relay", signal.SIGCONT)
            elif fault == "a_worker":
                if pair.a.procs.procs.get("worker-1") and pair.a.procs.procs["worker-1"].running:
                    pair.a.procs.stop("worker-1")
                else:
                    pair.a.start_worker(1)
        stop.set()
        feeder.join(60)
        n = len(set(accepted))
        rep_a = pair.a.wait_acknowledged(n, timeout_s=300)
        rows = wait_until(lambda: r if len(r := pair.a.results()) >= n else None, 120, f"{n} rows")
        assert sorted(r["item_id"] for r in rows) == sorted(set(accepted)), "lost or duplicated in a's results"
        rep_a = pair.a.report()
        assert rep_a["balanced"] and rep_a["received"] == rep_a["acknowledged"] == n

        def drained():
            r = pair.report()
            return r if r["links"][0]["in_flight"] == 0 else None

        fed = wait_until(drained, 120, "link drained")
        assert fed["balanced"], fed
        rep_b = pair.b.report()
        assert rep_b["balanced"] and rep_b["received"] == rep_b["acknowledged"]
        print(f"federation chaos seed={seed} items={n} faults={faults} link={fed['links'][0]['counters']}")
