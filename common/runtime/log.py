"""Logging: structlog event style everywhere, standard ``logging`` underneath for
library code, JSON lines in daemons.

- Library modules (the peer link, the producer client, claim stores: code that
  runs inside a user's application) log with :func:`get_logger`: a structlog
  logger whose events go to the standard ``logging`` logger of the same name
  (``ccsq.peer``, ``ccsq.producer``...). Nothing is configured on import, so an
  application controls them as usual (``logging.getLogger("ccsq").setLevel(...)``);
  unconfigured, Python prints only WARNING and above.
- Entry points (daemon mains, the ``ccsq`` CLI) call :func:`configure` once: it
  configures structlog (daemon modules log through it directly) and gives the
  ``ccsq`` stdlib logger a handler with the same rendering, so a daemon writes one
  JSON line per event whichever path it came by; on a terminal
  ``log_format = "auto"`` renders human-readable console lines.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


class _CurrentStderr:
    """A file-like that writes to whatever ``sys.stderr`` is *now* (not at configure
    time), so a logger configured once never writes to a closed or swapped stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _to_stdlib(logger: logging.Logger, method_name: str, event_dict: MutableMapping[str, Any]) -> tuple[tuple, dict]:
    """Last processor of library loggers: a readable message for plain ``logging``
    handlers (``event key=value ...``) and the event itself as ``record.ccsq_event``
    for :class:`EventFormatter`."""
    exc_info = event_dict.pop("exc_info", None)
    fields = " ".join(f"{k}={v}" for k, v in event_dict.items() if k not in ("event", "level"))
    text = f"{event_dict.get('event', '')} {fields}".rstrip()
    # stacklevel 4: the record names the line that logged (past BoundLogger.info and _proxy_to_logger)
    return (text,), {"extra": {"ccsq_event": event_dict}, "exc_info": exc_info, "stacklevel": 4}


def get_logger(name: str) -> Any:
    """A structlog-style logger (``log.info("event", key=value)``, ``.bind(...)``) that
    emits through the standard ``logging`` logger ``name``, honouring its level."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _to_stdlib,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


class EventFormatter(logging.Formatter):
    """Renders a stdlib record like the daemons' structlog output: JSON (or console)."""

    def __init__(self, use_console: bool) -> None:
        super().__init__()
        self._console = structlog.dev.ConsoleRenderer(colors=False) if use_console else None

    def format(self, record: logging.LogRecord) -> str:
        event = dict(getattr(record, "ccsq_event", None) or {"event": record.getMessage(), "logger": record.name})
        event.setdefault("level", record.levelname.lower())
        event["timestamp"] = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat().replace(
            "+00:00", "Z")
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        if self._console is not None:
            return self._console(None, "", event)
        return json.dumps(event, default=repr)


_handler: logging.Handler | None = None


def configure(log_format: str = "auto", level: int = logging.INFO) -> None:
    """Configure logging for this process (entry points only). ``log_format``: auto | json | console."""
    global _handler
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
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]  # write + flush suffice
        cache_logger_on_first_use=True,
    )
    ccsq_logger = logging.getLogger("ccsq")
    if _handler is not None:
        ccsq_logger.removeHandler(_handler)
    _handler = logging.StreamHandler(_CurrentStderr())
    _handler.setFormatter(EventFormatter(use_console))
    ccsq_logger.addHandler(_handler)
    ccsq_logger.setLevel(level)
    ccsq_logger.propagate = False  # the process's own root handlers would print each line twice
