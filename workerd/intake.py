"""Intake: DISPATCH -> hold in the journal -> fetch the payload -> the batch queue.

For each new lease of a DISPATCH the intake makes a :class:`~ccsq.workerd.jobs.Job`
in the worker's table of held jobs (the leases it holds and has not reported yet;
:mod:`ccsq.workerd.reports` removes a job once its report is journaled) and starts the job's runner, one asyncio task that carries it to its report::

    journal "held" (one fsync for the whole DISPATCH, shared by its jobs)
      -> fetch the payload from the claim check and verify its SHA-256
         (prefetch: outside the slot, while the GPU runs earlier items)
      -> batch key (kind, handler.batch_key(params)) -> the lanes' batch queue
      -> wait for the RunOutcome (:mod:`ccsq.workerd.lanes`)
      -> Reports.finish (:mod:`ccsq.workerd.reports`)

Fetch failures name a reason, never a ``retryable`` flag (the one failure policy
decides it): inline bytes that do not match their SHA-256 -> ``payload_missing``
(the item's own fault: dead-lettered); a blob this worker's claim store cannot
produce (absent, corrupt) or any other claim-store error (I/O, backend down) ->
``store_unavailable``: requeued after a backoff without counting the attempt (only
the broker's reconcile, gap G7, dead-letters a payload as missing), and the worker
turns unhealthy for a while (:mod:`ccsq.workerd.claims`); the worker keeps running.
A ``batch_key`` that raises fails the item (``fatal`` for a PermanentHandlerError,
else ``handler_error``).

A lease of a kind not served here, or one that arrives while draining, is given
back ``released`` (no attempt consumed) once held. WELCOME ``released`` leases
(:meth:`Intake.release`): a job not yet running is dropped at once; a running one
is finished and its result discarded; neither is ever reported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ccsq.common.wire import protocol as p
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.storage.claimstore import store_failure
from ccsq.common.wire.errors import PayloadMissing, PermanentHandlerError
from ccsq.workerd.claims import Claims
from ccsq.workerd.handlers import Handler
from ccsq.workerd.jobs import Job, JobState, Key, failure
from ccsq.workerd.journal import GroupCommit
from ccsq.workerd.lanes import Lanes
from ccsq.workerd.reports import Reports, Spawn

_NOT_RUNNING = (JobState.HOLDING, JobState.FETCHING, JobState.QUEUED)


class Intake:
    """New leases and their runners (see module doc). ``jobs`` is the worker's table of
    held jobs: the intake adds each new lease to it. ``draining()`` True gives every
    new lease back at once."""

    jobs: dict[Key, Job]  # held leases, not reported yet (Reports removes a reported one)

    def __init__(self, cfg: WorkerConfig, kinds: list[str], handler: Handler, claims: Claims, jw: GroupCommit,
                 jobs: dict[Key, Job], lanes: Lanes, reports: Reports, *, draining: Callable[[], bool], spawn: Spawn,
                 log: Any) -> None:
        self.cfg = cfg
        self.kinds = kinds
        self.handler = handler
        self.jobs = jobs
        self._claims = claims
        self._jw = jw
        self._lanes = lanes
        self._reports = reports
        self._draining = draining
        self._spawn = spawn
        self._log = log

    def fetching(self) -> bool:
        """Is a job on its way to the batch queue (being held or fetched)?"""
        return any(j.state in (JobState.HOLDING, JobState.FETCHING) for j in self.jobs.values())

    def on_dispatch(self, tasks: list[p.Task], clock_offset_s: float = 0.0) -> None:
        """New leases: hold them all in one journal write, and start a runner for each."""
        new: list[Job] = []
        for task in tasks:
            key = (task.item_id, task.token)
            if key in self.jobs or key in self._reports.unconfirmed:
                self._log.info("duplicate_dispatch", item_id=task.item_id, token=task.token)
                continue
            job = Job(task, clock_offset_s=clock_offset_s)
            self.jobs[key] = job
            new.append(job)
        if not new:
            return
        hold = asyncio.ensure_future(self._jw.hold([(j.task.item_id, j.task.token, j.task.kind) for j in new]))
        for job in new:
            if self._draining():
                coro = self._report_after(hold, job, failure(job.key, p.FailReason.RELEASED, "worker is shutting down"))
            elif job.task.kind not in self.kinds:
                self._log.warning("unexpected_kind", item_id=job.task.item_id, kind=job.task.kind, kinds=self.kinds)
                coro = self._report_after(
                    hold, job, failure(job.key, p.FailReason.RELEASED, f"kind {job.task.kind!r} is not served here")
                )
            else:
                coro = self._run_job(job, hold)
            job.runner = self._spawn(coro, f"job-{job.task.item_id}")
        self._log.info("dispatched", tasks=len(new), held=len(self.jobs))

    @staticmethod
    async def _await_hold(hold: asyncio.Future) -> None:
        """Wait for the shared journal write of a DISPATCH without ever cancelling it
        (a cancelled job must not cancel its siblings' hold)."""
        await asyncio.wait({hold})
        hold.result()

    async def _report_after(self, hold: asyncio.Future, job: Job, report: p.TaskFailure) -> None:
        await self._await_hold(hold)
        job.state = JobState.REPORTING
        await self._reports.report(job, report)

    async def _fail(self, job: Job, reason: p.FailReason, message: str) -> None:
        job.state = JobState.REPORTING
        await self._reports.report(job, failure(job.key, reason, message))

    async def _run_job(self, job: Job, hold: asyncio.Future) -> None:
        """One task: durable hold, fetch + verify (prefetch), batch queue, outcome, report."""
        task = job.task
        await self._await_hold(hold)
        job.state = JobState.FETCHING
        inline = task.payload.inline
        try:
            job.payload = await self._claims.fetch(task.payload)
        except Exception as exc:  # any claim-store error: what it means is store_failure's one rule
            reason = store_failure(exc, task.payload)
            if reason is p.FailReason.PAYLOAD_MISSING:  # inline bytes that do not match: the item's fault
                await self._fail(job, reason, str(exc))
                return
            # absent or corrupt in OUR view of the store, an I/O or backend error: this worker's
            # problem (unhealthy for a pause); requeued without counting the attempt
            self._log.error("payload_fetch_failed", item_id=task.item_id, token=task.token, error=repr(exc))
            self._claims.trouble(str(exc) if isinstance(exc, PayloadMissing) else repr(exc))
            await self._fail(job, reason, f"could not fetch payload from this worker's claim store: {exc!r}"[:1000])
            return
        if inline is None:
            self._claims.fetched()  # the store produced a blob: healthy at the next heartbeat
        try:
            key = (task.kind, self.handler.batch_key(dict(task.params)))
        except PermanentHandlerError as exc:
            await self._fail(job, p.FailReason.FATAL, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a handler bug in batch_key fails the item, not the worker
            await self._fail(job, p.FailReason.HANDLER_ERROR, f"batch_key: {exc!r}"[:1000])
            return
        outcome = self._lanes.submit(key, job)
        try:
            result = await outcome
        except asyncio.CancelledError:
            self._lanes.withdraw(key, job)
            raise
        await self._reports.finish(job, result)

    def release(self, job: Job) -> None:
        """The broker says this lease is not ours any more."""
        self._log.info("job_released", item_id=job.task.item_id, token=job.task.token, state=job.state.value)
        job.released = True
        if job.state in _NOT_RUNNING and job.runner is not None:
            job.runner.cancel()
            self._spawn(self._reports.forget_released(job), "forget-released")

    def give_back(self, job: Job, why: str) -> None:
        """Stop a job that has not finished and report it ``released`` (shutdown)."""
        if job.runner is not None:
            job.runner.cancel()
        job.state = JobState.REPORTING
        job.runner = self._spawn(self._reports.report(job, failure(job.key, p.FailReason.RELEASED, why)), "give-back")

    async def give_back_all(self, drain_timeout_s: float) -> None:
        """Shutdown: give back the jobs not running; wait ``drain_timeout_s`` for the
        running ones, then give those back too; wait (5 s) for their reports."""
        for job in list(self.jobs.values()):
            if job.state in _NOT_RUNNING:
                self.give_back(job, "worker is shutting down")
        running = [j.runner for j in self.jobs.values() if j.state is JobState.RUNNING and j.runner is not None]
        if running:
            await asyncio.wait(running, timeout=drain_timeout_s)
        for job in list(self.jobs.values()):
            if job.state is JobState.RUNNING:
                self.give_back(job, f"not finished within drain_timeout_s={drain_timeout_s}")
        reporting = [j.runner for j in self.jobs.values() if j.runner is not None]
        if reporting:
            await asyncio.wait(reporting, timeout=5.0)
