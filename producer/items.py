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
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Union

import msgpack

from ccsq.common.runtime.faults import crash_point
from ccsq.common.storage.claimstore import ClaimStore, inline_blob
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import InvalidRequest

Payload = Union[bytes, bytearray, memoryview, str, Path, BinaryIO]


_packers = threading.local()


def _pack() -> Any:
    """This thread's ``msgpack.Packer(use_bin_type=True).pack``: the bytes of
    ``msgpack.packb(..., use_bin_type=True)`` at half the cost (one Packer per thread)."""
    try:
        return _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True).pack
        return pack


def canonical_params(params: Mapping[str, protocol.Scalar]) -> bytes:
    """Deterministic bytes for a params map (sorted keys, msgpack)."""
    return _pack()(sorted(params.items()))


unchecked_constructor = protocol.trusted_constructor  # one builder of records without __init__ (the codec's)


#: ``SubmitItem(...)`` (all ten fields, positional) for fields :func:`_checked_fields` passed
_submit_item = unchecked_constructor(protocol.SubmitItem, ("key", "kind", "payload", "params", "priority", "deadline_ts",
                                                    "max_attempts", "max_runtime_s", "origin", "origin_sig"))


def derive_key(payload_sha256: str, kind: str, params: Mapping[str, protocol.Scalar]) -> str:
    """The default idempotency key: sha256 hex of payload digest, kind and canonical params."""
    return _key(payload_sha256, _kind_part(kind), canonical_params(params))


def _kind_part(kind: str) -> bytes:
    """``kind``'s bytes in :func:`derive_key`'s input (between the two NULs)."""
    return b"\0" + kind.encode("utf-8") + b"\0"


def _key(payload_sha256: str, kind_part: bytes, canonical: bytes) -> str:
    """:func:`derive_key` from its parts: one hash call over the joined bytes (the same bytes
    as feeding them one by one), so the same keys as every earlier version."""
    return hashlib.sha256(payload_sha256.encode("ascii") + kind_part + canonical).hexdigest()


def read_payload(payload: Payload) -> bytes:
    if type(payload) is bytes:  # the usual case: already immutable bytes, nothing to copy or check
        return payload
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


def check_params(params: Mapping[str, Any] | None) -> dict[str, protocol.Scalar]:
    params = dict(params or {})
    if len(params) > protocol.MAX_MAP_LEN:
        raise InvalidRequest(f"params has {len(params)} keys; at most {protocol.MAX_MAP_LEN}")
    for k, v in params.items():
        if not isinstance(k, str):
            raise InvalidRequest(f"params key {k!r} must be a string")
        if not isinstance(v, protocol.SCALAR_TYPES):
            raise InvalidRequest(f"params[{k!r}] must be str, int, float, bool, bytes or None, got {type(v).__name__}")
    return params


def item_size(item: protocol.SubmitItem) -> int:
    """The msgpack size of ``item`` in a SUBMIT (bytes), without packing its inline payload:
    the rest of the item is packed with ``inline`` as nil (1 byte), which then counts as
    a bin of ``n`` bytes (a 2, 3 or 5 byte header + n)."""
    body = protocol.encode_body(item)
    inline = item.payload.inline
    if inline is None:
        return len(_pack()(body))
    body["payload"]["inline"] = None  # encode_body made fresh maps: the item is not touched
    n = len(inline)
    return len(_pack()(body)) - 1 + (2 if n < 1 << 8 else 3 if n < 1 << 16 else 5) + n


#: msgpack bytes of a SubmitItem map besides its variable values, over-counted: map headers,
#: every field name (the two federation ones included), a 64-char sha256 string, the blob's
#: ``size`` and the scalar fields at their widest (9 bytes), ``inline`` / ``deadline_ts`` nil
_ITEM_FIXED_BOUND = 320  # counted: 252


