"""``python -m tests.chaos``: one chaos run; prints the summary line, exits 1 on any violation."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from tests.chaos.harness import FAULTS, ChaosOptions, clean, run_chaos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: random, printed)")
    ap.add_argument("--duration-s", type=float, default=600.0, help="seconds of fault injection (default %(default)s)")
    ap.add_argument("--rate", type=float, default=40.0, help="items per second submitted (default %(default)s)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--handler", choices=["echo", "sleep"], default="echo",
                    help="sleep: each item runs 0..--sleep-max-s, so faults land mid-job (default %(default)s)")
    ap.add_argument("--sleep-max-s", type=float, default=0.5)
    ap.add_argument("--fault-interval-s", type=float, default=None, help="mean seconds between faults (default 0.5; --ha: 4)")
    ap.add_argument("--settle-timeout-s", type=float, default=300.0)
    ap.add_argument("--only", default="", help=f"comma-separated fault kinds to use (of {','.join(FAULTS)})")
    ap.add_argument("--dir", default="", help="run directory (default: a temporary one, removed when all is well)")
    ap.add_argument("--quiet", action="store_true", help="print only the summary and violations")
    ap.add_argument("--federation", action="store_true",
                    help="two swarms and a relay (tests/chaos/federation.py): kills, freezes; same invariants across both")
    ap.add_argument("--ha", action="store_true",
                    help="a broker pair with etcd (tests/chaos/ha.py): kills and stops of the primary, switchovers, standby "
                         "and peer kills; same invariants on the primary at the end, and at least --min-failovers failovers")
    ap.add_argument("--min-failovers", type=int, default=20, help="with --ha: fewer failovers fail the run (default %(default)s)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix=f"ccsq-chaos-{seed}-"))
    if args.federation:
        return _federation(args, seed, root)
    if args.ha:
        return _ha(args, seed, root)
    if args.fault_interval_s is None:
        args.fault_interval_s = 0.5
    faults = dict(FAULTS)
    if args.only:
        want = {k.strip() for k in args.only.split(",") if k.strip()}
        unknown = want - set(FAULTS)
        if unknown:
            ap.error(f"unknown fault kinds {sorted(unknown)}")
        faults = {k: w for k, w in FAULTS.items() if k in want}
    print(f"chaos: seed={seed} dir={root} (replay: python -m tests.chaos --seed {seed} --duration-s {args.duration_s:g} "
          f"--rate {args.rate:g} "
          f"--handler {args.handler})",
          flush=True)
    result = run_chaos(ChaosOptions(root=root, seed=seed, duration_s=args.duration_s, rate=args.rate,
                                    workers=args.workers, handler=args.handler, sleep_max_s=args.sleep_max_s,
                                    fault_interval_s=args.fault_interval_s,
                                    settle_timeout_s=args.settle_timeout_s, faults=faults, verbose=not args.quiet))
    if result.ok and not args.dir:
        clean(root)
    elif not result.ok:
        print(f"chaos: run directory kept for inspection: {root}", flush=True)
    return 0 if result.ok else 1


def _ha(args: argparse.Namespace, seed: int, root: Path) -> int:
    from tests.chaos.ha import options_from, run_ha_chaos

    if args.fault_interval_s is None:
        args.fault_interval_s = 4.0
    print(f"chaos --ha: seed={seed} dir={root} (replay: python -m tests.chaos --ha --seed {seed} --duration-s {args.duration_s:g} "
          f"--rate {args.rate:g} --fault-interval-s {args.fault_interval_s:g})", flush=True)
    result = run_ha_chaos(options_from(args, seed, root))
    if result.ok and not args.dir:
        clean(root)
    elif not result.ok:
        print(f"chaos: run directory kept for inspection: {root}", flush=True)
    return 0 if result.ok else 1


def _federation(args: argparse.Namespace, seed: int, root: Path) -> int:
    from tests.chaos.federation import run_federation_chaos

    print(f"chaos --federation: seed={seed} dir={root} (replay: python -m tests.chaos --federation --seed {seed} "
          f"--duration-s {args.duration_s:g})", flush=True)
    result = run_federation_chaos(root, seed, args.duration_s, settle_timeout_s=args.settle_timeout_s,
                                  verbose=not args.quiet)
    for v in result.violations:
        print(f"VIOLATION {v}", flush=True)
    print(result.line(seed), flush=True)
    if result.ok and not args.dir:
        clean(root)
    elif not result.ok:
        print(f"chaos: run directory kept for inspection: {root}", flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
