"""The producer library: submit documents to a ccsq broker with a durable confirm.

Typical use (blocking)::

    from ccsq.producer import Client

    with Client.from_config_file("swarm/producer.toml") as client:
        receipt = client.submit(Path("scan.png"), "ocr", params={"lang": "en"})
        print(client.wait([receipt.item_id], timeout_s=600)[receipt.item_id].state)

:class:`AsyncClient` is the same API for asyncio code; :class:`Client` runs one
on a private event loop in a background thread.

Guarantees
- ``submit`` returns only after the broker's SUBMIT_ACK, which the broker sends
  after its ledger commit (fsync). Payloads over ``inline_max_bytes`` go to the
  claim store *before* the SUBMIT (claim check).
- Without an explicit ``key``, the idempotency key is
  ``sha256(payload sha256, kind, canonical params)``: submitting the same
  document twice is a no-op that returns the original item id.
- No reply in ``submit_timeout_s``, or a lost connection: the same SUBMIT is
  sent again (same key, so the broker deduplicates) with capped, jittered
  backoff, until the call's ``timeout_s``. QUEUE_FULL / DISK_FULL are retried
  the same way and then raised as :class:`QueueFull` / :class:`DiskFull`.
- With ``outbox_dir`` set, a submission the broker cannot confirm in time
  (unreachable, or refusing with QUEUE_FULL / DISK_FULL) is committed to a
  local durable spool instead and returns ``Receipt(spooled=True, item_id="")``;
  a background flusher sends spooled items in order once the broker is back.
  While the spool is not empty, new submissions join it (order is kept).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from ccsq.common.wire import protocol
from ccsq.common.wire.frames import FrameBudget
from ccsq.common.storage.claimstore import open_store
from ccsq.common.wire.config import ProducerConfig, load
from ccsq.common.wire.errors import (
    BrokerUnavailable,
    CcsqError,
    ConfigError,
    PayloadTooLarge,
    StoreUnavailable,
    Unauthorized,
)
from ccsq.common.runtime.log import get_logger
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.link.peer import BrokerLink, refusal_fix
from ccsq.common.link.requests import RequestTracker
from ccsq.common.wire.policy import refusal_error, refusal_final, refusal_retryable
from ccsq.producer.items import ItemBuilder, Payload, canonical_params, derive_key, item_size, item_size_bound  # noqa: F401 (public here too)
from ccsq.producer.outbox import Outbox
from ccsq.producer.replay import OutboxReplay

log = get_logger("ccsq.producer")

#: States after which an item will not change any more ("unknown": purged or never existed).
DONE_STATES = frozenset({s.value for s in protocol.TERMINAL_STATES} | {"unknown"})
#: ``wait``'s state for an item the broker never answered about in time (down or frozen):
#: not a verdict on the item, so not in DONE_STATES ("unknown" is the broker's own answer).
UNANSWERED_STATE = "unanswered"

DEFAULT_TIMEOUT_S = 60.0
_STATUS_IDS_PER_FRAME = 1000
_RETRY_BASE_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class Receipt:
    """What a submit returns. ``item_id`` is "" when ``spooled`` (in the local
    outbox, not yet confirmed by the broker); ``duplicate`` when the key was
    already known to the broker (``item_id`` is then the original item's)."""

    item_id: str
    key: str
    duplicate: bool = False
    spooled: bool = False
    #: no worker seen by the broker recently (since it started, or noted in its ledger the day before) serves this item's kind: it waits
    #: in ``ready`` until one connects (False when unknown: spooled, or an older broker)
    unserved: bool = False


#: ``Receipt(item_id, key, duplicate, spooled, unserved)`` without the frozen ``__init__`` (one per item)
_receipt = protocol.trusted_constructor(Receipt, ("item_id", "key", "duplicate", "spooled", "unserved"))


def _whole_status(request: Any, frames: list[protocol.Message]) -> protocol.StatusReply | None:
    """The STATUS_REPLY frames of one STATUS / CANCEL merged, once they answer every id
    asked (in the order asked); None while some are still to come."""
    parts = cast(list[protocol.StatusReply], frames)  # only STATUS_REPLY frames are added as parts (_on_message)
    by_id = {st.item_id: st for part in parts for st in part.items}
    asked = list(getattr(request, "item_ids", None) or ())
    if any(i not in by_id for i in asked):
        return None
    return protocol.StatusReply(parts[0].req, [by_id[i] for i in asked] if asked else list(by_id.values()))


class AsyncClient:
    """Producer client for asyncio code. Use ``async with AsyncClient(cfg) as c:``.

    ``base_dir`` resolves a relative ``file://`` claim store (default: the
    config file's directory, else the working directory).
    """

    # --- configuration ---
    config: ProducerConfig
    # --- owned resources ---
    _items: ItemBuilder  # the claim store (used from one thread) and the item rule
    _replay: OutboxReplay | None  # the outbox and its flusher (``outbox_dir`` set)
    _link: BrokerLink | None
    _tasks: list[asyncio.Task]
    # --- request state (event loop only) ---
    _requests: RequestTracker[protocol.Submit | protocol.Status | protocol.Cancel, protocol.Message]

    def __init__(self, config: ProducerConfig, *, base_dir: str | Path | None = None) -> None:
        self.config = config
        if base_dir is None:
            base_dir = Path(config.config_path).parent if config.config_path else Path.cwd()
        s3 = {k: getattr(config, f"s3_{k}", "") for k in ("endpoint_url", "region", "profile")}
        where = f"{config.config_path}: claim_store" if config.config_path else "claim_store"
        store = open_store(config.claim_store, base_dir=base_dir, create=False, s3=s3, where=where)
        try:
            store.check(where)  # a wrong root, bucket or credential: ConfigError now, not at the first submit
        except StoreUnavailable as exc:  # unreachable right now: submit retries / spools; say so once
            log.warning("claim_store_unavailable", error=str(exc))
        self._items = ItemBuilder(store, config.inline_max_bytes)
        self._link = None
        self._served: list[str] = []  # kinds the broker last named as served (with an unserved-kind warning)
        self._tasks = []
        self._requests = RequestTracker()
        self._budget = FrameBudget(config.max_frame_bytes)  # the one frame budget (common/wire/frames.py)
        self.log = log.bind(peer=config.peer_id)
        self._replay = None
        if config.outbox_dir:
            self._replay = OutboxReplay(
                Outbox(config.outbox_dir), send_frame=self._submit_confirmed, first_frame=lambda items: self._frames(items)[0],
                submit_timeout_s=config.submit_timeout_s, retry_base_s=_RETRY_BASE_S * 4,
                backoff_cap_s=config.reconnect_backoff_max_s, log=self.log)

    @classmethod
    def from_config_file(cls, path: str | Path) -> AsyncClient:
        """Build from a ``producer.toml`` (ConfigError on problems)."""
        return cls(load(ProducerConfig, path))

    # --- lifecycle ---
    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start connecting to the broker (and the outbox flusher); returns at once."""
        if self._link is not None:
            return
        self._link = BrokerLink(
            self.config,
            hello=lambda: protocol.Hello(role=protocol.Role.PRODUCER.value, info={"features": "unserved_kinds,kinds_served"}),
            on_message=self._on_message,
            on_connect=self._on_connect,
        )
        link_task = asyncio.create_task(self._link.run(), name="producer-link")
        link_task.add_done_callback(self._link_ended)
        self._tasks.append(link_task)
        if self._replay is not None:
            flusher = asyncio.create_task(self._replay.run(self._link.ready), name="producer-outbox-flusher")
            flusher.add_done_callback(self._flusher_done)
            self._tasks.append(flusher)

    def _link_ended(self, _task: asyncio.Task) -> None:
        """The link stopped for good: if the broker refused us, or another live process took
        our peer id, every waiting request fails now."""
        if self._link is not None and self._link.replaced:
            self._requests.fail_all(self._replaced_error())
            return
        if self._link is None or self._link.refused is None:
            return
        self._requests.fail_all(
            Unauthorized(refusal_fix(self.config, protocol.Role.PRODUCER.value, self._link.refused), code=self._link.refused.code))

    def _replaced_error(self) -> ConfigError:
        from ccsq.common.link.peer import id_in_use_message

        assert self._link is not None
        return ConfigError(id_in_use_message(self.config, self._link))

    def _flusher_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.log.error("outbox_flusher_crashed", error=f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        """Say BYE and stop. Unconfirmed direct submissions fail with BrokerUnavailable;
        spooled items stay in the outbox for the next run. While the broker is
        connected, the outbox gets a bounded chance (``submit_timeout_s``, at most
        5 s) to drain first, so confirmed items are removed rather than re-sent
        by the next run."""
        if self._replay is not None and self._link is not None and self._link.ready.is_set():
            try:
                await self.flush(timeout_s=min(self.config.submit_timeout_s, 5.0))
            except BrokerUnavailable:
                pass  # left for the next run; dedup makes the re-send harmless
        if self._link is not None:
            await self._link.stop("producer closed")
        for task in self._tasks:
            if task.get_name() == "producer-link":
                try:
                    await asyncio.wait_for(asyncio.shield(task), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
        self._requests.fail_all(BrokerUnavailable("client closed before the broker answered"))
        if self._replay is not None:
            self._replay.close()
            self._replay = None
        self._items.close()

    @property
    def connected(self) -> bool:
        """True while a session with the broker is up."""
        return self._link is not None and self._link.ready.is_set()

    # --- link callbacks ---
    def _on_message(self, env: Any) -> None:
        msg = env.message
        if isinstance(msg, protocol.SubmitAck):
            self._requests.resolve(msg.req, msg)
        elif isinstance(msg, protocol.StatusReply):  # the broker splits a large answer over several frames
            self._requests.add_part(msg.req, msg, _whole_status)
        elif isinstance(msg, protocol.Error):
            self.log.warning("broker_error", code=msg.code, message=msg.message, ref_seq=msg.ref_seq)
        else:
            self.log.warning("unexpected_message", type=type(msg).__name__)

    def _on_connect(self, welcome: protocol.Welcome) -> None:
        assert self._link is not None
        resent = self._requests.resend_all(self._link.send)
        if resent:
            self.log.info("pending_requests_resent", count=resent)
        if self._replay is not None:
            self._replay.wakeup.set()

    # --- request/reply with retries ---
    def _require_link(self) -> BrokerLink:
        if self._link is None:
            raise CcsqError("client not started: use `async with AsyncClient(cfg)` or call start()")
        return self._link

    def _check_refused(self, link: BrokerLink) -> None:
        """Raise Unauthorized (naming the fix) once the broker refused this peer for good;
        ConfigError once another live process took this peer id."""
        if link.replaced:
            raise self._replaced_error()
        refusal = link.refused or link.last_refusal
        if refusal is not None and refusal_final(refusal.code):
            raise Unauthorized(refusal_fix(self.config, protocol.Role.PRODUCER.value, refusal), code=refusal.code)

    async def wait_connected(self, timeout_s: float, *, refused_grace_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for a session with the broker: True when connected,
        False when the broker did not answer in time (down, or the endpoint is wrong).
        Raises Unauthorized as soon as the broker refuses this peer (unknown id, wrong
        key, wrong role), normally well within a second. ``refused_grace_s``: return
        False early once every connect was refused (nothing listens at the endpoint) for
        this many seconds, or at once on a CURVE mismatch (curve on one side only); a
        broker that accepts the connection but answers slowly still gets the whole
        ``timeout_s``. :meth:`connect_problem` then says why."""
        return await self._wait_ready(timeout_s, refused_grace_s=refused_grace_s)

    def kinds_served(self) -> list[str]:
        """The kinds that workers seen by the broker recently serve, as the broker named them
        with its last unserved-kind answer (a receipt with ``unserved``); [] before one, or
        from a broker that does not name them."""
        return list(self._served)

    async def connect_problem(self) -> str | None:
        """Why the link has no session yet, when known: ``"connection to ... refused ..."``
        or a CURVE mismatch with its fix; None otherwise (e.g. a silent broker)."""
        return self._require_link().connect_problem

    async def _wait_ready(self, timeout_s: float, *, refused_grace_s: float | None = None) -> bool:
        """True once a session is up; False after ``timeout_s``; Unauthorized as soon as
        the broker refuses our HELLO for good."""
        link = self._require_link()
        deadline = time.monotonic() + timeout_s
        while not link.ready.is_set():
            self._check_refused(link)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            since = link.refused_since_mono
            if refused_grace_s is not None and (
                    link.curve_mismatch or (since is not None and time.monotonic() - since >= refused_grace_s)):
                return False
            try:
                await asyncio.wait_for(link.ready.wait(), timeout=min(left, 0.05))
            except asyncio.TimeoutError:
                pass
        return True

    async def _roundtrip(self, build: Any, deadline_mono: float) -> protocol.Message:
        """Send ``build(req)`` and return the reply with the same ``req``.

        Re-sends the same message after ``submit_timeout_s`` without a reply and
        on every reconnect, with capped jittered backoff, until ``deadline_mono``
        (then BrokerUnavailable)."""
        link = self._require_link()
        req = self._requests.next_id()
        msg = build(req)
        fut = self._requests.register(req, msg)
        attempt = 0
        try:
            link.send(msg)  # if not connected, on_connect sends it
            while True:
                self._check_refused(link)
                left = deadline_mono - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailable(
                        f"no answer from the broker at {self.config.broker_endpoint} in time; "
                        "check that ccsq-brokerd runs and the endpoint is right"
                    )
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), timeout=min(left, self.config.submit_timeout_s))
                except asyncio.TimeoutError:
                    pass
                delay = backoff_delay_s(attempt, _RETRY_BASE_S, self.config.reconnect_backoff_max_s)
                attempt += 1
                self.log.info("request_retry", req=req, type=type(msg).__name__, attempt=attempt, in_s=round(delay, 3))
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, min(delay, deadline_mono - time.monotonic())))
                except asyncio.TimeoutError:
                    pass
                link.send(msg)
        finally:
            self._requests.discard(req)

    async def _submit_confirmed(
        self, items: list[protocol.SubmitItem], deadline_mono: float, unserved: set[str] | None = None
    ) -> tuple[dict[str, protocol.SubmitResult], list[protocol.SubmitItem], CcsqError | None]:
        """Send ``items`` (one frame) until each is confirmed or refused for good.

        Returns ``(results by key, unconfirmed items, last retryable error)``;
        results include permanent refusals (``error`` set). Kinds the broker says no
        worker serves are added to ``unserved``."""
        done: dict[str, protocol.SubmitResult] = {}
        remaining = items
        attempt = 0
        refused: CcsqError | None = None  # the broker's last retryable refusal of these items
        while True:
            try:
                # SUBMIT is answered by SUBMIT_ACK
                ack = cast(protocol.SubmitAck, await self._roundtrip(lambda req: protocol.Submit(req=req, items=remaining), deadline_mono))
            except BrokerUnavailable as exc:
                # the time ran out on a retry: the broker's own last word (QUEUE_FULL, ...) says
                # why better than "no answer" (a loaded broker answers a retry late)
                return done, remaining, refused or exc
            if unserved is not None:
                unserved.update(ack.unserved)
            if ack.served:
                self._served = list(ack.served)
            by_key = {r.key: r for r in ack.results}
            retry: list[protocol.SubmitItem] = []
            last: protocol.SubmitResult | None = None
            for item in remaining:
                res = by_key.get(item.key)
                if res is None or (res.error and refusal_retryable(res.error)):
                    retry.append(item)
                    last = res or last
                else:
                    done[item.key] = res
            if not retry:
                return done, [], None
            remaining = retry
            err = refusal_error(last.error, last.message) if last is not None else BrokerUnavailable(
                "broker answered without a result for some items")
            refused = err
            delay = backoff_delay_s(attempt, _RETRY_BASE_S * 4, self.config.reconnect_backoff_max_s)
            attempt += 1
            if time.monotonic() + delay >= deadline_mono:
                return done, remaining, err
            self.log.info("submit_refused_retrying", code=err.code, items=len(remaining), in_s=round(delay, 3))
            await asyncio.sleep(delay)

    def _frames(self, items: list[protocol.SubmitItem]) -> list[list[protocol.SubmitItem]]:
        """Split items into SUBMIT frames under ``max_frame_bytes`` (order kept); an item
        that cannot fit a frame on its own raises :class:`PayloadTooLarge`."""
        if len(items) <= self._budget.max_items and sum(map(item_size_bound, items)) <= self._budget.room_bytes:
            return [items]  # surely one frame (exact sizes are below the bounds): what the split gives
        return self._budget.split(items, size_of=item_size, too_large=self._too_large)

    def _too_large(self, item: protocol.SubmitItem, size_bytes: int) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"item {item.key[:16]}... is {size_bytes} bytes encoded, over the {self._budget.room_bytes} bytes one frame "
            f"holds (max_frame_bytes={self.config.max_frame_bytes}); "
            "lower inline_max_bytes or shrink params")

    # --- public API ---
    async def submit(
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
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Receipt:
        """Submit one item and return once the broker has committed it (or it is spooled).

        ``payload``: bytes, a path, or a binary file object. ``params``: str -> scalar.
        ``deadline_ts``: wall-clock UNIX seconds after which the item expires.
        ``timeout_s``: overall time for retries without an outbox.
        Raises QueueFull, DiskFull, BrokerUnavailable (retryable), Unauthorized,
        PayloadTooLarge, InvalidRequest or another PermanentError the broker names.
        """
        item = await self._items.build(
            payload, kind, params=params, key=key, priority=priority, deadline_ts=deadline_ts,
            max_attempts=max_attempts, max_runtime_s=max_runtime_s,
        )
        return (await self._submit_items([item], timeout_s))[0]

    async def submit_many(self, items: Iterable[Any], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Receipt]:
        """Submit many items in few SUBMIT frames; receipts in input order.

        Each element is ``(payload, kind)``, ``(payload, kind, params)`` or a dict
        of :meth:`submit`'s arguments (``payload``, ``kind``, ``params``, ``key``...).
        Items confirmed before a permanent refusal stay submitted (resubmitting
        is a no-op); the first permanent refusal is raised after all frames finish.
        """
        built = await self._items.build_many(items)
        return await self._submit_items(built, timeout_s)

    async def _submit_items(self, items: list[protocol.SubmitItem], timeout_s: float) -> list[Receipt]:
        """Send ``items`` (one per key reaches the broker) in few frames until confirmed, or
        spool them; receipts in input order. Raises the first error that left an item
        neither confirmed nor spooled, or the first permanent refusal."""
        if not items:
            return []
        if len({it.key for it in items}) == len(items):  # the usual batch: every key once
            unique = items
        else:
            unique = list({it.key: it for it in reversed(items)}.values())[::-1]  # one per key, first wins
        frames = self._frames(unique)  # PayloadTooLarge before anything is sent or spooled
        self._check_refused(self._require_link())  # refused for good: spooling would only hide it
        deadline = await self._direct_deadline(timeout_s)
        if deadline is None:
            assert self._replay is not None
            await self._replay.spool(unique, reason="outbox_not_empty_or_broker_unreachable")
            return [Receipt(item_id="", key=it.key, spooled=True) for it in items]
        results, unconfirmed, unserved = await self._send_frames(frames, deadline)
        if unserved:
            self.log.info("kind_not_served", kinds=sorted(unserved), served=self._served,
                          hint="no worker seen by the broker recently serves these kinds; the items wait in ready")
        if self._replay is not None and unconfirmed:
            await self._replay.spool(unconfirmed, reason="not_confirmed_in_time")
        return _receipts(items, results, {it.key for it in unconfirmed}, unserved, unique is not items)

    async def _direct_deadline(self, timeout_s: float) -> float | None:
        """When to give up sending directly (monotonic seconds), once a session is up; None:
        spool instead (the outbox is not empty, or no session within ``submit_timeout_s``).
        Without an outbox, raises BrokerUnavailable when no session comes in ``timeout_s``."""
        if self._replay is not None:
            if not await self._replay.is_empty() or not await self._wait_ready(self.config.submit_timeout_s):
                return None
            return time.monotonic() + self.config.submit_timeout_s
        deadline = time.monotonic() + timeout_s
        if not await self._wait_ready(timeout_s):
            raise BrokerUnavailable(
                f"no session with the broker at {self.config.broker_endpoint} within {timeout_s}s; "
                "check that ccsq-brokerd runs and the endpoint is right (or set outbox_dir to spool)"
            )
        return deadline

    async def _send_frames(self, frames: list[list[protocol.SubmitItem]], deadline_mono: float
                           ) -> tuple[dict[str, protocol.SubmitResult], list[protocol.SubmitItem], set[str]]:
        """Send every frame at once, each until confirmed or ``deadline_mono``. Returns
        ``(results by key, unconfirmed items, kinds no worker serves)``; without an outbox
        an unconfirmed item raises its frame's error (BrokerUnavailable, QueueFull...)."""
        unserved: set[str] = set()
        if len(frames) == 1:  # the usual batch: no task for gather to wrap it in
            outcomes = [await self._submit_confirmed(frames[0], deadline_mono, unserved)]
        else:
            outcomes = await asyncio.gather(*(self._submit_confirmed(f, deadline_mono, unserved) for f in frames))
        results: dict[str, protocol.SubmitResult] = {}
        unconfirmed: list[protocol.SubmitItem] = []
        errors: list[CcsqError] = []
        for done, left, err in outcomes:
            results.update(done)
            unconfirmed.extend(left)
            if left:
                errors.append(err or BrokerUnavailable("broker did not confirm in time"))
        if errors and self._replay is None:
            raise errors[0]
        return results, unconfirmed, unserved

    async def flush(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Wait until the outbox is empty (every spooled item confirmed or rejected).
        Raises BrokerUnavailable after ``timeout_s``. No-op without an outbox."""
        if self._replay is not None:
            await self._replay.flush(timeout_s)

    async def outbox_rejected(self) -> list[tuple[str, str, str]]:
        """``(key, error code, message)`` of spooled items the broker refused for good."""
        return [] if self._replay is None else await self._replay.outbox.rejected()

    async def outbox_count(self) -> int:
        """Items still in the local outbox (0 without one)."""
        return 0 if self._replay is None else await self._replay.outbox.count()

    async def status(self, item_ids: Iterable[str], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, protocol.ItemStatus]:
        """Current state of each item: ``{item_id: ItemStatus}`` (state "unknown" if the
        broker does not know it). Raises BrokerUnavailable after ``timeout_s``."""
        return await self._per_item(protocol.Status, item_ids, timeout_s)

    async def cancel(self, item_ids: Iterable[str], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, protocol.ItemStatus]:
        """Cancel items that have not started: a READY item becomes DEAD with error
        ``cancelled`` (gap event G7); leased, completed and terminal items are left
        alone. Returns every item's state after the cancel (idempotent, safe to
        retry). Raises BrokerUnavailable after ``timeout_s``."""
        return await self._per_item(protocol.Cancel, item_ids, timeout_s)

    async def _per_item(self, msg_cls: Any, item_ids: Iterable[str], timeout_s: float) -> dict[str, protocol.ItemStatus]:
        """Send ``msg_cls(req, item_ids)`` in chunks; merge the STATUS_REPLYs."""
        ids = list(dict.fromkeys(item_ids))
        out: dict[str, protocol.ItemStatus] = {}
        if not ids:
            return out
        deadline = time.monotonic() + timeout_s
        chunks = [ids[i:i + _STATUS_IDS_PER_FRAME] for i in range(0, len(ids), _STATUS_IDS_PER_FRAME)]
        replies = await asyncio.gather(
            *(self._roundtrip(lambda req, c=c: msg_cls(req=req, item_ids=c), deadline) for c in chunks)
        )
        for reply in cast(list[protocol.StatusReply], replies):  # STATUS / CANCEL are answered by STATUS_REPLY
            for st in reply.items:
                out[st.item_id] = st
        for i in ids:
            out.setdefault(i, protocol.ItemStatus(item_id=i, state="unknown"))
        return out

    async def wait(self, item_ids: Iterable[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, protocol.ItemStatus]:
        """Poll STATUS (with backoff, 50 ms up to 1 s) until every item is done
        (acknowledged, dead, expired, or unknown to the broker) or ``timeout_s`` passes.
        A broker that does not answer is waited for until ``timeout_s`` (it is not a
        terminal state). Returns the last status of every item; check ``.state`` for the
        ones not done (:data:`UNANSWERED_STATE` when the broker never answered for it)."""
        ids = list(dict.fromkeys(item_ids))
        deadline = time.monotonic() + timeout_s
        last: dict[str, protocol.ItemStatus] = {}
        todo = ids
        delay = 0.05
        while todo:
            left = deadline - time.monotonic()
            try:
                last.update(await self.status(todo, timeout_s=max(0.1, left)))
            except BrokerUnavailable:
                if time.monotonic() >= deadline:
                    break
            todo = [i for i in todo if i not in last or last[i].state not in DONE_STATES]
            if not todo or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 1.0)
        for i in ids:
            last.setdefault(i, protocol.ItemStatus(item_id=i, state=UNANSWERED_STATE))
        return last


def _receipts(requested: list[protocol.SubmitItem], results: dict[str, protocol.SubmitResult], spooled_keys: set[str],
              unserved: set[str], repeats: bool = True) -> list[Receipt]:
    """One receipt per requested item, in order (a repeated key is a duplicate of the first);
    raises the typed error of the first item the broker refused for good. ``repeats``:
    False when every key of ``requested`` is known to be there once."""
    receipts: list[Receipt] = []
    append = receipts.append
    seen: set[str] = set()
    if not repeats and not spooled_keys:  # the usual batch: every item confirmed, no key twice
        for item in requested:
            key = item.key
            res = results[key]
            if res.error:
                raise refusal_error(res.error, res.message or f"broker refused item {key}")
            append(_receipt(res.item_id, key, res.duplicate, False, item.kind in unserved))
        return receipts
    for item in requested:
        key = item.key
        if key in spooled_keys:
            seen.add(key)
            append(Receipt(item_id="", key=key, spooled=True))
            continue
        res = results[key]
        if res.error:
            raise refusal_error(res.error, res.message or f"broker refused item {key}")
        append(_receipt(res.item_id, key, res.duplicate or key in seen, False, item.kind in unserved))
        seen.add(key)
    return receipts


class Client:
    """Blocking producer client: an :class:`AsyncClient` on a private event loop in
    a background thread. Same methods, same errors. Use as a context manager."""

    def __init__(self, config: ProducerConfig, *, base_dir: str | Path | None = None) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ccsq-producer-loop", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._async = AsyncClient(config, base_dir=base_dir)
            self._call(self._async.start())
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def from_config_file(cls, path: str | Path) -> Client:
        """Build from a ``producer.toml`` (ConfigError on problems)."""
        return cls(load(ProducerConfig, path))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, payload: Payload, kind: str, **kwargs: Any) -> Receipt:
        """See :meth:`AsyncClient.submit`."""
        return self._call(self._async.submit(payload, kind, **kwargs))

    def submit_many(self, items: Iterable[Any], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Receipt]:
        """See :meth:`AsyncClient.submit_many` (the iterable is consumed on this thread)."""
        return self._call(self._async.submit_many(list(items), timeout_s=timeout_s))

    def status(self, item_ids: Iterable[str], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, protocol.ItemStatus]:
        """See :meth:`AsyncClient.status`."""
        return self._call(self._async.status(list(item_ids), timeout_s=timeout_s))

    def cancel(self, item_ids: Iterable[str], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, protocol.ItemStatus]:
        """See :meth:`AsyncClient.cancel`."""
        return self._call(self._async.cancel(list(item_ids), timeout_s=timeout_s))

    def wait(self, item_ids: Iterable[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, protocol.ItemStatus]:
        """See :meth:`AsyncClient.wait`."""
        return self._call(self._async.wait(list(item_ids), timeout_s=timeout_s))

    def flush(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """See :meth:`AsyncClient.flush`."""
        self._call(self._async.flush(timeout_s))

    @property
    def connected(self) -> bool:
        """True while a session with the broker is up."""
        return self._async.connected

    def wait_connected(self, timeout_s: float, *, refused_grace_s: float | None = None) -> bool:
        """See :meth:`AsyncClient.wait_connected`."""
        return self._call(self._async.wait_connected(timeout_s, refused_grace_s=refused_grace_s))

    def kinds_served(self) -> list[str]:
        """See :meth:`AsyncClient.kinds_served`."""
        return self._async.kinds_served()

    def connect_problem(self) -> str | None:
        """See :meth:`AsyncClient.connect_problem`."""
        return self._call(self._async.connect_problem())

    def outbox_count(self) -> int:
        """Items still in the local outbox (0 without one)."""
        return self._call(self._async.outbox_count())

    def outbox_rejected(self) -> list[tuple[str, str, str]]:
        """``(key, error code, message)`` of spooled items the broker refused for good."""
        return self._call(self._async.outbox_rejected())

    def close(self) -> None:
        """Stop the client (spooled items stay in the outbox)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._async.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
