"""Sessions: HELLO/WELCOME, HEARTBEAT, CREDIT, BYE and liveness, applied to the peer
table at once (no ledger writes; the actor's turn calls :meth:`Sessions.receive` for
every verified frame).

A session begins with HELLO and ends by the one disconnect rule (silent for
``heartbeat_interval_s x liveness``, an invalid envelope, an unroutable socket or an
overfull send queue),
by BYE, or by replacement; :meth:`Sessions.end` is the one place it ends. A live
session keeps its peer id: a HELLO for it from another process (another
``info["instance"]``) is refused with ``ID_IN_USE``; only the same instance
reconnecting replaces it, and a session past its liveness window ends when a new
HELLO comes (docs/security.md, "one peer id, one live session"). A lease
holder's HELLO lists the leases it still holds: those the broker knows are resumed,
the rest released, and leases the broker knows but the peer did not list expire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from ccsq.brokerd.clock import SYSTEM_CLOCK, Clock
from ccsq.brokerd.peers import PeerStatus, Session
from ccsq.common.wire import federation as fed
from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import MAC_OFFER_INFO

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.delivery import DeliveryTracker
    from ccsq.brokerd.metrics import BrokerStats
    from ccsq.brokerd.outbound import Outbound
    from ccsq.brokerd.peers import LeaseTimers, PeerTable
    from ccsq.common.wire.config import BrokerConfig
    from ccsq.common.wire.envelope import Envelope

log = structlog.get_logger("ccsq.brokerd")

SESSION_TYPES = (protocol.Hello, protocol.Heartbeat, protocol.Credit, protocol.Bye)
MAX_CREDIT = 1 << 20


class Sessions:
    """The session rules of the broker actor over its peer table.

    Collaborators: ``leases`` (resumed at HELLO, extended by heartbeats), ``delivery``
    (a session's unacknowledged deliveries when it ends), ``outbound`` (WELCOME, errors,
    heartbeats). Callbacks into the actor: ``defer(op, item_id, token, why)`` queues a
    lease expiry for the next transaction, ``wake_dispatch()``, ``worker_kinds(kinds)``
    (a worker said HELLO), ``count_reject(code, reason, peer, rid, now)``,
    ``heartbeat_info()`` (peer id -> Heartbeat.info to send, for relays),
    ``hello_opened(peer_id, session, ts_ms)`` (a HELLO opened a session: its replay identity
    for the ledger, written by the turn's transaction with the HELLO's lease effects)."""

    def __init__(self, cfg: BrokerConfig, epoch: int, peers: PeerTable, leases: LeaseTimers, delivery: DeliveryTracker,
                 outbound: Outbound, stats: BrokerStats, *, defer: Callable[[str, str, int, str], None],
                 wake_dispatch: Callable[[], None], worker_kinds: Callable[[tuple[str, ...]], None],
                 count_reject: Callable[[str, str, str | None, bytes, float], None],
                 heartbeat_info: Callable[[], dict[str, dict]], clock: Clock = SYSTEM_CLOCK,
                 hello_opened: Callable[[str, int, int], None] = lambda peer_id, session, ts_ms: None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.hb_s = cfg.heartbeat_interval_s
        self.silence_s = cfg.heartbeat_interval_s * cfg.liveness
        self.epoch = epoch
        self.peers = peers
        self.leases = leases
        self.delivery = delivery
        self.outbound = outbound
        self.stats = stats
        self._defer = defer
        self._wake_dispatch = wake_dispatch
        self._worker_kinds = worker_kinds
        self._count_reject = count_reject
        self._heartbeat_info = heartbeat_info
        self._hello_opened = hello_opened
        self._in_use_logged: set[tuple[str, str]] = set()  # (peer id, refused instance) logged once
        now = clock.monotonic_s()
        self._next_hb_mono = now + self.hb_s
        self._next_liveness_mono = now + self.hb_s / 2

    # --- inbound ---
    def receive(self, rid: bytes, env: Envelope, now: float) -> Session | None:
        """Apply a verified frame's session part. Returns the sender's session when the
        message is for the ledger; None when it was a session message or refused."""
        if isinstance(env.message, protocol.Hello):
            self._on_hello(rid, env, now)
            return None
        sess = self.peers.by_routing(rid)
        if sess is None or sess.peer_id != env.sender:
            self.outbound.send_raw(rid, protocol.Error(protocol.REJECT_NO_SESSION, "no session: reconnect and send HELLO", env.seq))
            return None
        sess.last_recv_mono = now
        msg = env.message
        if isinstance(msg, protocol.Heartbeat):
            self._on_heartbeat(sess, msg, env.ts_ms, now)
        elif isinstance(msg, protocol.Credit):
            self._on_credit(sess, msg, env.seq)
        elif isinstance(msg, protocol.Bye):
            self.end(sess, f"bye: {msg.reason}")
        else:
            return sess
        return None

    def _on_hello(self, rid: bytes, env: Envelope, now: float) -> None:
        hello: protocol.Hello = env.message  # type: ignore[assignment]
        if hello.role != env.role.value:
            why = f"authorized as {env.role.value}, HELLO says {hello.role}"
            self._count_reject(protocol.REJECT_ROLE, why, env.sender, rid, now)
            self.outbound.send_raw(rid, protocol.Error(protocol.REJECT_ROLE, why, env.seq))
            return
        old = self.peers.get(env.sender)
        if old is not None and old.routing_id != rid and not self._may_replace(old, hello, now):
            self._refuse_in_use(rid, env, hello, old, now)
            return
        self._replace(env.sender, rid)
        sess = self._open(rid, env, hello)
        self._hello_opened(env.sender, env.session, env.ts_ms)
        if sess.role is protocol.Role.WORKER or (sess.role is protocol.Role.RELAY and hello.info.get(fed.RELAY_SIDE) == fed.UPSTREAM):
            # a relay's upstream side takes work of its kinds like a worker (another swarm runs it)
            self._worker_kinds(sess.kinds or ("",))
        resumed: list[protocol.LeaseRef] = []
        released: list[protocol.LeaseRef] = []
        if sess.role in protocol.LEASE_HOLDER_ROLES:
            lost = protocol.parse_lost_info(hello.info.get(protocol.LOST_INFO))
            resumed, released = self._resume_leases(sess.peer_id, hello.leases, now, lost)
            self._wake_dispatch()
        if sess.role in (protocol.Role.COMPLETION, protocol.Role.RELAY):
            self.delivery.set_possible(True)
        mac = self.outbound.open_mac(rid, env)  # session MACs, when the HELLO offered them (signed WELCOME)
        self.outbound.send(rid, protocol.Welcome(self.hb_s, self.cfg.liveness, self.epoch, resumed, released, mac_x25519=mac))
        log.info("peer_connected", peer=sess.peer_id, role=sess.role.value, credit=sess.credit, kinds=list(sess.kinds),
                 resumed=len(resumed), released=len(released), info=sess.info, session_mac=bool(mac))

    def _may_replace(self, old: Session, hello: protocol.Hello, now: float) -> bool:
        """Whether a HELLO on another connection may take ``old``'s peer id: when ``old``
        is past its liveness window (the one disconnect rule, judged now rather than at
        the next tick: a crashed process's restart gets in as soon as the window lapses),
        or when the HELLO carries ``old``'s own instance (the same process reconnecting
        after a network blip), or when ``old``'s socket is gone (a crashed process: a
        heartbeat to it is unroutable, which ends it now). A live session of another
        (or an unnamed) instance keeps it."""
        if now - old.last_recv_mono > self.silence_s:
            self.end(old, f"silent for {now - old.last_recv_mono:.2f}s")
            return True
        mine = hello.info.get(protocol.INSTANCE_INFO)
        if mine and mine == old.info_hello.get(protocol.INSTANCE_INFO):
            return True
        info = self._heartbeat_info().get(old.peer_id)
        self.outbound.offer(old, protocol.Heartbeat(info=info) if info is not None else protocol.Heartbeat())
        return old.status is PeerStatus.GONE

    def _refuse_in_use(self, rid: bytes, env: Envelope, hello: protocol.Hello, old: Session, now: float) -> None:
        """Refuse a HELLO for ``old``'s peer id from another process (REJECT_ID_IN_USE,
        naming the id and the live holder); the live session is untouched (the codec
        retired it when it verified the HELLO: reinstated)."""
        self.outbound.reinstate_session(old.peer_id, old.session)
        heard_s = now - old.last_recv_mono
        left_s = max(0.0, self.silence_s - heard_s)
        holder = str(old.info_hello.get(protocol.INSTANCE_INFO) or "instance not named: an older peer")[:160]
        why = (f"peer id {old.peer_id!r} is in use by a live session from {holder} (heard {heard_s:.2f}s ago; "
               f"liveness window {self.silence_s:g}s): give each process its own peer id and key, or stop the other one")
        newcomer = hello.info.get(protocol.INSTANCE_INFO)
        self.outbound.send_raw(rid, protocol.Error(protocol.REJECT_ID_IN_USE, why, env.seq,
                                            retry_in_s=max(left_s, 0.001) if newcomer else 0.0))
        key = (old.peer_id, str(newcomer))
        if key not in self._in_use_logged:
            if len(self._in_use_logged) > 1024:
                self._in_use_logged.clear()
            self._in_use_logged.add(key)
            log.warning("peer_id_in_use_refused", peer=old.peer_id, holder=holder, newcomer=str(newcomer)[:160],
                        heard_s=round(heard_s, 3), lapses_in_s=round(left_s, 3))

    def _replace(self, peer_id: str, rid: bytes) -> None:
        """End the current session of ``peer_id``, if any, before a new one begins."""
        old = self.peers.get(peer_id)
        if old is None:
            return
        if old.routing_id != rid:
            # the same process reconnecting closed its old socket, so this reaches nobody
            # (another process is refused while this session is live: _may_replace)
            self.outbound.send_raw(old.routing_id,
                                   protocol.Error(protocol.ERROR_REPLACED, f"a newer session of {peer_id} replaced this one"))
        self.end(old, "replaced by a new session")

    def _open(self, rid: bytes, env: Envelope, hello: protocol.Hello) -> Session:
        info = {k: v for k, v in hello.info.items() if k != MAC_OFFER_INFO}  # the MAC offer is no peer info
        sess = Session(
            peer_id=env.sender,
            role=env.role,
            routing_id=rid,
            session=env.session,
            credit=max(0, min(hello.credit, MAX_CREDIT)),
            slots=hello.slots,
            kinds=tuple(hello.kinds),
            info=info,
            info_hello=dict(info),
            connected_mono=self.clock.monotonic_s(),
            last_recv_mono=self.clock.monotonic_s(),
        )
        self.peers.add(sess)
        return sess

    def _resume_leases(self, peer_id: str, listed: list[protocol.LeaseRef], now: float,
                       lost: set[tuple[str, int]] | None = None) -> tuple[list[protocol.LeaseRef], list[protocol.LeaseRef]]:
        """The leases a reconnecting holder lists: (resumed: the broker knows them with
        that token, their expiry extended; released: the broker does not). Leases the
        broker knows for it that it did not list end in the next transaction: those in
        ``lost`` (HELLO info ``lost``: their jobs were running when its process died)
        expire, counting the attempt (worker_lost, G2); the others never ran there and
        are released uncounted. ``lost`` None (an older worker, a relay): all expire."""
        resumed, released = [], []
        for ref in listed:
            if self.leases.extend(ref.item_id, ref.token, peer_id, self.leases.expiry(now)):
                resumed.append(ref)
            else:
                released.append(ref)
        held = {(ref.item_id, ref.token) for ref in listed}  # by token: an older token of the item is not this lease
        for lease in self.leases.held_by(peer_id):
            if (lease.item_id, lease.token) in held:
                continue
            if lost is None or (lease.item_id, lease.token) in lost:
                self._defer("expire", lease.item_id, lease.token, "worker reconnected without it")
            else:
                self._defer("release", lease.item_id, lease.token, "worker reconnected without it: never started there")
        return resumed, released

    def _on_heartbeat(self, sess: Session, msg: protocol.Heartbeat, ts_ms: int, now: float) -> None:
        if sess.role not in protocol.LEASE_HOLDER_ROLES:
            return
        self.stats.heartbeat(ts_ms)
        for ref in msg.leases:
            self.leases.extend(ref.item_id, ref.token, sess.peer_id, self.leases.expiry(now))
        if msg.healthy and not sess.healthy:
            self._wake_dispatch()
        sess.healthy = msg.healthy
        sess.busy, sess.done = msg.busy, msg.done
        if len(sess.info) + len(msg.info) > 256:
            sess.info = dict(sess.info_hello)
        sess.info.update(msg.info)

    def _on_credit(self, sess: Session, msg: protocol.Credit, seq: int) -> None:
        sess.credit_msgs += 1
        if msg.credit < 0 and sess.role is protocol.Role.RELAY:
            # a relay withdraws credit its downstream no longer backs (docs/federation.md):
            # whatever was already dispatched on it stays dispatched; the rest is gone
            sess.credit = max(0, sess.credit + msg.credit)
            return
        if msg.credit <= 0:
            self.outbound.send(sess.routing_id, protocol.Error(protocol.REJECT_MALFORMED, "credit must be > 0", seq))
            return
        sess.credit = min(sess.credit + msg.credit, MAX_CREDIT)
        self._wake_dispatch()
        self.delivery.set_possible(True)

    # --- the end of a session ---
    def end(self, sess: Session, reason: str) -> None:
        """Remove a session (the one disconnect rule, BYE, or replacement). Its leases
        stay until they expire; unsent DISPATCHes are released (never sent); its
        unacknowledged deliveries become deliverable again (G3)."""
        ended_before = sess.status is PeerStatus.GONE
        if self.peers.get(sess.peer_id) is sess:
            self.peers.remove(sess.peer_id)
        sess.status = PeerStatus.GONE
        self.outbound.drop_unsent(sess)
        if not ended_before:
            self.outbound.close_mac(sess.routing_id)  # (a later session may use the same socket and its own MAC keys)
            self.delivery.session_ended(sess.peer_id)  # (a later session of the same peer id may have deliveries in flight)
        log.info("peer_disconnected", peer=sess.peer_id, role=sess.role.value, reason=reason)

    # --- timers ---
    def next_wake_mono(self) -> float:
        return min(self._next_hb_mono, self._next_liveness_mono)

    def tick(self, now: float) -> None:
        """Liveness (end silent sessions) and heartbeats to every peer, when due."""
        if now >= self._next_liveness_mono:
            self._next_liveness_mono = now + min(self.hb_s / 2, 0.25)
            for sess in list(self.peers.by_id.values()):
                if now - sess.last_recv_mono > self.silence_s:
                    self.end(sess, f"silent for {now - sess.last_recv_mono:.2f}s")
        if now >= self._next_hb_mono:
            self._next_hb_mono = now + self.hb_s
            infos = self._heartbeat_info()
            for sess in list(self.peers.by_id.values()):
                self.outbound.offer(sess, protocol.Heartbeat(info=infos[sess.peer_id]) if sess.peer_id in infos else protocol.Heartbeat())

    def excuse_stall(self, gap_s: float) -> None:
        """The actor itself did not run for ``gap_s``: peers were not silent, it was."""
        for sess in self.peers.by_id.values():
            sess.last_recv_mono += gap_s

    def bye_all(self, reason: str) -> None:
        for s in self.peers.sessions():
            self.outbound.send_raw(s.routing_id, protocol.Bye(reason=reason))
