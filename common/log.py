"""structlog setup for entry points only (libraries never configure logging).

Daemons log JSON lines (one event name per thing that happens, ids as fields);
on a terminal ``log_format = "auto"`` renders human-readable console lines.
"""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """A file-like that writes to whatever ``sys.stderr`` is *now* (not at configure
    time), so a logger configured once never writes to a closed or swapped stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(log_format: str = "auto", level: int = logging.INFO) -> None:
    """Configure structlog for this process. ``log_format``: auto | json | console."""
    use_console = log_format == "console" or (log_format == "auto" and sys.stderr.isatty())
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    processors.append(structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
