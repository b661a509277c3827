"""The worker's dispatch intake: DISPATCH -> hold in the journal -> fetch the payload -> the batch queue.

For each new lease of a DISPATCH the intake makes a :class:`~ccsq.workerd.jobs.Job`
in the worker's table of held jobs (the leases it holds and has not reported yet;
:mod:`ccsq.workerd.reports` removes a job once its report is journaled) and starts ONE
runner for the whole frame, an asyncio task that carries its jobs to the batch queue::

    journal "held" (one fsync for the whole DISPATCH, shared by its jobs; "started" too, in
      the same commit, for the jobs a free lane will take at once: _start_with_hold)
      -> fetch each payload from the claim check and verify its SHA-256
         (inline ones on the loop, in turn; stored ones in the I/O threads, together;
         prefetch: outside the slot, while the GPU runs earlier items)
      -> batch key (kind, handler.batch_key(params)) -> the lanes' batch queue
    the lanes run each batch and hand its outputs to Reports.finish_outputs
    (:mod:`ccsq.workerd.lanes`, :mod:`ccsq.workerd.reports`): no task per job.

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
(:meth:`DispatchIntake.release`): a job not yet running is dropped at once; a running one
is finished and its result discarded; neither is ever reported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from collections.abc import Hashable
from typing import Any

from ccsq.common.runtime.faults import crash_point
from ccsq.common.wire import protocol
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.storage.claimstore import store_failure
from ccsq.common.wire.errors import PayloadMissing, PermanentHandlerError
from ccsq.workerd.claims import Claims
from ccsq.workerd.handlers import Handler
from ccsq.workerd.jobs import Job, JobState, Key, failure
from ccsq.workerd.worker_journal import GroupCommit, OpKind
from ccsq.workerd.lanes import Lanes
from ccsq.workerd.reports import Reports, Spawn

_NOT_RUNNING = (JobState.HOLDING, JobState.FETCHING, JobState.QUEUED)


class DispatchIntake:
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
        self._frames_in_flight = 0  # DISPATCH runners still bringing jobs to the batch queue
        self._own_batch_key = type(handler).batch_key is not Handler.batch_key  # else every job: (kind, None)

    def fetching(self) -> bool:
        """Is a job on its way to the batch queue (being held or fetched)? O(1): a DISPATCH
        frame's runner is still bringing its jobs there."""
        return self._frames_in_flight > 0

    def on_dispatch(self, tasks: list[protocol.Task], clock_offset_s: float = 0.0) -> None:
        """New leases: hold them all in one journal write, and start ONE runner for the frame."""
        crash_point("worker.dispatch_before_hold")  # died with leases its journal never saw (tests)
        new: list[tuple[Job, protocol.TaskFailure | None]] = []
        rows: list[tuple[str, int, str]] = []
        draining = self._draining()
        jobs, unconfirmed, kinds = self.jobs, self._reports.unconfirmed, self.kinds
        for task in tasks:
            key = (task.item_id, task.token)
            if key in jobs or key in unconfirmed:
                self._log.info("duplicate_dispatch", item_id=task.item_id, token=task.token)
                continue
            job = Job(task, clock_offset_s=clock_offset_s)
            jobs[key] = job
            verdict = None
            if draining:
                verdict = failure(key, protocol.FailReason.RELEASED, "worker is shutting down")
            elif task.kind not in kinds:
                self._log.warning("unexpected_kind", item_id=task.item_id, kind=task.kind, kinds=kinds)
                verdict = failure(key, protocol.FailReason.RELEASED, f"kind {task.kind!r} is not served here")
            new.append((job, verdict))
            rows.append((task.item_id, task.token, task.kind))
        if not new:
            return
        started = self._start_with_hold(new)
        if started:  # one commit: held, then started (the ops of one queue_ops call never split)
            hold = self._jw.queue_ops([(OpKind.HOLD, rows), (OpKind.STARTED, started)])
        else:
            hold = self._jw.queue(OpKind.HOLD, rows)  # the frame's runner awaits it (one future, no task)
        self._frames_in_flight += 1
        self._spawn(self._run_frame(new, hold), "dispatch")
        self._log.info("dispatched", tasks=len(new), held=len(jobs))

    def _start_with_hold(self, new: list[tuple[Job, protocol.TaskFailure | None]]) -> list[Key]:
        """The jobs of this frame that a free lane will start as soon as their hold is durable:
        they are journaled "started" in the hold's own commit (``job.started``), and the lane
        writes nothing more for them before the handler runs. Only while no other frame is on
        its way to the batch queue and nothing waits there (so these are the next items any lane
        takes), for a handler without its own ``batch_key`` (one batch group per kind), of the
        frame's first kind, with an inline payload verified on the loop (queued by the runner at
        once, in order), up to :meth:`Lanes.start_at_once` and never past an inline payload too large
        to verify on the loop (it is queued in frame order too, ahead of the jobs behind it); whole batches only when the batch queue
        may hold a partial one back (``max_wait_ms`` > 0). A crash between this commit and the
        handler's start counts their attempt (HELLO ``lost``), as it would a moment later."""
        if self._own_batch_key or self._frames_in_flight:
            return []
        room = self._lanes.start_at_once()
        if room <= 0:
            return []
        on_loop_max = self._claims.verify_on_loop_max_bytes()
        kind = None
        chosen: list[Job] = []
        for job, verdict in new:
            inline = job.task.payload.inline
            if verdict is not None or inline is None:
                continue  # never queued (its failure), or queued later (a stored payload): takes no lane room
            if len(inline) > on_loop_max:
                break  # fetched in the I/O threads but queued in frame order, AHEAD of the jobs behind it
            if kind is None:
                kind = job.task.kind
            elif job.task.kind != kind:
                break  # another batch group: it may wait for a lane
            chosen.append(job)
            if len(chosen) >= room:
                break
        if self._lanes.batches.max_wait_s > 0:  # a partial batch may wait for more: only whole batches go at once
            del chosen[len(chosen) - len(chosen) % self._lanes.max_batch:]
        for job in chosen:
            job.started = True
        return [job.key for job in chosen]

    @staticmethod
    async def _await_hold(hold: asyncio.Future) -> None:
        """Wait for the shared journal write of a DISPATCH without ever cancelling it
        (a cancelled waiter must not cancel the hold)."""
        await asyncio.wait({hold})
        hold.result()

    async def _run_frame(self, jobs: list[tuple[Job, protocol.TaskFailure | None]], hold: asyncio.Future) -> None:
        """The runner of one DISPATCH frame: durable hold, then each job to the batch queue
        (inline payloads verified on the loop, stored ones fetched in the I/O threads, each
        queued as soon as it arrives) or to its failure report. A job released or given back
        meanwhile is left alone (whoever did that reports or forgets it)."""
        try:
            await self._await_hold(hold)
            failed: list[tuple[Job, protocol.TaskFailure]] = []
            stored: list[Job] = []
            ready: list[tuple[Job, bytes]] = []
            on_loop_max = self._claims.verify_on_loop_max_bytes()
            holding, fetching = JobState.HOLDING, JobState.FETCHING
            for job, verdict in jobs:
                if job.released or job.state is not holding:
                    continue
                if verdict is not None:
                    failed.append((job, verdict))
                    continue
                job.state = fetching
                ref = job.task.payload
                if ref.inline is None:
                    stored.append(job)
                    continue
                try:  # inline: the digest checked on the loop, no hop (or in the I/O threads if it must)
                    payload = (self._claims.verify_inline(ref) if len(ref.inline) <= on_loop_max
                               else await self._claims.fetch(ref))
                except Exception as exc:  # noqa: BLE001 - what it means: store_failure's one rule
                    failed.append((job, self._fetch_failure(job, exc)))
                    continue
                ready.append((job, payload))
            if ready:
                self._queue_many(ready, failed)
            if stored:
                await asyncio.gather(*(self._fetch_stored(job) for job in stored))
            if failed:
                await self._fail_many(failed)
        finally:
            self._frames_in_flight -= 1
            self._lanes.poke()  # whether more items can come may have changed

    async def _fetch_stored(self, job: Job) -> None:
        """Fetch one stored payload (I/O threads), then queue it or report its failure."""
        failed: list[tuple[Job, protocol.TaskFailure]] = []
        try:
            payload = await self._claims.fetch(job.task.payload)
        except Exception as exc:  # noqa: BLE001 - what it means: store_failure's one rule
            if job.released or job.state is not JobState.FETCHING:
                return
            failed.append((job, self._fetch_failure(job, exc)))
        else:
            if job.released or job.state is not JobState.FETCHING:
                return
            self._claims.fetched()  # the store produced a blob: healthy at the next heartbeat
            self._queue(job, payload, failed)
        if failed:
            await self._fail_many(failed)

    def _fetch_failure(self, job: Job, exc: Exception) -> protocol.TaskFailure:
        task = job.task
        reason = store_failure(exc, task.payload)
        if reason is protocol.FailReason.PAYLOAD_MISSING:  # inline bytes that do not match: the item's fault
            return failure(job.key, reason, str(exc))
        # absent or corrupt in OUR view of the store, an I/O or backend error: this worker's
        # problem (unhealthy for a pause); requeued without counting the attempt
        self._log.error("payload_fetch_failed", item_id=task.item_id, token=task.token, error=repr(exc))
        self._claims.trouble(str(exc) if isinstance(exc, PayloadMissing) else repr(exc))
        return failure(job.key, reason, f"could not fetch payload from this worker's claim store: {exc!r}"[:1000])

    def _queue(self, job: Job, payload: bytes, failed: list[tuple[Job, protocol.TaskFailure]]) -> None:
        """A fetched, verified job -> its batch key -> the batch queue (or a failure)."""
        self._queue_many([(job, payload)], failed)

    def _queue_many(self, ready: list[tuple[Job, bytes]], failed: list[tuple[Job, protocol.TaskFailure]]) -> None:
        """Fetched, verified jobs -> their batch keys -> the batch queue (in order), or failures.
        A handler without its own ``batch_key`` puts them all under ``(kind, None)``."""
        own_key = self._own_batch_key
        out: list[tuple[Hashable, Job]] = []
        for job, payload in ready:
            task = job.task
            if own_key:
                try:
                    key = (task.kind, self.handler.batch_key(dict(task.params)))
                except PermanentHandlerError as exc:
                    failed.append((job, failure(job.key, protocol.FailReason.FATAL, str(exc))))
                    continue
                except Exception as exc:  # noqa: BLE001 - a handler bug in batch_key fails the item, not the worker
                    failed.append((job, failure(job.key, protocol.FailReason.HANDLER_ERROR, f"batch_key: {exc!r}"[:1000])))
                    continue
            else:
                key = (task.kind, None)
            job.payload = payload
            out.append((key, job))
        if out:
            self._lanes.submit_many(out)

    async def _fail_many(self, failed: list[tuple[Job, protocol.TaskFailure]]) -> None:
        for job, _ in failed:
            job.state = JobState.REPORTING
        await self._reports.report_many(failed)

    def release(self, job: Job) -> None:
        """The broker says this lease is not ours any more."""
        self._log.info("job_released", item_id=job.task.item_id, token=job.task.token, state=job.state.value)
        job.released = True
        if job.state in _NOT_RUNNING:
            if job.state is JobState.QUEUED:
                self._lanes.withdraw(job)
            self._spawn(self._reports.forget_released(job), "forget-released")

    def give_back(self, job: Job, why: str) -> None:
        """Stop a job that has not finished and report it ``released`` (shutdown); the
        outcome of a run in progress is discarded."""
        if job.state is JobState.QUEUED:
            self._lanes.withdraw(job)
        if job.runner is not None:
            job.runner.cancel()
        job.given_back = True
        job.state = JobState.REPORTING
        job.runner = self._spawn(self._reports.report(job, failure(job.key, protocol.FailReason.RELEASED, why)), "give-back")

    async def give_back_all(self, drain_timeout_s: float) -> None:
        """Shutdown: give back the jobs not running; wait ``drain_timeout_s`` for the
        running ones (their reports journaled), then give those back too; wait (5 s) for
        every report."""
        for job in list(self.jobs.values()):
            if job.state in _NOT_RUNNING:
                self.give_back(job, "worker is shutting down")

        def running() -> bool:
            return any(j.state is JobState.RUNNING or (j.state is JobState.REPORTING and not j.given_back)
                       for j in self.jobs.values())

        await self._reports.wait_held(lambda: not running(), drain_timeout_s)
        for job in list(self.jobs.values()):
            if job.state is JobState.RUNNING:
                self.give_back(job, f"not finished within drain_timeout_s={drain_timeout_s}")
        await self._reports.wait_held(lambda: not self.jobs, 5.0)