def item_size_bound(item: protocol.SubmitItem) -> int:
    """An upper bound of :func:`item_size` (bytes) from lengths alone, nothing packed: every
    string, bytes value and map at its widest header (5 bytes), every number at 9 bytes, a
    string at 4 bytes per character unless ASCII. Lets the frame splitter skip exact sizing
    when a whole batch surely fits one frame (``AsyncClient._frames``)."""
    inline = item.payload.inline
    key, kind = item.key, item.kind
    n = (_ITEM_FIXED_BOUND + (len(key) if key.isascii() else 4 * len(key)) + (len(kind) if kind.isascii() else 4 * len(kind))
         + len(item.origin) + len(item.origin_sig) + (0 if inline is None else len(inline)))
    for k, v in item.params.items():
        n += 14 + (len(k) if k.isascii() else 4 * len(k))  # key header 5, a number 9
        if isinstance(v, str):
            n += 5 + (len(v) if v.isascii() else 4 * len(v))
        elif isinstance(v, bytes):
            n += 5 + len(v)
    return n


class ItemBuilder:
    """Turns a caller's payload and options into one :class:`~ccsq.common.wire.protocol.SubmitItem`.
    ``store``: the claim store for payloads over ``inline_max_bytes`` (bytes)."""

    def __init__(self, store: ClaimStore, inline_max_bytes: int) -> None:
        self.store = store
        self.inline_max_bytes = inline_max_bytes
        #: payloads up to this size (bytes) are made into a blob on the event loop, no I/O: the
        #: store's own rule (:meth:`ClaimStore.inline_without_io`); -1 when every one needs the store
        self._on_loop_max = inline_max_bytes if store.inline_without_io(inline_max_bytes, inline_max_bytes) else -1
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
    ) -> protocol.SubmitItem:
        """Check the fields (:func:`~ccsq.common.wire.protocol.submit_fields_problem`, the
        broker's rule), then read the payload, put it in the claim store when it is over
        ``inline_max_bytes``, and build the item. Raises InvalidRequest (bad input: nothing
        was written), StoreUnavailable (the claim store is unreachable)."""
        fields = _checked_fields(kind, params, key, priority, deadline_ts, max_attempts, max_runtime_s)
        data = read_payload(payload)
        blob = self._blob_now(data) or await self._blob_stored(data)
        return _item(fields, key, blob)

    def _blob_now(self, data: bytes) -> protocol.Blob | None:
        """The payload's blob when making it needs no I/O (inline: a digest, so no coroutine
        hop), else None: then await :meth:`_blob_stored`."""
        if len(data) <= self._on_loop_max:  # the store's inline_without_io, its class part decided once
            return inline_blob(data)  # what its put_blob makes
        return None

    async def _blob_stored(self, data: bytes) -> protocol.Blob:
        """The payload put in the claim store (in the store's thread)."""
        blob = await self.store.aput_blob(data, self.inline_max_bytes, self._exec)
        if blob.inline is None:
            crash_point("producer.after_blob_put")
        return blob

    async def build_many(self, specs: Iterable[Any]) -> list[protocol.SubmitItem]:
        """:meth:`build` for each of ``specs`` in order, each checked before its payload is
        written, as a loop without a coroutine per tuple spec. A spec is ``(payload, kind)``,
        ``(payload, kind, params)`` or a dict of :meth:`build`'s arguments (``payload``,
        ``kind``, ``params``, ``key``...). Raises as :meth:`build` (items before the bad one
        may have written their blobs), InvalidRequest for a malformed spec."""
        built: list[protocol.SubmitItem] = []
        append = built.append
        pack = _pack()  # this thread's: the loop's (an await below resumes on the same thread)
        kind_parts: dict[str, bytes] = {}  # kind -> its bytes in derive_key's input
        for spec in specs:
            if isinstance(spec, tuple) and len(spec) in (2, 3):
                payload, kind = spec[0], spec[1]
                params = _checked_tuple_fields(kind, spec[2] if len(spec) == 3 else None)
            elif isinstance(spec, Mapping):  # any option: build's own keyword checks and errors
                spec = dict(spec)
                try:
                    payload, kind = spec.pop("payload"), spec.pop("kind")
                except KeyError as exc:
                    raise InvalidRequest(f"submit_many item needs {exc.args[0]!r}") from None
                append(await self.build(payload, kind, **spec))
                continue
            else:
                raise InvalidRequest("submit_many items are (payload, kind[, params]) tuples or dicts")
            # a tuple spec: build's steps inlined (same values: no key given, every option at its default)
            data = read_payload(payload)
            blob = self._blob_now(data) or await self._blob_stored(data)
            kind_part = kind_parts.get(kind)
            if kind_part is None:
                kind_part = kind_parts[kind] = _kind_part(kind)
            key = _key(blob.sha256, kind_part, pack(sorted(params.items())))  # derive_key, the kind's bytes once
            append(_submit_item(key, kind, blob, params, 0, None, 0, 0.0, b"", b""))
        return built

    def close(self) -> None:
        """Wait for a claim-store write in progress, then stop its thread."""
        self._exec.shutdown(wait=True)


