"""Where the console's numbers come from.

Online: one short admin session per page (:func:`ccsq.tools.admin_client._with_broker`,
the same request tracker as ``ccsq status``), one at a time (a second session
under the same peer id would replace the first). Offline (the broker gave no
WELCOME within ``connect_timeout_s``): the read-only commands answer from the
ledger with :func:`ccsq.tools.admin_client.offline`, the code path of
``ccsq status --offline``. The chart series, the drain forecast and the recent
gap events come from :func:`ccsq.brokerd.gap_report.load_report`, the code path of
``ccsq gap-report``, whether the broker runs or not.

Every ledger read opens one read-only snapshot, reads, and closes it (a few
milliseconds); they run one at a time on a single worker thread, so the event
loop never blocks and no two environments of the ledger are open at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar


from ccsq.tools import admin_client
from ccsq.tools.admin_client import AdminSession
from ccsq.common.wire.config import AdminConfig
from ccsq.common.wire.errors import BrokerUnavailable, CcsqError

T = TypeVar("T")
#: After the broker did not answer, pages read the ledger for this long before trying it again.
DOWN_RETRY_S = 5.0
#: How many of each window's newest gap events the item page searches for the item.
ITEM_EVENTS_SCANNED = 1000
CALL_TIMEOUT_S = 10.0


class Source:
    """The broker (an admin peer) and the ledger (read-only) behind the console.

    ``settings``: the console's ``admin.toml``. Methods raise
    :class:`~ccsq.common.wire.errors.BrokerUnavailable` (commands that need the broker),
    :class:`~ccsq.common.wire.errors.AdminFailed` (the broker, or the ledger, said no)
    and :class:`~ccsq.common.wire.errors.CcsqError` subclasses (ledger not readable).
    """

    def __init__(self, settings: AdminConfig, *, down_retry_s: float = DOWN_RETRY_S) -> None:
        self.settings = settings
        self.down_retry_s = down_retry_s
        self.broker_error = ""
        self._down_until = 0.0
        self._lock = asyncio.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ccsq-console-ledger")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # --- the two paths ---
    async def broker(self, fn: Callable[[AdminSession], Awaitable[T]]) -> T:
        """Run ``await fn(session)`` in one admin session. Raises BrokerUnavailable
        (at once while the broker was seen down less than ``down_retry_s`` ago)."""
        if time.monotonic() < self._down_until:
            raise BrokerUnavailable(self.broker_error)
        async with self._lock:
            timeout = min(self.settings.connect_timeout_s, 2.0)
            try:
                out = await admin_client._with_broker(self.settings, fn, timeout)  # noqa: SLF001 - its async form
            except BrokerUnavailable as exc:
                self.broker_error = str(exc)
                self._down_until = time.monotonic() + self.down_retry_s
                raise
            self._down_until = 0.0
            self.broker_error = ""
            return out

    async def ledger(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the ledger thread (one read at a time)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def read(self, command: str, args: dict | None = None) -> dict[str, Any]:
        """A read-only admin command (status, items_show, dlq_list): from the broker,
        else from the ledger. The document's ``source`` says which."""
        async def one(session: AdminSession) -> dict[str, Any]:
            return await session.call(command, args, timeout_s=CALL_TIMEOUT_S)

        try:
            doc = await self.broker(one)
            doc.setdefault("source", "broker")
            return doc
        except BrokerUnavailable:
            return await self.ledger(admin_client.offline, self.settings.data_dir, command, args)

    async def report(self) -> tuple[dict[str, Any] | None, str]:
        """(``ccsq gap-report --json``'s document, "") or (None, why the ledger is not readable here)."""
        from ccsq.brokerd.gap_report import load_report

        try:
            return await self.ledger(load_report, self.settings.data_dir), ""
        except CcsqError as exc:
            return None, f"{exc}"
        except Exception as exc:  # noqa: BLE001 - an LMDB error on a host without the ledger: say it on the page
            return None, f"{type(exc).__name__}: {exc}"

    async def gap_windows(self) -> tuple[list[dict[str, Any]] | None, dict[str, int], str]:
        """(windows as in ``gap-report --json``, rejected-frame counts, "") from one short
        ledger read (counts and recent events only: no forecast scan), or (None, {}, why)."""
        try:
            windows, rejects = await self.ledger(_gap_windows, self.settings.data_dir)
            return windows, rejects, ""
        except Exception as exc:  # noqa: BLE001 - no ledger here: the page uses the broker's counts
            return None, {}, f"{exc}"

    async def recent_items(self, state: str, kind: str) -> tuple[list[dict[str, Any]] | None, int, str]:
        """(:func:`_recent_items`'s records, records read, "") or (None, 0, why the ledger is not readable here)."""
        try:
            found, read = await self.ledger(_recent_items, self.settings.data_dir, state, kind)
            return found, read, ""
        except Exception as exc:  # noqa: BLE001 - no ledger on this host: the page says so
            return None, 0, f"{exc}"

    async def item_extras(self, item_id: str) -> dict[str, Any]:
        """{events: the item's gap events (newest first), payload, result: blob
        summaries or None}; {} when the ledger is not readable here."""
        try:
            return await self.ledger(_item_extras, self.settings.data_dir, item_id)
        except Exception:  # noqa: BLE001 - extras are optional on a host without the ledger
            return {}

    async def find_key(self, key: str) -> str | None:
        """The item id an idempotency key names (within the dedup window), or None."""
        try:
            return await self.ledger(_find_key, self.settings.data_dir, key)
        except Exception:  # noqa: BLE001 - no ledger here: search by id only
            return None


