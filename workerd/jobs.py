"""What the worker's parts hand each other: a held lease (:class:`Job`), the verdict of
its run (:class:`RunOutcome`), and the one way a failure report is made (:func:`failure`).

A job lives in the intake's table (``DispatchIntake.jobs``, :mod:`ccsq.workerd.dispatch_intake`) from
DISPATCH until its report is journaled (:mod:`ccsq.workerd.reports`); its
``state`` says where it is::

    HOLDING -> FETCHING -> QUEUED -> RUNNING -> REPORTING
    (intake: journal, claim store, batch queue)  (lanes)  (reports)

No task or future per job: the intake runs one task per DISPATCH frame, a lane hands a
whole batch's outputs to ``Reports.finish_outputs`` (one task per batch; a
:class:`RunOutcome` per item only for items skipped or overrun, ``Reports.finish_many``).

The worker names a failure's reason and nothing else: ``retryable`` (kept on the wire
for older brokers) follows from the reason through the one failure policy,
:func:`ccsq.common.wire.policy.task_failure` / ``FAIL_POLICY``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Hashable

from ccsq.common.wire import protocol
from ccsq.common.wire.policy import task_failure
from ccsq.workerd.worker_journal import Key

__all__ = ["Job", "JobState", "Key", "RunOutcome", "failure"]


class JobState(enum.Enum):
    HOLDING = "holding"  # journal write of the lease in progress
    FETCHING = "fetching"  # payload being fetched (prefetch)
    QUEUED = "queued"  # waiting for a slot
    RUNNING = "running"  # handler running in a thread
    REPORTING = "reporting"  # outcome decided, being stored/journaled


@dataclasses.dataclass(eq=False, slots=True)
class Job:
    """A lease this worker holds and has not reported yet."""

    task: protocol.Task
    state: JobState = JobState.HOLDING
    released: bool = False  # the broker took it back: finish quietly, never report
    given_back: bool = False  # reported released at shutdown: a run's outcome is discarded
    runner: asyncio.Task | None = None  # its give-back report, once given back
    clock_offset_s: float = 0.0  # broker wall clock - ours, as seen in the DISPATCH envelope
    payload: bytes | None = None  # fetched and verified (prefetch); dropped once run
    batch_key: Hashable = None  # its group in the batch queue, once queued
    started: bool = False  # journaled "started" with its hold (a lane was free on arrival): no write of its own

    def deadline_passed(self, now_wall_s: float) -> bool:
        """Whether ``deadline_ts`` has passed by the broker's clock (estimated)."""
        return self.task.deadline_ts is not None and now_wall_s + self.clock_offset_s >= self.task.deadline_ts

    @property
    def key(self) -> Key:
        return (self.task.item_id, self.task.token)


@dataclasses.dataclass(slots=True)  # not frozen: a frozen init costs ~2 us, one per item
class RunOutcome:
    """What a lane tells a job about its run: exactly one of the fields is set
    (``data`` may be b""): the result, the error, the overrun limit, or skipped."""

    data: bytes | None = None
    error: BaseException | None = None
    runtime_s: float = 0.0  # wall seconds of the handler call (the whole batch)
    timeout_s: float = 0.0  # > 0: the batch overran this max_runtime_s
    skipped: str = ""  # not run: why (deadline passed)


def failure(key: Key, reason: protocol.FailReason, message: str) -> protocol.TaskFailure:
    """The FAIL entry of lease ``key`` = (item_id, token) for ``reason``; ``retryable``
    comes from the one failure policy (:mod:`ccsq.common.wire.policy`). Every failure the
    worker reports is made here (tests/test_policy.py checks that workerd/ builds no other)."""
    return task_failure(key[0], key[1], reason, message)
