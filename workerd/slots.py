"""The GPU semaphore: at most ``slots`` inferences at once (docs/worker.md; case C06).

Acquire, run and release live in one ``async with`` scope; there is no
``asyncio.shield`` anywhere near it, so a waiter cancelled while queued (or
while holding the slot) never leaks a permit nor strands the others: the
``async with`` of :class:`asyncio.Semaphore` releases on every exit path.

A slot whose inference overran ``max_runtime_s`` stays taken until its thread
returns (a thread cannot be killed); :attr:`SlotGate.lost` counts those, so
the worker grants that much less credit meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SlotGate:
    """``slots`` permits with counters for heartbeats and tests.

    ``busy``: slots held now; ``peak``: the most ever held at once; ``lost``:
    held by an inference that timed out and has not returned yet.
    """

    slots: int
    busy: int
    peak: int
    lost: int
    _sem: asyncio.Semaphore

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.busy = 0
        self.peak = 0
        self.lost = 0
        self._sem = asyncio.Semaphore(slots)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the body of ``async with gate.slot():``."""
        async with self._sem:
            self.busy += 1
            self.peak = max(self.peak, self.busy)
            try:
                yield
            finally:
                self.busy -= 1

    @property
    def free(self) -> int:
        """Permits available right now (for tests and health)."""
        return self._sem._value  # noqa: SLF001 - asyncio has no public accessor
