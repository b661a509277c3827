"""The command line every ccsq daemon shares: ``ccsq-<name> --config FILE``."""

from __future__ import annotations

import argparse
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
    return parser.parse_args(argv).config
