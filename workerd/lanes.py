"""Lanes: batches of fetched items through the GPU slots, each ending in a :class:`RunOutcome`.

There are ``slots`` lanes. Each takes the next batch from the batch queue
(:mod:`ccsq.workerd.batching`: up to ``max_batch`` ready items of one ``(kind,
handler.batch_key(params))``), holds ONE slot of the semaphore
(:mod:`ccsq.workerd.slots`) for it, journals the items "started" (one transaction; none for
items the intake journaled started with their hold, :meth:`Lanes.start_at_once`),
and calls ``handler.run`` (one item) or ``handler.run_batch`` (several) in an
inference thread, never on the loop, so heartbeats keep flowing while a model runs
(case C06). ``max_batch`` = the config's, else the handler's (default 1);
``max_wait_ms`` likewise. The outputs of a handler call go, in one list, to
``on_outputs`` (the worker hands them to ``Reports.finish_outputs``, one task per batch,
:mod:`ccsq.workerd.reports`); items skipped or overrun get a :class:`RunOutcome` each,
through ``on_outcomes`` (``Reports.finish_many``): no future or task per item.

Deadline: an item whose ``deadline_ts`` has passed when its batch is about to start is
not run (outcome ``skipped``, logged ``deadline_skipped``): it is given back
``released`` (no attempt consumed), and the broker, which owns the ``expired``
state, moves it to ``expired`` when it next tries to lease it (``deadline passed
while ready``, a G6 event), exactly as for an item whose deadline passes while
queued at the broker. The check uses the broker's clock as seen in the DISPATCH
envelope's timestamp (transit time only makes that estimate earlier), so a worker
whose clock runs ahead never gives back an item the broker still considers alive.
Reporting ``cancelled`` or ``timeout`` instead would count a failed attempt and
could dead-letter the item rather than expire it.

Timeouts: a batch runs under the strictest ``max_runtime_s`` of its items (the task's,
else the config's; 0 = none), times the batch size when the handler has no batched
path and runs the items in turn. On overrun every item of the batch gets a ``timeout``
outcome at once, while the slot stays counted as *lost* (``SlotGate.lost``, less credit
meanwhile) until the thread returns; its result is then discarded.

A poison job in a batch kills its batch mates' attempts too (they were started with it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.errors import HandlerError
from ccsq.workerd.batching import BatchQueue
from ccsq.workerd.handlers import Handler
from ccsq.workerd.jobs import Job, JobState, RunOutcome
from ccsq.workerd.worker_journal import GroupCommit
from ccsq.workerd.slots import SlotGate


def _timed_batch(handler: Handler, items: list[tuple[bytes, dict]]) -> tuple[list[Any], float]:
    """Run one item with ``handler.run`` or several with ``handler.run_batch`` in an
    inference thread; returns (one output or exception per item, wall seconds).
    An exception from ``run`` / ``run_batch`` itself applies to every item."""
    t0 = time.perf_counter()
    try:
        out: list[Any] = [handler.run(*items[0])] if len(items) == 1 else list(handler.run_batch(items))
    except Exception as exc:  # noqa: BLE001 - typed per item by Reports.finish
        out = [exc] * len(items)
    return out, time.perf_counter() - t0


class Lanes:
    """The slots, the batch queue and the inference threads (see module doc).

    ``more_coming()`` tells the batch queue whether another item can arrive soon;
    ``on_capacity_change()`` is called when a lost slot comes back (credit);
    ``on_outcomes(pairs)`` gets ``(job, RunOutcome)`` for items not run or overrun, and
    ``on_outputs(jobs, outputs, runtime_s)`` a handler call's outputs (``bytes`` or an
    exception per job, in order): each job's outcome goes to one of them, once.
    """

    gate: SlotGate
    max_batch: int  # items per handler call (config, else the handler's)
    batches: BatchQueue  # fetched, verified items waiting for a lane
    # --- health ---
    batches_run: int  # handler calls made
    batch_items: int  # items in those calls
    batch_size_max: int  # the largest batch run
    observe_batch: Callable[[int, float], None] | None = None  # metrics hook (workerd/worker_metrics.py): once per handler call

    def __init__(self, cfg: WorkerConfig, handler: Handler, jw: GroupCommit, log: Any, *,
                 more_coming: Callable[[], bool], on_capacity_change: Callable[[], None],
                 on_outcomes: Callable[[list[tuple[Job, RunOutcome]]], object],
                 on_outputs: Callable[[list[Job], list[Any], float], object]) -> None:
        self.cfg = cfg
        self.handler = handler
        self.gate = SlotGate(cfg.slots)
        self.max_batch = max(1, cfg.max_batch or int(handler.max_batch))
        max_wait_ms = cfg.max_wait_ms if cfg.max_wait_ms >= 0 else float(handler.max_wait_ms)
        self.batches = BatchQueue(self.max_batch, max_wait_ms / 1000.0, more_coming)
        self.batches_run = 0
        self.batch_items = 0
        self.batch_size_max = 0
        self._jw = jw
        self._log = log
        self._on_capacity_change = on_capacity_change
        self._on_outcomes = on_outcomes
        self._on_outputs = on_outputs
        self._infer_pool = ThreadPoolExecutor(cfg.slots, thread_name_prefix="ccsq-infer")
        self._infer_futures: set[asyncio.Future] = set()
        self._idle = 0  # lanes waiting in batches.take() (they hold no batch and no slot)

    @property
    def stuck_threads(self) -> int:
        """Inference threads still running (after a timeout, or at exit)."""
        return sum(1 for f in self._infer_futures if not f.done())

    def shutdown(self) -> None:
        """Stop taking handler calls; a running (hung) thread is left behind."""
        self._infer_pool.shutdown(wait=False, cancel_futures=True)

    # --- the batch queue --------------------------------------------------------------
    def submit_many(self, keyed: list[tuple[Hashable, Job]]) -> None:
        """Queue fetched jobs under their batch keys, in order (one clock read, one wake-up);
        their RunOutcomes go to ``on_outcomes``."""
        queued = JobState.QUEUED
        for key, job in keyed:
            job.state = queued
            job.batch_key = key
        self.batches.put_many(keyed)

    def withdraw(self, job: Job) -> None:
        """Take a job that is still waiting out of the queue (released, given back)."""
        self.batches.discard(job.batch_key, job)

    def poke(self) -> None:
        """Whether more items can come may have changed: look at waiting batches again."""
        self.batches.poke()

    def start_at_once(self) -> int:
        """How many items queued now would start at once, without waiting for a slot: the idle
        lanes (with a free permit) times ``max_batch`` while nothing waits in the batch queue, else 0.
        The intake journals that many of a DISPATCH's items "started" with their hold (one fsync
        less on their way); items of one batch group only (:meth:`DispatchIntake.on_dispatch`)."""
        if self._idle <= 0 or len(self.batches) > 0:
            return 0
        return min(self._idle, self.gate.free) * self.max_batch

    # --- lanes: one per slot, one batch at a time under one permit ----------------------
    async def lane(self) -> None:
        while True:
            self._idle += 1
            try:
                _, taken = await self.batches.take()
            finally:
                self._idle -= 1
            jobs = [j for j in taken if not j.released and j.state is JobState.QUEUED]
            if not jobs:
                continue
            for job in jobs:
                job.state = JobState.RUNNING
            async with self.gate.slot():
                await self._run_batch(jobs)

    async def _run_batch(self, jobs: list[Job]) -> None:
        """Run one batch in an inference thread (the caller holds the slot)."""
        now_wall_s = time.time()
        run: list[Job] = []
        skipped: list[tuple[Job, RunOutcome]] = []
        for job in jobs:
            if job.deadline_passed(now_wall_s):
                self._log.info("deadline_skipped", item_id=job.task.item_id, token=job.task.token,
                               deadline_ts=job.task.deadline_ts)
                job.state = JobState.REPORTING
                job.payload = None
                skipped.append((job, RunOutcome(skipped=f"deadline_ts {job.task.deadline_ts} passed before the job started")))
            else:
                run.append(job)
        if skipped:
            self._on_outcomes(skipped)
        if not run:
            return
        fresh = [j.key for j in run if not j.started]  # the rest were journaled started with their hold
        if fresh:
            await self._jw.started(fresh)
        self._log_start(run)
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
        reporting = JobState.REPORTING
        for job in run:
            job.state = reporting
            job.payload = None
        self._on_outputs(run, outputs, runtime_s)

    def _log_start(self, run: list[Job]) -> None:
        if self.cfg.log_each_job:
            for job in run:
                t = job.task
                self._log.info("job_started", item_id=t.item_id, token=t.token, attempt=t.attempt, kind=t.kind)
        self.batches_run += 1
        self.batch_items += len(run)
        self.batch_size_max = max(self.batch_size_max, len(run))
        if not self.cfg.log_each_job:  # one line for the batch: [item_id, token, attempt] each
            self._log.info("batch_started", size=len(run), kind=run[0].task.kind, max_batch=self.max_batch,
                           items=[(j.task.item_id, j.task.token, j.task.attempt) for j in run])
        elif self.max_batch > 1:
            self._log.info("batch_started", size=len(run), kind=run[0].task.kind, max_batch=self.max_batch)

    def _batch_limit_s(self, run: list[Job]) -> float:
        """The strictest max_runtime_s of the batch (0 = none), times the batch size
        when the handler runs batch items one after another (no batched path)."""
        limits = [lim for j in run if (lim := j.task.max_runtime_s or self.cfg.max_runtime_s) > 0]
        if not limits:
            return 0.0
        looped = len(run) > 1 and type(self.handler).run_batch is Handler.run_batch
        return min(limits) * (len(run) if looped else 1)

    async def _on_timeout(self, run: list[Job], fut: asyncio.Future, limit_s: float) -> None:
        """Give the batch its ``timeout`` outcome now; keep the slot (counted lost) until the thread returns."""
        self.gate.lost += 1
        try:
            pairs: list[tuple[Job, RunOutcome]] = []
            for job in run:
                job.state = JobState.REPORTING
                job.payload = None
                self._log.warning("job_timed_out", item_id=job.task.item_id, token=job.task.token, max_runtime_s=limit_s)
                pairs.append((job, RunOutcome(timeout_s=limit_s)))
            self._on_outcomes(pairs)
            await asyncio.wait({fut})
            outcome = "error" if fut.exception() is not None else "result"
            for job in run:
                self._log.info("timed_out_job_returned", item_id=job.task.item_id, token=job.task.token, discarded=outcome)
        finally:
            self.gate.lost -= 1
            self._on_capacity_change()
