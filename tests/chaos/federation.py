"""``python -m tests.chaos --federation``: the chaos run grown to two swarms and a relay.

Swarm a (upstream: a producer feeds it, its own worker comes and goes) and swarm b
(downstream: one worker) on loopback, ``ccsq-relayd`` between them (``tests.fedswarm``).
At random: the relay, either broker and b's worker are SIGKILLed and restarted, the
relay is frozen (SIGSTOP) shorter and longer than the lease, a's worker is stopped or
started. Then the invariants of ``make chaos`` (``tests/chaos/checks.py``), across both:

* every item a accepted is once in a's ledger, terminal, and its result is once in a's
  results table (or, refused by a rule, in its quarantine): :func:`checks.check` on a;
* every execution beyond the first, on a's workers or b's (a relayed item in b carries
  its origin), is matched by a gap event: G2 in a (a relay lease lost is G2 with F1) or
  G2 in b for the item it became there;
* b's ledger balances, every item in it is terminal, no relayed result reached b's own
  results table; the link (``ccsq federation report``) balances with nothing in flight.

Used by ``tests/test_federation_chaos.py`` (soak) too.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tests.chaos import checks
from tests.fedswarm import FedPair
from tests.swarm import wait_until

FED_FAULTS = ("kill_relay", "kill_a", "kill_b", "kill_b_worker", "freeze_relay_short", "freeze_relay_long", "a_worker")


@dataclasses.dataclass
class FedResult:
    ok: bool
    summary: dict[str, Any]
    violations: list[str]

    def line(self, seed: int) -> str:
        s = self.summary
        return (f"federation faults={sum(s['faults'].values())} items={s['items']} lost={s['lost']} "
                f"duplicates={s['duplicates']} gap_events={s['gap_events']} link={s['link']} "
                f"balanced={str(s['balanced']).lower()} seed={seed}")


def _workers(swarm) -> list:
    return [p for n, p in swarm.procs.procs.items() if n.startswith("worker-")]


def run_federation_chaos(root: Path, seed: int, duration_s: float, *, item_s: float = 0.05,
                         settle_timeout_s: float = 300.0, verbose: bool = True) -> FedResult:
    """One run in ``root`` (kept; the caller removes it when all is well)."""
    rng = random.Random(seed)
    with FedPair(root, handler="sleep", kinds=("sleep",), b_workers=1, a_workers=1) as pair:
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        pair.start_relay()
        ev_a = checks.EventLog(pair.a.root / "broker-data")
        ev_b = checks.EventLog(pair.b.root / "broker-data")
        accepted: dict[str, str] = {}
        stop = threading.Event()

        def feed() -> None:
            with pair.a.client() as client:
                i = 0
                while not stop.is_set():
                    key = f"fed-{seed}-{i}-k"  # never ends in checks.REFUSED_KEY_SUFFIX: no rule refuses here
                    try:
                        accepted[key] = client.submit(f"chaos-{i}".encode(), "sleep", params={"seconds": item_s},
                                                      key=key, timeout_s=30).item_id
                        i += 1
                    except Exception:  # noqa: BLE001 - a's broker may be down: the same key again (dedup)
                        time.sleep(0.2)
                    time.sleep(0.05)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        faults: collections.Counter = collections.Counter()
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.5, 2.0))
            fault = rng.choice(FED_FAULTS)
            faults[fault] += 1
            if verbose:
                print(f"  t-{end - time.monotonic():5.1f}s {fault}", flush=True)
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
            ev_a.poll()
            ev_b.poll()
        stop.set()
        feeder.join(60)
        if not (pair.a.procs.procs.get("worker-1") and pair.a.procs.procs["worker-1"].running):
            pair.a.start_worker(1)  # the settle phase: a's own GPU too, so nothing waits on one path
        n = len(accepted)
        violations: list[str] = []
        try:
            pair.a.wait_acknowledged(n, timeout_s=settle_timeout_s)
            wait_until(lambda: len(pair.a.results()) >= n, 120, f"{n} rows in a's results")
            fed = wait_until(lambda: r if (r := pair.report())["links"][0]["in_flight"] == 0 else None, 120,
                             "the link drained")
        except TimeoutError as exc:
            violations.append(f"settle: {exc}")
            fed = pair.report()
        ev_a.poll()
        ev_b.poll()
        verdict = checks.check(data_dir=pair.a.root / "broker-data", results_db=pair.a.root / "results.db",
                               workers=_workers(pair.a), accepted=accepted, expected_payload={},
                               deleted_payload_keys=set(), events=ev_a)
        violations += [f"a: {v}" for v in verdict.violations]
        # --- b: balanced, terminal, relayed results never in b's own table ---
        rep_b = pair.b.report()
        if not rep_b["balanced"]:
            violations.append(f"b: ledger unbalanced: received={rep_b['counters']['received']} states={rep_b['states']}")
        b_items = checks.ledger_items(pair.b.root / "broker-data")
        origin_of = {r["id"]: r["origin"]["item_id"] for r in b_items if r.get("origin")}
        for r in b_items:
            if r["state"] not in checks.TERMINAL:
                violations.append(f"b: item {r['id']} stuck in {r['state']}")
        leaked = [r["item_id"] for r in checks.results_rows(pair.b.root / "results.db") if r["item_id"] in origin_of]
        if leaked:
            violations.append(f"b: relayed results reached b's own results table: {leaked[:5]}")
        # --- duplicates across both swarms vs the gap registers ---
        starts_a, fails_a = checks.executions(_workers(pair.a))
        starts_b, fails_b = checks.executions(_workers(pair.b))
        g2_a, g2_b = ev_a.per_item("G2"), ev_b.per_item("G2")
        runs: collections.Counter = collections.Counter(starts_a)
        retried: collections.Counter = collections.Counter(fails_a)
        events: collections.Counter = collections.Counter(g2_a)
        for b_id, a_id in origin_of.items():
            runs[a_id] += starts_b[b_id]
            retried[a_id] += fails_b[b_id]
            events[a_id] += g2_b[b_id]
        duplicates = gap_events = 0
        for a_id, k in runs.items():
            dup = max(0, k - 1 - retried[a_id])
            if dup:
                duplicates += dup
                gap_events += events[a_id]
                if dup > events[a_id] and not (ev_a.missed().get("G2") or ev_b.missed().get("G2")):
                    violations.append(f"item {a_id}: {k} executions across both swarms, {events[a_id]} G2/F1 events")
        if not fed.get("balanced"):
            violations.append(f"link unbalanced: {fed['links']}")
        link = fed["links"][0]["counters"] if fed.get("links") else {}
        summary = {**{k: verdict.summary[k] for k in ("items", "acknowledged", "quarantined", "lost")},
                   "duplicates": duplicates, "gap_events": gap_events, "faults": dict(faults),
                   "b_items": len(b_items), "relayed": len(origin_of),
                   "link": {k: link.get(k, 0) for k in ("leased", "returned", "fenced", "duplicate", "released")},
                   "balanced": verdict.summary["balanced"] and bool(rep_b["balanced"]) and bool(fed.get("balanced"))}
        return FedResult(not violations, summary, violations)
