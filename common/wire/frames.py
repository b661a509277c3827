"""The one frame budget and splitter: a list of records -> frames that each stay under a
byte budget and an item cap, order kept. Every sender uses it (the producer's SUBMIT, the
broker's DISPATCH / RESULT / STATUS_REPLY, the worker's COMPLETE / FAIL, the relay's
SUBMIT downstream and COMPLETE / FAIL upstream), so "what fits in one frame" is decided
in one place, on the bytes that are sent:

* :class:`FrameBudget` ``(max_frame_bytes, max_items)``: the room for records is
  ``max_frame_bytes`` less :data:`FRAME_SLACK_BYTES` (the envelope header, the message's
  other fields); a record's size is :func:`encoded_size`, its exact msgpack bytes.
* :func:`encode_fitting`: the last word. A frame that still comes out over
  ``max_frame_bytes`` once encoded is split in halves (:func:`halves`) and each half
  encoded again, so no record is ever lost or dead-lettered for the frame it shared;
  only a record that alone cannot fit any frame raises (and the broker refuses such an
  item at SUBMIT, before it is accepted: ``brokerd/outbound.py``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgpack

from ccsq.common.wire import protocol
from ccsq.common.wire.errors import DecodeError

T = TypeVar("T")
E = TypeVar("E")

#: Bytes of a frame that are not records: the envelope header (version, type, sender id,
#: session, sequence number, timestamp) and the message's other fields (``req``, map and
#: array headers). Also the room ZeroMQ allows above ``max_frame_bytes`` on receive
#: (ZMQ_MAXMSGSIZE), so a frame just over the limit reaches the codec and is refused with
#: a typed OVERSIZE and a counter instead of ZeroMQ dropping the connection.
FRAME_SLACK_BYTES = 4096
#: Records per frame unless a sender is configured otherwise (the broker: ``max_batch_items``).
MAX_ITEMS_PER_FRAME = 512

#: Message type -> the field holding its records (the list a frame is split on).
RECORD_LISTS: dict[type, str] = {
    protocol.Submit: "items", protocol.Dispatch: "tasks", protocol.Complete: "results", protocol.Fail: "failures",
    protocol.Result: "deliveries",
    protocol.Status: "item_ids", protocol.Cancel: "item_ids", protocol.StatusReply: "items", protocol.CompleteAck: "outcomes",
    protocol.FailAck: "outcomes",
}

_packers = threading.local()


def _pack(obj: Any) -> bytes:
    try:
        pack = _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True).pack
    return pack(obj)


def encoded_size(record: Any) -> int:
    """The exact msgpack bytes ``record`` (a protocol record such as :class:`~protocol.Task`, or a
    plain str / bytes / int) takes inside a frame's record list."""
    if dataclasses.is_dataclass(record):
        return len(_pack(protocol.encode_body(record)))
    return len(_pack(record))