#: The Items page lists at most this many recent items, found among this many newest records.
RECENT_LISTED = 50
RECENT_SCANNED = 5000


def _recent_items(data_dir: str | Path, state: str, kind: str, limit: int = RECENT_LISTED,
                  scan: int = RECENT_SCANNED) -> tuple[list[dict[str, Any]], int]:
    """(up to ``limit`` records of the newest items, newest first, in ``state`` and of
    ``kind`` when given (""= any), how many records were read). Item ids grow with arrival,
    so the ``items`` table read backwards is newest first; at most ``scan`` records are read
    (an older match is not listed: search it by id or key)."""
    from ccsq.brokerd.ledger import schema

    out: list[dict[str, Any]] = []
    read = 0
    with admin_client.offline_view(data_dir) as view:
        cur = view.txn.cursor(db=view.db["items"])
        ok = cur.last()
        while ok and read < scan and len(out) < limit:
            read += 1
            rec = schema.unpack_item(cur.value(), cur.key().decode())
            if (not state or rec["state"] == state) and (not kind or rec["kind"] == kind):
                out.append({k: rec.get(k) for k in ("id", "kind", "state", "attempt", "priority", "created_ms",
                                                    "worker", "error")})
            ok = cur.prev()
    return out, read


def _blob(b: Any) -> dict[str, Any] | None:
    if b is None:
        return None
    return {"sha256": b.sha256, "size": b.size, "inline": b.inline is not None}


def _item_extras(data_dir: str | Path, item_id: str) -> dict[str, Any]:
    from ccsq.brokerd import gaps

    with admin_client.offline_view(data_dir) as view:
        events = []
        for w in gaps.WINDOWS:
            events += [dict(ev, name=w.name) for ev in view.recent_events(w.id, ITEM_EVENTS_SCANNED) if ev.get("item_id") == item_id]
        rec = view.get(item_id)
        payload = result = None
        if rec is not None:
            try:
                payload = _blob(view.payload(item_id))
            except Exception:  # noqa: BLE001 - purged payload
                payload = None
            result = _blob(view.result(item_id))
    events.sort(key=lambda ev: ev["ts"], reverse=True)
    return {"events": events, "payload": payload, "result": result}


def _gap_windows(data_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    from ccsq.brokerd import gaps
    from ccsq.brokerd.gap_report import RECENT_EVENTS

    with admin_client.offline_view(data_dir) as view:
        counts = view.gap_counts()
        windows = [{"id": w.id, "name": w.name, "where": w.where, "why": w.why, "repair": w.repair, "counter": w.counter,
                    "count": counts[w.id], "recent": view.recent_events(w.id, RECENT_EVENTS)} for w in gaps.WINDOWS]
        return windows, view.rejects()


def _find_key(data_dir: str | Path, key: str) -> str | None:
    with admin_client.offline_view(data_dir) as view:
        found = view.key_entry(key)  # idempotency key -> [item_id, created_ms] (docs/ledger.md)
    return None if found is None else found[0]
