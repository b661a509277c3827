"""The outbox replay of the producer library: spool items the broker cannot confirm in time,
and send them again, in order, whenever the broker is connected.

:class:`OutboxReplay` owns the client's :class:`~ccsq.producer.outbox.Outbox` (the durable
spool) and its flusher task; the client hands it the one way it sends a SUBMIT frame until
confirmed (``send_frame``) and the one frame splitter (``first_frame``). An item leaves the
outbox only after the broker's SUBMIT_ACK (removed) or a permanent refusal (moved to the
outbox's ``rejected`` table); the broker's key dedup makes a re-send after a crash a no-op.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.errors import BrokerUnavailable, CcsqError
from ccsq.producer.outbox import Outbox

#: ``send_frame(items, deadline_mono)`` -> ``(results by key, unconfirmed items, last retryable error)``
SendFrame = Callable[[list[protocol.SubmitItem], float],
                     Awaitable[tuple[dict[str, protocol.SubmitResult], list[protocol.SubmitItem], CcsqError | None]]]

#: spooled items read per flush round (the first SUBMIT frame of them is sent)
PEEK_ITEMS = 1000


class OutboxReplay:
    """The spool and its flusher. ``submit_timeout_s``: how long one flushed frame waits
    for its SUBMIT_ACK; ``retry_base_s`` / ``backoff_cap_s``: the one backoff between
    rounds that left items unconfirmed (seconds)."""

    def __init__(self, outbox: Outbox, *, send_frame: SendFrame,
                 first_frame: Callable[[list[protocol.SubmitItem]], list[protocol.SubmitItem]],
                 submit_timeout_s: float, retry_base_s: float, backoff_cap_s: float, log: Any) -> None:
        self.outbox = outbox
        self._send_frame = send_frame
        self._first_frame = first_frame
        self._submit_timeout_s = submit_timeout_s
        self._retry_base_s = retry_base_s
        self._backoff_cap_s = backoff_cap_s
        self.log = log
        self.wakeup = asyncio.Event()
        self._spools = 0  # spool() calls so far: the flusher's emptiness verdict holds only if none came in between
        self._known_empty = False  # the flusher counted 0 items and nothing was spooled since

    async def is_empty(self) -> bool:
        """True when the outbox holds no item. Answered without a database query once the
        flusher has seen it empty and nothing was spooled since (the client asks on every
        submission: an executor hop and a count per call otherwise)."""
        return self._known_empty or await self.outbox.count() == 0

    async def spool(self, items: list[protocol.SubmitItem], reason: str) -> None:
        """Commit ``items`` to the outbox (fsync'd) and wake the flusher."""
        self._spools += 1
        self._known_empty = False
        new = await self.outbox.add(items)
        self.wakeup.set()
        self.log.info("submit_spooled", items=len(items), new=new, reason=reason)

    async def run(self, ready: asyncio.Event) -> None:
        """Send spooled items in order whenever ``ready`` (a broker session) is set; remove
        each after its ACK. Runs until cancelled."""
        attempt = 0
        while True:
            await ready.wait()
            batch = await self.outbox.peek(PEEK_ITEMS)
            if not batch:
                self.wakeup.clear()
                spools = self._spools
                if await self.outbox.count() == 0:
                    # a spool() begun before the count queued its write ahead of it on the outbox's
                    # one thread (so the count saw it); one begun since bumped ``_spools``
                    self._known_empty = spools == self._spools
                    await self.wakeup.wait()
                continue
            unconfirmed, err = await self._flush_frame(self._first_frame([it for _, it in batch]))
            if unconfirmed:
                delay = backoff_delay_s(attempt, self._retry_base_s, self._backoff_cap_s)
                attempt += 1
                self.log.info("outbox_flush_retry", code=err.code if err else "", in_s=round(delay, 3))
                await asyncio.sleep(delay)
            else:
                attempt = 0

    async def _flush_frame(self, items: list[protocol.SubmitItem]) -> tuple[list[protocol.SubmitItem], CcsqError | None]:
        """Send one frame of spooled items; remove the confirmed, reject the refused for good.
        Returns ``(unconfirmed items, last retryable error)``."""
        done, unconfirmed, err = await self._send_frame(items, time.monotonic() + self._submit_timeout_s)
        accepted = [k for k, r in done.items() if not r.error]
        if accepted:
            await self.outbox.remove(accepted)
        for item in items:
            res = done.get(item.key)
            if res is not None and res.error:
                await self.outbox.reject(item, res.error, res.message)
                self.log.error("outbox_item_rejected", key=item.key, code=res.error, message=res.message)
        self.log.info("outbox_flushed", sent=len(items), confirmed=len(accepted), left_unconfirmed=len(unconfirmed))
        return unconfirmed, err

    async def flush(self, timeout_s: float) -> None:
        """Wait until the outbox is empty (every spooled item confirmed or rejected).
        Raises BrokerUnavailable after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while await self.outbox.count() > 0:
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"outbox not empty after {timeout_s}s ({await self.outbox.count()} items left)")
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.25)

    def close(self) -> None:
        """Close the outbox (spooled items stay on disk for the next run)."""
        self.outbox.close()
