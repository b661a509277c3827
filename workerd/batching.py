"""Dynamic batching: group ready items of one kind (and model) for one handler call.

A :class:`BatchQueue` holds the items whose payload is fetched and verified
(the prefetch) and hands them out in batches to the worker's *lanes* (one
lane per GPU slot; a lane runs one batch at a time under one semaphore
permit). The rule, the one Triton's dynamic batcher and TorchServe use:

- items are grouped by a key (the worker uses ``(kind, handler.batch_key(params))``);
- the group whose oldest item has waited longest goes first (FIFO across groups);
- a group goes as soon as it holds ``max_batch`` items, or when its oldest item
  has waited ``max_wait_s``, or at once when ``more_coming()`` says no further
  item can arrive now (nothing being fetched, no credit left at the broker), so
  a partial batch never waits for items that cannot come;
- a batch holds at most ``max_batch`` items, oldest first.

With ``max_batch == 1`` every item goes alone and at once (no waiting).

Pure asyncio, no I/O; used from one event loop. Durations are monotonic seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class BatchQueue(Generic[T]):
    """Ready items by group key; :meth:`take` returns the next batch (see module doc).

    ``max_batch`` >= 1 items per batch; ``max_wait_s`` >= 0 seconds a partial
    batch may wait for more; ``more_coming()`` is asked before waiting.
    """

    max_batch: int
    max_wait_s: float
    _groups: dict[Hashable, deque[tuple[float, T]]]  # key -> (ready monotonic s, item), oldest first
    _changed: asyncio.Event
    _more_coming: Callable[[], bool]

    def __init__(self, max_batch: int, max_wait_s: float, more_coming: Callable[[], bool] = lambda: True) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._groups = {}
        self._changed = asyncio.Event()
        self._more_coming = more_coming

    def __len__(self) -> int:
        return sum(len(q) for q in self._groups.values())

    def put(self, key: Hashable, item: T) -> None:
        """Add a ready item to group ``key``."""
        self._groups.setdefault(key, deque()).append((time.monotonic(), item))
        self._changed.set()

    def put_many(self, keyed: list[tuple[Hashable, T]]) -> None:
        """:meth:`put` of several ``(key, item)``, in order."""
        now = time.monotonic()
        groups = self._groups
        for key, item in keyed:
            q = groups.get(key)
            if q is None:
                q = groups[key] = deque()
            q.append((now, item))
        if keyed:
            self._changed.set()

    def discard(self, key: Hashable, item: T) -> bool:
        """Remove ``item`` if it is still waiting (cancelled, released). True if it was."""
        q = self._groups.get(key)
        if q is None:
            return False
        for entry in q:
            if entry[1] is item:
                q.remove(entry)
                if not q:
                    del self._groups[key]
                return True
        return False

    def poke(self) -> None:
        """Re-evaluate waiting batches now (call when ``more_coming()`` may have changed)."""
        self._changed.set()

    def _ripe(self, now: float) -> tuple[Hashable, float] | None:
        """The group to take now, or None and how long to wait (as (None, wait_s))."""
        if not self._groups:
            return None
        key, q = min(self._groups.items(), key=lambda kv: kv[1][0][0])
        waited_s = now - q[0][0]
        if len(q) >= self.max_batch or waited_s >= self.max_wait_s or not self._more_coming():
            return key, 0.0
        # another group may already be full: take it rather than wait on the oldest
        for k, other in self._groups.items():
            if len(other) >= self.max_batch:
                return k, 0.0
        return None, self.max_wait_s - waited_s

    async def take(self) -> tuple[Hashable, list[T]]:
        """Wait for the next batch; returns ``(key, items)`` with 1..max_batch items."""
        while True:
            ripe = self._ripe(time.monotonic())
            if ripe is not None and ripe[0] is not None:
                key = ripe[0]
                q = self._groups[key]
                items = [q.popleft()[1] for _ in range(min(self.max_batch, len(q)))]
                if not q:
                    del self._groups[key]
                return key, items
            self._changed.clear()
            timeout_s = None if ripe is None else max(ripe[1], 0.0)
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                pass
