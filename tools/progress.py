"""The one progress bar of the ``ccsq`` commands (submit, dlq replay/purge, drain)."""

from __future__ import annotations

import sys


def progress(enabled: bool):
    """A rich progress bar on stderr when it is a terminal (and ``enabled``), else a no-op."""
    import contextlib

    if not (enabled and sys.stderr.isatty()):
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
