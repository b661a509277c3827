"""``python -m tests.sim --seed N --items M``: the deterministic simulation of a swarm
around the broker's real actor (docs/simulation.md).

Ends with one summary line ``items=N faults=N lost=N ... seed=N``; exit 1 on any
violation, after shrinking the fault list to the shortest one that still fails and
printing it with the command that replays it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time


#: a plant's default budget (``--plant NAME`` alone): these seeds (2, 4 and 1 workers; 60, 60 and
#: 300 items open) of PLANT_ITEMS items each, in turn, until one finds it (tests/test_sim.py)
PLANT_SEEDS = (1, 2, 3)
PLANT_ITEMS = 30_000
#: ... and of a relay's plant (tests/sim/plants.py RELAY_PLANTS): federated seeds (2, 4 and 1 downstream
#: workers; 0, 1 and 0 upstream)
RELAY_PLANT_SEEDS = (4, 9, 14)


def swarms_of(seed: int) -> int:
    """The default world of a seed: two federated swarms for seeds 4, 9, 14, ... (seed % 5 == 4), else one."""
    return 2 if seed % 5 == 4 else 1


def _parser() -> argparse.ArgumentParser:
    from tests.sim.plants import PLANTS

    plants = "\n".join(f"  {name:26} {what}" for name, (what, _) in PLANTS.items())
    ap = argparse.ArgumentParser(
        prog="python -m tests.sim", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Deterministic simulation of a ccsq swarm: the broker's real actor and LMDB ledger, simulated "
                    "network, disk and peers, seeded faults, invariants checked as it runs and at the end.",
        epilog=f"planted defects (--plant NAME):\n{plants}\n\nexit status: 0 all invariants held, 1 a violation "
               "(the shortest failing fault list is printed), 2 usage")
    ap.add_argument("--seed", type=int, default=None,
                    help="the seed (default 1; with --plant: seeds %s in turn until one finds it)" % ",".join(map(str, PLANT_SEEDS)))
    ap.add_argument("--items", type=int, default=None,
                    help=f"items to push through (default 100000; with --plant {PLANT_ITEMS})")
    ap.add_argument("--faults-per-item", type=float, default=0.1, help="faults per item (default 0.1)")
    ap.add_argument("--plant", default="", choices=[""] + list(PLANTS), metavar="NAME", help="switch on a planted defect")
    ap.add_argument("--faults", default="", metavar="I,J,...",
                    help="replay with only these faults of the seed's list (what a shrunk trace prints)")
    ap.add_argument("--kinds", default="", metavar="K,...", help="only faults of these kinds (tests/sim/faults.py KINDS)")
    ap.add_argument("--no-shrink", action="store_true", help="on a violation, print it without shrinking")
    ap.add_argument("--shrink-runs", type=int, default=40, help="most re-runs while shrinking (default 40)")
    ap.add_argument("--workers", type=int, default=0, help="workers (default: 1, 2 or 4 by seed)")
    ap.add_argument("--swarms", type=int, default=0, choices=(0, 1, 2),
                    help="1: one swarm; 2: two swarms federated by a relay (upstream a: producers, completion services, "
                         "0 or 1 workers by seed; downstream b: the workers and a completion service); "
                         "default: 2 for seeds 4, 9, 14, ... (seed %% 5 == 4), else 1")
    ap.add_argument("--max-open", type=int, default=0,
                    help="items the producers keep open at most (default: 60, 300, 1500 or 4000 by seed)")
    ap.add_argument("--verbose", action="store_true", help="print every traced event")
    return ap


def run_once(args, fault_idx: list[int] | None, *, verbose: bool = False):
    """One world: (world, wall seconds)."""
    from tests.sim import faults as faults_mod
    from tests.sim import plants as plants_mod
    from tests.sim.world import World

    swarms = args.swarms or swarms_of(args.seed)
    all_faults = faults_mod.generate(args.seed, args.items, args.faults_per_item, _kinds(args), federated=swarms > 1)
    chosen = all_faults if fault_idx is None else [all_faults[i] for i in fault_idx]
    undo = plants_mod.apply(args.plant) if args.plant else (lambda: None)
    t0 = time.perf_counter()
    try:
        workers = args.workers or (1, 2, 4)[args.seed % 3]
        max_open = args.max_open or (60, 300, 1500, 4000)[(args.seed // 3) % 4]
        world = World(args.seed, args.items, chosen, workers=workers, max_open=max_open, plant=args.plant, verbose=verbose,
                      swarms=swarms, up_workers=(0, 1)[(args.seed // 5) % 2])
        world.fault_index = fault_idx if fault_idx is not None else list(range(len(all_faults)))
        world.run(max_sim_s=1000.0 + args.items * 0.2)  # a last resort: the liveness check (STUCK_S) comes first
    finally:
        undo()
    return world, time.perf_counter() - t0


def _kinds(args) -> tuple[str, ...]:
    from tests.sim.faults import KINDS, RELAY_KINDS

    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS and k not in RELAY_KINDS]
    if unknown:
        raise SystemExit(f"unknown fault kinds {unknown}: choose from {', '.join([*KINDS, *RELAY_KINDS])}")
    return kinds


def summary(world, wall_s: float) -> str:
    v = world.violation
    lost = 0 if v is None or v.kind not in ("confirmed_lost", "not_ended") else 1
    return (f"items={world.items} workers={world.n_workers} max_open={world.max_open} landed={world.done_items} "
            f"dead={getattr(world, 'dead', 0)} faults={world.faults_fired} "
            f"lost={lost} violations={0 if v is None else 1} broker_crashes={world.stats['broker_crashes']} "
            f"peer_crashes={world.stats['peer_crashes']} turns={world.stats['turns']} sim_s={world.clock.t:.1f} "
            f"wall_s={wall_s:.1f} items_per_s={world.done_items / max(wall_s, 1e-9):.0f} "
            f"faults_per_s={world.faults_fired / max(wall_s, 1e-9):.0f} "
            f"gaps={','.join(f'{k}:{v}' for k, v in sorted(world.gap_totals.items()))} "
            f"{_federated(world)}"
            f"trace={world.digest.hexdigest()}"
            f"{' plant=' + world.plant if world.plant else ''} seed={world.seed}")


def _federated(world) -> str:
    """The summary's federation fields (a world of two swarms): items relayed into b, b's gap
    events, relay crashes, forged origins refused, the relay's journal counters of note."""
    if world.relay is None:
        return ""
    down = world.brokers[1]
    c = world.relay.jcounters
    return (f"swarms=2 up_workers={world.up_workers} relayed={len(down.relayed)} "
            f"relay_acked={c.get('ended_acked', 0)} relay_released={c.get('ended_released', 0) + c.get('ended_failed', 0)} "
            f"partition_released={c.get('partition_released', 0)} orphans={c.get('orphan_results', 0)} "
            f"relay_crashes={world.stats['relay_crashes']} forged_refused={world.stats['forged_refused']} "
            f"gaps_b={','.join(f'{k}:{v}' for k, v in sorted(down.gap_totals.items()))} ")


