"""The one frame splitter: a list of records -> frames that each stay under a byte budget
and an item cap, order kept. Every sender uses it (the producer's SUBMIT, the broker's
DISPATCH / RESULT / STATUS_REPLY, the worker's COMPLETE / FAIL, the relay's frames), so
"what fits in one frame" is decided in one place.

Sizes are the caller's estimate of each record's encoded size in bytes (``size_of``);
the budget is the frame's room for records (``max_frame_bytes`` less the envelope).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def split_frames(items: Iterable[T], *, size_of: Callable[[T], int] | None = None, budget_bytes: int | None = None,
                 max_items: int, too_large: Callable[[T, int], Exception] | None = None) -> list[list[T]]:
    """Split ``items`` into frames of at most ``max_items`` records whose ``size_of`` sum
    stays under ``budget_bytes`` (bytes). A record larger than the budget on its own goes
    in a frame by itself, or raises ``too_large(record, size_bytes)`` when given (the
    producer refuses such an item before anything is sent). Without ``size_of`` only the
    item cap applies. Returns ``[]`` for no items.

    Raises ``ValueError`` if ``max_items`` < 1."""
    if max_items < 1:
        raise ValueError(f"max_items must be >= 1, got {max_items}")
    frames: list[list[T]] = []
    cur: list[T] = []
    used = 0
    for item in items:
        n = size_of(item) if size_of is not None else 0
        if budget_bytes is not None and n > budget_bytes and too_large is not None:
            raise too_large(item, n)
        if cur and (len(cur) >= max_items or (budget_bytes is not None and used + n > budget_bytes)):
            frames.append(cur)
            cur, used = [], 0
        cur.append(item)
        used += n
    if cur:
        frames.append(cur)
    return frames

