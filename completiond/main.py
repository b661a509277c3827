"""``ccsq-completiond``: the completion service's console script (what its unit runs).

``ccsq-completiond [--config completion.toml]`` and the alias ``ccsq completion [--config ...]``
are one command: both find the same default config
(:func:`ccsq.common.runtime.daemon.default_config`: ``$CCSQ_CONFIG``, else
``/etc/ccsq/completion.toml``) and both run :func:`ccsq.completiond.completion.main`,
which prints the errors and returns the :class:`~ccsq.common.wire.errors.ExitCode`
(0 after SIGTERM, 77 refused, 78 config, 75 transient).
"""

from __future__ import annotations

from ccsq.common.runtime.daemon import CONFIG_ENV, config_path_from_argv, die
from ccsq.common.wire.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """``ccsq-completiond [--config FILE]``; returns an exit code."""
    try:
        config = config_path_from_argv(
            "ccsq-completiond", "run the completion service (results -> database, then ACK)",
            f"completion.toml (default: ${CONFIG_ENV}/completion.toml when ${CONFIG_ENV} is a directory, "
            f"${CONFIG_ENV} when it is a file, else /etc/ccsq/completion.toml)", argv, default_name="completion")
    except ConfigError as exc:  # no --config and no default file
        return die("ccsq-completiond", exc)
    from ccsq.completiond.completion import main as completion_main

    return int(completion_main(config, prog="ccsq-completiond"))


if __name__ == "__main__":
    raise SystemExit(main())