#: ``(kind, params, priority, deadline_ts, max_attempts, max_runtime_s)``, checked and normalised
_Fields = tuple[str, dict, int, "float | None", int, float]


def _checked_fields(kind: Any, params: Mapping[str, Any] | None, key: Any, priority: Any, deadline_ts: Any,
                    max_attempts: Any, max_runtime_s: Any) -> _Fields:
    """The caller's fields checked (InvalidRequest naming the problem) and normalised, before
    any payload is read or written: the argument checks, :func:`check_params`, then the
    broker's rule :func:`~ccsq.common.wire.protocol.submit_fields_problem`."""
    if not isinstance(kind, str) or not kind:
        raise InvalidRequest("kind must be a non-empty string")
    if key is not None and (not isinstance(key, str) or not key):
        raise InvalidRequest("key must be a non-empty string (or None to derive it)")
    if max_attempts is not None and max_attempts < 1:
        raise InvalidRequest(f"max_attempts must be >= 1, got {max_attempts}")
    if max_runtime_s is not None and max_runtime_s <= 0:
        raise InvalidRequest(f"max_runtime_s must be > 0, got {max_runtime_s}")
    params = check_params(params)
    priority = int(priority)
    deadline_ts = None if deadline_ts is None else float(deadline_ts)
    max_attempts = int(max_attempts or 0)
    max_runtime_s = float(max_runtime_s or 0.0)
    problem = protocol.submit_fields_problem(kind=kind, key=key, params=params, priority=priority, deadline_ts=deadline_ts,
                                      max_attempts=max_attempts, max_runtime_s=max_runtime_s)
    if problem:  # before the blob is written: bad input leaves no orphan
        raise InvalidRequest(problem)
    return kind, params, priority, deadline_ts, max_attempts, max_runtime_s


def _checked_tuple_fields(kind: Any, params: Mapping[str, Any] | None) -> dict[str, protocol.Scalar]:
    """:func:`_checked_fields` for a ``(payload, kind[, params])`` spec (no key, every option at
    its default): the same checks, errors and order on the two fields there are; returns
    the checked params (a copy)."""
    if not isinstance(kind, str) or not kind:
        raise InvalidRequest("kind must be a non-empty string")
    params = check_params(params)
    problem = protocol.submit_fields_problem(kind=kind, key=None, params=params, priority=0, deadline_ts=None,
                                      max_attempts=0, max_runtime_s=0.0)
    if problem:  # before the blob is written: bad input leaves no orphan
        raise InvalidRequest(problem)
    return params


def _item(fields: _Fields, key: str | None, blob: protocol.Blob) -> protocol.SubmitItem:
    kind, params, priority, deadline_ts, max_attempts, max_runtime_s = fields
    return _submit_item(key or derive_key(blob.sha256, kind, params), kind, blob, params, priority, deadline_ts,
                        max_attempts, max_runtime_s, b"", b"")  # no origin (relay submissions only)
