"""The worker's session: leases in, inference under the GPU semaphore, reports out.

One :class:`Worker` owns, on one event loop: the broker link (a
:class:`~ccsq.common.link.peer.BrokerLink`), the held jobs, the reports waiting for
the broker's confirmation, the credit it has granted, and the journal (whose
calls all run on one dedicated thread). Inference runs on a thread pool of
``slots`` threads, never on the loop, so heartbeats keep flowing while a model
runs (case C06); a loop-lag probe proves it (``loop_lag_max_ms`` in every
heartbeat's info: the worst lag since the previous heartbeat).

Life of a task (docs/architecture.md, "The path of one item", hops 4-6)::

    DISPATCH -> journal "held" (fsync) -> fetch payload + verify its SHA-256
      (prefetch: outside the slot, while the GPU runs earlier items)
      -> batch queue -> a lane takes a batch and a slot -> deadline check
      -> journal "started" -> handler.run / run_batch in a thread
      -> store result (inline <= 16 KiB, else claim store) -> journal "finished"
      -> crash point worker.after_result_stored -> COMPLETE -> grant 1 credit
      -> COMPLETE_ACK (any outcome) -> forget (journal row deleted)

Group commit (throughput): every journal write goes through one
:class:`~ccsq.workerd.journal.GroupCommit`, so the holds, starts, finished
reports and forgets that fall within ``JOURNAL_WINDOW_S`` (or arrive while
the previous commit's fsync runs) share ONE SQLite transaction. The reports
of one commit are sent at the end of that loop tick, together: one COMPLETE
(and one FAIL) frame for all of them, then one CREDIT. Order per item is
unchanged: result in the claim store -> journal committed -> COMPLETE sent ->
COMPLETE_ACK -> forget.

Batching (:mod:`ccsq.workerd.batching`): ``max_batch`` = the config's, else the
handler's (default 1); ``max_wait_ms`` likewise. There are ``slots`` *lanes*;
each takes the next batch (up to ``max_batch`` ready items of one
``(kind, handler.batch_key(params))``), holds ONE slot of the semaphore for
it, and calls ``handler.run`` (one item) or ``handler.run_batch`` (several) in
an inference thread. Each item of a batch is then stored, journaled and
reported on its own, exactly as a single item. A poison job in a batch kills
its batch mates' attempts too (they were started with it).

Deadline: an item whose ``deadline_ts`` has passed when its batch is about to
start is not run: it is given back with ``FAIL(reason="released",
retryable=True)`` (no attempt consumed, logged ``deadline_skipped``), and the
broker, which owns the ``expired`` state, moves it to ``expired`` when it next
tries to lease it (``deadline passed while ready``, a G6 event), exactly as
for an item whose deadline passes while queued at the broker. The check uses
the broker's clock as seen in the DISPATCH envelope's timestamp (transit time
only makes that estimate earlier), so a worker whose clock runs ahead never
gives back an item the broker still considers alive. Reporting ``cancelled``
or ``timeout`` instead would count a failed attempt and could dead-letter
the item rather than expire it.

Crash points (:mod:`ccsq.common.runtime.faults`): ``worker.after_infer`` fires when the
handler has returned, before anything is stored (a restart re-runs nothing
and the lease expires); ``worker.after_result_stored`` fires once the result
is in the claim store AND in the journal, before COMPLETE (a restart resends it).

Failures follow the same path with FAIL / FAIL_ACK:
``PermanentHandlerError`` -> ``fatal`` (not retryable); any other handler
exception -> ``handler_error`` (retryable, message = repr); over
``max_runtime_s`` (the task's, else the config's; 0 = none) -> ``timeout``
(retryable) at once, while the slot stays counted as *lost* until the thread
returns (its result is discarded); inline bytes that do not match their
SHA-256 -> ``payload_missing`` (not retryable); a blob this worker's claim store
cannot produce (absent, corrupt) or any other claim-store error (I/O error,
backend down, also when storing a result) -> ``store_unavailable`` (requeued
after a backoff without counting the attempt: only the broker's reconcile,
gap G7, dead-letters a payload as missing) and the worker reports itself
unhealthy (no new DISPATCH) for 1, 2, 4 ... 60 s; the worker keeps running.
Which reason is retryable is the one table ``ccsq.common.wire.policy.FAIL_POLICY``.
A batch runs under the strictest ``max_runtime_s`` of its items (times the
batch size when the handler has no batched path and runs the items in turn);
on overrun every item of the batch is reported ``timeout``.

Credit rule: outstanding credit = ``slots x max_batch + prefetch`` (minus
``max_batch`` per lost slot), so every lane can fill a whole batch and still
have ``prefetch`` items fetched and verified for the next one. The HELLO
grants that minus the leases held; each DISPATCHed task consumes one; after
a report is sent the missing credit is granted back in one batched
``Credit(n)``.

Unconfirmed reports are re-sent on every new session (``on_connect``) and on a
timer (every 2 x heartbeat interval); the broker treats replays idempotently.
A report is forgotten only when the broker confirms it with any outcome.

WELCOME ``released`` leases: a job not yet running is dropped at once; a
running one is finished and its result discarded; neither is ever reported.
A lease whose report is already decided (finished or failed) is still
replayed even if released: the broker confirms it (``fenced`` if the lease
moved on, which its gap register records, case C04), and dropping a finished
result would throw real work away.

Restart (the journal outlives the process):

- finished / failed rows: the report is re-sent as is; nothing is re-run.
- ``held`` rows (dispatched, never started): given back with
  ``FAIL(reason="released", retryable=True)`` so the broker re-leases them at
  once without consuming an attempt.
- ``started`` rows (the process died while the handler ran: a crash, an
  OOM kill, or a poison job that kills its worker): deleted, NOT listed in
  HELLO and NOT reported. The broker expires a lease that a reconnecting
  worker does not list at once ("worker reconnected without it"; at the
  latest when ``lease_ttl_s`` runs out), which
  consumes the attempt, records the at-least-once window in its gap register,
  and dead-letters a poison job with reason ``worker_lost`` after
  ``max_attempts`` (case C07b). Reporting ``released`` instead would not
  consume an attempt (a poison job would loop forever), and a
  ``handler_error`` would hide that the worker died.

Every lease with a report to send is listed in HELLO (and heartbeats) until confirmed.

Shutdown (SIGTERM): no more credit; jobs not yet running are given back
(``released``); running ones get ``drain_timeout_s`` to finish, then are given
back too; confirmations are awaited briefly; BYE; the caller exits 0.
Unconfirmed reports stay in the journal for the next start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from ccsq.common.wire import protocol as p
from ccsq.common.wire.frames import split_frames
from ccsq.common.storage.claimstore import ClaimStore
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.envelope import Envelope, EnvelopeCodec
from ccsq.common.wire.errors import ConfigError, HandlerError, PayloadMissing, PermanentHandlerError
from ccsq.common.runtime.faults import crash_point
from ccsq.common.link.peer import BrokerLink, LinkState
from ccsq.common.wire.policy import task_failure
from ccsq.workerd import providers
from ccsq.workerd.batching import BatchQueue
from ccsq.workerd.handlers import Handler
from ccsq.workerd.journal import EntryState, GroupCommit, Journal, Key
from ccsq.workerd.slots import SlotGate

log = structlog.get_logger("ccsq.workerd")

T = TypeVar("T")

INLINE_RESULT_MAX_BYTES = 16384  # results up to this size travel inline in COMPLETE
LAG_PROBE_INTERVAL_S = 0.02  # the loop-lag probe wakes this often
LAG_WARN_MS = 250.0  # log loop_lag when one wake-up is later than this
ACK_WAIT_ON_STOP_S = 2.0  # at shutdown, wait this long for outstanding confirmations
GPU_MEM_POLL_S = 10.0  # how often GPU free memory is sampled (GPU providers only)
REPORT_OVERHEAD_BYTES = 256  # frame budget per report besides its inline bytes
MAX_REPORTS_PER_FRAME = 256


def _report_size(pd: "Pending") -> int:
    """Estimated encoded bytes of one COMPLETE/FAIL record (inline result bytes counted)."""
    rep = pd.report
    return REPORT_OVERHEAD_BYTES + len(getattr(rep, "message", "")) + (
        rep.result.size if isinstance(rep, p.TaskResult) and rep.result.inline is not None else 0)
JOURNAL_WINDOW_S = 0.001  # journal group commit: writes within this window share one fsync
STORE_UNHEALTHY_MAX_S = 60.0  # cap of the time a worker reports itself unhealthy after claim-store failures


class JobState(enum.Enum):
    HOLDING = "holding"  # journal write of the lease in progress
    FETCHING = "fetching"  # payload being fetched (prefetch)
    QUEUED = "queued"  # waiting for a slot
    RUNNING = "running"  # handler running in a thread
    REPORTING = "reporting"  # outcome decided, being stored/journaled


@dataclasses.dataclass(eq=False)
class Job:
    """A lease this worker holds and has not reported yet."""

    task: p.Task
    state: JobState = JobState.HOLDING
    released: bool = False  # the broker took it back: finish quietly, never report
    runner: asyncio.Task | None = None
    clock_offset_s: float = 0.0  # broker wall clock - ours, as seen in the DISPATCH envelope
    payload: bytes | None = None  # fetched and verified (prefetch); dropped once run
    outcome: asyncio.Future | None = None  # resolved by the lane with a RunOutcome

    def deadline_passed(self, now_wall_s: float) -> bool:
        """Whether ``deadline_ts`` has passed by the broker's clock (estimated)."""
        return self.task.deadline_ts is not None and now_wall_s + self.clock_offset_s >= self.task.deadline_ts

    @property
    def key(self) -> Key:
        return (self.task.item_id, self.task.token)


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What a lane tells a job about its run: exactly one of the fields is set
    (``data`` may be b""): the result, the error, the overrun limit, or skipped."""

    data: bytes | None = None
    error: BaseException | None = None
    runtime_s: float = 0.0  # wall seconds of the handler call (the whole batch)
    timeout_s: float = 0.0  # > 0: the batch overran this max_runtime_s
    skipped: str = ""  # not run: why (deadline passed)


@dataclasses.dataclass(eq=False)
class Pending:
    """A report (result or failure) the broker has not confirmed yet."""

    report: p.TaskResult | p.TaskFailure
    sent_mono: float | None = None  # last send (monotonic s); None = not sent this session


def _timed_batch(handler: Handler, items: list[tuple[bytes, dict]]) -> tuple[list[Any], float]:
    """Run one item with ``handler.run`` or several with ``handler.run_batch`` in an
    inference thread; returns (one output or exception per item, wall seconds).
    An exception from ``run`` / ``run_batch`` itself applies to every item."""
    t0 = time.perf_counter()
    try:
        out: list[Any] = [handler.run(*items[0])] if len(items) == 1 else list(handler.run_batch(items))
    except Exception as exc:  # noqa: BLE001 - typed per item by Worker._finish
        out = [exc] * len(items)
    return out, time.perf_counter() - t0


class Worker:
    """The worker daemon's state and event handlers (see module doc).

    ``run()`` serves until :meth:`request_stop`, then drains. After it
    returns, ``fatal`` holds the exception of a bug that stopped it (exit 1),
    and ``stuck_threads`` the inference threads still running.
    """

    # --- collaborators ---
    cfg: WorkerConfig
    handler: Handler
    store: ClaimStore
    journal: Journal
    link: BrokerLink
    kinds: list[str]
    # --- execution ---
    gate: SlotGate
    max_batch: int  # items per handler call (config, else the handler's)
    capacity: int  # slots x max_batch + prefetch: the credit outstanding when idle
    batches: BatchQueue  # fetched, verified items waiting for a lane
    _jobs: dict[Key, Job]  # held leases, not reported yet
    _runners: set[asyncio.Task]
    _infer_futures: set[asyncio.Future]
    # --- reports awaiting confirmation ---
    _pending: dict[Key, Pending]
    _pending_empty: asyncio.Event
    # --- flow control and lifecycle ---
    _broker_credit: int  # credit the broker holds from us in this session
    _credit_flush_scheduled: bool
    _draining: bool
    _stop: asyncio.Event
    fatal: BaseException | None
    # --- health ---
    done: int  # results reported
    failed: int  # failures reported
    batches_run: int  # handler calls made
    batch_items: int  # items in those calls
    batch_size_max: int  # the largest batch run
    loop_lag_max_ms: float  # worst loop lag since start
    _lag_window_ms: float  # worst loop lag since the previous heartbeat
    gpu_mem_free_bytes: int | None
    observe_batch: Callable[[int, float], None] | None = None  # metrics hook (workerd/metrics.py): once per handler call

    def __init__(self, cfg: WorkerConfig, handler: Handler, store: ClaimStore, journal: Journal, *,
                 codec: EnvelopeCodec | None = None) -> None:
        """``codec`` defaults to one built from ``cfg``'s keys (ConfigError if they are bad)."""
        self.cfg = cfg
        self.handler = handler
        self.store = store
        self.journal = journal
        self.kinds = list(cfg.kinds) or [handler.name]
        self.link = BrokerLink(
            cfg,
            hello=self._hello,
            heartbeat=self._heartbeat,
            on_message=self._on_message,
            on_connect=self._on_connect,
            on_disconnect=self._on_disconnect,
            codec=codec,
        )
        self.gate = SlotGate(cfg.slots)
        self.max_batch = max(1, cfg.max_batch or int(handler.max_batch))
        max_wait_ms = cfg.max_wait_ms if cfg.max_wait_ms >= 0 else float(handler.max_wait_ms)
        self.capacity = cfg.slots * self.max_batch + cfg.prefetch
        self.batches = BatchQueue(self.max_batch, max_wait_ms / 1000.0, self._more_coming)
        self._jobs = {}
        self._runners = set()
        self._infer_futures = set()
        self._pending = {}
        self._pending_empty = asyncio.Event()
        self._pending_empty.set()
        self._broker_credit = 0
        self._credit_flush_scheduled = False
        self._draining = False
        self._stop = asyncio.Event()
        self.fatal = None
        self.done = 0
        self.failed = 0
        self.batches_run = 0
        self.batch_items = 0
        self.batch_size_max = 0
        self.loop_lag_max_ms = 0.0
        self._lag_window_ms = 0.0
        self.gpu_mem_free_bytes = None
        self.store_failures = 0  # payload fetches / result stores the claim store failed (missing blob included)
        self._store_streak = 0  # consecutive store failures; 0 after a successful fetch from the store
        self._store_bad_until = 0.0  # monotonic: unhealthy (no new DISPATCH) until then
        self._store_error = ""
        self._infer_pool = ThreadPoolExecutor(cfg.slots, thread_name_prefix="ccsq-infer")
        self._io_pool = ThreadPoolExecutor(4, thread_name_prefix="ccsq-io")
        self._journal_pool = ThreadPoolExecutor(1, thread_name_prefix="ccsq-journal")
        self._jw = GroupCommit(journal, self._journal_pool, JOURNAL_WINDOW_S)
        self._unsent: list[Key] = []  # reports to send at the end of this loop tick
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host = socket.gethostname()
        self.log = log.bind(worker=cfg.peer_id)

    # --- lifecycle ---------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin a graceful stop (SIGTERM): drain, BYE, return from run()."""
        self._stop.set()

    @property
    def stuck_threads(self) -> int:
        return sum(1 for f in self._infer_futures if not f.done())

    async def run(self, on_ready: Callable[[], object] | None = None) -> None:
        """Recover from the journal, call ``on_ready`` (systemd READY=1), serve the
        broker until :meth:`request_stop`, drain. Raises JournalCorrupt from recovery."""
        self._loop = asyncio.get_running_loop()
        await self.recover()
        if on_ready is not None:
            on_ready()
        for n in range(self.cfg.slots):
            self._spawn(self._lane(), f"lane-{n}")
        link_task = asyncio.create_task(self.link.run(), name="broker-link")
        aux = [
            asyncio.create_task(self._lag_probe(), name="loop-lag-probe"),
            asyncio.create_task(self._resend_loop(), name="report-resend"),
        ]
        if self.handler.provider in providers.GPU_PROVIDERS:
            aux.append(asyncio.create_task(self._gpu_mem_loop(), name="gpu-mem"))
        stop_wait = asyncio.create_task(self._stop.wait(), name="stop-wait")
        try:
            done, _ = await asyncio.wait({link_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if link_task in done and link_task.exception() is not None:
                self.fatal = link_task.exception()
                self.log.error("broker_link_crashed", exc_info=self.fatal)
            elif link_task in done and self.link.refused is not None:
                from ccsq.common.wire.errors import Unauthorized
                from ccsq.common.link.peer import refusal_fix

                self.fatal = Unauthorized(refusal_fix(self.cfg, p.Role.WORKER.value, self.link.refused))
            elif link_task in done and self.link.replaced:
                self.fatal = ConfigError(
                    f"another live worker uses peer id {self.cfg.peer_id!r}; give each worker its own id and key"
                )
            elif self.fatal is None:
                await self._drain()
        finally:
            stop_wait.cancel()
            await self._stop_link(link_task)
            for t in aux + list(self._runners):
                t.cancel()
            await asyncio.gather(*aux, *self._runners, return_exceptions=True)
            await self._jw.drain()  # queued journal writes (forgets of confirmed reports) still land
            self._infer_pool.shutdown(wait=False, cancel_futures=True)
            self._io_pool.shutdown(wait=False, cancel_futures=True)  # a hung store must not block exit
            self._journal_pool.shutdown(wait=True)
            self.log.info(
                "worker_stopped", done=self.done, failed=self.failed, unconfirmed=len(self._pending),
                loop_lag_max_ms=round(self.loop_lag_max_ms, 2), journal_commits=self._jw.commits,
                journal_writes=self._jw.ops,
            )

    async def _stop_link(self, link_task: asyncio.Task) -> None:
        if link_task.done():
            return
        try:
            await asyncio.wait_for(self.link.stop("shutdown"), timeout=2.0)
            await asyncio.wait_for(asyncio.shield(link_task), timeout=2.0)
        except asyncio.TimeoutError:
            link_task.cancel()
            await asyncio.gather(link_task, return_exceptions=True)

    async def recover(self) -> None:
        """Turn the journal's rows into pending reports (see module doc: Restart)."""
        entries = await self._j(self.journal.entries)
        counts = {s.value: 0 for s in EntryState}
        lost: list[Key] = []
        for e in entries:
            counts[e.state.value] += 1
            report = e.report
            if e.state is EntryState.STARTED:
                self.log.warning("job_lost_in_crash", item_id=e.item_id, token=e.token, kind=e.kind)
                lost.append((e.item_id, e.token))
                continue
            if report is None:  # held, never started: give it back without costing an attempt
                report = task_failure(e.item_id, e.token, p.FailReason.RELEASED,
                                      "worker restarted before starting the job")
                await self._jw.record([(report, e.kind)])
            self._pending[(e.item_id, e.token)] = Pending(report)
        if lost:
            await self._jw.forget(lost)
        self._pending_changed()
        if entries:
            self.log.info("journal_recovered", **counts)

    # --- BrokerLink callbacks ----------------------------------------------------
    def _hello(self) -> p.Hello:
        self._broker_credit = 0 if self._draining else max(0, self._capacity() - len(self._jobs))
        return p.Hello(
            role=p.Role.WORKER.value,
            slots=self.cfg.slots,
            credit=self._broker_credit,
            kinds=list(self.kinds),
            leases=self._lease_refs(),
            info=self._info(),
        )

    def _info(self) -> dict[str, p.Scalar]:
        info: dict[str, p.Scalar] = {
            "provider": self.handler.provider,
            "cpu_fallback": self.handler.cpu_fallback,
            "requested_provider": self.cfg.provider,
            "handler": self.handler.name,
            "handler_version": self.handler.version,
            "host": self._host,
            "prefetch": self.cfg.prefetch,
            "max_batch": self.max_batch,
        }
        if self.handler.cpu_fallback:
            info["fallback_reason"] = self.handler.provider_reason[:300]
        return info

    def _heartbeat(self) -> p.Heartbeat:
        lag, self._lag_window_ms = self._lag_window_ms, 0.0
        info: dict[str, p.Scalar] = {
            "loop_lag_max_ms": round(lag, 2),
            "lost_slots": self.gate.lost,
            "unconfirmed": len(self._pending),
            "draining": self._draining,
            "batches": self.batches_run,
            "batch_items": self.batch_items,
            "batch_size_max": self.batch_size_max,
        }
        if self.gpu_mem_free_bytes is not None:
            info["gpu_mem_free_bytes"] = self.gpu_mem_free_bytes
        info.update(self.handler.health())
        store_ok = time.monotonic() >= self._store_bad_until
        info.update(store_ok=store_ok, store_failures=self.store_failures)
        if not store_ok:
            info["store_error"] = self._store_error[:200]
        return p.Heartbeat(
            leases=self._lease_refs(),
            busy=self.gate.busy,
            done=self.done,
            healthy=self.gate.lost < self.gate.slots and store_ok,
            info=info,
        )

    def _store_trouble(self, error: str) -> None:
        """The claim store failed us (a blob missing here, an I/O or backend error):
        unhealthy for 1, 2, 4 ... 60 s (consecutive episodes), said at once in a
        HEARTBEAT (healthy = false, info store_ok/store_error) *before* the FAIL, so
        the broker dispatches no more to this worker until a later heartbeat says
        healthy (docs/deployment.md, "a store that lost a blob")."""
        self.store_failures += 1
        self._store_error = error
        now = time.monotonic()
        if now < self._store_bad_until:
            return  # the same episode (the rest of a batch already dispatched)
        self._store_streak += 1
        self._store_bad_until = now + min(STORE_UNHEALTHY_MAX_S, 2.0 ** (self._store_streak - 1))
        self.log.warning("claim_store_unhealthy", failures=self.store_failures, streak=self._store_streak,
                         error=error[:300])
        self.link.send(self._heartbeat())

    def _on_connect(self, welcome: p.Welcome) -> None:
        for ref in welcome.released:
            job = self._jobs.get((ref.item_id, ref.token))
            if job is not None:
                self._release(job)
        self.log.info("session_started", resumed=len(welcome.resumed), released=len(welcome.released),
                      unconfirmed=len(self._pending), credit=self._broker_credit)
        self._send_reports(list(self._pending))
        self._credit_changed()

    def _on_disconnect(self, reason: str) -> None:
        self._broker_credit = 0
        for pend in self._pending.values():
            pend.sent_mono = None
        level = self.log.info if self._draining else self.log.warning
        level("session_lost", reason=reason, held=len(self._jobs), unconfirmed=len(self._pending))

    def _on_message(self, env: Envelope) -> None:
        msg = env.message
        if isinstance(msg, p.Dispatch):
            self._on_dispatch(msg.tasks, env.ts_ms / 1000.0 - time.time())
        elif isinstance(msg, p.CompleteAck):
            self._on_acks(msg.outcomes, p.TaskResult)
        elif isinstance(msg, p.FailAck):
            self._on_acks(msg.outcomes, p.TaskFailure)
        elif isinstance(msg, p.Error):
            self.log.warning("broker_error", code=msg.code, message=msg.message, ref_seq=msg.ref_seq)
        elif isinstance(msg, p.Bye):
            self.log.info("broker_bye", reason=msg.reason)
        else:
            self.log.warning("unexpected_message", type=msg.TYPE.name)

    # --- dispatch and execution -----------------------------------------------------
    def _on_dispatch(self, tasks: list[p.Task], clock_offset_s: float = 0.0) -> None:
        self._broker_credit -= len(tasks)
        if self._broker_credit < 0:
            self.log.warning("credit_overrun", extra_tasks=-self._broker_credit)
            self._broker_credit = 0
        new: list[Job] = []
        for task in tasks:
            key = (task.item_id, task.token)
            if key in self._jobs or key in self._pending:
                self.log.info("duplicate_dispatch", item_id=task.item_id, token=task.token)
                continue
            job = Job(task, clock_offset_s=clock_offset_s)
            self._jobs[key] = job
            new.append(job)
        if not new:
            return
        hold = asyncio.ensure_future(self._jw.hold([(j.task.item_id, j.task.token, j.task.kind) for j in new]))
        for job in new:
            if self._draining:
                coro = self._report_after(hold, job, self._failure(job, p.FailReason.RELEASED, "worker is shutting down"))
            elif job.task.kind not in self.kinds:
                self.log.warning("unexpected_kind", item_id=job.task.item_id, kind=job.task.kind, kinds=self.kinds)
                coro = self._report_after(
                    hold, job, self._failure(job, p.FailReason.RELEASED, f"kind {job.task.kind!r} is not served here")
                )
            else:
                coro = self._run_job(job, hold)
            job.runner = self._spawn(coro, f"job-{job.task.item_id}")
        self.log.info("dispatched", tasks=len(new), held=len(self._jobs))

    @staticmethod
    async def _await_hold(hold: asyncio.Future) -> None:
        """Wait for the shared journal write of a DISPATCH without ever cancelling it
        (a cancelled job must not cancel its siblings' hold)."""
        await asyncio.wait({hold})
        hold.result()

    async def _report_after(self, hold: asyncio.Future, job: Job, report: p.TaskFailure) -> None:
        await self._await_hold(hold)
        job.state = JobState.REPORTING
        await self._report(job, report)

    async def _run_job(self, job: Job, hold: asyncio.Future) -> None:
        """One task: durable hold, fetch + verify (prefetch), batch queue, outcome, report."""
        loop = asyncio.get_running_loop()
        task = job.task
        await self._await_hold(hold)
        job.state = JobState.FETCHING
        try:
            inline = task.payload.inline
            if inline is not None and self.store.inline_without_io(len(inline), INLINE_RESULT_MAX_BYTES):
                job.payload = self.store.get_blob(task.payload)  # inline: a hash check, no I/O, no thread hop
            else:
                job.payload = await loop.run_in_executor(self._io_pool, self.store.get_blob, task.payload)
        except PayloadMissing as exc:
            job.state = JobState.REPORTING
            if inline is not None:  # the bytes came with the item and do not match: the item's fault
                await self._report(job, self._failure(job, p.FailReason.PAYLOAD_MISSING, str(exc)))
                return
            # absent or corrupt in OUR view of the store: this worker's problem until the broker's
            # reconcile confirms the blob gone (G7); requeued without counting the attempt
            self._store_trouble(str(exc))
            await self._report(job, self._failure(
                job, p.FailReason.STORE_UNAVAILABLE, f"payload not in this worker's claim store: {exc}"[:1000]))
            return
        except Exception as exc:  # any other claim-store error (I/O, backend): this attempt failed, retry later
            self.log.error("payload_fetch_failed", item_id=task.item_id, token=task.token, error=repr(exc))
            self._store_trouble(repr(exc))
            job.state = JobState.REPORTING
            await self._report(job, self._failure(
                job, p.FailReason.STORE_UNAVAILABLE, f"could not fetch payload: {exc!r}"[:1000]))
            return
        if inline is None:
            self._store_streak = 0  # the store produced a blob: healthy at the next heartbeat
        try:
            key = (task.kind, self.handler.batch_key(dict(task.params)))
        except PermanentHandlerError as exc:
            job.state = JobState.REPORTING
            await self._report(job, self._failure(job, p.FailReason.FATAL, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - a handler bug in batch_key fails the item, not the worker
            job.state = JobState.REPORTING
            await self._report(job, self._failure(job, p.FailReason.HANDLER_ERROR, f"batch_key: {exc!r}"[:1000]))
            return
        job.state = JobState.QUEUED
        job.outcome = loop.create_future()
        self.batches.put(key, job)
        try:
            outcome = await job.outcome
        except asyncio.CancelledError:
            self.batches.discard(key, job)
            raise
        await self._finish(job, outcome)

    # --- lanes: one per slot, one batch at a time under one permit ------------------
    def _more_coming(self) -> bool:
        """Can another item reach the batch queue soon (credit at the broker, or a fetch)?"""
        return self._broker_credit > 0 or any(
            j.state in (JobState.HOLDING, JobState.FETCHING) for j in self._jobs.values())

    async def _lane(self) -> None:
        while True:
            _, taken = await self.batches.take()
            jobs = [j for j in taken if not j.released and j.outcome is not None and not j.outcome.done()]
            if not jobs:
                continue
            for job in jobs:
                job.state = JobState.RUNNING
            async with self.gate.slot():
                await self._run_batch(jobs)

    @staticmethod
    def _resolve(job: Job, outcome: RunOutcome) -> None:
        if job.outcome is not None and not job.outcome.done():
            job.outcome.set_result(outcome)
        job.payload = None

    async def _run_batch(self, jobs: list[Job]) -> None:
        """Run one batch in an inference thread (the caller holds the slot)."""
        now_wall_s = time.time()
        run: list[Job] = []
        for job in jobs:
            if job.deadline_passed(now_wall_s):
                self.log.info("deadline_skipped", item_id=job.task.item_id, token=job.task.token,
                              deadline_ts=job.task.deadline_ts)
                job.state = JobState.REPORTING
                self._resolve(job, RunOutcome(skipped=f"deadline_ts {job.task.deadline_ts} passed before the job started"))
            else:
                run.append(job)
        if not run:
            return
        await self._jw.started([j.key for j in run])
        if self.cfg.log_each_job:
            for job in run:
                t = job.task
                self.log.info("job_started", item_id=t.item_id, token=t.token, attempt=t.attempt, kind=t.kind)
        self.batches_run += 1
        self.batch_items += len(run)
        self.batch_size_max = max(self.batch_size_max, len(run))
        if not self.cfg.log_each_job:  # one line for the batch: [item_id, token, attempt] each
            self.log.info("batch_started", size=len(run), kind=run[0].task.kind, max_batch=self.max_batch,
                          items=[(j.task.item_id, j.task.token, j.task.attempt) for j in run])
        elif self.max_batch > 1:
            self.log.info("batch_started", size=len(run), kind=run[0].task.kind, max_batch=self.max_batch)
        limit_s = self._batch_limit_s(run)
        items = [(j.payload or b"", dict(j.task.params)) for j in run]
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._infer_pool, _timed_batch, self.handler, items)
        self._infer_futures.add(fut)
        fut.add_done_callback(self._infer_futures.discard)
        done, _ = await asyncio.wait({fut}, timeout=limit_s if limit_s > 0 else None)
        if not done:
            await self._on_timeout(run, fut, limit_s)
            return
        if fut.exception() is not None:  # a BaseException from the handler (SystemExit...): every item
            outputs, runtime_s = [fut.exception()] * len(run), 0.0
        else:
            outputs, runtime_s = fut.result()
        if self.observe_batch is not None:
            self.observe_batch(len(run), runtime_s)
        if len(outputs) != len(run):
            err = HandlerError(f"run_batch returned {len(outputs)} outputs for {len(run)} items")
            outputs = [err] * len(run)
        for job, out in zip(run, outputs):
            job.state = JobState.REPORTING
            if isinstance(out, BaseException):
                self._resolve(job, RunOutcome(error=out, runtime_s=runtime_s))
            else:
                self._resolve(job, RunOutcome(data=out, runtime_s=runtime_s))

    def _batch_limit_s(self, run: list[Job]) -> float:
        """The strictest max_runtime_s of the batch (0 = none), times the batch size
        when the handler runs batch items one after another (no batched path)."""
        limits = [lim for j in run if (lim := j.task.max_runtime_s or self.cfg.max_runtime_s) > 0]
        if not limits:
            return 0.0
        looped = len(run) > 1 and type(self.handler).run_batch is Handler.run_batch
        return min(limits) * (len(run) if looped else 1)

    async def _on_timeout(self, run: list[Job], fut: asyncio.Future, limit_s: float) -> None:
        """Report ``timeout`` for the batch now; keep the slot (counted lost) until the thread returns."""
        self.gate.lost += 1
        try:
            for job in run:
                job.state = JobState.REPORTING
                self.log.warning("job_timed_out", item_id=job.task.item_id, token=job.task.token, max_runtime_s=limit_s)
                self._resolve(job, RunOutcome(timeout_s=limit_s))
            await asyncio.wait({fut})
            outcome = "error" if fut.exception() is not None else "result"
            for job in run:
                self.log.info("timed_out_job_returned", item_id=job.task.item_id, token=job.task.token, discarded=outcome)
        finally:
            self.gate.lost -= 1
            self._credit_changed()

    async def _finish(self, job: Job, outcome: RunOutcome) -> None:
        if outcome.skipped:
            await self._report(job, self._failure(job, p.FailReason.RELEASED, outcome.skipped))
            return
        if outcome.timeout_s > 0:
            await self._report(job, self._failure(
                job, p.FailReason.TIMEOUT, f"exceeded max_runtime_s={outcome.timeout_s}"))
            return
        exc = outcome.error
        if isinstance(exc, PermanentHandlerError):
            await self._report(job, self._failure(job, p.FailReason.FATAL, str(exc)))
            return
        if exc is not None:
            self.log.info("handler_error", item_id=job.task.item_id, token=job.task.token, error=repr(exc))
            await self._report(job, self._failure(job, p.FailReason.HANDLER_ERROR, repr(exc)[:1000]))
            return
        data, runtime_s = outcome.data, outcome.runtime_s
        if not isinstance(data, bytes):
            await self._report(job, self._failure(
                job, p.FailReason.HANDLER_ERROR, f"handler returned {type(data).__name__}, expected bytes"))
            return
        crash_point("worker.after_infer")
        if job.released:
            await self._forget_released(job)
            return
        loop = asyncio.get_running_loop()
        try:
            if self.store.inline_without_io(len(data), INLINE_RESULT_MAX_BYTES):
                blob = self.store.put_blob(data, INLINE_RESULT_MAX_BYTES)  # inline: a hash, no I/O, no thread hop
            else:
                blob = await loop.run_in_executor(self._io_pool, self.store.put_blob, data, INLINE_RESULT_MAX_BYTES)
        except Exception as exc:  # any claim-store backend error: the attempt failed, retry elsewhere
            self.log.error("result_store_failed", item_id=job.task.item_id, exc_info=exc)
            self._store_trouble(repr(exc))
            await self._report(job, self._failure(job, p.FailReason.STORE_UNAVAILABLE,
                                                  f"could not store result: {exc!r}"[:1000]))
            return
        result = p.TaskResult(job.task.item_id, job.task.token, blob, self.handler.name, str(self.handler.version),
                              round(runtime_s, 6))
        await self._report(job, result)

    @staticmethod
    def _failure(job: Job, reason: p.FailReason, message: str) -> p.TaskFailure:
        """A FAIL entry; ``retryable`` comes from the one failure policy (:mod:`ccsq.common.wire.policy`)."""
        return task_failure(job.task.item_id, job.task.token, reason, message)

    async def _report(self, job: Job, report: p.TaskResult | p.TaskFailure) -> None:
        """Journal the outcome (fsync), then send it and grant credit back."""
        if job.released:
            await self._forget_released(job)
            return
        await self._jw.record([(report, job.task.kind)])
        if isinstance(report, p.TaskResult):
            crash_point("worker.after_result_stored")
        if job.released:  # released while the record was written
            await self._forget_released(job)
            return
        key = job.key
        self._jobs.pop(key, None)
        self._pending[key] = Pending(report)
        self._pending_changed()
        if isinstance(report, p.TaskResult):
            self.done += 1
            if self.cfg.log_each_job:
                self.log.info("job_completed", item_id=key[0], token=key[1], runtime_s=report.runtime_s,
                              result_bytes=report.result.size)
        else:
            self.failed += 1
            self.log.info("job_failed", item_id=key[0], token=key[1], reason=report.reason,
                          retryable=report.retryable, message=report.message[:200])
        self._queue_send(key)
        self._credit_changed()
        self.batches.poke()

    def _release(self, job: Job) -> None:
        """The broker says this lease is not ours any more."""
        self.log.info("job_released", item_id=job.task.item_id, token=job.task.token, state=job.state.value)
        job.released = True
        if job.state in (JobState.HOLDING, JobState.FETCHING, JobState.QUEUED) and job.runner is not None:
            job.runner.cancel()
            self._spawn(self._forget_released(job), "forget-released")

    async def _forget_released(self, job: Job) -> None:
        self.log.info("job_dropped", item_id=job.task.item_id, token=job.task.token, state=job.state.value)
        self._jobs.pop(job.key, None)
        await self._jw.forget([job.key])
        self._credit_changed()

    def _give_back(self, job: Job, why: str) -> None:
        """Stop a job that has not finished and report it ``released`` (shutdown)."""
        if job.runner is not None:
            job.runner.cancel()
        job.state = JobState.REPORTING
        job.runner = self._spawn(self._report(job, self._failure(job, p.FailReason.RELEASED, why)), "give-back")

    # --- reports and confirmations -------------------------------------------------
    def _queue_send(self, key: Key) -> None:
        """Send this report at the end of the loop tick, with every other report
        journaled in the same group commit: one COMPLETE and one FAIL frame."""
        if self._loop is None:  # not serving (unit use): send at once
            self._send_reports([key])
            return
        if not self._unsent:
            self._loop.call_soon(self._flush_unsent)
        self._unsent.append(key)

    def _flush_unsent(self) -> None:
        keys, self._unsent = self._unsent, []
        self._send_reports(keys)

    def _send_reports(self, keys: list[Key]) -> None:
        if self.link.state is not LinkState.READY:
            return
        results: list[Pending] = []
        failures: list[Pending] = []
        for key in keys:
            pend = self._pending.get(key)
            if pend is not None:
                (results if isinstance(pend.report, p.TaskResult) else failures).append(pend)
        now = time.monotonic()
        if results and not self.cfg.log_each_job:  # per report frame instead of job_completed per item
            self.log.info("results_reported", items=len(results), done=self.done)
        for chunk in self._chunks(results):
            if self.link.send(p.Complete(results=[pd.report for pd in chunk])):  # type: ignore[misc]
                for pd in chunk:
                    pd.sent_mono = now
        for chunk in self._chunks(failures):
            if self.link.send(p.Fail(failures=[pd.report for pd in chunk])):  # type: ignore[misc]
                for pd in chunk:
                    pd.sent_mono = now

    def _chunks(self, pends: list[Pending]) -> list[list[Pending]]:
        return split_frames(pends, size_of=_report_size, budget_bytes=max(4096, self.cfg.max_frame_bytes // 2),
                            max_items=MAX_REPORTS_PER_FRAME)

    def _on_acks(self, outcomes: list[p.ItemOutcome], kind: type) -> None:
        forget: list[Key] = []
        for o in outcomes:
            key = (o.item_id, o.token)
            pend = self._pending.get(key)
            if pend is None or not isinstance(pend.report, kind):
                self.log.debug("confirmation_for_unknown_report", item_id=o.item_id, token=o.token, outcome=o.outcome)
                continue
            del self._pending[key]
            forget.append(key)
            if o.outcome == p.Outcome.FENCED.value:
                self.log.warning("report_fenced", item_id=o.item_id, token=o.token)
            elif o.outcome not in (p.Outcome.ACCEPTED.value, p.Outcome.DUPLICATE.value):
                self.log.info("report_confirmed", item_id=o.item_id, token=o.token, outcome=o.outcome)
        if forget:
            self._spawn(self._jw.forget(forget), "journal-forget")
            self._pending_changed()

    def _pending_changed(self) -> None:
        if self._pending:
            self._pending_empty.clear()
        else:
            self._pending_empty.set()

    async def _resend_loop(self) -> None:
        while True:
            interval_s = 2 * self.link.heartbeat_interval_s
            await asyncio.sleep(interval_s)
            if self.link.state is not LinkState.READY:
                continue
            now = time.monotonic()
            stale = [k for k, pd in self._pending.items() if pd.sent_mono is None or now - pd.sent_mono >= interval_s]
            if stale:
                self.log.info("reports_resent", count=len(stale))
                self._send_reports(stale)

    # --- credit --------------------------------------------------------------------
    def _capacity(self) -> int:
        return max(0, self.capacity - self.gate.lost * self.max_batch)

    def _credit_changed(self) -> None:
        if not self._credit_flush_scheduled and self._loop is not None:
            self._credit_flush_scheduled = True
            self._loop.call_soon(self._flush_credit)

    def _flush_credit(self) -> None:
        """Grant what is missing from capacity, in one CREDIT (batches several completions)."""
        self._credit_flush_scheduled = False
        if self._draining or self.link.state is not LinkState.READY:
            return
        want = self._capacity() - len(self._jobs) - self._broker_credit
        if want > 0 and self.link.send(p.Credit(credit=want)):
            self._broker_credit += want

    # --- shutdown -------------------------------------------------------------------
    async def _drain(self) -> None:
        self._draining = True
        self.log.info("worker_draining", held=len(self._jobs), unconfirmed=len(self._pending),
                      drain_timeout_s=self.cfg.drain_timeout_s)
        for job in list(self._jobs.values()):
            if job.state in (JobState.HOLDING, JobState.FETCHING, JobState.QUEUED):
                self._give_back(job, "worker is shutting down")
        running = [j.runner for j in self._jobs.values() if j.state is JobState.RUNNING and j.runner is not None]
        if running:
            await asyncio.wait(running, timeout=self.cfg.drain_timeout_s)
        for job in list(self._jobs.values()):
            if job.state is JobState.RUNNING:
                self._give_back(job, f"not finished within drain_timeout_s={self.cfg.drain_timeout_s}")
        reporting = [j.runner for j in self._jobs.values() if j.runner is not None]
        if reporting:
            await asyncio.wait(reporting, timeout=5.0)
        if self._pending and self.link.state is LinkState.READY:
            try:
                await asyncio.wait_for(self._pending_empty.wait(), timeout=ACK_WAIT_ON_STOP_S)
            except asyncio.TimeoutError:
                self.log.warning("unconfirmed_at_stop", count=len(self._pending))

    # --- health probes --------------------------------------------------------------
    async def _lag_probe(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LAG_PROBE_INTERVAL_S)
            lag_ms = max(0.0, (time.monotonic() - t0 - LAG_PROBE_INTERVAL_S) * 1000.0)
            self._lag_window_ms = max(self._lag_window_ms, lag_ms)
            self.loop_lag_max_ms = max(self.loop_lag_max_ms, lag_ms)
            if lag_ms > LAG_WARN_MS:
                self.log.warning("loop_lag", lag_ms=round(lag_ms, 1))

    async def _gpu_mem_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.gpu_mem_free_bytes = await loop.run_in_executor(self._io_pool, providers.gpu_mem_free_bytes)
            await asyncio.sleep(GPU_MEM_POLL_S)

    # --- helpers -----------------------------------------------------------------------
    async def _j(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a journal call on the journal's own thread (calls stay in order)."""
        return await asyncio.get_running_loop().run_in_executor(self._journal_pool, fn, *args)

    def _lease_refs(self) -> list[p.LeaseRef]:
        """Leases we hold: jobs not released by the broker, then unconfirmed reports."""
        keys = [k for k, job in self._jobs.items() if not job.released]
        keys += [k for k in self._pending if k not in self._jobs]
        return [p.LeaseRef(item_id, token) for item_id, token in keys]

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        """A background task whose unexpected exception stops the worker (a bug must not hide)."""
        t = asyncio.create_task(coro, name=name)
        self._runners.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        self._runners.discard(t)
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None and self.fatal is None:
            self.fatal = exc
            self.log.error("worker_task_failed", task=t.get_name(), exc_info=exc)
            self._stop.set()
