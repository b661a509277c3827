"""The one request tracker: request id -> waiting future, failed all at once when the session ends.

Every peer that sends requests and waits for the reply with the same ``req`` (the producer's
SUBMIT / STATUS / CANCEL, the admin tools' ADMIN) keeps them here, on its event loop:

    req = tracker.next_id()
    fut = tracker.register(req, msg)      # msg kept to re-send on a new session (optional)
    link.send(msg)
    ... reply = await fut ...             # on_message: tracker.resolve(reply.req, reply)
    tracker.discard(req)                  # done waiting (answered, timed out, cancelled)

A reply the peer may split over several frames with the same ``req`` (the broker's
STATUS_REPLY under its frame budget) goes through :meth:`add_part` with a ``complete``
function that merges the parts once they answer the whole request.

``fail_all(exc)`` ends every wait at once (the session is refused for good, or the client
closes); ``resend_all(send)`` hands the still-unanswered messages to a new session.
Not thread-safe: use it from the one event loop that owns the link.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

M = TypeVar("M")  # the request message kept for re-sending
R = TypeVar("R")  # the reply a future resolves to


@dataclasses.dataclass(slots=True)
class _Waiting(Generic[M, R]):
    msg: M | None
    future: asyncio.Future[R]
    parts: list[R] = dataclasses.field(default_factory=list)  # frames of a reply split by the peer


class RequestTracker(Generic[M, R]):
    """Request ids (1, 2, 3...) and the futures waiting for their replies."""

    def __init__(self) -> None:
        self._next = 1
        self._waiting: dict[int, _Waiting[M, R]] = {}

    def __len__(self) -> int:
        """Requests still registered (answered ones are forgotten at once)."""
        return len(self._waiting)

    def next_id(self) -> int:
        """A new request id: 1, 2, 3... (unique for this tracker's life)."""
        req = self._next
        self._next += 1
        return req

    def register(self, req: int, msg: M | None = None) -> asyncio.Future[R]:
        """Start waiting for the reply to ``req``; returns the future (of the running loop)
        that :meth:`resolve` completes. ``msg``: the request, kept for :meth:`resend_all`.
        Raises ValueError if ``req`` is already waiting."""
        if req in self._waiting:
            raise ValueError(f"request {req} is already waiting")
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting[req] = _Waiting(msg, fut)
        return fut

    def resolve(self, req: int, reply: R) -> bool:
        """Complete the wait for ``req`` with ``reply`` and forget it. False when nothing
        waits for ``req`` (a late or duplicate reply, or one for a request given up)."""
        w = self._waiting.pop(req, None)
        if w is None or w.future.done():
            return False
        w.future.set_result(reply)
        return True

    def add_part(self, req: int, part: R, complete: Callable[[M | None, list[R]], R | None]) -> bool:
        """Keep ``part``, one frame of the reply to ``req``; when ``complete(msg, parts)``
        returns a reply (the parts answer the whole request), complete the wait with it and
        forget ``req``. False when nothing waits for ``req``. Parts of a re-sent request's
        second answer are merged the same way (``complete`` must tolerate repeats)."""
        w = self._waiting.get(req)
        if w is None or w.future.done():
            return False
        w.parts.append(part)
        whole = complete(w.msg, w.parts)
        if whole is not None:
            del self._waiting[req]
            w.future.set_result(whole)
        return True

    def discard(self, req: int) -> None:
        """Stop waiting for ``req`` (answered, timed out or abandoned); a future not yet
        done is cancelled. No error if ``req`` is not waiting."""
        w = self._waiting.pop(req, None)
        if w is not None and not w.future.done():
            w.future.cancel()

    def fail_all(self, exc: BaseException) -> int:
        """End every wait with ``exc`` (the session ended for good, the client closes) and
        forget them all; returns how many futures got it."""
        failed = 0
        for w in self._waiting.values():
            if not w.future.done():
                w.future.set_exception(exc)
                failed += 1
        self._waiting.clear()
        return failed

    def resend_all(self, send: Callable[[M], Any]) -> int:
        """Call ``send(msg)`` for every unanswered request registered with a message, in
        request order (a new session: the broker forgot the old one); returns the count."""
        sent = 0
        for w in list(self._waiting.values()):
            if w.msg is not None and not w.future.done():
                send(w.msg)
                sent += 1
        return sent