def shrink(args, failing: list[int], kind: str) -> list[int]:
    """Drop faults (halves, then quarters, ... then one by one) while the run still fails with
    the same kind of violation; at most ``args.shrink_runs`` re-runs."""
    runs = 0
    cur = list(failing)
    n = 2
    while len(cur) >= 1 and runs < args.shrink_runs:
        chunk = max(1, len(cur) // n)
        removed = False
        for start in range(0, len(cur), chunk):
            if runs >= args.shrink_runs:
                break
            trial = cur[:start] + cur[start + chunk:]
            runs += 1
            world, _ = run_once(args, trial)
            if world.violation is not None and world.violation.kind == kind:
                cur = trial
                removed = True
                break
        if not removed:
            if chunk == 1:
                break
            n = min(len(cur), n * 2)
        else:
            n = max(2, n - 1)
    return cur


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # one seed, one hash order of every set of strings
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "tests.sim", *(sys.argv[1:] if argv is None else argv)])
    import structlog
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    gc.set_threshold(100_000, 50, 1000)  # millions of long-lived records: full collections rarely (no cycles kept)
    args = _parser().parse_args(argv)
    idx = [int(x) for x in args.faults.split(",") if x] if args.faults else None
    from tests.sim.plants import RELAY_PLANTS

    plant_seeds = RELAY_PLANT_SEEDS if args.plant in RELAY_PLANTS else PLANT_SEEDS
    seeds = [args.seed] if args.seed is not None else list(plant_seeds) if args.plant else [1]
    if args.items is None:
        args.items = PLANT_ITEMS if args.plant else 100_000
    for seed in seeds:
        args.seed = seed
        world, wall_s = run_once(args, idx, verbose=args.verbose)
        if world.violation is not None:
            break
        print(summary(world, wall_s), flush=True)
    v = world.violation
    if v is None:
        return 0
    print(f"VIOLATION {v.kind}: {v.detail}", flush=True)
    failing = world.fault_index
    if not args.no_shrink and failing:
        failing = shrink(args, failing, v.kind)
        again, _ = run_once(args, failing)
        from tests.sim import faults as faults_mod

        all_faults = faults_mod.generate(args.seed, args.items, args.faults_per_item, _kinds(args),
                                         federated=(args.swarms or swarms_of(args.seed)) > 1)
        print(f"shortest failing fault list ({len(failing)} of {len(world.fault_index)} faults):")
        for i in failing:
            print(f"  #{i} {faults_mod.describe(all_faults[i])}")
        if again.violation is not None:
            print(f"  -> VIOLATION {again.violation.kind}: {again.violation.detail}")
        print("replay: python -m tests.sim --seed {} --items {}{}{} --faults {}".format(
            args.seed, args.items, (f" --faults-per-item {args.faults_per_item}" if args.faults_per_item != 0.1 else "")
            + (f" --swarms {args.swarms}" if args.swarms else ""),
            (f" --plant {args.plant}" if args.plant else "") + (f" --kinds {args.kinds}" if args.kinds else ""),
            ",".join(map(str, failing)) or '""'))
    print(summary(world, wall_s), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
