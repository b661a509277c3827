"""Building SUBMIT items in the producer library: one item is checked once, on its fields,
before its payload is written anywhere; then built once; and sized for the frame splitter
without packing its payload again.

:class:`ItemBuilder` owns the claim store handle and the one thread it is used from:
payloads up to ``inline_max_bytes`` travel inline (hashed on the event loop, no I/O), larger
ones go to the claim store first (claim check). The idempotency key is
:func:`derive_key` of digest, kind and params unless the caller gives one.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Union

import msgpack

from ccsq.common.runtime.faults import crash_point
from ccsq.common.storage.claimstore import ClaimStore
from ccsq.common.wire import protocol as p
from ccsq.common.wire.errors import InvalidRequest

Payload = Union[bytes, bytearray, memoryview, str, Path, BinaryIO]


def canonical_params(params: Mapping[str, p.Scalar]) -> bytes:
    """Deterministic bytes for a params map (sorted keys, msgpack)."""
    return msgpack.packb(sorted(params.items()), use_bin_type=True)


def derive_key(payload_sha256: str, kind: str, params: Mapping[str, p.Scalar]) -> str:
    """The default idempotency key: sha256 hex of payload digest, kind and canonical params."""
    h = hashlib.sha256()
    h.update(payload_sha256.encode("ascii"))
    h.update(b"\0")
    h.update(kind.encode("utf-8"))
    h.update(b"\0")
    h.update(canonical_params(params))
    return h.hexdigest()


def read_payload(payload: Payload) -> bytes:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    if isinstance(payload, (str, Path)):
        try:
            return Path(payload).read_bytes()
        except OSError as exc:
            raise InvalidRequest(f"payload file {payload}: {exc.strerror or exc}") from None
    if hasattr(payload, "read"):
        data = payload.read()
        if not isinstance(data, (bytes, bytearray)):
            raise InvalidRequest("payload file object must be opened in binary mode ('rb')")
        return bytes(data)
    raise InvalidRequest(f"payload must be bytes, a path or a binary file object, got {type(payload).__name__}")


def check_params(params: Mapping[str, Any] | None) -> dict[str, p.Scalar]:
    params = dict(params or {})
    if len(params) > p.MAX_MAP_LEN:
        raise InvalidRequest(f"params has {len(params)} keys; at most {p.MAX_MAP_LEN}")
    for k, v in params.items():
        if not isinstance(k, str):
            raise InvalidRequest(f"params key {k!r} must be a string")
        if not isinstance(v, (str, int, float, bool, bytes, type(None))):
            raise InvalidRequest(f"params[{k!r}] must be str, int, float, bool, bytes or None, got {type(v).__name__}")
    return params


def item_size(item: p.SubmitItem) -> int:
    """The msgpack size of ``item`` in a SUBMIT (bytes), without packing its inline payload:
    the rest of the item is packed with ``inline`` as nil (1 byte), which then counts as
    a bin of ``n`` bytes (a 2, 3 or 5 byte header + n)."""
    body = p.encode_body(item)
    inline = item.payload.inline
    if inline is None:
        return len(msgpack.packb(body, use_bin_type=True))
    body["payload"]["inline"] = None  # encode_body made fresh maps: the item is not touched
    n = len(inline)
    return len(msgpack.packb(body, use_bin_type=True)) - 1 + (2 if n < 1 << 8 else 3 if n < 1 << 16 else 5) + n


class ItemBuilder:
    """Turns a caller's payload and options into one :class:`~ccsq.common.wire.protocol.SubmitItem`.
    ``store``: the claim store for payloads over ``inline_max_bytes`` (bytes)."""

    def __init__(self, store: ClaimStore, inline_max_bytes: int) -> None:
        self.store = store
        self.inline_max_bytes = inline_max_bytes
        self._exec = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ccsq-claimstore")

    async def build(
        self,
        payload: Payload,
        kind: str,
        *,
        params: Mapping[str, Any] | None = None,
        key: str | None = None,
        priority: int = 0,
        deadline_ts: float | None = None,
        max_attempts: int | None = None,
        max_runtime_s: float | None = None,
    ) -> p.SubmitItem:
        """Check the fields (:func:`~ccsq.common.wire.protocol.submit_fields_problem`, the
        broker's rule), then read the payload, put it in the claim store when it is over
        ``inline_max_bytes``, and build the item. Raises InvalidRequest (bad input: nothing
        was written), StoreUnavailable (the claim store is unreachable)."""
        if not isinstance(kind, str) or not kind:
            raise InvalidRequest("kind must be a non-empty string")
        if key is not None and (not isinstance(key, str) or not key):
            raise InvalidRequest("key must be a non-empty string (or None to derive it)")
        if max_attempts is not None and max_attempts < 1:
            raise InvalidRequest(f"max_attempts must be >= 1, got {max_attempts}")
        if max_runtime_s is not None and max_runtime_s <= 0:
            raise InvalidRequest(f"max_runtime_s must be > 0, got {max_runtime_s}")
        params = check_params(params)
        fields = dict(kind=kind, params=params, priority=int(priority),
                      deadline_ts=None if deadline_ts is None else float(deadline_ts),
                      max_attempts=int(max_attempts or 0), max_runtime_s=float(max_runtime_s or 0.0))
        problem = p.submit_fields_problem(key=key, **fields)  # before the blob is written: bad input leaves no orphan
        if problem:
            raise InvalidRequest(problem)
        data = read_payload(payload)
        blob = await self.store.aput_blob(data, self.inline_max_bytes, self._exec)
        if blob.inline is None:
            crash_point("producer.after_blob_put")
        return p.SubmitItem(key=key or derive_key(blob.sha256, kind, params), payload=blob, **fields)

    def close(self) -> None:
        """Wait for a claim-store write in progress, then stop its thread."""
        self._exec.shutdown(wait=True)
