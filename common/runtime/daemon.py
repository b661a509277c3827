"""The command line every ccsq daemon shares: ``ccsq-<name> --config FILE``."""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

#: The config file each command reads when --config is not given.
CONFIG_ENV = "CCSQ_CONFIG"
CONFIG_DIR = Path("/etc/ccsq")


def default_config(name: str) -> str:
    """The config file for a command that reads ``<name>.toml`` when --config is left out:
    ``$CCSQ_CONFIG/<name>.toml`` (a directory, e.g. the one ``ccsq init`` wrote),
    ``$CCSQ_CONFIG`` (a file), else ``/etc/ccsq/<name>.toml``."""
    env = os.environ.get(CONFIG_ENV)
    if env:
        path = Path(env)
        return str(path / f"{name}.toml") if path.is_dir() else str(path)
    return str(CONFIG_DIR / f"{name}.toml")


def config_path_from_argv(prog: str, description: str, config_help: str, argv: list[str] | None = None) -> str:
    """Parse ``--config FILE`` (required) from ``argv`` (``sys.argv[1:]`` when None) and
    return FILE. argparse prints usage and exits 2 when it is missing or unknown
    arguments are given; ``--help`` prints ``description``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument("--version", action="version", version=version_string(prog))
    return parser.parse_args(argv).config


def version_string(prog: str) -> str:
    """``PROG VERSION`` of the installed ccsq distribution (``--version`` of every command)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{prog} {version('ccsq')}"
    except PackageNotFoundError:
        return f"{prog} unknown"


#: Net container allocations between young collections after :func:`settle_gc` (CPython's
#: default is 700).
GC_YOUNG_THRESHOLD = 10_000


def settle_gc(young_threshold: int | None = GC_YOUNG_THRESHOLD) -> None:
    """Call once start-up is over (imports, config, keys, ledger or model), just before
    serving: collect, then freeze what is left out of the cyclic collector's scans
    (``gc.freeze``: it lives as long as the process), and with ``young_threshold`` collect
    the young generation after that many net container allocations instead of 700 (older
    generations keep their ratios). A daemon's per-frame work makes thousands of
    short-lived objects and little cyclic garbage: with the defaults the broker ran ~25
    young collections per thousand jobs (~15 µs of CPU per job), the worker's echo bench
    ~110 and a full one re-walking ~48,000 start-up objects, the completion service 65 ms
    of collections per 20,000 results (docs/benchmarks.md, issue 15)."""
    gc.collect()
    gc.freeze()
    if young_threshold:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(young_threshold, gen1, gen2)