@dataclasses.dataclass(frozen=True, slots=True)
class FrameBudget:
    """What one frame may carry: ``max_frame_bytes`` (the config key of every role) and at
    most ``max_items`` records. Raises ``ValueError`` if ``max_items`` < 1."""

    max_frame_bytes: int
    max_items: int = MAX_ITEMS_PER_FRAME

    def __post_init__(self) -> None:
        if self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items}")

    @property
    def room_bytes(self) -> int:
        """Bytes the records of one frame may take: ``max_frame_bytes`` less the slack
        (at least half the frame, for the smallest allowed ``max_frame_bytes``)."""
        return max(self.max_frame_bytes - FRAME_SLACK_BYTES, self.max_frame_bytes // 2)

    def fits(self, size_bytes: int) -> bool:
        """Whether a record of ``size_bytes`` (its :func:`encoded_size`) fits a frame alone."""
        return size_bytes <= self.room_bytes

    def split(self, records: Iterable[T], *, size_of: Callable[[T], int] | None = encoded_size,
              too_large: Callable[[T, int], Exception] | None = None) -> list[list[T]]:
        """:func:`split_frames` under this budget (``size_of`` None: the item cap only)."""
        return split_frames(records, size_of=size_of, budget_bytes=self.room_bytes if size_of is not None else None,
                            max_items=self.max_items, too_large=too_large)


def split_frames(items: Iterable[T], *, size_of: Callable[[T], int] | None = None, budget_bytes: int | None = None,
                 max_items: int, too_large: Callable[[T, int], Exception] | None = None) -> list[list[T]]:
    """Split ``items`` into frames of at most ``max_items`` records whose ``size_of`` sum
    stays under ``budget_bytes`` (bytes). A record larger than the budget on its own goes
    in a frame by itself, or raises ``too_large(record, size_bytes)`` when given (the
    producer refuses such an item before anything is sent). Without ``size_of`` only the
    item cap applies. Returns ``[]`` for no items. Senders use :meth:`FrameBudget.split`.

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


def text_bound(s: str) -> int:
    """Bytes of ``s`` packed, at most: a 5-byte header and 4 bytes a character unless ASCII
    (for the size bounds of :func:`split_bounded`)."""
    return 5 + (len(s) if s.isascii() else 4 * len(s))


def params_bound(params: protocol.Params) -> int:
    """Bytes of a params map packed, at most: every value at its widest header, a number at 9 bytes."""
    n = 5
    for k, v in params.items():
        n += text_bound(k) + (text_bound(v) if isinstance(v, str) else 5 + len(v) if isinstance(v, bytes) else 9)
    return n


def split_bounded(items: list[T], *, size_of: Callable[[T], int], bound_of: Callable[[T], int] | None = None,
                  bound: Callable[[list[T]], int] | None = None, budget_bytes: int, max_items: int) -> list[list[T]]:
    """:func:`split_frames` by ``size_of``, except that when the records' ``bound_of`` sum (an
    upper bound of ``size_of``, from lengths alone; or ``bound``: such an upper bound of the
    whole list's ``size_of`` sum, in one call) fits ``budget_bytes`` and they are at most
    ``max_items``, they are one frame without any record sized exactly (packed twice: to size
    it, then to send it). Same frames either way when the bound holds; :func:`encode_fitting`
    still splits a frame that comes out too large. Raises ``TypeError`` unless exactly one of
    ``bound_of`` and ``bound`` is given."""
    if (bound_of is None) == (bound is None):
        raise TypeError("split_bounded: give exactly one of bound_of and bound")
    if items and len(items) <= max_items and (bound(items) if bound is not None
                                              else sum(map(bound_of, items))) <= budget_bytes:  # type: ignore[arg-type]
        return [items]
    return split_frames(items, size_of=size_of, budget_bytes=budget_bytes, max_items=max_items)


def halves(msg: protocol.Message) -> tuple[protocol.Message, protocol.Message] | None:
    """``msg`` as two messages of the same type, each with half its records (order kept,
    every other field copied), or None when it has fewer than two records or is not a
    message of records (:data:`RECORD_LISTS`)."""
    field = RECORD_LISTS.get(type(msg))
    if field is None:
        return None
    records = getattr(msg, field)
    if len(records) < 2:
        return None
    mid = len(records) // 2
    replace: Callable[..., protocol.Message] = dataclasses.replace  # every message type is a dataclass
    return replace(msg, **{field: records[:mid]}), replace(msg, **{field: records[mid:]})


def too_large(exc: BaseException) -> bool:
    """Whether ``exc`` is the codec's refusal of an outgoing frame over ``max_frame_bytes``."""
    return isinstance(exc, DecodeError) and exc.code == "PAYLOAD_TOO_LARGE"


def encode_fitting(msg: protocol.Message, encode: Callable[[protocol.Message], E]) -> list[tuple[protocol.Message, E]]:
    """``[(message, encode(message)), ...]``: ``msg`` encoded, or, when its frame comes out
    over ``max_frame_bytes`` (``encode`` raises PAYLOAD_TOO_LARGE), its :func:`halves`
    encoded the same way, recursively, in order. Raises that DecodeError when a message
    of one record (or of no records) still does not fit."""
    try:
        return [(msg, encode(msg))]
    except DecodeError as exc:
        parts = halves(msg) if too_large(exc) else None
        if parts is None:
            raise
    return [*encode_fitting(parts[0], encode), *encode_fitting(parts[1], encode)]

