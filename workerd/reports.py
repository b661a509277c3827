"""Reports: a run's outcome -> journaled report -> COMPLETE / FAIL -> confirmation -> forget;
and the credit granted back.

Order per item: result in the claim store -> journal "finished" / "failed" (fsync)
-> crash point ``worker.after_result_stored`` -> COMPLETE / FAIL -> credit back ->
COMPLETE_ACK / FAIL_ACK (any outcome) -> forget (journal row deleted). Until the
broker confirms it, a report is *unconfirmed* (:attr:`Reports.unconfirmed`): it is
listed in HELLO and heartbeats, re-sent on every new session and on a timer (every
2 x heartbeat interval; the broker treats replays idempotently), and kept in the
journal for the next start. The deletion of a confirmed report's row is a lazy
journal write (:class:`~ccsq.workerd.worker_journal.GroupCommit`): it rides with the next commit.

Per batch, not per item: a lane hands :meth:`Reports.finish_many` the outcomes of a
whole batch (one task); their reports are journaled in one write
(:meth:`Reports.report_many`) and sent in one frame.

Group commit (throughput): the reports journaled in one commit of the
:class:`~ccsq.workerd.worker_journal.GroupCommit` are sent at the end of that loop tick,
together: one COMPLETE (and one FAIL) frame for all of them (split by the one frame
budget, :class:`ccsq.common.wire.frames.FrameBudget`), then one CREDIT.

The failure decision (:meth:`Reports.finish`): the worker names a reason, and
``retryable`` follows from it (:func:`ccsq.workerd.jobs.failure`, the one failure
policy ``ccsq.common.wire.policy.FAIL_POLICY``):

- ``PermanentHandlerError`` -> ``fatal``; any other handler exception, or a handler
  that returns something other than bytes -> ``handler_error`` (message = repr);
- over ``max_runtime_s`` -> ``timeout``; deadline passed before the start -> ``released``;
- a result the claim store cannot store -> ``store_unavailable`` (requeued without
  counting the attempt) and the worker turns unhealthy (:mod:`ccsq.workerd.claims`).

Crash points (:mod:`ccsq.common.runtime.faults`): ``worker.after_infer`` fires when the
handler has returned, before anything is stored (a restart re-runs nothing and the
lease expires); ``worker.after_result_stored`` fires once the result is in the claim
store AND in the journal, before COMPLETE (a restart resends it).

A lease the broker released (WELCOME ``released``) is never reported once released
before its report is journaled: its row is forgotten. A report already journaled is
still replayed even if released: the broker confirms it (``fenced`` if the lease moved
on, which its gap register records, case C04), and dropping a finished result would
throw real work away.

Credit rule (:class:`Credit`): outstanding credit = ``slots x max_batch + prefetch``
(minus ``max_batch`` per lost slot), so every lane can fill a whole batch and still
have ``prefetch`` items fetched and verified for the next one. The HELLO grants that
minus the leases held; each DISPATCHed task consumes one; after reports are sent the
missing credit is granted back in one batched ``Credit(n)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, cast

from ccsq.common.link.peer import BrokerLink, LinkState
from ccsq.common.runtime.faults import crash_point, crash_point_armed
from ccsq.common.storage.claimstore import store_failure
from ccsq.common.wire import protocol
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.errors import PermanentHandlerError
from ccsq.common.wire.frames import FrameBudget, encoded_size, split_bounded, text_bound
from ccsq.workerd.claims import Claims
from ccsq.workerd.handlers import Handler
from ccsq.workerd.jobs import Job, Key, RunOutcome, failure
from ccsq.workerd.worker_journal import EntryState, GroupCommit, JournalEntry

#: Each job's TaskResult without a frozen ``__init__`` (one ``object.__setattr__`` a field; the class
#: has no checks of its own): the same object, ~4 us less a job (ledger/schema.py ``trusted_task``)
_task_result = protocol.trusted_constructor(protocol.TaskResult, (
    "item_id", "token", "result", "handler", "handler_version", "runtime_s", "proof", "proof_sig"))

_FENCED = protocol.Outcome.FENCED.value  # enum .value is a property: read once, not per confirmation
_CONFIRMED_QUIETLY = frozenset((protocol.Outcome.ACCEPTED.value, protocol.Outcome.DUPLICATE.value))

Report = protocol.TaskResult | protocol.TaskFailure
Spawn = Callable[[Coroutine[Any, Any, Any], str], asyncio.Task]


@dataclasses.dataclass(eq=False, slots=True)
class Unconfirmed:
    """A report (result or failure) the broker has not confirmed yet."""

    report: Report
    sent_mono: float | None = None  # last send (monotonic s); None = not sent this session


def _report_size(u: Unconfirmed) -> int:
    """The encoded bytes of one COMPLETE/FAIL record (common/wire/frames.py)."""
    return encoded_size(u.report)


#: msgpack bytes of a TaskResult map besides its strings and bytes, over-counted: map headers,
#: every field name (the extension ones included), the blob's map with its digest, numbers at 9 bytes
_RESULT_FIXED_BOUND = 260  # counted: 173 (every string empty)


def _report_bound(u: Unconfirmed) -> int:
    """An upper bound of :func:`_report_size` of a result from lengths alone (a COMPLETE of one
    worker's batch then goes out as one frame, nothing packed to size it): see ``frames.split_bounded``."""
    r = cast(protocol.TaskResult, u.report)
    inline = r.result.inline
    return (_RESULT_FIXED_BOUND + text_bound(r.item_id) + text_bound(r.handler) + text_bound(r.handler_version)
            + (0 if inline is None else len(inline)) + len(r.proof) + len(r.proof_sig))


class Credit:
    """The credit this worker has granted the broker in this session (see module doc).

    ``available()`` = capacity (less lost slots) minus the leases held; ``draining()``
    True stops all grants. :meth:`changed` grants what is missing at the end of the
    loop tick, in one CREDIT.
    """

    granted: int  # credit the broker holds from us in this session
    loop: asyncio.AbstractEventLoop | None  # set while serving; None: grant nothing

    def __init__(self, link: BrokerLink, available: Callable[[], int], draining: Callable[[], bool], log: Any) -> None:
        self.granted = 0
        self.loop = None
        self._link = link
        self._available = available
        self._draining = draining
        self._log = log
        self._flush_scheduled = False

    def hello(self) -> int:
        """The credit a new session's HELLO grants (the broker forgets the old one)."""
        self.granted = 0 if self._draining() else max(0, self._available())
        return self.granted

    def dispatched(self, n: int) -> None:
        """The broker used ``n`` credit (one DISPATCH)."""
        self.granted -= n
        if self.granted < 0:
            self._log.warning("credit_overrun", extra_tasks=-self.granted)
            self.granted = 0

    def session_lost(self) -> None:
        self.granted = 0

    def changed(self) -> None:
        """Capacity or holdings changed: grant what is missing at the end of this tick."""
        if not self._flush_scheduled and self.loop is not None:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Grant what is missing from capacity, in one CREDIT (batches several completions)."""
        self._flush_scheduled = False
        if self._draining() or self._link.state is not LinkState.READY:
            return
        want = self._available() - self.granted
        if want > 0 and self._link.send(protocol.Credit(credit=want)):
            self.granted += want


class Reports:
    """The reports of one worker, from a run's outcome to the broker's confirmation.

    ``held`` is the worker's table of held jobs (the intake adds them): a job leaves it here, when its report
    is journaled (it becomes unconfirmed) or it is forgotten released. ``poke()`` tells
    the lanes that fewer items are held. ``loop`` is set while serving (None: send at
    once, for unit use).
    """

    unconfirmed: dict[Key, Unconfirmed]  # reports journaled and not confirmed yet
    lost: list[Key]  # journaled started when the previous process died: HELLO info "lost" until WELCOMEd
    all_confirmed: asyncio.Event  # set while unconfirmed is empty
    done: int  # results reported
    failed: int  # failures reported
    loop: asyncio.AbstractEventLoop | None

    def __init__(self, cfg: WorkerConfig, handler: Handler, claims: Claims, link: BrokerLink, jw: GroupCommit,
                 held: dict[Key, Job], credit: Credit, *, poke: Callable[[], None], spawn: Spawn, log: Any) -> None:
        self.cfg = cfg
        self.handler = handler
        self.unconfirmed = {}
        self.lost = []
        self.all_confirmed = asyncio.Event()
        self.all_confirmed.set()
        self.done = 0
        self.failed = 0
        self.loop = None
        self._claims = claims
        self._link = link
        self._jw = jw
        self._held = held
        self._credit = credit
        self._poke = poke
        self._spawn = spawn
        self._log = log
        self._unsent: list[Key] = []  # reports to send at the end of this loop tick
        self._held_event = asyncio.Event()  # set when a job leaves the held table (wait_held)
        self._handler_version = str(handler.version)

    async def recover(self, entries: list[JournalEntry]) -> None:
        """Turn the journal's rows into unconfirmed reports (worker module doc: Restart)."""
        given_back: list[tuple[Report, str]] = []
        for e in entries:
            report = e.report
            if e.state is EntryState.STARTED:
                # reported in HELLO info "lost" (the broker counts their attempts, C07b);
                # the row stays until the broker WELCOMEd that HELLO (forget_lost)
                self._log.warning("job_lost_in_crash", item_id=e.item_id, token=e.token, kind=e.kind)
                self.lost.append((e.item_id, e.token))
                continue
            if report is None:  # held, never started: give it back without costing an attempt
                report = failure((e.item_id, e.token), protocol.FailReason.RELEASED, "worker restarted before starting the job")
                given_back.append((report, e.kind))
            self.unconfirmed[(e.item_id, e.token)] = Unconfirmed(report)
        if given_back:  # journaled (one write) before the session that sends them starts
            await self._jw.record(given_back)
        self._unconfirmed_changed()

    async def forget_lost(self) -> None:
        """A WELCOME answered the HELLO that reported :attr:`lost`: their rows go."""
        lost, self.lost = self.lost, []
        if lost:
            await self._jw.forget(lost)

    # --- outcome -> report --------------------------------------------------------------
    async def finish_many(self, pairs: list[tuple[Job, RunOutcome]]) -> None:
        """Name each outcome's failure reason, or store its result; then :meth:`report_many`
        them all (one journal write). A job given back meanwhile is skipped (its
        ``released`` report is on its way); one the broker released is forgotten."""
        await self._finish(pairs, None)

    async def finish_outputs(self, jobs: list[Job], outputs: list[Any], runtime_s: float) -> None:
        """:meth:`finish_many` of one handler call's outputs (``bytes`` or an exception per
        job, in order; ``runtime_s`` the call's wall seconds), without a RunOutcome per job."""
        await self._finish(zip(jobs, outputs), runtime_s)

    async def _finish(self, pairs: Iterable[tuple[Job, Any]], runtime_s: float | None) -> None:
        """The loop of :meth:`finish_many` (``runtime_s`` None: RunOutcomes) and
        :meth:`finish_outputs` (raw outputs). Inline results are made here, on the loop,
        when the claim store needs no I/O for them (one SHA-256 each)."""
        reports: list[tuple[Job, Report]] = []
        dropped: list[Job] = []
        big: list[tuple[Job, bytes, float]] = []
        inline_result = self._claims.inline_result
        after_infer = crash_point_armed("worker.after_infer")
        name, version = self.handler.name, self._handler_version
        rt = 0.0 if runtime_s is None else round(runtime_s, 6)
        task_result = protocol.TaskResult
        for job, x in pairs:
            if job.given_back:
                continue
            if runtime_s is not None and isinstance(x, bytes):  # the common case: a result
                data, job_rt = x, rt
            else:
                outcome = x if runtime_s is None else (
                    RunOutcome(error=x, runtime_s=runtime_s) if isinstance(x, BaseException)
                    else RunOutcome(data=x, runtime_s=runtime_s))
                why = self._failure_reason(outcome)
                if why is not None:
                    if why[0] is protocol.FailReason.HANDLER_ERROR and outcome.error is not None:
                        self._log.info("handler_error", item_id=job.task.item_id, token=job.task.token,
                                       error=repr(outcome.error))
                    reports.append((job, failure(job.key, *why)))
                    continue
                data, job_rt = cast(bytes, outcome.data), round(outcome.runtime_s, 6)
            if after_infer:
                crash_point("worker.after_infer")
            if job.released:
                dropped.append(job)
            elif (inline := inline_result(data)) is not None:  # put_result's blob, made here (no I/O)
                t = job.task
                reports.append((job, task_result(t.item_id, t.token, inline, name, version, job_rt)))
            else:
                big.append((job, data, job_rt))
        if big:  # results the claim store must write: in the I/O threads, together
            for job, rep in await asyncio.gather(*(self._store(job, data, job_rt) for job, data, job_rt in big)):
                if rep is None:
                    dropped.append(job)
                else:
                    reports.append((job, rep))
        if dropped:
            await self.forget_released_many(dropped)
        if reports:
            await self.report_many(reports)

    def _result(self, job: Job, blob: protocol.Blob, runtime_s: float) -> protocol.TaskResult:
        return _task_result(job.task.item_id, job.task.token, blob, self.handler.name, self._handler_version, runtime_s, b"", b"")

    async def _store(self, job: Job, data: bytes, runtime_s: float) -> tuple[Job, Report | None]:
        """Store one result in the claim store: its report, or None if released meanwhile."""
        try:
            blob = await self._claims.put_result(data)
        except Exception as exc:  # any claim-store backend error: requeued (attempt not counted), run elsewhere
            self._log.error("result_store_failed", item_id=job.task.item_id, exc_info=exc)
            self._claims.trouble(repr(exc))
            return job, failure(job.key, store_failure(exc), f"could not store result: {exc!r}"[:1000])
        return job, (None if job.released else self._result(job, blob, runtime_s))

    @staticmethod
    def _failure_reason(outcome: RunOutcome) -> tuple[protocol.FailReason, str] | None:
        """The reason (and message) a run failed, or None for a result to store."""
        if outcome.skipped:
            return protocol.FailReason.RELEASED, outcome.skipped
        if outcome.timeout_s > 0:
            return protocol.FailReason.TIMEOUT, f"exceeded max_runtime_s={outcome.timeout_s}"
        exc = outcome.error
        if isinstance(exc, PermanentHandlerError):
            return protocol.FailReason.FATAL, str(exc)
        if exc is not None:
            return protocol.FailReason.HANDLER_ERROR, repr(exc)[:1000]
        if not isinstance(outcome.data, bytes):
            return protocol.FailReason.HANDLER_ERROR, f"handler returned {type(outcome.data).__name__}, expected bytes"
        return None

    async def report(self, job: Job, report: Report) -> None:
        """:meth:`report_many` of one report."""
        await self.report_many([(job, report)])

    async def report_many(self, reports: Sequence[tuple[Job, Report]]) -> None:
        """Journal the reports (one write, fsync), then send them (one frame each way at the
        end of the loop tick) and grant credit back. Released jobs are forgotten instead."""
        live = [(job, rep) for job, rep in reports if not job.released]
        if len(live) < len(reports):
            await self.forget_released_many([job for job, _ in reports if job.released])
        if not live:
            return
        await self._jw.record([(rep, job.task.kind) for job, rep in live])
        if crash_point_armed("worker.after_result_stored"):
            for job, rep in live:
                if isinstance(rep, protocol.TaskResult):
                    crash_point("worker.after_result_stored")
        log_each = self.cfg.log_each_job
        released: list[Job] = []
        held, unconfirmed, task_result = self._held, self.unconfirmed, protocol.TaskResult
        sent: list[Key] = []
        done = 0
        for job, rep in live:
            if job.released:  # released while the record was written
                released.append(job)
                continue
            key = (rep.item_id, rep.token)
            held.pop(key, None)
            unconfirmed[key] = Unconfirmed(rep)
            sent.append(key)
            if type(rep) is task_result:
                done += 1
                if log_each:
                    self._log.info("job_completed", item_id=key[0], token=key[1], runtime_s=rep.runtime_s,
                                   result_bytes=rep.result.size)
            else:
                self.failed += 1
                fail = cast(protocol.TaskFailure, rep)  # the only other report type (TaskResult has no subclasses)
                self._log.info("job_failed", item_id=key[0], token=key[1], reason=fail.reason,
                               retryable=fail.retryable, message=fail.message[:200])
        self.done += done
        self._queue_send_many(sent)
        self._unconfirmed_changed()
        self._held_changed()
        if released:
            await self.forget_released_many(released)
        self._credit.changed()
        self._poke()

    async def forget_released(self, job: Job) -> None:
        """The broker took the lease back: drop the job and its journal row, unreported."""
        await self.forget_released_many([job])

    async def forget_released_many(self, jobs: list[Job]) -> None:
        """:meth:`forget_released` of several jobs: one journal write."""
        for job in jobs:
            self._log.info("job_dropped", item_id=job.task.item_id, token=job.task.token, state=job.state.value)
            self._held.pop(job.key, None)
        self._held_changed()
        await self._jw.forget([job.key for job in jobs])
        self._credit.changed()

    async def wait_held(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until ``done()`` about the held jobs is true; it is
        asked again whenever a job leaves the table. Returns its last answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._held_event.clear()
            try:
                await asyncio.wait_for(self._held_event.wait(), timeout=left)
            except asyncio.TimeoutError:
                return done()
        return True

    def _held_changed(self) -> None:
        self._held_event.set()

    # --- sending and confirmations ------------------------------------------------------
    def _queue_send_many(self, keys: list[Key]) -> None:
        """Send these reports at the end of the loop tick, with every other report
        journaled in the same group commit: one COMPLETE and one FAIL frame."""
        if not keys:
            return
        if self.loop is None:  # not serving (unit use): send at once
            self.send(keys)
            return
        if not self._unsent:
            self.loop.call_soon(self._flush_unsent)
        self._unsent.extend(keys)

    def _flush_unsent(self) -> None:
        keys, self._unsent = self._unsent, []
        self.send(keys)

    def send(self, keys: list[Key]) -> None:
        """Send the unconfirmed reports of ``keys`` (others are skipped), when the session is up."""
        if self._link.state is not LinkState.READY:
            return
        results: list[Unconfirmed] = []
        failures: list[Unconfirmed] = []
        for key in keys:
            u = self.unconfirmed.get(key)
            if u is not None:
                (results if isinstance(u.report, protocol.TaskResult) else failures).append(u)
        now = time.monotonic()
        if results and not self.cfg.log_each_job:  # per report frame instead of job_completed per item
            self._log.info("results_reported", items=len(results), done=self.done)
        budget = FrameBudget(self.cfg.max_frame_bytes)
        for chunk in split_bounded(results, size_of=_report_size, bound_of=_report_bound, budget_bytes=budget.room_bytes,
                                   max_items=budget.max_items):
            if self._link.send(protocol.Complete(results=[u.report for u in chunk])):  # type: ignore[misc]
                for u in chunk:
                    u.sent_mono = now
        for chunk in self._chunks(failures):
            if self._link.send(protocol.Fail(failures=[u.report for u in chunk])):  # type: ignore[misc]
                for u in chunk:
                    u.sent_mono = now

    def _chunks(self, reports: list[Unconfirmed]) -> list[list[Unconfirmed]]:
        return FrameBudget(self.cfg.max_frame_bytes).split(reports, size_of=_report_size)

    def on_acks(self, outcomes: list[protocol.ItemOutcome], kind: type) -> None:
        """COMPLETE_ACK (``kind`` TaskResult) / FAIL_ACK (TaskFailure): forget what is confirmed."""
        forget: list[Key] = []
        for o in outcomes:
            key = (o.item_id, o.token)
            u = self.unconfirmed.get(key)
            if u is None or not isinstance(u.report, kind):
                self._log.debug("confirmation_for_unknown_report", item_id=o.item_id, token=o.token, outcome=o.outcome)
                continue
            del self.unconfirmed[key]
            forget.append(key)
            if o.outcome == _FENCED:
                self._log.warning("report_fenced", item_id=o.item_id, token=o.token)
            elif o.outcome not in _CONFIRMED_QUIETLY:
                self._log.info("report_confirmed", item_id=o.item_id, token=o.token, outcome=o.outcome)
        if forget:
            self._spawn(self._jw.forget(forget, lazy=True), "journal-forget")  # rides with the next commit
            self._unconfirmed_changed()

    def session_started(self) -> None:
        """A new session: send every unconfirmed report again."""
        self.send(list(self.unconfirmed))

    def session_lost(self) -> None:
        for u in self.unconfirmed.values():
            u.sent_mono = None

    async def resend_loop(self) -> None:
        """Every 2 x heartbeat interval, re-send reports not (re)sent for that long."""
        while True:
            interval_s = 2 * self._link.heartbeat_interval_s
            await asyncio.sleep(interval_s)
            if self._link.state is not LinkState.READY:
                continue
            now = time.monotonic()
            stale = [k for k, u in self.unconfirmed.items() if u.sent_mono is None or now - u.sent_mono >= interval_s]
            if stale:
                self._log.info("reports_resent", count=len(stale))
                self.send(stale)

    def _unconfirmed_changed(self) -> None:
        if self.unconfirmed:
            self.all_confirmed.clear()
        else:
            self.all_confirmed.set()
