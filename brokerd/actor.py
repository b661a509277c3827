"""The broker actor: the one asyncio task that owns the ledger and the peer table.

One *turn* of the loop (:meth:`Broker.turn`):

1. drain every readable frame from the ROUTER (up to a budget) and verify it
   (:meth:`Broker._decode`);
2. apply session messages (HELLO, HEARTBEAT, CREDIT, BYE) to the peer table at once
   (``brokerd/sessions.py``);
3. apply ledger messages (SUBMIT, COMPLETE, FAIL, ACK, STATUS, CANCEL, ADMIN) plus the
   background slices (deferred releases, due lease expiries, deadline and purge
   scans, dispatch, result delivery) in ONE write transaction with ONE fsync
   (:meth:`Broker._transact` -> :meth:`Broker._apply_ops`);
4. after the commit: crash points, in-memory effects (lease timers, deliveries in
   flight, credit, wake-ups, log lines), then the replies (``brokerd/outbound.py``).

Step 3 reads the actor's in-memory state and leaves it as it found it: in-memory
effects, replies and log lines are collected in a :class:`Batch` and applied only
after commit, so a full map (``lmdb.MapFullError``) can abort and retry the whole
step after growing the map, or with SUBMITs refused (QUEUE_FULL) at the maximum
size. Nothing is half-applied and nothing is confirmed before it is durable. What
step 3 does change at once are hints that hold whether or not it commits: the
federation route of a relayed item's result and "delivery possible" with it (the
delivery checks the ledger state), the ledger measurements of ``_ledger_stats``
(pages in use, reader report), and the worker kinds written for the next start
(``_kinds_unsaved``: lost with an aborted turn, harmless).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import msgpack
import structlog

from ccsq.brokerd.transport import FrameTransport
from ccsq.brokerd.clock import SYSTEM_CLOCK, Clock
from ccsq.common.wire import federation as fed
from ccsq.brokerd.admin import MAX_ITEMS_PER_COMMAND, AdminCommands, BrokerView
from ccsq.brokerd.delivery import DeliveryTracker
from ccsq.brokerd.frame_intake import FrameIntake
from ccsq.brokerd.dispatch import Dispatcher
from ccsq.brokerd.ledger import Ledger, LedgerTxn, ReadersFull, disk_free_bytes, reader_report
from ccsq.brokerd.ledger import maintenance
from ccsq.brokerd.ledger.schema import trusted_outcome
from ccsq.brokerd.metrics import BrokerStats, build_snapshot
from ccsq.brokerd.outbound import UNSENT_RETRY_S, Outbound, dispatch_refusals, status_size
from ccsq.brokerd.peers import LeaseTimers, PeerTable, Session
from ccsq.brokerd.primary import CHECK_INTERVAL_S, READ_COMMANDS, HaPrimary
from ccsq.brokerd.relaying import Federation, Relaying, relay_sessions
from ccsq.brokerd.sessions import Sessions
from ccsq.common.wire import protocol
from ccsq.common.wire.frames import split_frames
from ccsq.common.wire.config import BrokerConfig
from ccsq.common.wire.envelope import Envelope
from ccsq.common.wire.errors import ConfigError
from ccsq.common.runtime.faults import crash_point

log = structlog.get_logger("ccsq.brokerd")

# A turn's work is bounded so that a frame arriving during it (a heartbeat) never
# waits long, however much is queued: measured on 2 shared cores, a turn of the
# budgets below takes ~10-20 ms (docs/benchmarks.md, benchmark 2).
MAX_FRAMES_PER_TURN = 256  # ~60 us of signature check each
MAX_BYTES_PER_TURN = 512 * 1024  # decoding (signature over the body, msgpack) costs per byte too
#: Item operations (submitted items, results, failures, acks) one turn's transaction
#: applies (~25 us each). A frame is never split; frames beyond the budget are
#: carried, in order, to the next turn.
TURN_ITEM_BUDGET = 256
CARRY_MAX_ITEMS = 4 * TURN_ITEM_BUDGET  # above this many carried, read only a trickle (ZeroMQ queues the rest)
TRICKLE_FRAMES, TRICKLE_BYTES = 16, 16 * 1024  # ... enough for heartbeats and HELLOs, less than a turn applies
COMMIT_DELAY_S = 0.001  # after a turn that committed peer frames, gather this long before the next turn
BACKGROUND_INTERVAL_S = 1.0  # deadline and purge scans
BACKGROUND_BUSY_INTERVAL_S = 0.02  # ... while they still have a backlog
SLICE_ENTRIES = 500  # index entries per deadline/purge slice
#: A turn the full map cut down to "minimal" or "acks" (or nothing) then purges up to
#: this many entries, one per delete-only transaction (``Broker._purge_while_full``,
#: docs/ledger.md).
FULL_PURGE_ENTRIES = 16
DISK_CHECK_INTERVAL_S = 1.0
MAX_SERVED_LISTED = 100  # kinds named as served next to an unserved-kind warning (SUBMIT_ACK ``served``)
SOFT_FULL_FRACTION = 0.9  # at the max map size, refuse SUBMIT above this share in use
GROW_AT_FRACTION = 0.75  # grow the map before a turn when this share is in use
#: Admission control (C08): room kept in the ledger for the result of every accepted
#: item not yet completed (ready or leased): the worker's inline result limit
#: (``workerd.worker.INLINE_RESULT_MAX_BYTES``, 16 KiB; larger results go to the claim
#: store) plus 8 KiB for LMDB overflow-page rounding and the record and index rewrites
#: of COMPLETE and ACK. A SUBMIT item is refused with QUEUE_FULL when the bytes in use
#: + the items admitted since they were measured + (ready + leased + 1) x this reserve
#: + the item's own size exceed SOFT_FULL_FRACTION x max_map_size_bytes. The broker
#: config's ``result_reserve_bytes`` sets it (default below).
RESULT_RESERVE_BYTES = 16384 + 8192
ITEM_RECORD_BYTES = 1024  # an item's record, index and key entries besides its inline payload
LEDGER_FULL_ADVICE = ("the ledger is full at max_map_size_bytes: raise max_map_size_bytes in the broker's config "
                      "and restart ccsq-brokerd (completions and acks that do not fit are retried by their peers)")
#: The pages in use (for QUEUE_FULL and map growth) are measured in a turn's own
#: transaction at most this often; the hot path opens no read transaction of its own.
LEDGER_STATS_INTERVAL_S = 0.1
READER_WARN_REPEAT_MIN_S = 5.0  # a reader past reader_warn_age_s is logged again at most this often
#: Records of items not yet done the ledger keeps in memory between turns (``Ledger.cache_records``:
#: a LEASE, COMPLETE or ACK then reads its record without unpacking it, a LEASE or a RESULT
#: its payload or result when at most 2 KiB): ~1.5 KiB each and the blobs, at most ~6 KiB.
RECORD_CACHE_ITEMS = 8192


@dataclasses.dataclass
class Batch:
    """What one transaction does once it has committed, in this order: crash points
    (named, for the tests), in-memory effects and log lines, replies. Nothing in it
    happens if the transaction aborts."""

    replies: list[tuple[bytes, protocol.Message]] = dataclasses.field(default_factory=list)
    # called with no arguments; `...`: mypy cannot infer lambdas that bind values as defaults against `[]`
    effects: list[Callable[..., object]] = dataclasses.field(default_factory=list)
    crash_points: list[str] = dataclasses.field(default_factory=list)
    reads: set[int] = dataclasses.field(default_factory=set)  # id() of replies that only read (a primary sends them unheld)

    def crash(self, name: str) -> None:
        if name not in self.crash_points:
            self.crash_points.append(name)

    def log(self, level: str, event: str, **fields: object) -> None:
        """Log ``event`` once the transaction has committed: a map-full retry redoes the
        whole step, and an aborted one did nothing worth a line."""
        self.effects.append(lambda: getattr(log, level)(event, **fields))


#: Kinds whose worker said HELLO within this long before a broker start count as served
#: at once after it (meta ``w:<kind>``), instead of waiting two liveness windows.
KINDS_SERVED_MEMORY_S = 86400.0


_ACCEPTED, _DUPLICATE = protocol.Outcome.ACCEPTED.value, protocol.Outcome.DUPLICATE.value


def wall_ms() -> int:
    """Wall ms on the system clock (for callers outside the actor; the actor reads its own clock)."""
    return SYSTEM_CLOCK.wall_ms()


class Broker:
    """The broker actor. Build it with an open :class:`Ledger` and a bound
    :class:`~ccsq.brokerd.transport.Transport` (or any :class:`~ccsq.brokerd.transport.FrameTransport`);
    ``await run()`` until :meth:`stop`, or call :meth:`turn` with frames (the simulation).
    ``clock``: every time the actor and its modules read (:mod:`ccsq.brokerd.clock`)."""

    # --- configuration ---
    cfg: BrokerConfig
    hb_s: float  # heartbeat interval (seconds)
    silence_s: float  # heartbeat_interval_s x liveness
    lease_ttl_s: float
    # --- owned state ---
    ledger: Ledger
    transport: FrameTransport
    clock: Clock
    peers: PeerTable
    leases: LeaseTimers
    epoch: int
    relaying: Relaying  # what relays bring in (origins, proofs, F1-F4), what they are told
    intake: FrameIntake  # verifies every frame; counts, logs and answers refusals
    dispatcher: Dispatcher  # ready items to lease holders with credit
    delivery: DeliveryTracker  # results sent and not yet acknowledged, redeliveries owed
    sessions: Sessions  # HELLO, HEARTBEAT, CREDIT, BYE, liveness
    outbound: Outbound  # every frame the actor sends
    deferred: list[tuple[str, str, int, str]]  # (op, item_id, token, why) for the next transaction
    rejects: collections.Counter  # refusal code -> frames and relayed items refused since start (the intake's)

    def __init__(self, cfg: BrokerConfig, ledger: Ledger, transport: FrameTransport, clock: Clock = SYSTEM_CLOCK,
                 ha: HaPrimary | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.hb_s = cfg.heartbeat_interval_s
        self.silence_s = cfg.heartbeat_interval_s * cfg.liveness
        self.lease_ttl_s = cfg.lease_ttl_s
        self.ledger = ledger
        ledger.cache_records(RECORD_CACHE_ITEMS)  # the actor is the ledger's one writer
        self.transport = transport
        self.codec = transport.codec
        self.peers = PeerTable()
        self.leases = LeaseTimers(cfg.lease_ttl_s)
        self.deferred = []
        self._carry: list[tuple[int, bytes, Session, Envelope]] = []  # (items, op): beyond the last turn's budget
        self._carry_items = 0
        self.snapshot: dict = {}  # read by the metrics thread (brokerd/metrics.py)
        self.stats = BrokerStats()  # live instruments (histograms, counters), thread-safe
        self._kinds_seen: dict[str, bool] = {}  # kinds a worker connected since start serves ("": any)
        self._kinds_unsaved: set[str] = set()  # kinds of HELLOs not yet noted in the ledger (meta w:<kind>)
        self._kinds_recorded = False  # the ledger named kinds served recently: no grace after start needed
        #: peer id -> (session, HELLO ts_ms) of HELLOs that opened a session, for the ledger (meta
        #: p:<peer>): written by the next transaction that commits, in every mode, before (or with)
        #: any lease effect of those HELLOs; kept until one commits
        self._hellos_unsaved: dict[str, tuple[int, int]] = {}
        self._stopping = False
        self._started_mono = self.clock.monotonic_s()
        self._last_turn_mono = self._started_mono
        now = self.clock.monotonic_s()
        self._next_background_mono = now
        self._committed_ops = 0  # peer ledger messages the last turn committed (commit delay)
        self._disk_checked_mono = 0.0
        self._disk_full = False
        self._used_bytes = ledger.used_bytes()  # pages in use, refreshed by _ledger_stats in a turn's txn
        self._admitted_bytes = 0  # admission cost of items committed since _used_bytes was measured
        self.ledger_full_since_ms = 0  # wall ms when a turn last found the ledger full at max size (0: not full)
        self._ledger_stats_due_mono = 0.0
        self.readers_doc: dict = {}  # reader_report() of the last background turn (status, metrics)
        self._reader_warn_next_mono = 0.0
        #: a replicated primary (brokerd/primary.py, docs/ha.md): its election epoch, the confirm
        #: gate, the failover hook; None: a single broker (its epoch is bumped per start, as always)
        self.ha = ha
        self.gate = ha.gate if ha is not None else None
        self.epoch = ledger.bump_epoch() if ha is None else ha.epoch
        self._failover: _Failover | None = None  # a planned failover in progress
        self.fed = Federation.from_config(cfg, ledger.ledger_id)  # relays (docs/federation.md)
        self.outbound = Outbound(transport, self.peers, cfg.max_frame_bytes, end_session=self._end_session,
                                 defer=self._defer, unblocked=self._unblocked)
        self.intake = FrameIntake(self.codec, self.peers, self.outbound, self._end_session, clock=clock)
        self.rejects = self.intake.rejects  # (the same counters: the metrics and admin read them here)
        self._rejects_unsaved = self.intake.unsaved  # written to the ledger and cleared by _transact
        self.dispatcher = Dispatcher(cfg, self.peers, self.leases, self.fed, self.outbound.reply_budget, clock=clock)
        self.delivery = DeliveryTracker(self.epoch, self.fed, cfg.max_batch_items, self.outbound.reply_budget)
        self.relaying = Relaying(self.fed, self.peers, self.codec.authorized, ledger, self.delivery, self.rejects, clock=clock)
        self.sessions = Sessions(cfg, self.epoch, self.peers, self.leases, self.delivery, self.outbound, self.stats,
                                 defer=self._defer, wake_dispatch=self._wake_dispatch, worker_kinds=self._worker_hello,
                                 count_reject=self.intake.count_reject, heartbeat_info=self.relaying.heartbeat_info,
                                 clock=clock, hello_opened=self._hello_opened)
        self.admin = AdminCommands(self._admin_view())
        self._recover()
        if self.fed.enabled:
            with self.ledger.read() as view:
                log.info("federation_recovered", swarm=self.fed.swarm_id, routed=self.delivery.recover_routes(view))

    # --- lifecycle ---
    def _recover(self) -> None:
        """Restart recovery: every leased item gets expiry now + lease_ttl_s, so its
        worker can come back and resume it."""
        expires = self.leases.expiry(self.clock.monotonic_s())
        with self.ledger.read() as view:
            for item_id, token, worker in view.leased_items():
                self.leases.add(item_id, token, worker, expires)
            states, counters = view.states(), view.counters()
            self.peers.draining = set(view.draining())
            recent = view.kinds_served(self.clock.wall_ms() - int(KINDS_SERVED_MEMORY_S * 1000))
            self._kinds_seen.update(dict.fromkeys(recent, True))
            self._kinds_recorded = bool(recent)
            hellos = view.last_hellos()
        self.codec.restore_hellos(hellos)  # a HELLO accepted before this start, or signed before it, is REPLAY
        log.info("ledger_recovered", epoch=self.epoch, leases=len(self.leases), states=states, received=counters["received"],
                 draining=sorted(self.peers.draining))

    def stop(self) -> None:
        """Ask :meth:`run` to finish the current turn, say BYE and return."""
        self._stopping = True
        self.transport.wake()

    def reload_keys(self) -> None:
        """SIGHUP: re-read authorized keys; on error the old table stays in force."""
        try:
            self.codec.authorized.reload()
        except ConfigError as exc:
            log.error("authorized_keys_reload_failed", error=str(exc))
            return
        log.info("authorized_keys_reloaded", peers=len(self.codec.authorized))

    async def run(self) -> None:
        log.info("broker_started", endpoint=self.transport.endpoint, epoch=self.epoch, ledger=str(self.ledger.path))
        while not self._stopping:
            timeout = self._idle_timeout_s(self.clock.monotonic_s())
            if timeout > 0:
                await self.transport.wait_readable(timeout)
            if self._stopping:
                break
            if self._carry_items < CARRY_MAX_ITEMS:
                frames = self.transport.drain(MAX_FRAMES_PER_TURN, MAX_BYTES_PER_TURN)
            else:
                frames = self.transport.drain(TRICKLE_FRAMES, TRICKLE_BYTES)
            self._committed_ops = 0
            t0 = time.perf_counter()
            self.turn(frames)
            self.stats.turned(time.perf_counter() - t0)
            if self._committed_ops and self.transport.drained_all and not self._carry:
                # Under load more frames follow a committed turn: gather them a moment so
                # the next commit (one fsync) carries more (PostgreSQL's commit_delay).
                # The replies of this turn are already sent: nothing waits for durability.
                await asyncio.sleep(COMMIT_DELAY_S)
            else:
                await asyncio.sleep(0)
        self._shutdown()

    def _shutdown(self) -> None:
        self.sessions.bye_all("broker shutting down")
        log.info("broker_stopped", peers=len(self.peers))

    def _idle_timeout_s(self, now: float) -> float:
        if self.deferred or self._rejects_unsaved or self._carry or self._hellos_unsaved:
            return 0.0
        wake = min(self.sessions.next_wake_mono(), self._next_background_mono)
        if self._workers_with_credit():
            wake = min(wake, self.dispatcher.at_mono)
        if self.delivery.possible and any(s.credit > 0 for s in self._result_takers()):
            return 0.0
        due = self.leases.next_due_mono()
        if due is not None:
            wake = min(wake, due)
        if self.outbound.any_unsent():
            wake = min(wake, now + UNSENT_RETRY_S)
        if self.gate is not None and (self.gate.held or self._failover is not None):
            wake = min(wake, now + CHECK_INTERVAL_S)  # on_durable wakes sooner
        return max(0.0, min(wake - now, 1.0))

    # --- one turn ---
    def turn(self, frames: list[list[bytes]]) -> None:
        now = self.clock.monotonic_s()
        self._compensate_stall(now)
        ledger_ops: list[tuple[bytes, Session, Envelope]] = []
        for raw in frames:
            decoded = self._decode(raw, now)
            if decoded is None:
                continue
            rid, env = decoded
            sess = self.sessions.receive(rid, env, now)  # HELLO, HEARTBEAT, CREDIT, BYE end here
            if sess is not None:
                ledger_ops.append((rid, sess, env))
        self._transact(self._take_budget(ledger_ops), self._compensate_stall(self.clock.monotonic_s()))
        self._timers(self._compensate_stall(self.clock.monotonic_s()))

    def _take_budget(self, new_ops: list[tuple[bytes, Session, Envelope]]) -> list[tuple[bytes, Session, Envelope]]:
        """This turn's ledger ops: carried ones first, then new ones, in arrival order,
        whole frames up to :data:`TURN_ITEM_BUDGET` items (at least one frame); the
        rest is carried to the next turn."""
        if not self._carry:  # the common case: no carry, and this turn's frames fit the budget
            counts = [_op_items(env.message) for _, _, env in new_ops]
            if sum(counts) - (counts[-1] if counts else 0) < TURN_ITEM_BUDGET:
                return new_ops  # (all but the last under the budget: the loop below takes them all)
            new = [(n, rid, sess, env) for n, (rid, sess, env) in zip(counts, new_ops)]
        else:
            new = [(_op_items(env.message), rid, sess, env) for rid, sess, env in new_ops]
        queue = self._carry + new if self._carry else new
        total = self._carry_items + sum(n for n, *_ in new)
        taken = items = 0
        for n, *_ in queue:
            if taken and items >= TURN_ITEM_BUDGET:
                break
            items += n
            taken += 1
        self._carry, self._carry_items = queue[taken:], total - items
        return [(rid, sess, env) for _, rid, sess, env in queue[:taken]]

    def _compensate_stall(self, now: float) -> float:
        """If this loop did not run for a long time (SIGSTOP, VM pause, swap), the
        peers were not silent: we were. Shift liveness and lease timers by the
        stall so queued heartbeats get processed before anyone is declared gone.
        Called before every liveness or expiry decision; returns ``now``."""
        gap = now - self._last_turn_mono
        self._last_turn_mono = now
        if gap <= max(2.0, 2 * self.hb_s):
            return now
        self.sessions.excuse_stall(gap)
        self.leases.shift(gap)
        log.warning("broker_stalled", stalled_s=round(gap, 3), peers=len(self.peers), leases=len(self.leases))
        return now

    # --- decoding (brokerd/frame_intake.py) ---
    def _decode(self, raw: list[bytes], now: float) -> tuple[bytes, Envelope] | None:
        return self.intake.decode(raw, now)

    def _unserved(self, sess: Session, items: list[protocol.SubmitItem]) -> list[str]:
        """Kinds of ``items`` that no worker connected since the broker started serves, for a
        producer that asked (HELLO info ``features``); [] in the first liveness windows after
        start (workers are still reconnecting)."""
        if "unserved_kinds" not in _features(sess):
            return []
        if not self._kinds_recorded and self.clock.monotonic_s() - self._started_mono < 2 * self.silence_s:
            return []  # no record of recent workers (new ledger): they may still be reconnecting
        if "" in self._kinds_seen:  # a worker that takes every kind
            return []
        return sorted({it.kind for it in items} - self._kinds_seen.keys())

    def _served(self, sess: Session) -> list[str]:
        """The kinds :meth:`_unserved` counts as served (up to 100), for a producer whose HELLO
        ``features`` list ``kinds_served`` (older producers would refuse the field)."""
        if "kinds_served" not in _features(sess):
            return []
        return sorted(k for k in self._kinds_seen if k)[:MAX_SERVED_LISTED]

    def _worker_hello(self, kinds: tuple[str, ...]) -> None:
        """A worker said HELLO serving ``kinds`` (("",): every kind): for :meth:`_unserved`,
        and noted in the ledger by the next transaction (meta ``w:<kind>``)."""
        self._kinds_seen.update(dict.fromkeys(kinds, True))
        self._kinds_unsaved.update(kinds)

    # --- glue for brokerd/sessions.py, brokerd/outbound.py and brokerd/admin.py ---
    def _end_session(self, sess: Session, reason: str) -> None:
        self.sessions.end(sess, reason)

    def _hello_opened(self, peer_id: str, session: int, ts_ms: int) -> None:
        """A HELLO opened a session: its replay identity goes into the ledger with this turn's
        transaction (:meth:`_transact`), the one that applies the lease effects it deferred, so
        that a restarted broker (or a promoted standby) refuses it and older ones (REPLAY)."""
        self._hellos_unsaved[peer_id] = (session, ts_ms)

    def _defer(self, op: str, item_id: str, token: int, why: str) -> None:
        """Queue a ledger op (release, expire, dead) for the next transaction."""
        self.deferred.append((op, item_id, token, why))

    def _unblocked(self) -> None:
        """A peer's queue of unsent messages emptied: dispatch and delivery may go on."""
        self._wake_dispatch()
        self._wake_delivery()

    def _admin_view(self) -> BrokerView:
        def set_draining(worker: str, draining: bool) -> None:
            if draining:
                self.peers.draining.add(worker)
            else:
                self.peers.draining.discard(worker)
                self._wake_dispatch()

        return BrokerView(
            cfg=self.cfg, endpoint=self.transport.endpoint, ledger=self.ledger, peers=self.peers, leases=self.leases,
            authorized=self.codec.authorized, rejects=self.rejects, reply_budget=self.outbound.reply_budget,
            uptime_s=lambda: self.clock.monotonic_s() - self._started_mono,
            send_counts=lambda: {"again": self.transport.sent_again, "unroutable": self.transport.sent_unroutable},
            ledger_full_since_ms=lambda: self.ledger_full_since_ms, deliveries_in_flight=self.delivery.count,
            wake_dispatch=self._wake_dispatch, set_draining=set_draining, clock=self.clock, noise=self.intake.noise,
            ha_status=self.ha_status)

    # --- the transaction of a turn ---
    def _background_due(self, now: float) -> bool:
        if self.deferred or self._rejects_unsaved or self._hellos_unsaved or now >= self._next_background_mono:
            return True
        due = self.leases.next_due_mono()
        if due is not None and due <= now:
            return True
        if now >= self.dispatcher.at_mono and self._workers_with_credit():
            return True
        return self.delivery.possible and any(s.credit > 0 for s in self._result_takers())

    def _result_takers(self) -> list[Session]:
        """Completion services, and downstream relays while a routed result waits for one."""
        takers = self.peers.sessions(protocol.Role.COMPLETION)
        if self.delivery.routed_all:
            takers += relay_sessions(self.peers, fed.DOWNSTREAM)
        return takers

    def _transact(self, ops: list[tuple[bytes, Session, Envelope]], now: float) -> None:
        if not ops and not self._background_due(now):  # a carry implies ops: _take_budget takes >= 1
            return
        deferred, self.deferred = self.deferred, []
        due = self.leases.pop_due(now, SLICE_ENTRIES)
        background = now >= self._next_background_mono
        refuse = self._submit_refusal(ops, now)

        def step(txn: LedgerTxn, mode: str) -> tuple[Batch, bool]:
            # one run of the turn's ledger work; the ledger runs it again after growing a full map or in a smaller mode
            batch = Batch()
            if self._hellos_unsaved:  # in every mode: tiny, and before any lease effect of those HELLOs
                txn.note_hellos(self._hellos_unsaved, self.clock.wall_ms())
            if mode == "acks":  # at the max size even without growth: only what keeps delivery moving
                self._apply_ops(txn, batch, [op for op in ops if isinstance(op[2].message, (protocol.Ack, protocol.Status))], "QUEUE_FULL")
            else:
                self._apply_ops(txn, batch, ops, refuse if mode == "normal" else (refuse or "QUEUE_FULL"))
                self._apply_deferred(txn, batch, deferred)
                if self._kinds_unsaved:  # a hint for the next start only: lost with an aborted turn, harmless
                    txn.note_kinds_served(self._kinds_unsaved, self.clock.wall_ms())
                    self._kinds_unsaved = set()
                self._apply_expiries(txn, batch, due)
            backlog = False
            if background and mode not in ("minimal", "acks"):
                backlog = maintenance.expire_deadlines(txn, self.clock.wall_ms(), SLICE_ENTRIES) >= SLICE_ENTRIES
                backlog = maintenance.purge(txn, self.clock.wall_ms(), SLICE_ENTRIES) >= SLICE_ENTRIES or backlog
                maintenance.append_sample(txn, self.clock.wall_ms(), self.cfg.accounting_sample_interval_s)
            if mode not in ("minimal", "acks") and (self.gate is None or self.gate.may_plan()):
                self._dispatch(txn, batch, now)
                self._deliver(txn, batch)
            for code, n in self._rejects_unsaved.items():
                txn.count_reject(code, n)
            if (background or now >= self._ledger_stats_due_mono) and mode != "acks":
                self._ledger_stats(txn, now, background)
            if txn.changed:
                t0, records = time.perf_counter(), txn.records
                txn.commit()
                self.stats.committed(records, time.perf_counter() - t0)
                self._committed_ops = len(ops)
            else:
                txn.abort()
            return batch, backlog

        mode, done = self.ledger.transact(step)
        committed = done is not None
        batch, backlog = done or (Batch(), False)  # (unused when nothing committed: it returns below)
        if mode == "acks" or not committed:
            # Still full with only completions, failures and acks: those did not fit, so they
            # are unanswered (peers resend them); acks and status were committed alone when
            # they fitted. The due work is put back and tried again next turn.
            self.ledger_full_since_ms = self.ledger_full_since_ms or self.clock.wall_ms()
            log.error("ledger_full_batch_dropped", ops=len(ops), acks_committed=committed, advice=LEDGER_FULL_ADVICE)
            self.deferred = deferred + self.deferred
            for lease in due:
                self.leases.requeue_check(lease)
            self._purge_while_full()
            if not committed:
                return
        if background:
            # a slice that used its whole budget has more to do: come back soon
            self._next_background_mono = now + (BACKGROUND_BUSY_INTERVAL_S if backlog else BACKGROUND_INTERVAL_S)
            self._refresh_snapshot()
        if self.ledger_full_since_ms and mode == "normal" and any(isinstance(e.message, protocol.Complete) for _, _, e in ops):
            self.ledger_full_since_ms = 0  # completions fit again
            log.info("ledger_full_cleared")
        self._rejects_unsaved.clear()
        self._hellos_unsaved.clear()
        for name in batch.crash_points:
            crash_point(name)
        for fn in batch.effects:
            fn()
        if self.gate is not None:  # a primary: confirms wait for the standbys and the lease (brokerd/primary.py)
            rep = self.ledger.replication
            self.gate.hold(rep.position[1] if rep is not None else 0, batch.replies, batch.reads, self._send)
            return
        for rid, msg in batch.replies:
            self._send(rid, msg)

    def _purge_while_full(self) -> int:
        """The map is full at its maximum and the turn ran without background work: purge
        acknowledged items past ``retention_s`` (and expired idempotency keys, old gap
        events), one entry per delete-only transaction, up to :data:`FULL_PURGE_ENTRIES`
        transactions. One entry each because LMDB reuses the pages a commit frees only
        from the commit after the next (its previous meta page still points at them), so
        each purge commit unlocks the room the one before it freed. Without this a full
        map stays full (completions need room that only a purge frees). Only
        acknowledged items go: nothing unacknowledged is touched. Returns the entries
        purged (0: none due, or none fitted)."""

        def step(txn: LedgerTxn, mode: str) -> int:
            n = maintenance.purge(txn, self.clock.wall_ms(), 1)
            if txn.changed:
                txn.commit()
            else:
                txn.abort()
            return n

        done = 0
        for _ in range(FULL_PURGE_ENTRIES):
            _mode, n = self.ledger.transact(step)
            if not n:
                break
            done += n
        if done:
            self._ledger_stats_due_mono = 0.0  # measure the freed room on the next turn
            log.info("ledger_full_purged", entries=done)
        return done

    def _refresh_snapshot(self) -> None:
        """Replace :attr:`snapshot` (read by the metrics thread; never the ledger itself)."""
        try:
            self.snapshot = build_snapshot(self)
        except ReadersFull as exc:  # live readers hold every slot: keep the old snapshot, go on
            log.error("ledger_readers_full", error=str(exc))

    def _ledger_stats(self, txn: LedgerTxn, now: float, background: bool) -> None:
        """In the turn's transaction, at most every :data:`LEDGER_STATS_INTERVAL_S`: pages in
        use (for :meth:`_submit_refusal`), the commit history entry (reader ages), LMDB's
        reader check (stale slots of dead readers freed); on background turns also the
        reader report, with a warning when the oldest snapshot is older than
        ``reader_warn_age_s``."""
        self._ledger_stats_due_mono = now + LEDGER_STATS_INTERVAL_S
        used = self.ledger.used_bytes(txn.txn)
        self._used_bytes = used
        self._admitted_bytes = 0  # measured with this turn's items (the reset stands only if it commits)
        if txn.changed:
            txn.note_history(self.clock.wall_ms(), used // self.ledger.env.stat()["psize"])
        cleared = self.ledger.clear_stale_readers()  # ~1 us: a dead reader pins history for at most ~0.1 s
        if cleared:
            log.warning("ledger_stale_readers_cleared", cleared=cleared, total=self.ledger.stale_readers_cleared)
        if not background:
            return
        doc = reader_report(self.ledger, txn, self.clock.wall_ms(), warn_age_s=self.cfg.reader_warn_age_s)
        self.readers_doc = doc
        old = doc["oldest"]
        if old is not None and not old["self"] and old["age_s"] >= self.cfg.reader_warn_age_s and now >= self._reader_warn_next_mono:
            self._reader_warn_next_mono = now + max(self.cfg.reader_warn_age_s, READER_WARN_REPEAT_MIN_S)
            log.warning("ledger_reader_old", pid=old["pid"], txnid=old["txnid"], lag_txns=old["lag_txns"], age_s=old["age_s"],
                        pinned_bytes=old["pinned_bytes"], file_bytes=doc["file_bytes"], live_bytes=doc["live_bytes"],
                        advice="this process holds an old LMDB snapshot: pages freed since cannot be reused and data.mdb "
                               "grows; end its transaction (or the process) - see docs/ledger.md")

    def _submit_refusal(self, ops: list[tuple[bytes, Session, Envelope]], now: float) -> str:
        """"" or the code every new item of this turn is refused with (DISK_FULL, QUEUE_FULL)."""
        if not any(isinstance(env.message, protocol.Submit) for _, _, env in ops):
            return ""
        if now - self._disk_checked_mono >= DISK_CHECK_INTERVAL_S:
            self._disk_checked_mono = now
            self._disk_full = disk_free_bytes(self.ledger.path) < self.cfg.min_free_disk_bytes
        if self._disk_full:
            return "DISK_FULL"
        used, size = self._used_bytes, self.ledger.map_size_bytes()  # measured in a turn's txn (no read txn here)
        if used > GROW_AT_FRACTION * size and self.ledger.grow_map():
            log.info("ledger_map_grown", map_size_bytes=self.ledger.map_size_bytes())
            size = self.ledger.map_size_bytes()
        if not self.ledger.can_grow() and used > SOFT_FULL_FRACTION * size:
            return "QUEUE_FULL"
        return ""

    def _apply_ops(self, txn: LedgerTxn, batch: Batch, ops: list[tuple[bytes, Session, Envelope]], refuse: str) -> None:
        now_ms = self.clock.wall_ms()
        admitted = 0  # admission cost of this turn's new items
        for rid, sess, env in ops:
            msg = env.message
            if isinstance(msg, protocol.Submit):
                results = []
                # items not yet completed (ready + leased): read once per frame, then counted here
                open_items = 0 if refuse else (txn.state_count(protocol.ItemState.READY.value)
                                               + txn.state_count(protocol.ItemState.LEASED.value))
                relayed = sess.role is protocol.Role.RELAY
                too_big = dispatch_refusals(msg.items, self.outbound.budget, id_len=len(self.ledger.id_prefix) + 16,
                                            swarm_id=self.fed.swarm_id, relayed=relayed, federated=self.fed.enabled)
                submit, admission = txn.submit, self._admission_refusal
                added = 0  # new ready items of this frame
                for at, item in enumerate(msg.items):
                    if too_big is not None and too_big[at]:  # it could never be sent to a taker: refused now, not dead-lettered later
                        results.append(protocol.SubmitResult(item.key, "", error="PAYLOAD_TOO_LARGE", message=too_big[at]))
                        continue
                    inline = item.payload.inline
                    cost = (0 if inline is None else len(inline)) + ITEM_RECORD_BYTES  # (blob_size)
                    refusal = refuse or admission(open_items, admitted + cost)
                    if relayed:
                        r = self.relaying.submit(txn, batch, sess, item, now_ms, refusal)
                    else:
                        r = submit(item, now_ms, refuse=refusal)
                    if r.item_id and not r.duplicate:  # a new ready item
                        admitted += cost
                        open_items += 1
                        added += 1
                    results.append(r)
                unserved = self._unserved(sess, msg.items)
                batch.replies.append((rid, protocol.SubmitAck(msg.req, results, unserved=unserved,
                                                       served=self._served(sess) if unserved else [])))
                if added:
                    batch.crash("broker.after_submit_commit")
                    batch.effects.append(self._wake_dispatch)
            elif isinstance(msg, protocol.Complete):
                outcomes = []
                ended = []  # (item_id, token) whose lease timer goes after commit
                relay = sess.role is protocol.Role.RELAY
                federated, complete, sender = self.fed.enabled, txn.complete, env.sender
                for res in msg.results:
                    outcome = self.relaying.complete(txn, batch, sess, res, now_ms) if relay \
                        else complete(res, now_ms, sender)
                    outcomes.append(trusted_outcome(res.item_id, res.token, outcome))
                    if federated and outcome == _ACCEPTED:
                        reply_to = (txn.record(res.item_id) or {}).get("reply_to")
                        if reply_to:  # at once, not after commit: this turn's _deliver must skip it too
                            self.delivery.route(reply_to, res.item_id)  # (a hint: delivery checks the ledger state)
                    if outcome == _ACCEPTED or outcome == _DUPLICATE:
                        ended.append((res.item_id, res.token))
                if ended:
                    batch.effects.append(lambda e=ended: self._leases_end(e))
                batch.crash("broker.after_complete_commit")
                batch.effects.append(self._wake_delivery)
                batch.replies.append((rid, protocol.CompleteAck(outcomes)))
            elif isinstance(msg, protocol.Fail):
                outcomes = []
                for f in msg.failures:
                    outcome = txn.fail(f, now_ms, env.sender)
                    outcomes.append(protocol.ItemOutcome(f.item_id, f.token, outcome))
                    if f.reason == protocol.FailReason.STORE_UNAVAILABLE.value and outcome == protocol.Outcome.ACCEPTED.value:
                        batch.effects.append(lambda w=sess.peer_id: self.peers.note_store_failure(w))
                    if outcome == protocol.Outcome.ACCEPTED.value:
                        self._lease_ends(batch, f.item_id, f.token)
                batch.effects.append(self._wake_dispatch)
                batch.replies.append((rid, protocol.FailAck(outcomes)))
            elif isinstance(msg, protocol.Ack):
                done: list[str] = []
                unknown: list[str] = []
                quarantined = {q.item_id: q.error or "quarantined" for q in msg.quarantined}
                newly = 0
                for item_id in msg.item_ids:
                    acked = txn.ack(item_id, now_ms, quarantined.get(item_id, "") if quarantined else "")
                    (unknown if acked is None else done).append(item_id)
                    newly += acked is True
                if done:
                    batch.effects.append(lambda ids=done: self._acknowledged_all(ids))
                if newly:  # after the commit: the completion peer's "done" in `ccsq status` / the console
                    batch.effects.append(lambda s=sess, n=newly: setattr(s, "acked", s.acked + n))
                batch.crash("broker.after_ack_commit")
                batch.replies.append((rid, protocol.AckOk(done, unknown)))
            elif isinstance(msg, (protocol.Status, protocol.Cancel)):
                if isinstance(msg, protocol.Cancel):  # only READY items: a running one is the worker's to finish
                    for i in msg.item_ids:
                        if sess.role is protocol.Role.RELAY and ((txn.record(i) or {}).get("reply_to") != sess.peer_id):
                            continue  # a relay cancels only the items it submitted (docs/federation.md)
                        if txn.dead_letter_ready(i, protocol.FailReason.CANCELLED.value, f"cancelled by {env.sender}", now_ms):
                            batch.log("info", "item_cancelled", item=i, by=env.sender)
                statuses = [txn.item_status(i) for i in msg.item_ids]
                chunks = split_frames(statuses, size_of=status_size, budget_bytes=self.outbound.reply_budget(), max_items=1 << 16)
                for chunk in chunks or [[]]:
                    reply = protocol.StatusReply(msg.req, chunk)
                    if isinstance(msg, protocol.Status):
                        batch.reads.add(id(reply))
                    batch.replies.append((rid, reply))
            elif isinstance(msg, protocol.Admin):
                if msg.command == "failover":  # a primary's planned switchover: not a ledger command
                    batch.effects.append(lambda r=rid, m=msg: self._failover_start(r, m))
                    continue
                answer = self.admin.handle(txn, batch, sess, msg)
                if msg.command in READ_COMMANDS:
                    batch.reads.add(id(answer))
                batch.replies.append((rid, answer))
        if admitted:
            batch.effects.append(lambda n=admitted: self._note_admitted(n))

    def _note_admitted(self, cost: int) -> None:
        """After commit: items of admission ``cost`` bytes joined the ledger since it was measured."""
        self._admitted_bytes += cost

    def _lease_ends(self, batch: Batch, item_id: str, token: int) -> None:
        """After commit, the lease timer of ``item_id`` with ``token`` goes (completed,
        failed, released, expired or dead-lettered in this transaction)."""
        batch.effects.append(lambda: self.leases.discard(item_id, token))

    def _leases_end(self, ended: list[tuple[str, int]]) -> None:
        """After commit: the lease timers of ``ended`` (item id, token) go (as :meth:`_lease_ends`)."""
        self.leases.discard_many(ended)

    def _admission_refusal(self, open_items: int, cost: int) -> str:
        """"QUEUE_FULL" when one more item of ``cost`` bytes (plus this turn's earlier ones)
        would leave no room for the results of the ``open_items`` already accepted and not
        completed (ready + leased), and its own; see the config's ``result_reserve_bytes``.
        "" otherwise."""
        need = self._used_bytes + self._admitted_bytes + cost + (open_items + 1) * self.cfg.result_reserve_bytes
        return "QUEUE_FULL" if need > SOFT_FULL_FRACTION * self.ledger.max_map_size_bytes else ""

    def _apply_deferred(self, txn: LedgerTxn, batch: Batch, deferred: list[tuple[str, str, int, str]]) -> None:
        now_ms = self.clock.wall_ms()
        for op, item_id, token, why in deferred:
            if op == "release":
                if txn.release(item_id, token, now_ms):
                    batch.log("info", "lease_released", item=item_id, token=token, why=why)
            elif op == "expire":
                holder = (txn.get(item_id) or {}).get("worker", "")
                new = txn.expire_lease(item_id, token, now_ms, why)
                self.relaying.note_lease_lost(txn, item_id, holder, now_ms, new)
                if new:
                    batch.effects.append(lambda n=new: self.stats.lease_expired(n))
                    batch.log("info", "lease_expired", item=item_id, token=token, why=why, now=new, at_ms=now_ms)
            elif op == "dead":
                if txn.dead_letter(item_id, token, why, "cannot be dispatched", now_ms):
                    batch.log("warning", "item_dead", item=item_id, reason=why)
            self._lease_ends(batch, item_id, token)
        if deferred:
            batch.effects.append(self._wake_dispatch)

    def _apply_expiries(self, txn: LedgerTxn, batch: Batch, due: list) -> None:
        now_ms = self.clock.wall_ms()
        for lease in due:
            new = txn.expire_lease(lease.item_id, lease.token, now_ms, "lease expired")
            self.relaying.note_lease_lost(txn, lease.item_id, lease.worker, now_ms, new)
            holder = self.peers.by_id.get(lease.worker)
            if new and holder is not None:  # silent since its last frame: no DISPATCH until it speaks again
                holder.lease_lost_recv_mono = holder.last_recv_mono
            if new:
                batch.effects.append(lambda n=new: self.stats.lease_expired(n))
                batch.log("info", "lease_expired", item=lease.item_id, token=lease.token, worker=lease.worker, now=new,
                          at_ms=now_ms)
                if new == protocol.ItemState.DEAD.value:
                    batch.log("warning", "item_dead", item=lease.item_id, reason="worker_lost")
            self._lease_ends(batch, lease.item_id, lease.token)
        if due:
            batch.effects.append(self._wake_dispatch)

    # --- dispatch (brokerd/dispatch.py) ---
    def _workers_with_credit(self) -> list[Session]:
        return self.dispatcher.takers()

    def _wake_dispatch(self) -> None:
        self.dispatcher.wake()

    def _dispatch(self, txn: LedgerTxn, batch: Batch, now: float) -> None:
        self.dispatcher.plan(txn, batch, now, self.clock.wall_ms())

    # --- result delivery (brokerd/delivery.py) ---
    def _wake_delivery(self) -> None:
        self.delivery.set_possible(True)

    def _deliver(self, txn: LedgerTxn, batch: Batch) -> None:
        """Plan this turn's RESULT frames: routed results to their relays, the rest to
        completion services with credit; whether more wait is set after commit."""
        if not self.delivery.possible:
            return
        now_ms = self.clock.wall_ms()
        more_routed = False
        if self.delivery.routed_all:
            more_routed = self.delivery.plan_routed(txn, batch, relay_sessions(self.peers, fed.DOWNSTREAM), self._delivered, now_ms)
        takers = [s for s in self.peers.sessions(protocol.Role.COMPLETION) if s.credit > 0 and not s.unsent]
        if not takers:
            if self.delivery.routed_all:
                batch.effects.append(lambda: self.delivery.set_possible(more_routed))
            return
        more = self.delivery.plan(txn, batch, takers, self._delivered, now_ms)
        batch.effects.append(lambda: self.delivery.set_possible(more or more_routed))

    def _delivered(self, sess: Session, deliveries: list[protocol.Delivery]) -> None:
        """After commit: ``deliveries`` were handed to ``sess``; they spend its credit."""
        if self.delivery.sent(sess, deliveries):
            sess.credit -= len(deliveries)

    def _acknowledged_all(self, item_ids: list[str]) -> None:
        """After commit: ACKs of ``item_ids``; they need neither delivery nor routing any more."""
        self.delivery.acknowledged_many(item_ids)


    # --- sending (brokerd/outbound.py) and timers ---
    def _send(self, rid: bytes, msg: protocol.Message) -> None:
        self.outbound.send(rid, msg)

    def _timers(self, now: float) -> None:
        """Unsent messages to peers whose pipe has room again, then liveness and heartbeats;
        a primary's held confirms that may leave now, and a planned failover's progress."""
        if self.gate is not None:
            if self.gate.release(self._send):
                self._wake_dispatch()
                self._wake_delivery()
            if self._failover is not None:
                self._failover_step(now)
        self.outbound.flush()
        self.sessions.tick(now)

    def release_durable(self) -> None:
        """A primary's replication server read acknowledgements that made turns durable (its
        ``on_durable``, called in the loop between two turns of this actor): their held replies
        leave now, not after this actor's next turn and its commit (brokerd/role.py)."""
        if self.gate is not None and self.gate.release(self._send):
            self._wake_dispatch()
            self._wake_delivery()
        self.transport.wake()

    # --- a replicated primary (brokerd/primary.py, docs/ha.md) ---
    def ha_status(self) -> dict:
        """The status document's ``ha`` section."""
        if self.ha is None:
            return {"role": "single", "epoch": self.epoch}
        assert self.gate is not None
        server = self.ha.server.status()
        return {**server, "role": "primary", "epoch": self.epoch, "node": self.cfg.ha_node_id,  # (the server's own
                "etcd": self.cfg.ha_etcd_endpoints, "swarm": self.cfg.ha_namespace(),  # "mode" is not the gate's)
                "repl_endpoint": self.ha.repl_endpoint, **self.gate.status(), "failover": "in progress" if self._failover else ""}

    def _failover_start(self, rid: bytes, msg: protocol.Admin) -> None:
        """Admin ``failover`` (``timeout_s``, ``to``): stop confirming, then
        (:meth:`_failover_step`) hand over once a standby of the sync set (``to``: that one)
        holds the last turn, or refuse after ``timeout_s``. A ``to`` that is not a connected
        standby in sync is refused at once, naming the ones that are."""
        if self.ha is None or self.gate is None:
            self._send(rid, protocol.AdminReply(msg.req, False, error="failover: this is a single broker (ha_etcd_endpoints is "
                                                               "empty): there is no standby to hand over to"))
            return
        if self._failover is not None:
            self._send(rid, protocol.AdminReply(msg.req, False, error="failover: one is already in progress"))
            return
        timeout_s = msg.args.get("timeout_s", 10.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            self._send(rid, protocol.AdminReply(msg.req, False, error="failover: timeout_s must be a number of seconds in (0, 600]"))
            return
        to = msg.args.get("to", "")
        if not isinstance(to, str):
            self._send(rid, protocol.AdminReply(msg.req, False, error="failover: to must be a node id (a string), e.g. broker-2"))
            return
        if to:
            eligible = self._failover_candidates()
            if to not in eligible:
                self._send(rid, protocol.AdminReply(msg.req, False, error=(
                    f"failover: {to!r} is not a connected standby in sync (in sync now: "
                    f"{', '.join(eligible) or 'none'}): nothing changed, this broker stays primary")))
                return
        rep = self.ledger.replication
        target = rep.position[1] if rep is not None else 0
        self.gate.paused = f"planned failover: waiting for {to or 'a standby'} to hold seq {target}"
        self._failover = _Failover(rid, msg.req, self.clock.monotonic_s() + float(timeout_s), target, to)
        log.warning("ha_failover_started", seq=target, timeout_s=timeout_s, to=to or None)
        self.transport.wake()

    def _failover_candidates(self) -> list[str]:
        """The standbys a planned failover may hand over to: connected, not copying, and in
        the sync set as written to etcd (async: every connected one)."""
        assert self.ha is not None and self.gate is not None
        members = set(self.gate.members)
        return [str(s.get("node")) for s in self.ha.server.status().get("standbys", [])
                if s.get("copying") is None and (self.gate.mode == "async" or (s.get("in_sync") and s.get("node") in members))]

    def _failover_step(self, now: float) -> None:
        assert self._failover is not None and self.ha is not None and self.gate is not None
        fo = self._failover
        if fo.pinning is not None:  # the sync set is being pinned to fo.node (a thread): wait for etcd's answer
            if fo.pinning.is_alive():
                return
            if fo.pin_error:
                self._failover_refuse(fo, f"failover: {fo.pin_error}: nothing changed, this broker stays primary")
                return
            body = msgpack.packb({"ok": True, "epoch": self.epoch, "standby": fo.node, "seq": fo.target}, use_bin_type=True)
            self._send(fo.rid, protocol.AdminReply(fo.req, True, body=body))
            self.outbound.flush()
            log.warning("ha_failover_handing_over", standby=fo.node, seq=fo.target)
            self._failover = None
            self.gate.lose(f"planned failover to {fo.node}")
            self.ha.step_down(f"planned failover to {fo.node}")
            return
        members = set(self.gate.members)  # async: any standby may take over (the set is empty)
        ready = [str(s.get("node")) for s in self.ha.server.status().get("standbys", [])
                 if (s.get("node") in members or self.gate.mode == "async") and int(s.get("seq", 0)) >= fo.target
                 and (not fo.to or s.get("node") == fo.to)]
        if ready:
            fo.node = ready[0]
            if self.gate.mode == "async":  # any standby may campaign: nothing to pin
                fo.pinning = threading.Thread(target=lambda: None)
            else:  # only fo.node may take the key (brokerd/primary.py ConfirmGate.pin), then resign

                def pin(f: _Failover = fo, gate=self.gate, wake=self.transport.wake) -> None:
                    f.pin_error = gate.pin(f.node)
                    wake()

                fo.pinning = threading.Thread(target=pin, name="ccsq-ha-failover-pin", daemon=True)
            fo.pinning.start()
            return
        if now >= fo.deadline:
            who = f"{fo.to!r} did not acknowledge" if fo.to else f"no standby of the sync set {sorted(members)} acknowledged"
            self._failover_refuse(fo, f"failover: {who} seq {fo.target} in time: nothing changed, this broker stays primary "
                                  "(see ccsq status: ha.standbys)")

    def _failover_refuse(self, fo: "_Failover", error: str) -> None:
        assert self.gate is not None
        self._failover = None
        self.gate.unpin()
        self.gate.paused = ""
        self.gate.recheck()
        self.gate.release(self._send)
        log.warning("ha_failover_refused", seq=fo.target, to=fo.to or None, members=sorted(self.gate.members), error=error)
        self._send(fo.rid, protocol.AdminReply(fo.req, False, error=error))


@dataclasses.dataclass
class _Failover:
    """A planned failover in progress (admin ``failover``): who asked, until when, the seq
    the standby must hold, the wanted node (``to``, "" = any of the sync set), and once one
    is ready its ``node`` and the thread pinning the sync set to it."""

    rid: bytes
    req: int
    deadline: float
    target: int
    to: str
    node: str = ""
    pinning: threading.Thread | None = None
    pin_error: str = ""


def _features(sess: Session) -> set[str]:
    """The optional replies a peer's HELLO info ``features`` asks for (comma- or space-separated)."""
    return set(str(sess.info_hello.get("features", "")).replace(",", " ").split())


def _op_items(msg: protocol.Message) -> int:
    """How many item operations a ledger message asks for (its share of a turn's budget)."""
    if isinstance(msg, protocol.Admin):
        if msg.args.get("all") is True:
            return MAX_ITEMS_PER_COMMAND
        ids = msg.args.get("item_ids")
        return max(1, ids.count(",") + 1) if isinstance(ids, str) else 1
    for attr in ("items", "results", "failures", "item_ids"):
        v = getattr(msg, attr, None)
        if v is not None:
            return max(1, len(v))
    return 1


