"""``ccsq-completiond``: the completion service's console script (what its unit runs).

``ccsq-completiond [--config completion.toml]`` is ``ccsq completion [--config ...]``:
one parser, so both find the same default config (``$CCSQ_CONFIG``, else
``/etc/ccsq/completion.toml``), print the same errors and exit with the same
:class:`~ccsq.common.errors.ExitCode` (0 after SIGTERM, 77 refused, 78 config).
The service itself is :func:`ccsq.completiond.completion.main`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """``ccsq-completiond ARGS`` = ``ccsq completion ARGS``; returns an exit code."""
    from ccsq.common.cli import main as ccsq_main

    return ccsq_main(["completion", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
