"""The producer loop every system is driven with, so the load is the same shape.

``submit_batch(start, count)`` must durably submit jobs ``start .. start+count-1``
and return only after the system's durable confirm for all of them. The loop
keeps ``window`` batches in flight (unpaced: as fast as confirms come back) or
releases one batch every ``batch / rate_per_s`` seconds (paced), never more
than ``window`` unconfirmed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

SubmitBatch = Callable[[int, int], Awaitable[None]]


async def produce(submit_batch: SubmitBatch, n: int, *, batch: int, window: int,
                  rate_per_s: float | None = None) -> dict[str, float]:
    """Submit ``n`` jobs; returns ``{"submit_s", "confirm_p50_ms", "confirm_max_ms", "behind_s"}``.

    ``behind_s``: with a rate, how far the last batch was released behind its schedule
    (0 when the system kept up)."""
    sem = asyncio.Semaphore(window)
    confirm_ms: list[float] = []
    tasks: list[asyncio.Task] = []
    t0 = time.monotonic()
    behind_s = 0.0

    async def one(start: int, count: int) -> None:
        t = time.monotonic()
        try:
            await submit_batch(start, count)
        finally:
            confirm_ms.append((time.monotonic() - t) * 1000)
            sem.release()

    for start in range(0, n, batch):
        count = min(batch, n - start)
        if rate_per_s:
            due = t0 + start / rate_per_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                behind_s = -delay
        await sem.acquire()
        tasks.append(asyncio.create_task(one(start, count)))
    await asyncio.gather(*tasks)
    confirm_ms.sort()
    return {
        "submit_s": round(time.monotonic() - t0, 3),
        "confirm_p50_ms": round(confirm_ms[len(confirm_ms) // 2], 2) if confirm_ms else 0.0,
        "confirm_max_ms": round(confirm_ms[-1], 2) if confirm_ms else 0.0,
        "behind_s": round(behind_s, 3),
    }
