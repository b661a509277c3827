"""The broker actor: the one asyncio task that owns the ledger and the peer table.

One *turn* of the loop:

1. drain every readable frame from the ROUTER (up to a budget) and verify it;
2. apply session messages (HELLO, HEARTBEAT, CREDIT, BYE) to the peer table at once;
3. apply ledger messages (SUBMIT, COMPLETE, FAIL, ACK, STATUS, ADMIN) plus the
   background slices (deferred releases, due lease expiries, deadline and purge
   scans, dispatch, result delivery) in ONE write transaction with ONE fsync;
4. after the commit: crash points, in-memory effects, then the replies.

Step 3 is a pure function of the ledger and the inputs: all in-memory effects
and replies are collected in a :class:`Batch` and only applied after commit,
so a full map (``lmdb.MapFullError``) aborts and retries the whole step after
growing the map, or with SUBMITs refused (QUEUE_FULL) at the maximum size.
Nothing is half-applied and nothing is confirmed before it is durable.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable

import structlog

from ccsq.brokerd import transport as tp
from ccsq.common.wire import federation as fed
from ccsq.brokerd import gaps
from ccsq.brokerd.admin import MAX_ITEMS_PER_COMMAND, AdminCommands
from ccsq.brokerd.ledger import Ledger, LedgerTxn, ReadersFull, disk_free_bytes, reader_report
from ccsq.brokerd.ledger import maintenance
from ccsq.brokerd.metrics import BrokerStats, build_snapshot
from ccsq.brokerd.peers import LeaseTimers, PeerStatus, PeerTable, Session
from ccsq.common.wire import protocol as p
from ccsq.common.wire.frames import split_frames
from ccsq.common.wire.config import BrokerConfig
from ccsq.common.wire.envelope import Envelope
from ccsq.common.wire.errors import ConfigError, DecodeError
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
DELIVER_PER_TURN = 128  # results sent to completion services in one turn
CARRY_MAX_ITEMS = 4 * TURN_ITEM_BUDGET  # above this many carried, read only a trickle (ZeroMQ queues the rest)
TRICKLE_FRAMES, TRICKLE_BYTES = 16, 16 * 1024  # ... enough for heartbeats and HELLOs, less than a turn applies
LEASE_BUDGET_CHECK_EVERY = 32  # leases between two looks at the dispatch slice's clock
MAX_PENDING_PER_PEER = 10_000
PENDING_RETRY_S = 0.01
COMMIT_DELAY_S = 0.001  # after a turn that committed peer frames, gather this long before the next turn
BACKGROUND_INTERVAL_S = 1.0  # deadline and purge scans
BACKGROUND_BUSY_INTERVAL_S = 0.02  # ... while they still have a backlog
SLICE_ENTRIES = 500  # index entries per deadline/purge slice
REJECT_LOG_INTERVAL_S = 10.0
REJECT_LOG_LINES_PER_INTERVAL = 100  # frame_rejected lines per interval, all peers together
DISK_CHECK_INTERVAL_S = 1.0
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
#: Codes raised after the signature was verified: the sender is authenticated, so it gets an ERROR.
POST_VERIFY_CODES = frozenset(
    {p.REJECT_UNKNOWN_TYPE, p.REJECT_ROLE, p.REJECT_STALE, p.REJECT_REPLAY, p.REJECT_NO_SESSION}
)
SESSION_TYPES = (p.Hello, p.Heartbeat, p.Credit, p.Bye)
#: Refusals an unauthenticated sender may get (rate-limited; nothing but the id it claimed).
STRANGER_ANSWERS = {
    p.REJECT_UNKNOWN_SENDER: "peer id {peer!r} is not in the broker's authorized_keys",
    p.REJECT_BAD_SIGNATURE: "the signature of {peer!r} does not verify with the public key the broker holds for it",
}
STRANGER_ANSWER_INTERVAL_S = 2.0  # per claimed peer id
STRANGER_ANSWERS_PER_S = 20.0  # all strangers together


@dataclasses.dataclass
class Batch:
    """What one transaction will do once it has committed."""

    replies: list[tuple[bytes, p.Message]] = dataclasses.field(default_factory=list)
    effects: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    crash_points: list[str] = dataclasses.field(default_factory=list)

    def crash(self, name: str) -> None:
        if name not in self.crash_points:
            self.crash_points.append(name)


#: Kinds whose worker said HELLO within this long before a broker start count as served
#: at once after it (meta ``w:<kind>``), instead of waiting two liveness windows.
KINDS_SERVED_MEMORY_S = 86400.0


def wall_ms() -> int:
    return int(time.time() * 1000)


class Broker:
    """The broker actor. Build it with an open :class:`Ledger` and a bound
    :class:`~ccsq.brokerd.transport.Transport`; ``await run()`` until :meth:`stop`."""

    # --- configuration ---
    cfg: BrokerConfig
    hb_s: float  # heartbeat interval (seconds)
    silence_s: float  # heartbeat_interval_s x liveness
    lease_ttl_s: float
    # --- owned state ---
    ledger: Ledger
    transport: tp.Transport
    peers: PeerTable
    leases: LeaseTimers
    epoch: int
    delivered: dict[str, str]  # item id -> completion peer id (in flight, not yet acknowledged)
    redeliver: set[str]  # item ids whose next delivery is a redelivery (G3)
    deferred: list[tuple[str, str, int, str]]  # (op, item_id, token, why) for the next transaction
    rejects: collections.Counter  # DecodeError code -> count (since start)

    def __init__(self, cfg: BrokerConfig, ledger: Ledger, transport: tp.Transport) -> None:
        self.cfg = cfg
        self.hb_s = cfg.heartbeat_interval_s
        self.silence_s = cfg.heartbeat_interval_s * cfg.liveness
        self.lease_ttl_s = cfg.lease_ttl_s
        self.ledger = ledger
        self.transport = transport
        self.codec = transport.codec
        self.peers = PeerTable()
        self.leases = LeaseTimers()
        self.delivered = {}
        self.redeliver = set()
        # every completed-index entry below this completion seq is in self.delivered
        # (the scan for deliveries starts here); reset to 0 when one leaves it unacked
        self._delivered_below_cseq = 0
        self._delivery_floor_resets = 0  # bumped on each reset: a scan older than it must not advance it
        self.deferred = []
        self._carry: list[tuple[int, bytes, Session, Envelope]] = []  # (items, op): beyond the last turn's budget
        self._carry_items = 0
        self.rejects = collections.Counter()
        self.snapshot: dict = {}  # read by the metrics thread (brokerd/metrics.py)
        self.stats = BrokerStats()  # live instruments (histograms, counters), thread-safe
        self._rejects_unsaved: collections.Counter = collections.Counter()
        self._reject_logged: dict[tuple[bytes | str, str], float] = {}
        self._reject_window_mono, self._reject_window_lines, self._reject_lines_dropped = -1e9, 0, 0
        self._kinds_seen: dict[str, bool] = {}  # kinds a worker connected since start serves ("": any)
        self._kinds_unsaved: set[str] = set()  # kinds of HELLOs not yet noted in the ledger (meta w:<kind>)
        self._kinds_recorded = False  # the ledger named kinds served recently: no grace after start needed
        self._stranger_answered: dict[str, float] = {}  # claimed peer id -> when last answered
        self._stranger_tokens, self._stranger_tokens_mono = STRANGER_ANSWERS_PER_S, time.monotonic()
        self._stopping = False
        self._started_mono = time.monotonic()
        self._last_turn_mono = self._started_mono
        now = time.monotonic()
        self._next_hb_mono = now + self.hb_s
        self._next_liveness_mono = now + self.hb_s / 2
        self._next_background_mono = now
        self._dispatch_at_mono = now  # when a dispatch pass may find work (inf: nothing until an event)
        self._deliver_possible = True
        self._committed_ops = 0  # peer ledger messages the last turn committed (commit delay)
        self._disk_checked_mono = 0.0
        self._disk_full = False
        self._rr = 0  # round-robin start among workers
        self.admin = AdminCommands(self)
        self._used_bytes = ledger.used_bytes()  # pages in use, refreshed by _ledger_stats in a turn's txn
        self._admitted_bytes = 0  # admission cost of items committed since _used_bytes was measured
        self.ledger_full_since_ms = 0  # wall ms when a turn last found the ledger full at max size (0: not full)
        self._ledger_stats_due_mono = 0.0
        self.readers_doc: dict = {}  # reader_report() of the last background turn (status, metrics)
        self._reader_warn_next_mono = 0.0
        self.epoch = ledger.bump_epoch()
        self.fed = fed.Federation.from_config(cfg, ledger.ledger_id)  # relays (docs/federation.md)
        self._recover()
        if self.fed.enabled:
            with self.ledger.read() as view:
                log.info("federation_recovered", swarm=self.fed.swarm_id, routed=self.fed.recover(view))

    # --- lifecycle ---
    def _recover(self) -> None:
        """Restart recovery: every leased item gets expiry now + lease_ttl_s, so its
        worker can come back and resume it."""
        expires = time.monotonic() + self.lease_ttl_s
        with self.ledger.read() as view:
            for item_id, token, worker in view.leased_items():
                self.leases.add(item_id, token, worker, expires)
            states, counters = view.states(), view.counters()
            self.peers.draining = set(view.draining())
            recent = view.kinds_served(wall_ms() - int(KINDS_SERVED_MEMORY_S * 1000))
            self._kinds_seen.update(dict.fromkeys(recent, True))
            self._kinds_recorded = bool(recent)
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
            timeout = self._idle_timeout_s(time.monotonic())
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
        for s in self.peers.sessions():
            try:
                self.transport.send(s.routing_id, p.Bye(reason="broker shutting down"))
            except DecodeError:
                pass
        log.info("broker_stopped", peers=len(self.peers))

    def _idle_timeout_s(self, now: float) -> float:
        if self.deferred or self._rejects_unsaved or self._carry:
            return 0.0
        wake = min(self._next_hb_mono, self._next_liveness_mono, self._next_background_mono)
        if self._workers_with_credit():
            wake = min(wake, self._dispatch_at_mono)
        if self._deliver_possible and any(s.credit > 0 for s in self._result_takers()):
            return 0.0
        due = self.leases.next_due_mono()
        if due is not None:
            wake = min(wake, due)
        if any(s.pending for s in self.peers.by_id.values()):
            wake = min(wake, now + PENDING_RETRY_S)
        return max(0.0, min(wake - now, 1.0))

    # --- one turn ---
    def turn(self, frames: list[list[bytes]]) -> None:
        now = time.monotonic()
        self._compensate_stall(now)
        ledger_ops: list[tuple[bytes, Session, Envelope]] = []
        for raw in frames:
            decoded = self._decode(raw, now)
            if decoded is None:
                continue
            rid, env = decoded
            if isinstance(env.message, p.Hello):
                self._on_hello(rid, env, now)
                continue
            sess = self.peers.by_routing(rid)
            if sess is None or sess.peer_id != env.sender:
                self._send_raw(rid, p.Error(p.REJECT_NO_SESSION, "no session: reconnect and send HELLO", env.seq))
                continue
            sess.last_recv_mono = now
            if isinstance(env.message, SESSION_TYPES):
                self._on_session_message(sess, env, now)
            else:
                ledger_ops.append((rid, sess, env))
        self._transact(self._take_budget(ledger_ops), self._compensate_stall(time.monotonic()))
        self._timers(self._compensate_stall(time.monotonic()))

    def _take_budget(self, new_ops: list[tuple[bytes, Session, Envelope]]) -> list[tuple[bytes, Session, Envelope]]:
        """This turn's ledger ops: carried ones first, then new ones, in arrival order,
        whole frames up to :data:`TURN_ITEM_BUDGET` items (at least one frame); the
        rest is carried to the next turn."""
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
        for sess in self.peers.by_id.values():
            sess.last_recv_mono += gap
        self.leases.shift(gap)
        log.warning("broker_stalled", stalled_s=round(gap, 3), peers=len(self.peers), leases=len(self.leases))
        return now

    # --- decoding and the one disconnect rule ---
    def _decode(self, raw: list[bytes], now: float) -> tuple[bytes, Envelope] | None:
        rid = raw[0]
        sess = self.peers.by_routing(rid)
        try:
            return rid, self.codec.decode(raw[1:], bound_sender=sess.peer_id if sess else None)
        except DecodeError as exc:
            self._count_reject(exc.code, str(exc)[:300], sess.peer_id if sess else exc.sender, rid, now)
            if sess is not None or exc.code in POST_VERIFY_CODES:
                self._send_raw(rid, p.Error(exc.code, str(exc)[:300]))
            elif exc.code in STRANGER_ANSWERS and exc.answerable and exc.sender and self._may_answer_stranger(exc.sender, now):
                # unauthenticated: a fixed sentence naming only the id it claimed (docs/security.md)
                self._send_raw(rid, p.Error(exc.code, STRANGER_ANSWERS[exc.code].format(peer=exc.sender)))
            if sess is not None:
                self._end_session(sess, f"invalid envelope: {exc.code}")
            return None

    def _count_reject(self, code: str, reason: str, peer: str | None, rid: bytes, now: float) -> None:
        """Count a refused frame (metric ccsq_frames_rejected, persisted) and log it at most
        once per REJECT_LOG_INTERVAL_S per claimed peer id (per connection when none)."""
        self.rejects[code] += 1
        self._rejects_unsaved[code] += 1
        key = (peer or rid, code)
        if now - self._reject_logged.get(key, -1e9) >= REJECT_LOG_INTERVAL_S:
            if now - self._reject_window_mono >= REJECT_LOG_INTERVAL_S:  # a new window for all peers together
                if self._reject_lines_dropped:
                    log.warning("frame_rejected_suppressed", lines=self._reject_lines_dropped,
                                interval_s=REJECT_LOG_INTERVAL_S, limit=REJECT_LOG_LINES_PER_INTERVAL)
                self._reject_window_mono, self._reject_window_lines, self._reject_lines_dropped = now, 0, 0
            if self._reject_window_lines >= REJECT_LOG_LINES_PER_INTERVAL:  # many ids: a flood, not a peer
                self._reject_lines_dropped += 1
                return
            self._reject_window_lines += 1
            if len(self._reject_logged) > 10_000:
                self._reject_logged.clear()
            self._reject_logged[key] = now
            log.warning("frame_rejected", code=code, reason=reason, peer=peer)

    def _may_answer_stranger(self, sender: str, now: float) -> bool:
        """Whether an unauthenticated sender may get its refusal now: at most once per
        STRANGER_ANSWER_INTERVAL_S per claimed id, and STRANGER_ANSWERS_PER_S for all
        strangers together (token bucket), so a flood costs the broker no more than its frames."""
        last = self._stranger_answered.get(sender)
        if last is not None and now - last < STRANGER_ANSWER_INTERVAL_S:
            return False
        elapsed = now - self._stranger_tokens_mono
        self._stranger_tokens = min(STRANGER_ANSWERS_PER_S, self._stranger_tokens + elapsed * STRANGER_ANSWERS_PER_S)
        self._stranger_tokens_mono = now
        if self._stranger_tokens < 1.0:
            return False
        self._stranger_tokens -= 1.0
        if len(self._stranger_answered) > 10_000:
            self._stranger_answered.clear()
        self._stranger_answered[sender] = now
        return True

    def _unserved(self, sess: Session, items: list[p.SubmitItem]) -> list[str]:
        """Kinds of ``items`` that no worker connected since the broker started serves, for a
        producer that asked (HELLO info ``features``); [] in the first liveness windows after
        start (workers are still reconnecting)."""
        if "unserved_kinds" not in str(sess.info_hello.get("features", "")):
            return []
        if not self._kinds_recorded and time.monotonic() - self._started_mono < 2 * self.silence_s:
            return []  # no record of recent workers (new ledger): they may still be reconnecting
        if "" in self._kinds_seen:  # a worker that takes every kind
            return []
        return sorted({it.kind for it in items} - self._kinds_seen.keys())

    def _end_session(self, sess: Session, reason: str) -> None:
        """Remove a session (the one disconnect rule, BYE, or replacement). Its
        leases stay until they expire; unsent DISPATCHes are released (never sent);
        its unacknowledged deliveries become deliverable again (G3)."""
        if self.peers.get(sess.peer_id) is sess:
            self.peers.remove(sess.peer_id)
        sess.status = PeerStatus.GONE
        for msg in sess.pending:
            if isinstance(msg, p.Dispatch):
                for t in msg.tasks:
                    self.deferred.append(("release", t.item_id, t.token, "dispatch never sent"))
        sess.pending.clear()
        for item_id in sess.in_flight:
            if self.delivered.get(item_id) == sess.peer_id:
                del self.delivered[item_id]
                self.redeliver.add(item_id)
                self._delivered_below_cseq = 0
                self._delivery_floor_resets += 1
        if sess.in_flight:
            self._deliver_possible = True
        sess.in_flight.clear()
        log.info("peer_disconnected", peer=sess.peer_id, role=sess.role.value, reason=reason)

    # --- session messages (peer table only; no ledger writes) ---
    def _on_hello(self, rid: bytes, env: Envelope, now: float) -> None:
        hello: p.Hello = env.message  # type: ignore[assignment]
        if hello.role != env.role.value:
            self._count_reject(p.REJECT_ROLE, f"authorized as {env.role.value}, HELLO says {hello.role}", env.sender, rid, now)
            self._send_raw(rid, p.Error(p.REJECT_ROLE, f"authorized as {env.role.value}, HELLO says {hello.role}", env.seq))
            return
        old = self.peers.get(env.sender)
        if old is not None:
            if old.routing_id != rid:
                # a reconnecting peer closed its old socket, so this reaches nobody; a second
                # live process with the same peer id gets it and stops instead of fighting
                self._send_raw(old.routing_id, p.Error(p.ERROR_REPLACED, f"a newer session of {env.sender} replaced this one"))
            self._end_session(old, "replaced by a new session")
        sess = Session(
            peer_id=env.sender,
            role=env.role,
            routing_id=rid,
            session=env.session,
            credit=max(0, min(hello.credit, 1 << 20)),
            slots=hello.slots,
            kinds=tuple(hello.kinds),
            info=dict(hello.info),
            info_hello=dict(hello.info),
        )
        self.peers.add(sess)
        resumed: list[p.LeaseRef] = []
        released: list[p.LeaseRef] = []
        if env.role is p.Role.WORKER:
            self._kinds_seen.update(dict.fromkeys(sess.kinds or ("",), True))
            self._kinds_unsaved.update(sess.kinds or ("",))
        if env.role in p.LEASE_HOLDER_ROLES:
            listed = set()
            for ref in hello.leases:
                listed.add(ref.item_id)
                if self.leases.extend(ref.item_id, ref.token, env.sender, now + self.lease_ttl_s):
                    resumed.append(ref)
                else:
                    released.append(ref)
            for lease in self.leases.held_by(env.sender):
                if lease.item_id not in listed:
                    self.deferred.append(("expire", lease.item_id, lease.token, "worker reconnected without it"))
            self._dispatch_at_mono = now
        if env.role in (p.Role.COMPLETION, p.Role.RELAY):
            self._deliver_possible = True
        welcome = p.Welcome(self.hb_s, self.cfg.liveness, self.epoch, resumed, released)
        self._send(rid, welcome)
        log.info(
            "peer_connected",
            peer=env.sender,
            role=env.role.value,
            credit=sess.credit,
            kinds=list(sess.kinds),
            resumed=len(resumed),
            released=len(released),
            info=sess.info,
        )

    def _on_session_message(self, sess: Session, env: Envelope, now: float) -> None:
        msg = env.message
        if isinstance(msg, p.Heartbeat):
            if sess.role in p.LEASE_HOLDER_ROLES:
                self.stats.heartbeat(env.ts_ms)
                for ref in msg.leases:
                    self.leases.extend(ref.item_id, ref.token, sess.peer_id, now + self.lease_ttl_s)
                if msg.healthy and not sess.healthy:
                    self._dispatch_at_mono = now
                sess.healthy = msg.healthy
                sess.busy, sess.done = msg.busy, msg.done
                if len(sess.info) + len(msg.info) > 256:
                    sess.info = dict(sess.info_hello)
                sess.info.update(msg.info)
        elif isinstance(msg, p.Credit):
            if msg.credit <= 0:
                self._send(sess.routing_id, p.Error(p.REJECT_MALFORMED, "credit must be > 0", env.seq))
                return
            sess.credit = min(sess.credit + msg.credit, 1 << 20)
            self._dispatch_at_mono = now
            self._deliver_possible = True
        elif isinstance(msg, p.Bye):
            self._end_session(sess, f"bye: {msg.reason}")

    # --- the transaction of a turn ---
    def _background_due(self, now: float) -> bool:
        if self.deferred or self._rejects_unsaved or now >= self._next_background_mono:
            return True
        due = self.leases.next_due_mono()
        if due is not None and due <= now:
            return True
        if now >= self._dispatch_at_mono and self._workers_with_credit():
            return True
        return self._deliver_possible and any(s.credit > 0 for s in self._result_takers())

    def _result_takers(self) -> list[Session]:
        """Completion services, and downstream relays while a routed result waits for one."""
        takers = self.peers.sessions(p.Role.COMPLETION)
        if self.fed.routed_all:
            takers += [s for s in self.peers.sessions(p.Role.RELAY) if fed.relay_side(s) == fed.DOWNSTREAM]
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
            if mode == "acks":  # at the max size even without growth: only what keeps delivery moving
                self._apply_ops(txn, batch, [op for op in ops if isinstance(op[2].message, (p.Ack, p.Status))], "QUEUE_FULL")
            else:
                self._apply_ops(txn, batch, ops, refuse if mode == "normal" else (refuse or "QUEUE_FULL"))
                self._apply_deferred(txn, batch, deferred)
                if self._kinds_unsaved:  # a hint for the next start only: lost with an aborted turn, harmless
                    txn.note_kinds_served(self._kinds_unsaved, wall_ms())
                    self._kinds_unsaved = set()
                self._apply_expiries(txn, batch, due)
            backlog = False
            if background and mode not in ("minimal", "acks"):
                backlog = maintenance.expire_deadlines(txn, wall_ms(), SLICE_ENTRIES) >= SLICE_ENTRIES
                backlog = maintenance.purge(txn, wall_ms(), SLICE_ENTRIES) >= SLICE_ENTRIES or backlog
                maintenance.append_sample(txn, wall_ms(), self.cfg.accounting_sample_interval_s)
            if mode not in ("minimal", "acks"):
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
            self.ledger_full_since_ms = self.ledger_full_since_ms or wall_ms()
            log.error("ledger_full_batch_dropped", ops=len(ops), acks_committed=committed, advice=LEDGER_FULL_ADVICE)
            self.deferred = deferred + self.deferred
            for lease in due:
                self.leases.requeue_check(lease)
            if not committed:
                return
        if background:
            # a slice that used its whole budget has more to do: come back soon
            self._next_background_mono = now + (BACKGROUND_BUSY_INTERVAL_S if backlog else BACKGROUND_INTERVAL_S)
            self._refresh_snapshot()
        if self.ledger_full_since_ms and mode == "normal" and any(isinstance(e.message, p.Complete) for _, _, e in ops):
            self.ledger_full_since_ms = 0  # completions fit again
            log.info("ledger_full_cleared")
        self._rejects_unsaved.clear()
        for name in batch.crash_points:
            crash_point(name)
        for fn in batch.effects:
            fn()
        for rid, msg in batch.replies:
            self._send(rid, msg)

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
            txn.note_history(wall_ms(), used // self.ledger.env.stat()["psize"])
        cleared = self.ledger.clear_stale_readers()  # ~1 us: a dead reader pins history for at most ~0.1 s
        if cleared:
            log.warning("ledger_stale_readers_cleared", cleared=cleared, total=self.ledger.stale_readers_cleared)
        if not background:
            return
        doc = reader_report(self.ledger, txn, wall_ms(), warn_age_s=self.cfg.reader_warn_age_s)
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
        if not any(isinstance(env.message, p.Submit) for _, _, env in ops):
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
        now_ms = wall_ms()
        admitted = 0  # admission cost of this turn's new items
        for rid, sess, env in ops:
            msg = env.message
            if isinstance(msg, p.Submit):
                results = []
                # items not yet completed (ready + leased): read once per frame, then counted here
                pending = 0 if refuse else (txn.state_count(p.ItemState.READY.value)
                                            + txn.state_count(p.ItemState.LEASED.value))
                for item in msg.items:
                    cost = _blob_size(item.payload) + ITEM_RECORD_BYTES
                    refusal = refuse or self._admission_refusal(pending, admitted + cost)
                    if sess.role is p.Role.RELAY:
                        r = self._submit_relayed(txn, batch, sess, item, now_ms, refusal)
                    else:
                        r = txn.submit(item, now_ms, refuse=refusal)
                    if r.item_id and not r.duplicate:  # a new ready item
                        admitted += cost
                        pending += 1
                    results.append(r)
                batch.replies.append((rid, p.SubmitAck(msg.req, results, unserved=self._unserved(sess, msg.items))))
                if any(r.item_id and not r.duplicate for r in results):
                    batch.crash("broker.after_submit_commit")
                    batch.effects.append(self._wake_dispatch)
            elif isinstance(msg, p.Complete):
                outcomes = []
                for r in msg.results:
                    outcome = self._complete_relayed(txn, batch, sess, r, now_ms) if sess.role is p.Role.RELAY \
                        else txn.complete(r, now_ms, env.sender)
                    outcomes.append(p.ItemOutcome(r.item_id, r.token, outcome))
                    if self.fed.enabled and outcome == p.Outcome.ACCEPTED.value:
                        reply_to = (txn.get(r.item_id) or {}).get("reply_to")
                        if reply_to:  # at once, not after commit: this turn's _deliver must skip it too
                            self.fed.route(reply_to, r.item_id)  # (a hint: delivery checks the ledger state)
                    if outcome in (p.Outcome.ACCEPTED.value, p.Outcome.DUPLICATE.value):
                        batch.effects.append(lambda i=r.item_id, t=r.token: self.leases.discard(i, t))
                batch.crash("broker.after_complete_commit")
                batch.effects.append(self._wake_delivery)
                batch.replies.append((rid, p.CompleteAck(outcomes)))
            elif isinstance(msg, p.Fail):
                outcomes = []
                for f in msg.failures:
                    outcome = txn.fail(f, now_ms, env.sender)
                    outcomes.append(p.ItemOutcome(f.item_id, f.token, outcome))
                    if f.reason == p.FailReason.STORE_UNAVAILABLE.value and outcome == p.Outcome.ACCEPTED.value:
                        batch.effects.append(lambda w=sess.peer_id: self.peers.note_store_failure(w))
                    if outcome == p.Outcome.ACCEPTED.value:
                        batch.effects.append(lambda i=f.item_id, t=f.token: self.leases.discard(i, t))
                batch.effects.append(self._wake_dispatch)
                batch.replies.append((rid, p.FailAck(outcomes)))
            elif isinstance(msg, p.Ack):
                done, unknown = [], []
                quarantined = {q.item_id: q.error or "quarantined" for q in msg.quarantined}
                for item_id in msg.item_ids:
                    r = txn.ack(item_id, now_ms, quarantined.get(item_id, ""))
                    (unknown if r is None else done).append(item_id)
                    if r is not None:
                        batch.effects.append(lambda i=item_id: self._forget_delivery(i))
                batch.crash("broker.after_ack_commit")
                batch.replies.append((rid, p.AckOk(done, unknown)))
            elif isinstance(msg, (p.Status, p.Cancel)):
                if isinstance(msg, p.Cancel):  # only READY items: a running one is the worker's to finish
                    for i in msg.item_ids:
                        if txn.dead_letter_ready(i, p.FailReason.CANCELLED.value, f"cancelled by {env.sender}", now_ms):
                            log.info("item_cancelled", item=i, by=env.sender)
                statuses = [txn.item_status(i) for i in msg.item_ids]
                for chunk in split_frames(statuses, size_of=_status_size, budget_bytes=self._reply_budget(), max_items=1 << 16) or [[]]:
                    batch.replies.append((rid, p.StatusReply(msg.req, chunk)))
            elif isinstance(msg, p.Admin):
                batch.replies.append((rid, self.admin.handle(txn, batch, sess, msg)))
        if admitted:
            batch.effects.append(lambda n=admitted: setattr(self, "_admitted_bytes", self._admitted_bytes + n))

    def _admission_refusal(self, pending: int, cost: int) -> str:
        """"QUEUE_FULL" when one more item of ``cost`` bytes (plus this turn's earlier ones)
        would leave no room for the results of the ``pending`` items already accepted and not
        completed, and its own; see the config's ``result_reserve_bytes``. "" otherwise."""
        need = self._used_bytes + self._admitted_bytes + cost + (pending + 1) * self.cfg.result_reserve_bytes
        return "QUEUE_FULL" if need > SOFT_FULL_FRACTION * self.ledger.max_map_size_bytes else ""

    def _apply_deferred(self, txn: LedgerTxn, batch: Batch, deferred: list[tuple[str, str, int, str]]) -> None:
        now_ms = wall_ms()
        for op, item_id, token, why in deferred:
            if op == "release":
                if txn.release(item_id, token, now_ms):
                    log.info("lease_released", item=item_id, token=token, why=why)
            elif op == "expire":
                holder = (txn.get(item_id) or {}).get("worker", "")
                new = txn.expire_lease(item_id, token, now_ms, why)
                self._note_relay_lease_lost(txn, item_id, holder, now_ms, new)
                if new:
                    batch.effects.append(lambda n=new: self.stats.lease_expired(n))
                    log.info("lease_expired", item=item_id, token=token, why=why, now=new)
            elif op == "dead":
                if txn.dead_letter(item_id, token, why, "cannot be dispatched", now_ms):
                    log.warning("item_dead", item=item_id, reason=why)
            batch.effects.append(lambda i=item_id, t=token: self.leases.discard(i, t))
        if deferred:
            batch.effects.append(self._wake_dispatch)

    def _apply_expiries(self, txn: LedgerTxn, batch: Batch, due: list) -> None:
        now_ms = wall_ms()
        for lease in due:
            new = txn.expire_lease(lease.item_id, lease.token, now_ms, "lease expired")
            self._note_relay_lease_lost(txn, lease.item_id, lease.worker, now_ms, new)
            if new:
                batch.effects.append(lambda n=new: self.stats.lease_expired(n))
                log.info("lease_expired", item=lease.item_id, token=lease.token, worker=lease.worker, now=new)
                if new == p.ItemState.DEAD.value:
                    log.warning("item_dead", item=lease.item_id, reason="worker_lost")
            batch.effects.append(lambda i=lease.item_id, t=lease.token: self.leases.discard(i, t))
        if due:
            batch.effects.append(self._wake_dispatch)

    # --- dispatch (pull: only to workers with credit) ---
    def _workers_with_credit(self) -> list[Session]:
        return [
            s
            for s in self.peers.sessions(p.Role.WORKER) + self._relays(fed.UPSTREAM)
            if s.credit > 0 and s.healthy and not s.pending and s.peer_id not in self.peers.draining
        ]

    def _wake_dispatch(self) -> None:
        self._dispatch_at_mono = 0.0

    def _dispatch(self, txn: LedgerTxn, batch: Batch, now: float) -> None:
        if now < self._dispatch_at_mono:
            return
        workers = self._workers_with_credit()
        if not workers:
            return
        if txn.state_count(p.ItemState.READY.value) == 0:
            batch.effects.append(lambda: setattr(self, "_dispatch_at_mono", float("inf")))
            return
        budget_end = time.monotonic() + self.cfg.slice_budget_ms / 1000.0
        k = self._rr % len(workers)
        workers = workers[k:] + workers[:k]
        self._rr += 1
        now_ms = wall_ms()
        ttl_ms = int(self.lease_ttl_s * 1000)
        next_at = float("inf")
        exhausted = False
        for sess in workers:
            if time.monotonic() > budget_end:
                exhausted = True
                break
            limit = min(sess.credit, self.cfg.max_batch_items)
            relay = sess.role is p.Role.RELAY  # never an item that came by relay (max_hops); signed
            ids, hint = (fed.scan_for_relay(txn, list(sess.kinds) or None, limit, now_ms) if relay
                         else txn.scan_ready(list(sess.kinds) or None, limit, now_ms))
            if hint is not None:
                next_at = min(next_at, now + max(0, hint - now_ms) / 1000.0)
            tasks = []
            for n, item_id in enumerate(ids):
                if n % LEASE_BUDGET_CHECK_EVERY == LEASE_BUDGET_CHECK_EVERY - 1 and time.monotonic() > budget_end:
                    exhausted = True  # the slice's time is up: the next turn goes on
                    break
                task = txn.lease(item_id, sess.peer_id, now_ms, ttl_ms)
                if task is not None:
                    tasks.append(self.fed.sign_task(txn, task, self.cfg.max_attempts) if relay else task)
            if len(ids) == limit and sess.credit > len(tasks):
                exhausted = True  # some were expired or more may be waiting
            if not tasks:
                continue
            batch.crash("broker.after_lease_commit")
            batch.effects.append(lambda s=sess, ts=tasks: self._leased(s, ts))
            for chunk in split_frames(tasks, size_of=_task_size, budget_bytes=self._reply_budget(), max_items=self.cfg.max_batch_items):
                batch.replies.append((sess.routing_id, p.Dispatch(chunk)))
        at = 0.0 if exhausted else next_at
        batch.effects.append(lambda: setattr(self, "_dispatch_at_mono", at))

    def _leased(self, sess: Session, tasks: list[p.Task]) -> None:
        expires = time.monotonic() + self.lease_ttl_s
        for t in tasks:
            self.leases.add(t.item_id, t.token, sess.peer_id, expires)
        sess.credit -= len(tasks)

    # --- result delivery to completion services ---
    def _wake_delivery(self) -> None:
        self._deliver_possible = True

    def _forget_delivery(self, item_id: str) -> None:
        self.fed.unroute(item_id)
        peer = self.delivered.pop(item_id, None)
        self.redeliver.discard(item_id)
        if peer is not None:
            sess = self.peers.get(peer)
            if sess is not None:
                sess.in_flight.discard(item_id)

    def _deliver(self, txn: LedgerTxn, batch: Batch) -> None:
        if not self._deliver_possible:
            return
        more_routed = self._deliver_routed(txn, batch) if self.fed.routed_all else False
        sessions = [s for s in self.peers.sessions(p.Role.COMPLETION) if s.credit > 0 and not s.pending]
        if not sessions:
            if self.fed.routed_all:
                batch.effects.append(lambda: setattr(self, "_deliver_possible", more_routed))
            return
        now_ms = wall_ms()
        planned: set[str] = set()
        more = False
        floor = self._delivered_below_cseq
        budget = DELIVER_PER_TURN
        for sess in sessions:
            limit = min(sess.credit, self.cfg.max_batch_items, budget)
            if limit <= 0:
                more = True
                break
            routed = self.fed.routed_all  # results of relayed items go to their relay only
            ids, floor = txn.completed_ids(lambda i: i in self.delivered or i in planned or i in routed, limit, floor)
            if len(ids) == limit:
                more = True
            if not ids:
                continue
            budget -= len(ids)
            deliveries = []
            for item_id in ids:
                planned.add(item_id)
                rec = txn.get(item_id)
                redelivery = item_id in self.redeliver
                why = "completion session ended before ACK"
                if not redelivery and rec is not None and rec.get("completed_epoch", self.epoch) < self.epoch:
                    redelivery, why = True, "completed before a broker restart: may have been delivered"
                if redelivery:
                    txn.note_redelivery(item_id, now_ms, why)
                deliveries.append(txn.delivery(item_id, redelivery))
            batch.effects.append(lambda s=sess, ds=deliveries: self._delivered(s, ds))
            for chunk in split_frames(deliveries, size_of=_delivery_size, budget_bytes=self._reply_budget(), max_items=self.cfg.max_batch_items):
                batch.replies.append((sess.routing_id, p.Result(chunk)))
        batch.effects.append(lambda: setattr(self, "_deliver_possible", more or more_routed))
        batch.effects.append(lambda f=floor, g=self._delivery_floor_resets: self._advance_delivery_floor(f, g))

    def _advance_delivery_floor(self, cseq: int, resets: int) -> None:
        """After commit: entries below ``cseq`` are all delivered (in flight), unless
        a session ended since the scan and made some deliverable again."""
        if resets == self._delivery_floor_resets:
            self._delivered_below_cseq = max(self._delivered_below_cseq, cseq)

    def _delivered(self, sess: Session, deliveries: list[p.Delivery]) -> None:
        if sess.status is PeerStatus.GONE:
            # the session ended between the scan and this commit: nothing was
            # delivered to it; the next delivery of these items is a redelivery
            for d in deliveries:
                self.redeliver.add(d.item_id)
            self._delivered_below_cseq = 0
            self._delivery_floor_resets += 1
            self._deliver_possible = True
            return
        for d in deliveries:
            self.delivered[d.item_id] = sess.peer_id
            self.redeliver.discard(d.item_id)
            sess.in_flight.add(d.item_id)
        sess.credit -= len(deliveries)

    # --- sending (never blocks, never drops silently) ---
    def _reply_budget(self) -> int:
        return max(self.cfg.max_frame_bytes - 8192, self.cfg.max_frame_bytes // 2)

    def _send_raw(self, rid: bytes, msg: p.Message) -> None:
        """Best-effort send to a routing id without a session (errors to strangers)."""
        try:
            self.transport.send(rid, msg)
        except DecodeError:
            pass

    def _send(self, rid: bytes, msg: p.Message) -> None:
        sess = self.peers.by_routing(rid)
        if sess is None:
            # The session ended after this reply was made: whatever it confirmed is
            # durable; the peer re-sends on its next session (at-least-once).
            self._unsendable(msg, "no session")
            return
        if sess.pending:
            if len(sess.pending) >= MAX_PENDING_PER_PEER:
                self._end_session(sess, "send queue overflow")
                self._unsendable(msg, "send queue overflow")
                return
            sess.pending.append(msg)
            return
        self._try_send(sess, msg, queue_on_again=True)

    def _try_send(self, sess: Session, msg: p.Message, *, queue_on_again: bool) -> bool:
        try:
            r = self.transport.send(sess.routing_id, msg)
        except DecodeError as exc:
            log.error("reply_too_large", peer=sess.peer_id, type=msg.TYPE.name, error=str(exc))
            self._unsendable(msg, "too large", dead=True)
            return True
        if r == tp.SENT:
            return True
        if r == tp.AGAIN:
            if queue_on_again:
                sess.pending.append(msg)
            return False
        self._end_session(sess, "unroutable (socket gone)")
        self._unsendable(msg, "unroutable")
        return False

    def _unsendable(self, msg: p.Message, why: str, *, dead: bool = False) -> None:
        """A reply that cannot be sent: DISPATCHed leases go back (never sent)."""
        if isinstance(msg, p.Dispatch):
            op = "dead" if dead else "release"
            for t in msg.tasks:
                self.deferred.append((op, t.item_id, t.token, "payload_too_large" if dead else f"dispatch {why}"))

    # --- timers: heartbeats, liveness, pending sends ---
    def _timers(self, now: float) -> None:
        for sess in [s for s in self.peers.by_id.values() if s.pending]:
            while sess.pending and sess.status is PeerStatus.CONNECTED:
                msg = sess.pending[0]
                if not self._try_send(sess, msg, queue_on_again=False):
                    break
                if sess.pending:
                    sess.pending.popleft()
            if not sess.pending:
                self._dispatch_at_mono = 0.0
                self._deliver_possible = True
        if now >= self._next_liveness_mono:
            self._next_liveness_mono = now + min(self.hb_s / 2, 0.25)
            for sess in list(self.peers.by_id.values()):
                if now - sess.last_recv_mono > self.silence_s:
                    self._end_session(sess, f"silent for {now - sess.last_recv_mono:.2f}s")
        if now >= self._next_hb_mono:
            self._next_hb_mono = now + self.hb_s
            caps = self._relay_capacity()
            for sess in list(self.peers.by_id.values()):
                if not sess.pending:
                    hb = p.Heartbeat(info=caps[sess.peer_id]) if sess.peer_id in caps else p.Heartbeat()
                    self._try_send(sess, hb, queue_on_again=False)

    # --- federation (common/wire/federation.py, docs/federation.md) ---
    def _relays(self, side: str) -> list[Session]:
        return [s for s in self.peers.sessions(p.Role.RELAY) if fed.relay_side(s) == side]

    def _reject_counted(self, txn: LedgerTxn, batch: Batch, code: str, peer: str, item: str, why: str) -> None:
        txn.count_reject(code)
        batch.effects.append(lambda: self.rejects.update([code]))
        log.warning("relayed_rejected", code=code, peer=peer, item=item[:120], reason=why[:300])

    def _submit_relayed(self, txn: LedgerTxn, batch: Batch, sess: Session, item: p.SubmitItem, now_ms: int,
                        refuse: str) -> p.SubmitResult:
        """A relay's SUBMIT: only items whose origin signature verifies; the item records its
        origin and the relay, and its idempotency key is the origin (a resubmission is G9)."""
        origin, why = fed.check_origin(item, self.fed.trust, self.fed.swarm_id)
        if origin is None:
            self._reject_counted(txn, batch, fed.ORIGIN_REJECTED, sess.peer_id, item.key, why)
            txn.event(gaps.F4_RELAYED_ITEM_REFUSED, item.key[:200], now_ms, f"from {sess.peer_id}: {why[:200]}")
            return p.SubmitResult(item.key, "", error=fed.ORIGIN_REJECTED, message=why)
        res = txn.submit(item, now_ms, refuse=refuse, origin=origin, reply_to=sess.peer_id)
        if res.duplicate and (txn.get(res.item_id) or {}).get("origin") != origin:
            # a producer took this origin key first: never hand the relay someone else's item
            why = f"key {item.key[:120]} belongs to an item that did not come by relay"
            self._reject_counted(txn, batch, fed.ORIGIN_KEY_TAKEN, sess.peer_id, item.key, why)
            return p.SubmitResult(item.key, "", error=fed.ORIGIN_KEY_TAKEN, message=why)
        if res.duplicate:
            txn.event(gaps.F3_RELAYED_RESUBMIT, res.item_id, now_ms, f"origin {origin['swarm']}:{origin['item_id']} from {sess.peer_id}")
            if (txn.get(res.item_id) or {}).get("state") == p.ItemState.ACKNOWLEDGED.value:
                # the upstream leased it again after an earlier relay took this result home and
                # it was fenced there: deliver the (still stored) result once more (G3)
                self.fed.route(sess.peer_id, res.item_id)
                self._deliver_possible = True
        return res

    def _complete_relayed(self, txn: LedgerTxn, batch: Batch, sess: Session, r: p.TaskResult, now_ms: int) -> str:
        """A relay's COMPLETE counts only with the downstream broker's valid proof."""
        why = fed.check_proof(r, self.fed.trust, self.fed.swarm_id)
        if why:
            self._reject_counted(txn, batch, fed.RESULT_REJECTED, sess.peer_id, r.item_id, why)
            return p.Outcome.REJECTED.value
        before = txn.get(r.item_id) or {}
        outcome = txn.complete(r, now_ms, sess.peer_id)
        if outcome == p.Outcome.FENCED.value or (outcome == p.Outcome.ACCEPTED.value and before.get("state") == p.ItemState.READY.value):
            txn.event(gaps.F2_RELAYED_RESULT_LATE, r.item_id, now_ms, f"token {r.token} from {sess.peer_id}: {outcome}")
        return outcome

    def _note_relay_lease_lost(self, txn: LedgerTxn, item_id: str, holder: str, now_ms: int, new_state: str) -> None:
        key = self.codec.authorized.get(holder)
        if new_state and key is not None and key.role is p.Role.RELAY:
            txn.event(gaps.F1_RELAY_LEASE_LOST, item_id, now_ms, f"lease of relay {holder}: item now {new_state}")

    def _deliver_routed(self, txn: LedgerTxn, batch: Batch) -> bool:
        """Deliver completed relayed items to the relay that submitted them (when it is
        connected with credit; kept otherwise), each with this broker's signed proof.
        Returns whether more are waiting."""
        more = False
        now_ms = wall_ms()
        for sess in self._relays(fed.DOWNSTREAM):
            ids = self.fed.routed.get(sess.peer_id)
            if not ids or sess.credit <= 0 or sess.pending:
                continue
            limit = min(sess.credit, self.cfg.max_batch_items)
            todo = [i for i in ids if i not in self.delivered]
            if len(todo) > limit:
                more, todo = True, todo[:limit]
            deliveries = []
            for item_id in todo:
                rec = txn.get(item_id)
                if rec is None or rec["state"] not in (p.ItemState.COMPLETED.value, p.ItemState.ACKNOWLEDGED.value):
                    batch.effects.append(lambda i=item_id: self.fed.unroute(i))
                    continue
                redelivery = item_id in self.redeliver or rec["state"] == p.ItemState.ACKNOWLEDGED.value
                why = "relay session ended before ACK" if rec["state"] == p.ItemState.COMPLETED.value else \
                    "acknowledged result asked for again by a relay (its upstream leased the item again)"
                if not redelivery and rec.get("completed_epoch", self.epoch) < self.epoch:
                    redelivery, why = True, "completed before a broker restart: may have been delivered"
                if redelivery:
                    txn.note_redelivery(item_id, now_ms, why)
                deliveries.append(self.fed.sign_delivery(rec, txn.delivery(item_id, redelivery)))
            if not deliveries:
                continue
            batch.effects.append(lambda s=sess, ds=deliveries: self._delivered(s, ds))
            for chunk in split_frames(deliveries, size_of=_delivery_size, budget_bytes=self._reply_budget(), max_items=self.cfg.max_batch_items):
                batch.replies.append((sess.routing_id, p.Result(chunk)))
        return more

    def _relay_capacity(self) -> dict[str, dict]:
        """Heartbeat.info per relay session: to downstream relays the free worker capacity of
        their kinds; to upstream relays of policy ``deadline`` whether this swarm's drain
        forecast misses a kind's nearest deadline (recomputed at most every 5 s)."""
        relays = self._relays(fed.DOWNSTREAM)
        pressed = [s for s in self._relays(fed.UPSTREAM) if s.info_hello.get(fed.POLICY) == "deadline"]
        if not relays and not pressed:
            return {}
        out = {}
        with self.ledger.read() as view:
            kind_states = view.kind_states()
            workers = self.peers.sessions(p.Role.WORKER)
            out = {s.peer_id: fed.capacity(workers, self.peers.draining, kind_states, s.kinds) for s in relays}
            if pressed:
                now = time.monotonic()
                cached = getattr(self, "_fed_forecast", None)
                if cached is None or now - cached[0] >= 5.0:
                    from ccsq.brokerd.report import queue_forecast

                    cached = (now, queue_forecast(kind_states, view.samples(), view.nearest_deadlines(), wall_ms()))
                    self._fed_forecast = cached
                out.update({s.peer_id: fed.deadline_pressure(cached[1], s.kinds) for s in pressed})
        return out


def _op_items(msg: p.Message) -> int:
    """How many item operations a ledger message asks for (its share of a turn's budget)."""
    if isinstance(msg, p.Admin):
        if msg.args.get("all") is True:
            return MAX_ITEMS_PER_COMMAND
        ids = msg.args.get("item_ids")
        return max(1, ids.count(",") + 1) if isinstance(ids, str) else 1
    for attr in ("items", "results", "failures", "item_ids"):
        v = getattr(msg, attr, None)
        if v is not None:
            return max(1, len(v))
    return 1



def _blob_size(b: p.Blob | None) -> int:
    return 0 if b is None or b.inline is None else len(b.inline)


def _params_size(params: dict) -> int:
    return sum(len(k) + (len(v) if isinstance(v, (str, bytes)) else 9) for k, v in params.items())


def _status_size(s: p.ItemStatus) -> int:
    return 200 + len(s.error) + _blob_size(s.result)


def _task_size(t: p.Task) -> int:
    return 260 + len(t.kind) + _blob_size(t.payload) + _params_size(t.params)


def _delivery_size(d: p.Delivery) -> int:
    return 320 + len(d.key) + len(d.kind) + _blob_size(d.result) + _params_size(d.params)

