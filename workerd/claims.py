"""The worker's claim store: fetch a payload, store a result, and the health they decide.

Inline payloads and results up to ``INLINE_RESULT_MAX_BYTES`` need no I/O (a hash
check, a hash): they are handled on the loop; anything else goes to the worker's I/O
threads, so a slow store never stalls heartbeats.

A store that fails us (a blob missing or corrupt in OUR view of it, an I/O error, a
backend down; when fetching a payload or storing a result) makes the worker
*unhealthy*: :meth:`Claims.trouble` marks it so for a pause and calls ``on_unhealthy``
at once (the worker sends a HEARTBEAT with ``healthy = false``, ``info.store_ok =
false``, ``info.store_error`` *before* the FAIL), so the broker dispatches nothing more
to it until a later heartbeat says healthy (docs/deployment.md, "a store that lost a
blob"). The pause of the n-th episode in a row is :func:`unhealthy_pause_s`:
``STORE_UNHEALTHY_MIN_S`` plus the one backoff (full jitter) of attempt n-1, at most
``STORE_UNHEALTHY_MAX_S`` in all: 1-2 s, then 1-3, 1-5, ... 1-60 s. A fetch that the
store answers resets the sequence (:meth:`Claims.fetched`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from ccsq.common.storage.claimstore import HASH_ON_LOOP_MAX_BYTES, ClaimStore, inline_blob, sha256_hex
from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.errors import PayloadMissing

INLINE_RESULT_MAX_BYTES = 16384  # results up to this size travel inline in COMPLETE
STORE_UNHEALTHY_MIN_S = 1.0  # the shortest unhealthy pause after a claim-store failure (never 0)
STORE_UNHEALTHY_MAX_S = 60.0  # the longest


def unhealthy_pause_s(streak: int, rng: random.Random | None = None) -> float:
    """Seconds unhealthy for the ``streak``-th claim-store episode in a row (>= 1):
    ``STORE_UNHEALTHY_MIN_S + backoff_delay_s(streak - 1, STORE_UNHEALTHY_MIN_S,
    STORE_UNHEALTHY_MAX_S - STORE_UNHEALTHY_MIN_S)``, so within [1, 60] s."""
    return STORE_UNHEALTHY_MIN_S + backoff_delay_s(
        streak - 1, STORE_UNHEALTHY_MIN_S, STORE_UNHEALTHY_MAX_S - STORE_UNHEALTHY_MIN_S, rng)


class Claims:
    """One worker's claim store with its I/O threads and health (see module doc).

    ``store`` may be replaced (the metrics wrapper counts its errors). Used from one
    event loop.
    """

    store: ClaimStore
    failures: int  # payload fetches / result stores the claim store failed (missing blob included)
    streak: int  # consecutive episodes; 0 after a successful fetch from the store
    error: str  # the last failure, for the heartbeat
    _bad_until_mono: float  # unhealthy (no new DISPATCH) until then

    def __init__(self, store: ClaimStore, io_pool: Executor, on_unhealthy: Callable[[], object], log: Any) -> None:
        self.store = store
        self.failures = 0
        self.streak = 0
        self.error = ""
        self._bad_until_mono = 0.0
        self._io_pool = io_pool
        self._on_unhealthy = on_unhealthy
        self._log = log

    async def fetch(self, ref: protocol.Blob) -> bytes:
        """The payload's bytes, SHA-256 verified (inline ones on the loop, stored ones in
        the I/O threads). Raises PayloadMissing (absent, corrupt, inline bytes that do not
        match) or the backend's error; what it means: :func:`store_failure`."""
        return await self.store.aget_blob(ref, self._io_pool)

    def verify_on_loop_max_bytes(self) -> int:
        """The largest inline payload :meth:`verify_inline` may check in place of
        :meth:`fetch` (``HASH_ON_LOOP_MAX_BYTES``), or 0 when this store's reads are not the
        base class's (a wrapper or a backend of its own: always :meth:`fetch`)."""
        return HASH_ON_LOOP_MAX_BYTES if self.store.inline_without_io(0, HASH_ON_LOOP_MAX_BYTES) else 0

    @staticmethod
    def verify_inline(ref: protocol.Blob) -> bytes:
        """:meth:`fetch` of an inline payload on the caller's thread (what the base store's
        ``get_blob`` does for one): its bytes, SHA-256 verified, or PayloadMissing."""
        inline = ref.inline
        if inline is None or sha256_hex(inline) != ref.sha256:
            raise PayloadMissing(f"inline payload does not match its sha256 {ref.sha256}")
        return inline

    async def put_result(self, data: bytes) -> protocol.Blob:
        """A reference to ``data``: inline up to ``INLINE_RESULT_MAX_BYTES``, else stored.
        Raises the backend's error."""
        return await self.store.aput_blob(data, INLINE_RESULT_MAX_BYTES, self._io_pool)

    def inline_result(self, data: bytes) -> protocol.Blob | None:
        """:meth:`put_result`'s blob for ``data`` when making it needs no I/O (it stays inline and
        the store's ``put_blob`` is the base class's: ``ClaimStore.inline_without_io``), made here
        on the caller's thread (one SHA-256); else None, and :meth:`put_result` stores it."""
        if self.store.inline_without_io(len(data), INLINE_RESULT_MAX_BYTES):
            return inline_blob(data)
        return None

    @property
    def ok(self) -> bool:
        return time.monotonic() >= self._bad_until_mono

    def fetched(self) -> None:
        """The store produced a blob: the next episode starts the sequence again."""
        self.streak = 0

    def trouble(self, error: str) -> None:
        """The store failed us: count it; a new episode makes the worker unhealthy for
        :func:`unhealthy_pause_s` and says so at once (``on_unhealthy``)."""
        self.failures += 1
        self.error = error
        now = time.monotonic()
        if now < self._bad_until_mono:
            return  # the same episode (the rest of a batch already dispatched)
        self.streak += 1
        self._bad_until_mono = now + unhealthy_pause_s(self.streak)
        self._log.warning("claim_store_unhealthy", failures=self.failures, streak=self.streak, error=error[:300])
        self._on_unhealthy()

    def info(self) -> dict[str, protocol.Scalar]:
        """Heartbeat info: ``store_ok``, ``store_failures``, and ``store_error`` while unhealthy."""
        ok = self.ok
        info: dict[str, protocol.Scalar] = {"store_ok": ok, "store_failures": self.failures}
        if not ok:
            info["store_error"] = self.error[:200]
        return info
