"""Handlers: what a worker runs on each item, loaded by entry point name.

A handler is a class with ``name``, ``version``, ``max_batch`` (1),
``max_wait_ms``, ``__init__(config: WorkerConfig)``, ``load()`` (once, in the
worker process, may be slow), ``provider`` / ``cpu_fallback`` /
``provider_reason`` after ``load()``, and ``run(payload: bytes, params: dict)
-> bytes`` (called in an inference thread, never on the event loop). A
handler raises :class:`~ccsq.common.wire.errors.PermanentHandlerError` for input
that can never succeed (dead-lettered at once) and anything else for a
retryable failure.

Batching (:mod:`ccsq.workerd.batching`): a handler declares ``max_batch``
(items per call, default 1) and ``max_wait_ms`` (how long a partial batch
waits for more, default 0); the worker config's ``max_batch`` /
``max_wait_ms`` override them. The worker groups ready items by
``(kind, batch_key(params))`` and calls ``run_batch(items)`` with
``items: list[(payload, params)]`` under ONE GPU slot; it returns one entry per
item, in order: the result ``bytes``, or an exception instance for an item
that failed alone (a :class:`PermanentHandlerError` instance dead-letters
just that item). An exception raised by ``run_batch`` itself fails every item
of the batch. The default ``run_batch`` calls ``run`` on each item in turn
(per-item errors kept per item), so every handler works with any
``max_batch``; a handler with a real batched path overrides it.

Handlers are registered in the entry point group ``ccsq.handlers``
(``echo``, ``sleep``, ``fail``, ``ocr``); :func:`load_handler` finds one by name.

Built-in test handlers:

- ``echo``: returns the payload (batch path: one pass over the batch).
- ``sleep``: waits ``params["seconds"]`` (float, default 0.1) and returns
  ``{"slept_s": ..., "burn": ...}`` as JSON; with ``params["burn"]`` true it
  burns CPU in pure Python instead (holding the GIL as much as Python lets a
  thread; case C06). Batch path: like a GPU batch, one wait of the largest
  ``seconds`` in the batch serves every item (``"batch": n`` in each result).
- ``fail``: raises HandlerError, or PermanentHandlerError when
  ``params["permanent"]``; with ``params["kill_worker"]`` it SIGKILLs its own
  process (a poison job, case C07b).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import time
from collections.abc import Hashable
from typing import Any, ClassVar

from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.errors import ConfigError, HandlerError, PermanentHandlerError
from ccsq.workerd import providers

ENTRY_POINT_GROUP = "ccsq.handlers"


class Handler:
    """Base class: the provider check for handlers without a model of their own."""

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    max_batch: ClassVar[int] = 1
    max_wait_ms: ClassVar[float] = 0.0

    config: WorkerConfig
    provider: str  # ONNX Runtime provider really used ("" before load)
    cpu_fallback: bool
    provider_reason: str  # why the GPU is not used ("" when it is / none asked)

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.provider = ""
        self.cpu_fallback = False
        self.provider_reason = ""

    def load(self) -> None:
        """Check the configured provider on a real (tiny) ONNX Runtime session.

        Raises GpuUnavailable when a GPU is required and not usable."""
        self.apply_report(
            providers.probe(
                self.config.provider,
                allow_cpu_fallback=self.config.allow_cpu_fallback,
                threads=self.config.handler_threads,
            )
        )

    def apply_report(self, report: providers.ProviderReport) -> None:
        self.provider = report.provider
        self.cpu_fallback = report.cpu_fallback
        self.provider_reason = report.reason

    def run(self, payload: bytes, params: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def run_batch(self, items: list[tuple[bytes, dict[str, Any]]]) -> list[bytes | BaseException]:
        """Run a batch (see module doc); default: ``run`` on each item, errors kept per item."""
        out: list[bytes | BaseException] = []
        for payload, params in items:
            try:
                out.append(self.run(payload, params))
            except Exception as exc:  # noqa: BLE001 - handed back per item, typed by the worker
                out.append(exc)
        return out

    def batch_key(self, params: dict[str, Any]) -> Hashable:
        """Items may share a batch only with equal keys (besides their kind); default: all may."""
        return None

    def health(self) -> dict[str, Any]:
        """Extra facts for heartbeats (scalars only); default none."""
        return {}


class EchoHandler(Handler):
    """Returns the payload unchanged."""

    name = "echo"
    version = "1"

    def run(self, payload: bytes, params: dict[str, Any]) -> bytes:
        return payload

    def run_batch(self, items: list[tuple[bytes, dict[str, Any]]]) -> list[bytes | BaseException]:
        return [payload for payload, _ in items]


def _float_param(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PermanentHandlerError(f"params[{key!r}] must be a number >= 0, got {value!r}")
    return float(value)


class SleepHandler(Handler):
    """Sleeps (or burns CPU, ``burn``) for ``seconds``; returns a small JSON document."""

    name = "sleep"
    version = "1"

    def run(self, payload: bytes, params: dict[str, Any]) -> bytes:
        seconds = _float_param(params, "seconds", 0.1)
        burn = bool(params.get("burn", False))
        end = time.perf_counter() + seconds
        if burn:
            n = 0
            while time.perf_counter() < end:
                n += sum(range(200))
        else:
            time.sleep(seconds)
        return json.dumps({"slept_s": seconds, "burn": burn, "payload_bytes": len(payload)}).encode()

    def run_batch(self, items: list[tuple[bytes, dict[str, Any]]]) -> list[bytes | BaseException]:
        """One sleep of the largest ``seconds`` for the whole batch (a GPU batch costs
        about one item's time); an item with a bad ``seconds`` fails alone; ``burn``
        items run one by one (CPU work does not batch)."""
        if any(params.get("burn") for _, params in items):
            return super().run_batch(items)
        seconds: list[float | BaseException] = []
        for _, params in items:
            try:
                seconds.append(_float_param(params, "seconds", 0.1))
            except PermanentHandlerError as exc:
                seconds.append(exc)
        longest = max((s for s in seconds if isinstance(s, float)), default=0.0)
        time.sleep(longest)
        return [
            s if isinstance(s, BaseException)
            else json.dumps({"slept_s": s, "burn": False, "payload_bytes": len(payload), "batch": len(items)}).encode()
            for s, (payload, _) in zip(seconds, items)
        ]


class FailHandler(Handler):
    """Always fails: retryable by default, permanent with ``permanent``, or kills the worker with ``kill_worker``."""

    name = "fail"
    version = "1"

    def run(self, payload: bytes, params: dict[str, Any]) -> bytes:
        if params.get("kill_worker"):
            os.kill(os.getpid(), signal.SIGKILL)
        if params.get("permanent"):
            raise PermanentHandlerError("fail handler: permanent failure requested")
        raise HandlerError("fail handler: failure requested")


def available_handlers() -> list[str]:
    return sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def load_handler(name: str, config: WorkerConfig) -> Handler:
    """Instantiate the handler registered as ``name`` (not yet loaded).

    Raises ConfigError for an unknown name or a handler whose module cannot be
    imported (missing optional dependency)."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not eps:
        raise ConfigError(f"handler = {name!r} is not installed; known handlers: {available_handlers()}")
    (ep,) = list(eps)[:1]
    try:
        cls = ep.load()
    except ImportError as exc:
        raise ConfigError(f"handler {name!r} cannot be imported ({exc}); install its extra, e.g. pip install 'ccsq[cpu]'") from None
    return cls(config)
