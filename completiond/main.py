"""``ccsq-completiond``: the completion service's console script (what its unit runs).

``ccsq-completiond [--config completion.toml]`` and the alias ``ccsq completion [--config ...]``
are one command: both find the same default config
(:func:`ccsq.common.runtime.daemon.default_config`: ``$CCSQ_CONFIG``, else
``/etc/ccsq/completion.toml``) and both run :func:`ccsq.completiond.completion.main`,
which prints the errors and returns the :class:`~ccsq.common.wire.errors.ExitCode`
(0 after SIGTERM, 77 refused, 78 config, 75 transient).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ccsq.common.runtime.daemon import CONFIG_ENV, default_config, version_string
from ccsq.common.wire.errors import ExitCode


def main(argv: list[str] | None = None) -> int:
    """``ccsq-completiond [--config FILE]``; returns an exit code."""
    parser = argparse.ArgumentParser(prog="ccsq-completiond",
                                     description="run the completion service (results -> database, then ACK)")
    parser.add_argument("--config", default=None,
                        help=f"completion.toml (default: ${CONFIG_ENV}/completion.toml when ${CONFIG_ENV} is a "
                             f"directory, ${CONFIG_ENV} when it is a file, else /etc/ccsq/completion.toml)")
    parser.add_argument("--version", action="version", version=version_string("ccsq-completiond"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = args.config or default_config("completion")
    if args.config is None and not Path(config).exists():
        print(f"ccsq-completiond: no --config given and {config} does not exist: pass --config FILE, or set "
              f"{CONFIG_ENV} to the directory `ccsq init` wrote", file=sys.stderr)
        return ExitCode.CONFIG
    from ccsq.completiond.completion import main as completion_main

    return int(completion_main(config))


if __name__ == "__main__":
    raise SystemExit(main())
