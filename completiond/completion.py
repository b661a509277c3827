"""The completion service: results from the broker into a database, then ACK.

A peer with role ``completion``. The broker sends RESULT frames (at most the
credit granted); for each batch (up to ``batch_max`` results: what arrived while
the previous transaction ran, plus what arrives within ``batch_wait_ms``, 0 by default)
the service

1. resolves each result (inline, or from the claim store, digest verified),
2. writes the batch in ONE database transaction (idempotent upsert by item id);
   a row the database refuses for a data reason (a constraint, a trigger, a value
   the column cannot hold) goes to ``results_quarantine`` instead (gap G12),
3. ``crash_point("completion.after_db_commit")``,
4. sends ACK (re-sent on timeout and on reconnect until its ACK_OK comes),
5. grants CREDIT for the batch once its ACK_OK comes.

The next batch does not wait for the ACK_OK: it is gathered and landed while the broker
commits the ACK (at most ``MAX_ACKS_IN_FLIGHT`` ACKs wait for their ACK_OK at once), so
a result waits for at most the database transaction in progress, not for that
transaction plus the broker's commit of its ACK.

So an ACK always follows its own batch's commit; a crash between 2 and 4 makes the broker
redeliver, and the upsert lands the result once (``deliveries`` counts it).
When the database fails or a write takes longer than ``db_slow_s``, the
service stops (no ACK, no credit), backs off exponentially (capped at
``backoff_max_s``, jittered), reconnects and retries the same batch; results
wait in the broker. SIGTERM/SIGINT: finish the current batch, BYE, exit 0.

Run it with ``ccsq completion --config completion.toml`` (:func:`main`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import structlog

from ccsq.common.wire import protocol
from ccsq.common.storage.claimstore import ClaimStore, open_configured_store
from ccsq.common.wire.config import CompletionConfig, load
from ccsq.common.wire.envelope import Envelope
from ccsq.common.wire.errors import CcsqError, ConfigError, ExitCode, PayloadMissing, PortInUse, StoreUnavailable
from ccsq.common.runtime.daemon import die, settle_gc
from ccsq.common.runtime.faults import crash_point
from ccsq.common.runtime.log import configure
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.link.peer import BrokerLink
from ccsq.common.runtime.systemd import Notifier, stop_signals_and_watchdog
from ccsq.completiond.resultsdb import (
    ResultRow,
    ResultsDB,
    describe_error,
    open_results_db,
    params_to_json,
    text_or_none,
)

log = structlog.get_logger("ccsq.completion")
PROG = "ccsq completion"  # how its errors begin on stderr as `ccsq completion` (main(prog=...) for ccsq-completiond)

_DB_BACKOFF_BASE_S = 0.05
#: first delay before a delivery whose result blob is missing is looked at again (doubles, jittered)
_PARK_BASE_S = 0.5
_STOP_ACK_GRACE_S = 5.0  # on shutdown, how long to wait for the last ACK_OK
#: Database error text per quarantined row in an ACK (batch_max <= 2048 keeps the ACK far below 1 MiB).
ACK_ERROR_MAX_CHARS = 200
#: ACKs sent and not answered by ACK_OK yet, at most; the pipeline waits for one before landing more.
MAX_ACKS_IN_FLIGHT = 4


@dataclasses.dataclass(eq=False, slots=True)
class _AckInFlight:
    """An ACK sent after its batch committed, waiting for ACK_OK (re-sent until then)."""

    msg: protocol.Ack
    session: int  # the link session its deliveries came in (credit goes back only within it)
    credit: int  # credit to grant back on ACK_OK (deliveries of that session)
    sent_mono: float  # last (re)send, monotonic seconds


class CompletionService:
    """One completion peer. ``run()`` serves until :meth:`request_stop`.

    ``db``/``store`` default to the ones named in ``config`` (relative paths
    against the config file's directory).
    """

    # --- configuration and resources ---
    config: CompletionConfig
    db: ResultsDB
    store: ClaimStore
    link: BrokerLink
    _db_exec: concurrent.futures.ThreadPoolExecutor  # the only thread that touches ``db``
    _io_exec: concurrent.futures.ThreadPoolExecutor  # claim-store reads
    # --- state (event loop only) ---
    _incoming: collections.deque[tuple[int, Sequence[protocol.Delivery]]]  # (session number, a RESULT's deliveries)
    _arrived: asyncio.Event  # set when a RESULT is appended to ``_incoming``
    _acks: dict[frozenset[str], _AckInFlight]  # ACKs in flight by their item ids, oldest first (re-sent on reconnect)
    _ack_ok: asyncio.Event  # set when an ACK_OK retires an ACK in flight
    _stop: asyncio.Event
    healthy: bool  # last database write succeeded
    landed: int  # results written so far (this process)
    acked: int  # results acknowledged so far (this process)
    quarantined: int  # results written to results_quarantine so far (this process)
    db_retry_in_s: float = 0.0  # current database backoff delay (0 = healthy)
    db_failures: int = 0  # failed database writes (this process)
    observe_db_write: Callable[[int, float], None] | None = None  # metrics hook: (rows, seconds) per landed batch

    def __init__(self, config: CompletionConfig, *, db: ResultsDB | None = None, store: ClaimStore | None = None,
                 notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier()  # sd_notify STATUS= lines (a no-op outside systemd)
        base_dir = Path(config.config_path).parent if config.config_path else Path.cwd()
        self.db = db or open_results_db(config.database, base_dir, timeout_s=2 * config.db_slow_s)
        self.store = store or open_configured_store(config)  # a wrong root/bucket: ConfigError before READY
        self._db_exec = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ccsq-results-db")
        self._io_exec = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ccsq-claimstore")
        self.healthy = True
        self.landed = 0
        self.acked = 0
        self.quarantined = 0
        self._acks = {}
        self._incoming = collections.deque()
        self._arrived = asyncio.Event()
        # deliveries whose result blob was missing: item_id -> (session, delivery, retry_at_mono, attempt);
        # re-read with backoff so a restored blob lands without a restart
        self._parked: dict[str, tuple[int, protocol.Delivery, float, int]] = {}
        self._ack_ok = asyncio.Event()
        self._stop = asyncio.Event()
        self.log = log.bind(peer=config.peer_id)
        self.link = BrokerLink(  # loads the keys: ConfigError here, before READY
            config,
            hello=lambda: protocol.Hello(role=protocol.Role.COMPLETION.value, credit=config.credit),
            on_message=self._on_message,
            on_connect=self._on_connect,
        )

    # --- lifecycle ---
    def request_stop(self) -> None:
        """Finish the current batch, say BYE and return from :meth:`run` (loop thread only)."""
        if not self._stop.is_set():
            self.log.info("completion_stopping")
            self._stop.set()

    async def run(self) -> None:
        """Serve until :meth:`request_stop`. Database problems never end it; bugs do."""
        link_task = asyncio.create_task(self.link.run(), name="completion-link")
        link_task.add_done_callback(lambda _t: self.request_stop() if self.link.replaced or self.link.refused else None)
        self.log.info("completion_started", database=_redact(self.db.url), credit=self.config.credit,
                      batch_max=self.config.batch_max)
        resender = asyncio.create_task(self._resend_acks(), name="completion-ack-resend")
        try:
            await self._make_schema()
            await self._pump()
            await self._drain_acks()
        finally:
            resender.cancel()
            await self.link.stop("completion stopping")
            try:
                await asyncio.wait_for(link_task, timeout=2.0)
            except asyncio.TimeoutError:
                link_task.cancel()
            await asyncio.get_running_loop().run_in_executor(self._db_exec, self.db.close)
            self._db_exec.shutdown(wait=True)
            self._io_exec.shutdown(wait=True)
            self.log.info("completion_stopped", landed=self.landed, acked=self.acked, quarantined=self.quarantined)

    async def _make_schema(self) -> None:
        """Connect and create the results schema now, so an empty database has its ``results``
        table (readers and dashboards can query it) before the first result lands. A database
        that is down is not fatal here: it is logged and :meth:`_land` retries with backoff."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._db_exec, self.db.connect)
        except self.db.driver_errors() as exc:
            self.log.warning("db_unhealthy", error=describe_error(exc)[:500], items=0, attempt=0,
                             retry_in_s=None, when="start: the schema is made at the first write")
            await asyncio.get_running_loop().run_in_executor(self._db_exec, self.db.reset)

    # --- link callbacks ---
    def _on_message(self, env: Envelope) -> None:
        msg = env.message
        if isinstance(msg, protocol.Result):
            if msg.deliveries:  # kept as the frame's list: no per-result queue entry
                self._incoming.append((self.link.sessions, msg.deliveries))
                self._arrived.set()
        elif isinstance(msg, protocol.AckOk):
            self._on_ack_ok(msg)
        elif isinstance(msg, protocol.Error):
            self.log.warning("broker_error", code=msg.code, message=msg.message, ref_seq=msg.ref_seq)
        else:
            self.log.warning("unexpected_message", type=type(msg).__name__)

    def _on_connect(self, welcome: protocol.Welcome) -> None:
        self._resend_stale(0.0)  # the broker's ACK is idempotent: every one not answered, again

    # --- the pipeline ---
    async def _pump(self) -> None:
        while not self._stop.is_set():
            fresh = await self._gather()
            due = self._due_parked()  # parked retries already gave their credit back
            if not fresh and not due:
                continue
            groups = fresh + [(sess, (d,)) for sess, d in due]
            rows, missing = await self._resolve(groups)
            if missing or self._parked:
                self._park(groups, missing)
            quarantined: list[tuple[ResultRow, str]] = []
            if rows:
                landed = await self._land(rows)
                if landed is None:
                    return  # stopping while the database is down: nothing acknowledged, the broker keeps them
                quarantined = landed
            crash_point("completion.after_db_commit")
            credit = sum(len(ds) for session, ds in fresh if session == self.link.sessions)
            if rows:  # ACK now; its credit comes back with its ACK_OK, while the next batch lands
                self._send_ack(sorted({r[0] for r in rows}),
                               [protocol.Quarantined(r[0], error[:ACK_ERROR_MAX_CHARS]) for r, error in quarantined], credit)
                await self._acks_below(MAX_ACKS_IN_FLIGHT)
            else:
                self._grant(credit, len(missing))

    def _park(self, groups: list[tuple[int, Sequence[protocol.Delivery]]], missing: list[protocol.Delivery]) -> None:
        """Remember deliveries whose result blob is missing (never ACKed); forget landed ones."""
        missing_ids = {d.item_id for d in missing}
        sessions: dict[str, int] = {}
        for sess, ds in groups:
            for d in ds:
                sessions[d.item_id] = sess
                if d.item_id not in missing_ids:
                    self._parked.pop(d.item_id, None)
        for d in missing:
            attempt = self._parked.get(d.item_id, (0, d, 0.0, 0))[3]
            retry_at = time.monotonic() + backoff_delay_s(attempt, _PARK_BASE_S, self.config.backoff_max_s)
            self._parked[d.item_id] = (sessions[d.item_id], d, retry_at, attempt + 1)

    def _due_parked(self) -> list[tuple[int, protocol.Delivery]]:
        """Parked deliveries due for another read. Ones from an ended session are
        dropped: the broker redelivers them to the new session itself (G3)."""
        if not self._parked:
            return []
        now = time.monotonic()
        due = []
        for item_id, (sess, d, retry_at, _) in list(self._parked.items()):
            if sess != self.link.sessions:
                del self._parked[item_id]
            elif retry_at <= now:
                due.append((sess, d))
        return due

    async def _gather(self) -> list[tuple[int, Sequence[protocol.Delivery]]]:
        """Up to ``batch_max`` deliveries as ``(session, deliveries)`` groups (whole RESULT
        frames, the last one split when it does not fit): wait for the first, then at most
        ``batch_wait_ms`` for more; returns early (possibly empty) when a parked delivery
        is due or when asked to stop."""
        if not self._incoming:
            self._arrived.clear()
            stop_wait = asyncio.ensure_future(self._stop.wait())
            arrived = asyncio.ensure_future(self._arrived.wait())
            wake_s = min((r for _, _, r, _ in self._parked.values()), default=None)
            try:
                await asyncio.wait({stop_wait, arrived}, return_when=asyncio.FIRST_COMPLETED,
                                   timeout=None if wake_s is None else max(0.0, wake_s - time.monotonic()))
            finally:
                stop_wait.cancel()
                arrived.cancel()
            if not self._incoming:
                return []
        groups: list[tuple[int, Sequence[protocol.Delivery]]] = []
        room = self.config.batch_max
        deadline = time.monotonic() + self.config.batch_wait_ms / 1000.0
        while True:
            while self._incoming and room > 0:
                sess, ds = self._incoming.popleft()
                if len(ds) > room:
                    self._incoming.appendleft((sess, ds[room:]))
                    ds = ds[:room]
                groups.append((sess, ds))
                room -= len(ds)
            left = deadline - time.monotonic()
            if room <= 0 or left <= 0:
                return groups
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=left)
            except asyncio.TimeoutError:
                return groups

    async def _resolve(self, groups: list[tuple[int, Sequence[protocol.Delivery]]]) -> tuple[list[tuple], list[protocol.Delivery]]:
        """One row per delivery (a tuple in the column order of :class:`ResultRow`), the
        result bytes read and verified (:meth:`ClaimStore.aget_blob`: an inline result on
        the loop, a stored one off it); deliveries whose result is missing or corrupt are
        returned separately (never acknowledged)."""
        rows: list[tuple] = []
        missing: list[protocol.Delivery] = []
        read = self._read_blob
        landed_ts = time.time()  # one database transaction: one landing time
        for _, ds in groups:
            for d in ds:
                try:
                    data = await read(d)
                except PayloadMissing as exc:
                    self.log.error("result_missing", item_id=d.item_id, sha256=d.result.sha256, error=str(exc))
                    missing.append(d)
                    continue
                except _Stopping:
                    return rows, missing + [d]  # stopping while the claim store fails: d is not acknowledged
                rows.append((d.item_id, d.key, d.kind, params_to_json(d.params), data, d.result.sha256,
                             text_or_none(data), d.attempt, d.handler, d.handler_version, d.completed_ts, landed_ts))
        return rows, missing

    async def _read_blob(self, d: protocol.Delivery) -> bytes:
        """The result of ``d``, digest verified. A store that is unreachable or failing
        (not "absent": that is PayloadMissing) is read again with backoff: the result
        waits safely in the broker and is never ACKed without it; raises _Stopping when
        asked to stop meanwhile."""
        attempt = 0
        while True:
            try:
                return await self.store.aget_blob(d.result, self._io_exec)
            except (OSError, StoreUnavailable) as exc:
                delay_s = backoff_delay_s(attempt, 0.05, self.config.backoff_max_s)
                attempt += 1
                self.log.warning("result_read_failed", item_id=d.item_id, error=str(exc), retry_in_s=round(delay_s, 3))
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=delay_s)
                    raise _Stopping
                except asyncio.TimeoutError:
                    continue

    async def _land(self, rows: list[tuple]) -> list[tuple[ResultRow, str]] | None:
        """Write ``rows`` (:class:`ResultRow` tuples; :meth:`ResultsDB.land`), retrying with backoff until it commits.
        Returns the rows quarantined with their errors, or None only if asked to stop
        while the database is failing."""
        loop = asyncio.get_running_loop()
        attempt = 0
        down_since = 0.0
        errors = self.db.driver_errors()
        while True:
            t0 = time.monotonic()
            # plain tuples in ResultRow's column order (_resolve builds no NamedTuple per row)
            fut = loop.run_in_executor(self._db_exec, self.db.land, cast("list[ResultRow]", rows))
            error: str | None = None
            quarantined: list[tuple[ResultRow, str]] = []
            try:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout=self.config.db_slow_s)
                except asyncio.TimeoutError:
                    self.log.warning("db_slow", items=len(rows), over_s=self.config.db_slow_s)
                    # abort the write (off the loop: a cancel may need a round trip); if it
                    # committed meanwhile, it simply counts as landed
                    await loop.run_in_executor(None, self.db.interrupt)
                    await fut
                quarantined = fut.result()
            except errors as exc:
                error = describe_error(exc)
            if error is None:
                self.landed += len(rows)
                self.db_retry_in_s = 0.0
                if self.observe_db_write is not None:
                    self.observe_db_write(len(rows), time.monotonic() - t0)
                if not self.healthy:
                    self.log.info("db_recovered", after_s=round(time.monotonic() - (down_since or t0), 3),
                                  attempts=attempt + 1)
                    self.notifier.status("serving: database recovered")
                    self.healthy = True
                for row, why in quarantined:  # the exception path: one line per refused row
                    item_id, key, kind = row[:3]
                    self.log.warning("result_quarantined", item_id=item_id, key=key, kind=kind, error=why[:500])
                self.quarantined += len(quarantined)
                self.log.debug("batch_landed", items=len(rows), write_s=round(time.monotonic() - t0, 4))
                return quarantined
            if self.healthy:
                self.notifier.status(f"database unhealthy, retrying: {error[:200]}")
            self.healthy = False
            down_since = down_since or t0
            await loop.run_in_executor(self._db_exec, self.db.reset)
            delay = backoff_delay_s(attempt, _DB_BACKOFF_BASE_S, self.config.backoff_max_s)
            attempt += 1
            self.db_failures += 1
            self.db_retry_in_s = delay
            self.log.warning("db_unhealthy", error=error[:500], items=len(rows), attempt=attempt,
                             retry_in_s=round(delay, 3))
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=delay)
                self.log.warning("batch_abandoned", items=len(rows), reason="stopping while the database is down")
                return None
            except asyncio.TimeoutError:
                pass

    def _send_ack(self, item_ids: list[str], quarantined: list[protocol.Quarantined], credit: int) -> None:
        """Send the ACK of a committed batch (if not connected, :meth:`_on_connect` sends it) and
        keep it in flight until its ACK_OK (:meth:`_on_ack_ok`) grants ``credit`` back."""
        msg = protocol.Ack(item_ids=item_ids, quarantined=quarantined)
        self._acks[frozenset(item_ids)] = _AckInFlight(msg, self.link.sessions, credit, time.monotonic())
        self.link.send(msg)

    def _on_ack_ok(self, msg: protocol.AckOk) -> None:
        """ACK_OK answers one ACK: every id of it, as done or unknown (another ACK of the same
        ids, a re-send, finds nothing: ignored). Counts it and grants its credit back."""
        answered = frozenset(msg.item_ids) | frozenset(msg.unknown)
        a = self._acks.pop(answered, None)
        if a is None:  # not the exact set (a broker that splits or merges): the oldest it covers
            key = next((k for k in self._acks if k <= answered), None)
            if key is None:
                return
            a = self._acks.pop(key)
        if msg.unknown:
            self.log.info("ack_unknown_items", count=len(msg.unknown))
        n = len(a.msg.item_ids)
        self.acked += n
        self.log.info("results_acked", items=n, total=self.acked)
        if a.session == self.link.sessions:  # a new session's HELLO already reset the credit
            self._grant(a.credit, 0)
        self._ack_ok.set()

    async def _acks_below(self, limit: int) -> None:
        """Wait until fewer than ``limit`` ACKs are in flight (or asked to stop)."""
        while len(self._acks) >= limit and not self._stop.is_set():
            self._ack_ok.clear()
            stop_wait = asyncio.ensure_future(self._stop.wait())
            answered = asyncio.ensure_future(self._ack_ok.wait())
            try:
                await asyncio.wait({stop_wait, answered}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
                answered.cancel()

    async def _drain_acks(self) -> None:
        """Stopping: wait (at most ``_STOP_ACK_GRACE_S``) for the ACK_OK of every ACK in flight;
        what is left the broker redelivers to the next session (the upsert lands it once)."""
        deadline = time.monotonic() + _STOP_ACK_GRACE_S
        while self._acks:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                self.log.warning("ack_abandoned", items=sum(len(a.msg.item_ids) for a in self._acks.values()),
                                 reason="stopping; the broker will redeliver")
                return
            self._ack_ok.clear()
            try:
                await asyncio.wait_for(self._ack_ok.wait(), timeout=min(left_s, 1.0))
            except asyncio.TimeoutError:
                self._resend_stale(1.0)

    async def _resend_acks(self) -> None:
        """Re-send every ACK not answered within a liveness window (the broker's ACK is idempotent)."""
        while True:
            wait_s = max(self.link.heartbeat_interval_s * self.link.liveness, 0.5)
            await asyncio.sleep(wait_s / 2)
            self._resend_stale(wait_s)

    def _resend_stale(self, older_than_s: float) -> None:
        now = time.monotonic()
        for a in self._acks.values():
            if now - a.sent_mono >= older_than_s and self.link.send(a.msg):
                a.sent_mono = now
                self.log.info("ack_resent", items=len(a.msg.item_ids))

    def _grant(self, credit: int, missing: int) -> None:
        """Give back ``credit`` (deliveries that came in the current session; ``missing`` of them
        parked because their result blob is missing)."""
        if credit and self.link.send(protocol.Credit(credit=credit)):
            self.log.debug("credit_granted", credit=credit, missing=missing)


class _Stopping(Exception):
    """Asked to stop while a result could not be read (the claim store is failing)."""


def _redact(url: str) -> str:
    """A database URL without its password (for logs)."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return url


async def _serve(service: CompletionService) -> None:
    notifier = service.notifier

    def on_signal(_signame: str) -> None:
        notifier.stopping("finishing the current batch")
        service.request_stop()

    async with stop_signals_and_watchdog(notifier, on_signal):
        # ready = serving: neither the broker nor the database has to be up (both are retried)
        notifier.ready(f"results to {_redact(service.db.url)}")
        await service.run()


def main(config_path: str | Path, prog: str = PROG) -> int:
    """Entry point of ``ccsq completion --config completion.toml`` (and of ``ccsq-completiond``,
    ``prog`` the name its errors begin with on stderr); returns an :class:`ExitCode`."""
    try:
        notifier = Notifier.from_env()
        config = load(CompletionConfig, config_path)
        configure(config.log_format)
        service = CompletionService(config, notifier=notifier)
        from ccsq.completiond.completion_metrics import start_completion_metrics

        metrics = start_completion_metrics(service, config.metrics_listen, where=f"{config_path}: metrics_listen")
    except ConfigError as exc:
        return die(prog, exc, f"configuration error: {exc}")
    except StoreUnavailable as exc:
        return die(prog, exc, f"claim store unavailable (transient, restart later): {exc}")
    except PortInUse as exc:
        return die(prog, exc, f"transient: {exc}")
    settle_gc(young_threshold=None)  # start-up's heap out of the collector's way (its thresholds as they were)
    try:
        asyncio.run(_serve(service))
    except CcsqError as exc:
        log.error("completion_failed", code=exc.code, error=str(exc))
        return ExitCode.FAILURE
    finally:
        if metrics is not None:
            metrics.shutdown()
    if service.link.refused is not None:
        from ccsq.common.link.peer import refusal_fix

        return die(prog, ExitCode.UNAUTHORIZED, refusal_fix(config, protocol.Role.COMPLETION.value, service.link.refused))
    if service.link.replaced:
        from ccsq.common.link.peer import id_in_use_message

        return die(prog, ExitCode.CONFIG, f"configuration error: {id_in_use_message(config, service.link)}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
