"""The worker's session: leases in, inference under the GPU semaphore, reports out.

One :class:`Worker` owns, on one event loop, the broker link (a
:class:`~ccsq.common.link.peer.BrokerLink`), the journal (whose calls all run on one
dedicated thread, written through one :class:`~ccsq.workerd.worker_journal.GroupCommit`) and
its lifecycle, and wires together the parts that do the work, one module each:

- :mod:`ccsq.workerd.dispatch_intake` (:class:`DispatchIntake`): DISPATCH -> hold in the journal ->
  fetch the payload (claim check, digest verified) -> batch queue; owns the held jobs;
- :mod:`ccsq.workerd.lanes` (:class:`Lanes`): the GPU slots, batches, deadlines,
  timeouts, each item's :class:`~ccsq.workerd.jobs.RunOutcome`;
- :mod:`ccsq.workerd.reports` (:class:`Reports`, :class:`Credit`): outcome -> report
  (the failure reason) -> journal -> COMPLETE / FAIL -> COMPLETE_ACK / FAIL_ACK ->
  forget, the unconfirmed reports, and the credit granted back;
- :mod:`ccsq.workerd.claims` (:class:`Claims`): the claim store (fetch, store a result)
  and the health it decides;
- :mod:`ccsq.workerd.jobs`: the job, its states, and the one way a failure is made.

Life of a task (docs/architecture.md, "The path of one item", hops 4-6)::

    DISPATCH -> journal "held" (fsync) -> fetch payload + verify its SHA-256
      (prefetch: outside the slot, while the GPU runs earlier items)
      -> batch queue -> a lane takes a batch and a slot -> deadline check
      -> journal "started" -> handler.run / run_batch in a thread
      -> store result (inline <= 16 KiB, else claim store) -> journal "finished"
      -> crash point worker.after_result_stored -> COMPLETE -> grant 1 credit
      -> COMPLETE_ACK (any outcome) -> forget (journal row deleted)

Inference runs on a thread pool of ``slots`` threads, never on the loop, so
heartbeats keep flowing while a model runs (case C06); a loop-lag probe proves it
(``loop_lag_max_ms`` in every heartbeat's info: the worst lag since the previous
heartbeat). Every lease held or with a report to send is listed in HELLO (and
heartbeats) until confirmed. A heartbeat says ``healthy = false`` while every slot
is lost to an overrun or while the claim store is failing.

Restart (the journal outlives the process):

- finished / failed rows: the report is re-sent as is; nothing is re-run.
- ``held`` rows (dispatched, never started): given back with
  ``FAIL(reason="released")`` (retryable) so the broker re-leases them at
  once without consuming an attempt.
- ``started`` rows (the process died while the handler ran: a crash, an
  OOM kill, or a poison job that kills its worker; or in the moment before a
  free lane started a lease journaled started with its hold,
  :mod:`ccsq.workerd.dispatch_intake`): NOT listed in HELLO's
  leases and NOT reported, but named in HELLO ``info["lost"]``; the rows
  are deleted once the broker WELCOMEd that HELLO. The broker expires those
  leases at once ("worker reconnected without it"; at the latest when
  ``lease_ttl_s`` runs out), which consumes the attempt, records the
  at-least-once window in its gap register, and dead-letters a poison job
  with reason ``worker_lost`` after ``max_attempts`` (case C07b). Reporting
  ``released`` instead would not consume an attempt (a poison job would
  loop forever), and a ``handler_error`` would hide that the worker died.
- leases the broker holds for this worker that the journal does not know (a
  DISPATCH whose hold was not yet journaled when the process died: a
  prefetched item behind a poison job): neither listed nor lost, so the
  broker releases them without counting an attempt (they never ran here).

Shutdown (SIGTERM): no more credit; jobs not yet running are given back
(``released``); running ones get ``drain_timeout_s`` to finish, then are given
back too; confirmations are awaited briefly; BYE; the caller exits 0.
Unconfirmed reports stay in the journal for the next start.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from ccsq.common.link.peer import BrokerLink, LinkState
from ccsq.common.storage.claimstore import ClaimStore
from ccsq.common.wire import protocol
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.envelope import Envelope, EnvelopeCodec
from ccsq.common.wire.errors import ConfigError
from ccsq.workerd import providers
from ccsq.workerd.claims import INLINE_RESULT_MAX_BYTES, Claims  # noqa: F401 (INLINE_RESULT_MAX_BYTES: named here by docs)
from ccsq.workerd.handlers import Handler
from ccsq.workerd.dispatch_intake import DispatchIntake
from ccsq.workerd.jobs import Job, Key
from ccsq.workerd.worker_journal import EntryState, GroupCommit, Journal
from ccsq.workerd.lanes import Lanes
from ccsq.workerd.reports import Credit, Reports
from ccsq.workerd.slots import SlotGate

log = structlog.get_logger("ccsq.workerd")

T = TypeVar("T")

LAG_PROBE_INTERVAL_S = 0.02  # the loop-lag probe wakes this often
LAG_WARN_MS = 250.0  # log loop_lag when one wake-up is later than this
ACK_WAIT_ON_STOP_S = 2.0  # at shutdown, wait this long for outstanding confirmations
GPU_MEM_POLL_S = 10.0  # how often GPU free memory is sampled (GPU providers only)
JOURNAL_WINDOW_S = 0.0  # journal group commit: no timer (one loop tick; writes queued during a commit share the next)


class Worker:
    """The worker daemon's session: its parts, the broker link's callbacks, start and
    stop (see module doc).

    ``run()`` serves until :meth:`request_stop`, then drains. After it
    returns, ``fatal`` holds the exception of a bug that stopped it (exit 1),
    and ``stuck_threads`` the inference threads still running.
    """

    # --- collaborators ---
    cfg: WorkerConfig
    handler: Handler
    journal: Journal
    journal_writer: GroupCommit  # every journal write goes through it (group commit)
    link: BrokerLink
    kinds: list[str]
    # --- the parts ---
    jobs: dict[Key, Job]  # held leases, not reported yet: DispatchIntake adds them, Reports removes them
    claims: Claims
    lanes: Lanes
    credit: Credit
    reports: Reports
    intake: DispatchIntake
    capacity: int  # slots x max_batch + prefetch: the credit outstanding when idle
    # --- lifecycle ---
    _runners: set[asyncio.Task]
    _draining: bool
    _stop: asyncio.Event
    fatal: BaseException | None
    # --- health ---
    loop_lag_max_ms: float  # worst loop lag since start
    _lag_window_ms: float  # worst loop lag since the previous heartbeat
    gpu_mem_free_bytes: int | None

    def __init__(self, cfg: WorkerConfig, handler: Handler, store: ClaimStore, journal: Journal, *,
                 codec: EnvelopeCodec | None = None) -> None:
        """``codec`` defaults to one built from ``cfg``'s keys (ConfigError if they are bad)."""
        self.cfg = cfg
        self.handler = handler
        self.journal = journal
        self.kinds = list(cfg.kinds) or [handler.name]
        self.log = log.bind(worker=cfg.peer_id)
        self.link = BrokerLink(
            cfg,
            hello=self._hello,
            heartbeat=self._heartbeat,
            on_message=self._on_message,
            on_connect=self._on_connect,
            on_disconnect=self._on_disconnect,
            codec=codec,
        )
        self._runners = set()
        self._draining = False
        self._stop = asyncio.Event()
        self.fatal = None
        self.loop_lag_max_ms = 0.0
        self._lag_window_ms = 0.0
        self.gpu_mem_free_bytes = None
        self._io_pool = ThreadPoolExecutor(4, thread_name_prefix="ccsq-io")
        self._journal_pool = ThreadPoolExecutor(1, thread_name_prefix="ccsq-journal")
        self.journal_writer = GroupCommit(journal, self._journal_pool, JOURNAL_WINDOW_S)
        self._host = socket.gethostname()
        self.claims = Claims(store, self._io_pool, on_unhealthy=lambda: self.link.send(self._heartbeat()), log=self.log)
        self.lanes = Lanes(cfg, handler, self.journal_writer, self.log, more_coming=self._more_coming,
                           on_capacity_change=lambda: self.credit.changed(),
                           on_outcomes=lambda pairs: self._spawn(self.reports.finish_many(pairs), "finish"),
                           on_outputs=lambda jobs, outs, rt: self._spawn(self.reports.finish_outputs(jobs, outs, rt),
                                                                         "finish"))
        self.capacity = cfg.slots * self.lanes.max_batch + cfg.prefetch
        self.jobs = {}
        self.credit = Credit(self.link, available=lambda: self._capacity() - len(self.jobs),
                             draining=lambda: self._draining, log=self.log)
        self.reports = Reports(cfg, handler, self.claims, self.link, self.journal_writer, self.jobs, self.credit,
                               poke=self.lanes.poke, spawn=self._spawn, log=self.log)
        self.intake = DispatchIntake(cfg, self.kinds, handler, self.claims, self.journal_writer, self.jobs, self.lanes,
                             self.reports, draining=lambda: self._draining, spawn=self._spawn, log=self.log)

    # the claim store (the metrics wrapper replaces it) and the slots, as main and metrics see them
    @property
    def store(self) -> ClaimStore:
        return self.claims.store

    @store.setter
    def store(self, store: ClaimStore) -> None:
        self.claims.store = store

    @property
    def gate(self) -> SlotGate:
        return self.lanes.gate

    # --- lifecycle ---------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin a graceful stop (SIGTERM): drain, BYE, return from run()."""
        self._stop.set()

    @property
    def stuck_threads(self) -> int:
        return self.lanes.stuck_threads

    async def run(self, on_ready: Callable[[], object] | None = None) -> None:
        """Recover from the journal, call ``on_ready`` (systemd READY=1), serve the
        broker until :meth:`request_stop`, drain. Raises JournalCorrupt from recovery."""
        self.reports.loop = self.credit.loop = asyncio.get_running_loop()
        await self.recover()
        if on_ready is not None:
            on_ready()
        for n in range(self.cfg.slots):
            self._spawn(self.lanes.lane(), f"lane-{n}")
        link_task = asyncio.create_task(self.link.run(), name="broker-link")
        aux = [
            asyncio.create_task(self._lag_probe(), name="loop-lag-probe"),
            asyncio.create_task(self.reports.resend_loop(), name="report-resend"),
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

                self.fatal = Unauthorized(refusal_fix(self.cfg, protocol.Role.WORKER.value, self.link.refused))
            elif link_task in done and self.link.replaced:
                from ccsq.common.link.peer import id_in_use_message

                self.fatal = ConfigError(id_in_use_message(self.cfg, self.link))
            elif self.fatal is None:
                await self._drain()
        finally:
            stop_wait.cancel()
            await self._stop_link(link_task)
            for t in aux + list(self._runners):
                t.cancel()
            await asyncio.gather(*aux, *self._runners, return_exceptions=True)
            await self.journal_writer.drain()  # queued journal writes (forgets of confirmed reports) still land
            self.lanes.shutdown()
            self._io_pool.shutdown(wait=False, cancel_futures=True)  # a hung store must not block exit
            self._journal_pool.shutdown(wait=True)
            self.log.info(
                "worker_stopped", done=self.reports.done, failed=self.reports.failed,
                unconfirmed=len(self.reports.unconfirmed), loop_lag_max_ms=round(self.loop_lag_max_ms, 2),
                journal_commits=self.journal_writer.commits, journal_writes=self.journal_writer.ops,
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
        """Turn the journal's rows into unconfirmed reports (see module doc: Restart)."""
        entries = await self._j(self.journal.entries)
        await self.reports.recover(entries)
        if entries:
            counts = {s.value: 0 for s in EntryState}
            for e in entries:
                counts[e.state.value] += 1
            self.log.info("journal_recovered", **counts)

    async def _drain(self) -> None:
        self._draining = True
        self.log.info("worker_draining", held=len(self.jobs), unconfirmed=len(self.reports.unconfirmed),
                      drain_timeout_s=self.cfg.drain_timeout_s)
        await self.intake.give_back_all(self.cfg.drain_timeout_s)
        if self.reports.unconfirmed and self.link.state is LinkState.READY:
            try:
                await asyncio.wait_for(self.reports.all_confirmed.wait(), timeout=ACK_WAIT_ON_STOP_S)
            except asyncio.TimeoutError:
                self.log.warning("unconfirmed_at_stop", count=len(self.reports.unconfirmed))

    # --- BrokerLink callbacks ----------------------------------------------------
    def _hello(self) -> protocol.Hello:
        credit = self.credit.hello()
        return protocol.Hello(
            role=protocol.Role.WORKER.value,
            slots=self.cfg.slots,
            credit=credit,
            kinds=list(self.kinds),
            leases=self._lease_refs(),
            info=self._info(),
        )

    def _info(self) -> dict[str, protocol.Scalar]:
        info: dict[str, protocol.Scalar] = {
            "provider": self.handler.provider,
            "cpu_fallback": self.handler.cpu_fallback,
            "requested_provider": self.cfg.provider,
            "handler": self.handler.name,
            "handler_version": self.handler.version,
            "host": self._host,
            "prefetch": self.cfg.prefetch,
            "max_batch": self.lanes.max_batch,
            # the jobs that died running (only their attempts count; other unlisted leases never ran)
            protocol.LOST_INFO: protocol.lost_info(self.reports.lost),
        }
        if self.handler.cpu_fallback:
            info["fallback_reason"] = self.handler.provider_reason[:300]
        return info

    def _heartbeat(self) -> protocol.Heartbeat:
        lag, self._lag_window_ms = self._lag_window_ms, 0.0
        lanes = self.lanes
        info: dict[str, protocol.Scalar] = {
            "loop_lag_max_ms": round(lag, 2),
            "lost_slots": lanes.gate.lost,
            "unconfirmed": len(self.reports.unconfirmed),
            "draining": self._draining,
            "batches": lanes.batches_run,
            "batch_items": lanes.batch_items,
            "batch_size_max": lanes.batch_size_max,
        }
        if self.gpu_mem_free_bytes is not None:
            info["gpu_mem_free_bytes"] = self.gpu_mem_free_bytes
        info.update(self.handler.health())
        store_info = self.claims.info()
        info.update(store_info)
        return protocol.Heartbeat(
            leases=self._lease_refs(),
            busy=lanes.gate.busy,
            done=self.reports.done,
            healthy=lanes.gate.lost < lanes.gate.slots and bool(store_info["store_ok"]),
            info=info,
        )

    def _on_connect(self, welcome: protocol.Welcome) -> None:
        for ref in welcome.released:
            job = self.jobs.get((ref.item_id, ref.token))
            if job is not None:
                self.intake.release(job)
        self.log.info("session_started", resumed=len(welcome.resumed), released=len(welcome.released),
                      unconfirmed=len(self.reports.unconfirmed), credit=self.credit.granted)
        self.reports.session_started()
        if self.reports.lost:
            self._spawn(self.reports.forget_lost(), "forget-lost")
        self.credit.changed()

    def _on_disconnect(self, reason: str) -> None:
        self.credit.session_lost()
        self.reports.session_lost()
        level = self.log.info if self._draining else self.log.warning
        level("session_lost", reason=reason, held=len(self.jobs), unconfirmed=len(self.reports.unconfirmed))

    def _on_message(self, env: Envelope) -> None:
        msg = env.message
        if isinstance(msg, protocol.Dispatch):
            self.credit.dispatched(len(msg.tasks))
            self.intake.on_dispatch(msg.tasks, env.ts_ms / 1000.0 - time.time())
        elif isinstance(msg, protocol.CompleteAck):
            self.reports.on_acks(msg.outcomes, protocol.TaskResult)
        elif isinstance(msg, protocol.FailAck):
            self.reports.on_acks(msg.outcomes, protocol.TaskFailure)
        elif isinstance(msg, protocol.Error):
            self.log.warning("broker_error", code=msg.code, message=msg.message, ref_seq=msg.ref_seq)
        elif isinstance(msg, protocol.Bye):
            self.log.info("broker_bye", reason=msg.reason)
        else:
            self.log.warning("unexpected_message", type=msg.TYPE.name)

    # --- credit and the batch queue's question ----------------------------------------
    def _capacity(self) -> int:
        return max(0, self.capacity - self.lanes.gate.lost * self.lanes.max_batch)

    def _more_coming(self) -> bool:
        """Can another item reach the batch queue soon (credit at the broker, or a fetch)?"""
        return self.credit.granted > 0 or self.intake.fetching()

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

    def _lease_refs(self) -> list[protocol.LeaseRef]:
        """Leases we hold: jobs not released by the broker, then unconfirmed reports."""
        keys = [k for k, job in self.jobs.items() if not job.released]
        keys += [k for k in self.reports.unconfirmed if k not in self.jobs]
        return [protocol.LeaseRef(item_id, token) for item_id, token in keys]

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
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
