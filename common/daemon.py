"""The command line every ccsq daemon shares: ``ccsq-<name> --config FILE``."""

from __future__ import annotations

import argparse


def config_path_from_argv(prog: str, description: str, config_help: str, argv: list[str] | None = None) -> str:
    """Parse ``--config FILE`` (required) from ``argv`` (``sys.argv[1:]`` when None) and
    return FILE. argparse prints usage and exits 2 when it is missing or unknown
    arguments are given; ``--help`` prints ``description``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help=config_help)
    return parser.parse_args(argv).config
