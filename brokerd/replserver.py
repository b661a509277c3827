"""The primary's replication server (docs/ha.md, "The link"): its own ROUTER on
``ha_repl_endpoint`` serving standby brokers.

One :class:`ReplicationServer` runs on the primary in the broker's event loop. Per
standby session (HELLO of a peer of role ``standby``, signed with its node key; WELCOME
``broker_epoch`` = this primary's election epoch) it

- streams the turns after the standby's position (:class:`~ccsq.brokerd.replica.Shipper`:
  the backlog first, then every turn committed since, right after its commit: the
  ledger calls :meth:`ReplicationServer.sink` in the actor's thread);
- answers ERROR ``NEED_COPY`` when the backlog no longer holds those turns or the
  standby holds a tail this primary never wrote (``BacklogTruncated`` / ``Diverged``),
  or holds no ledger at all, then ships a consistent copy (``take_copy`` in a thread, so
  the actor keeps committing): REPL_COPY_CHUNK frames within the frame budget of
  common/wire/frames.py, at most :data:`COPY_WINDOW_CHUNKS` unacknowledged
  (REPL_COPY_ACK), far below the socket's send high-water mark, so no chunk is ever
  refused or dropped; once the standby installed it, the turns after the copy's position;
- counts REPL_ACKs (:class:`~ccsq.brokerd.replica.SyncTracker`) and keeps the *in-sync
  set*: a standby joins once it acknowledged the primary's last turn at the time (its
  position at HELLO counts: what it reports there is fsynced); it leaves when its session
  ends (the one disconnect rule: silent for ``heartbeat_interval_s x liveness``, or an
  invalid frame, or BYE, or a new HELLO of the same node), when it needs a copy, or when
  it lags: its oldest unacknowledged turn is older than ``heartbeat_interval_s x
  liveness`` (:meth:`lag_out_s`), or more than :data:`LAG_OUT_TURNS` turns behind.
  Every change is reported through ``on_members`` (which writes ``/ccsq/<swarm>/sync``
  in etcd, in a thread) and only *after* it returned does the change count: a joining
  standby's acknowledgements count toward :meth:`durable_seq` only once etcd lists it, a
  leaving one's stay counted until etcd no longer lists it.

:meth:`durable_seq` (sync mode): the highest seq held by *every* listed member, 0 while
fewer than ``sync_standbys`` are listed; never goes down (a turn at or below a value it
returned was durable then). So every member of ``/sync``, the standbys that may
campaign, holds every turn confirmed. Async mode (``cfg.ha_mode = "async"``): the log's
last seq, no ``on_members`` call (haprim writes the empty set).

Errors to standbys: ERROR ``NEED_COPY``; ERROR :data:`OTHER_LEDGER` for a standby that
holds another ledger (it exits 78); ``ROLE`` for a peer that is not a standby; the
codec's ``REJECT_*`` code (rate-limited) for a frame that does not verify.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from ccsq.brokerd import replica as replica_link
from ccsq.brokerd.ledger import replication
from ccsq.brokerd.transport import SENT, UNROUTABLE, Transport
from ccsq.common.wire import frames
from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_curve_secret, load_private_key

log = structlog.get_logger("ccsq.brokerd")

#: Default of ``ha_repl_endpoint`` (docs/ha.md) when the config has no such key.
DEFAULT_REPL_ENDPOINT = "tcp://127.0.0.1:5556"
#: ERROR code: the standby holds another ledger than this primary (another swarm's?).
OTHER_LEDGER = "OTHER_LEDGER"
#: Copy chunks in flight per standby before its REPL_COPY_ACK.
COPY_WINDOW_CHUNKS = 4
#: Send high-water mark of the replication ROUTER (messages per standby). Above the copy
#: window plus heartbeats; streaming turns that meet it wait in the session's outbox.
REPL_SNDHWM = 256
#: A standby more turns than this behind the last one leaves the in-sync set.
LAG_OUT_TURNS = 10_000
#: Messages waiting in one session's outbox (its socket at the high-water mark) before the
#: session is ended as too slow (it reconnects and catches up from the backlog or a copy).
MAX_OUTBOX_MESSAGES = 100_000
#: Frames one pass of the loop takes from the socket.
DRAIN_FRAMES = 256


@dataclasses.dataclass(eq=False)
class _Copy:
    """A consistent copy on its way to one standby."""

    dir: Path
    position: tuple[int, int] = (0, 0)
    total: int = 0
    sent: int = 0
    acked: int = 0
    fd: int | None = None
    task: asyncio.Task | None = None
    started_mono: float = 0.0


@dataclasses.dataclass(eq=False)
class _Session:
    rid: bytes
    node: str
    opened_mono: float
    last_recv_mono: float
    last_sent_mono: float = 0.0
    shipper: replica_link.Shipper | None = None
    acked: int = 0
    copy: _Copy | None = None
    copies: int = 0
    outbox: collections.deque = dataclasses.field(default_factory=collections.deque)
    ended: bool = False


class ReplicationServer:
    """The primary's side of every standby (see the module). ``log``: the ledger's
    :class:`~ccsq.brokerd.ledger.replication.ReplicationLog` of ``epoch``; when its sink
    is unset the server becomes it (so ``ledger.replicate(epoch)`` then the server, or
    ``ledger.replicate(epoch, sink=server.sink)``: either order). ``on_durable()``: called
    in the loop when :meth:`durable_seq` rose (wake the actor). ``on_members(node ids)``:
    the in-sync set changed; called in a worker thread, one call at a time, may block;
    an exception is logged and the call retried with the house backoff.

    The ROUTER is bound in the constructor (:attr:`endpoint`: the bound address), CURVE
    server with ``cfg.curve_secret_key`` when ``cfg.curve`` (ZAP allows the authorized
    CURVE keys and the service's own). Raises
    :class:`~ccsq.brokerd.transport.EndpointInUse` (exit 75)."""

    def __init__(self, cfg: Any, ledger: Any, log: replication.ReplicationLog, epoch: int, *, sync_standbys: int,
                 on_durable: Callable[[], None], on_members: Callable[[list[str]], None],
                 authorized: AuthorizedKeys | None = None) -> None:
        self.cfg, self.ledger, self.log, self.epoch = cfg, ledger, log, epoch
        if log.sink is None:
            log.sink = self.sink
        self.sync_standbys = sync_standbys
        self.mode = getattr(cfg, "ha_mode", "sync")
        self.on_durable, self.on_members = on_durable, on_members
        self.hb_s, self.liveness = float(cfg.heartbeat_interval_s), int(cfg.liveness)
        self.silence_s = self.hb_s * self.liveness
        self.max_frame_bytes = int(cfg.max_frame_bytes)
        self.chunk_bytes = self.max_frame_bytes - frames.FRAME_SLACK_BYTES
        self.tracker = replica_link.SyncTracker(epoch=epoch, sync_standbys=sync_standbys)
        authorized = authorized or AuthorizedKeys(Path(cfg.authorized_keys))
        self.codec = EnvelopeCodec(cfg.peer_id, load_private_key(Path(cfg.private_key)), authorized,
                                   max_frame_bytes=self.max_frame_bytes, max_clock_skew_s=cfg.max_clock_skew_s,
                                   require_hello=True, session_macs=True)
        curve_secret = load_curve_secret(Path(cfg.curve_secret_key)) if cfg.curve else None
        allow = None
        if curve_secret is not None:
            import zmq

            own = zmq.curve_public(curve_secret)
            allow = lambda key: key == own or authorized.curve_allowed(key)  # noqa: E731 - the ZAP decision
        self.transport = Transport(getattr(cfg, "ha_repl_endpoint", DEFAULT_REPL_ENDPOINT), self.codec,
                                   sndhwm=REPL_SNDHWM, max_frame_bytes=self.max_frame_bytes,
                                   curve_secret_key=curve_secret, curve_allow=allow)
        self.endpoint = self.transport.endpoint
        self.copies_dir = Path(cfg.data_dir) / "repl-copies"
        shutil.rmtree(self.copies_dir, ignore_errors=True)  # a crashed run's half-shipped copies
        self.sessions: dict[bytes, _Session] = {}
        self.by_node: dict[str, _Session] = {}
        #: the in-sync set etcd lists (counted), the one wanted, a write in flight
        self.members: frozenset[str] = frozenset()
        self._want: frozenset[str] = frozenset()
        self._writing: frozenset[str] | None = None
        self._write_failures = 0
        self._retry_at_mono = 0.0
        self._durable = 0
        self._pending: collections.deque[replication.WriteSet] = collections.deque()
        #: (seq, commit monotonic time, bytes of the turns before it) since the start, for lag
        self._turns: collections.deque[tuple[int, float, int]] = collections.deque(maxlen=replication.BACKLOG_TURNS)
        self._bytes_total = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._in_pass = False  # run() is in its own pass (it checks EVENTS before it waits again: no wake needed)
        self._stopping = False
        self._refused_at: dict[bytes, float] = {}
        self._copy_tasks: set[asyncio.Task] = set()
        self.counters: collections.Counter[str] = collections.Counter()

    # --- the actor's side ---
    def sink(self, ws: replication.WriteSet) -> None:
        """After the commit of ``ws`` (the ledger calls it): ship it to every streaming
        standby now when called in the server's loop thread, else on the loop's next pass."""
        self._turns.append((ws.seq, time.monotonic(), self._bytes_total))
        self._bytes_total += ws.nbytes()
        self._pending.append(ws)
        if self._loop is None:
            return
        if threading.get_ident() == self._thread:
            self._ship_pending()  # (its sends wake run()'s wait: _flush)
        else:
            self._loop.call_soon_threadsafe(self.transport.wake)

    def durable_seq(self) -> int:
        """Sync mode: the highest seq every in-sync standby etcd lists has fsynced (0 while
        fewer than ``sync_standbys`` are listed); async mode: the last committed seq."""
        if self.mode == "async" or self.sync_standbys <= 0:
            return self.log.position[1]
        return self._durable

    def _recompute_durable(self) -> None:
        if self.mode == "async" or self.sync_standbys <= 0 or len(self.members) < self.sync_standbys:
            return
        value = min(self.tracker.acked.get(m, 0) for m in self.members)
        if value > self._durable:
            self._durable = value
            self.on_durable()

    def last_seq(self) -> int:
        return self.log.position[1]

    # --- lifecycle ---
    async def run(self) -> None:
        """Serve until :meth:`stop`; then BYE to every standby and close the socket."""
        self._loop, self._thread = asyncio.get_running_loop(), threading.get_ident()
        next_tick = 0.0
        try:
            while not self._stopping:
                now = time.monotonic()
                wake_at = next_tick
                if self._retry_at_mono > now and self._want != self.members:
                    wake_at = min(wake_at, self._retry_at_mono)
                await self.transport.wait_readable(max(0.0, wake_at - now))
                self._in_pass = True
                for raw in self.transport.drain(DRAIN_FRAMES):
                    self._on_frames(raw, time.monotonic())
                self._ship_pending()
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + min(self.hb_s / 2, 0.25)
                self._membership(now)
                self._in_pass = False
        finally:
            for sess in list(self.sessions.values()):
                self.transport.send(sess.rid, protocol.Bye(reason="primary stopping"))
                self._end(sess, "primary stopping", membership=False)
            self.transport.close(linger_ms=200)
            if self._copy_tasks:  # take_copy threads read the ledger: done before it may close
                await asyncio.gather(*self._copy_tasks, return_exceptions=True)
            shutil.rmtree(self.copies_dir, ignore_errors=True)

    def stop(self) -> None:
        self._stopping = True
        if self._loop is not None:
            if threading.get_ident() == self._thread:
                self.transport.wake()
            else:
                self._loop.call_soon_threadsafe(self.transport.wake)

    # --- frames ---
    def _refuse(self, rid: bytes, code: str, message: str, ref_seq: int = 0) -> None:
        now = time.monotonic()
        if now - self._refused_at.get(rid, -1e9) < 1.0:
            return
        if len(self._refused_at) > 4096:
            self._refused_at.clear()
        self._refused_at[rid] = now
        self.transport.send(rid, protocol.Error(code, message, ref_seq))

    def _on_frames(self, raw: list[bytes], now: float) -> None:
        rid, body = raw[0], raw[1:]
        sess = self.sessions.get(rid)
        try:
            env = self.codec.decode(body, bound_sender=sess.node if sess is not None else None)
        except DecodeError as exc:
            self.counters[f"rejected_{exc.code}"] += 1
            log.warning("standby_frame_rejected", code=exc.code, reason=str(exc)[:200],
                        standby=sess.node if sess else None)
            self._refuse(rid, exc.code, f"replication link: {exc}")
            if sess is not None:
                self._end(sess, f"invalid frame: {exc.code}")
            return
        msg = env.message
        if env.role is not protocol.Role.STANDBY:
            self._refuse(rid, protocol.REJECT_ROLE, f"{env.sender} has role {env.role.value}: only a standby (a node id "
                         f"with role standby in authorized_keys) connects to ha_repl_endpoint", env.seq)
            return
        if isinstance(msg, protocol.Hello):
            self._on_hello(rid, env, now)
            return
        if sess is None or sess.node != env.sender:
            self._refuse(rid, protocol.REJECT_NO_SESSION, "no replication session: send HELLO", env.seq)
            return
        sess.last_recv_mono = now
        if isinstance(msg, protocol.ReplAck):
            self._on_ack(sess, msg, now)
        elif isinstance(msg, protocol.ReplCopyAck):
            self._on_copy_ack(sess, msg, now)
        elif isinstance(msg, protocol.Bye):
            self._end(sess, f"bye: {msg.reason}")

    def _on_hello(self, rid: bytes, env: Any, now: float) -> None:
        hello = env.message
        try:
            lid, pos = replica_link.standby_position(hello)
        except replication.ReplicationError as exc:
            self._refuse(rid, protocol.REJECT_MALFORMED, str(exc), env.seq)
            return
        old = self.by_node.get(env.sender)
        if old is not None:
            self._end(old, "replaced by a new session of the same node")
        old = self.sessions.get(rid)
        if old is not None:
            self._end(old, "replaced by a new HELLO")
        sess = _Session(rid, env.sender, now, now)
        self.sessions[rid], self.by_node[env.sender] = sess, sess
        # session MACs when the standby's HELLO offered them (as on the peer link: the HELLO and
        # this WELCOME are signed; every later frame both ways carries an HMAC-SHA256 tag, not an
        # Ed25519 signature of its whole body: a REPL_TURNS carries ~1.7 KB per job)
        mac = self.codec.open_session_mac(env, rid)
        self._send(sess, protocol.Welcome(self.hb_s, self.liveness, broker_epoch=self.epoch, mac_x25519=mac))
        log.info("standby_connected", standby=sess.node, ledger_id=lid or None, position=list(pos),
                 primary_position=list(self.log.position))
        if not lid:
            self._start_copy(sess, "the standby holds no ledger yet")
            return
        if lid != self.ledger.ledger_id:
            self._send(sess, protocol.Error(OTHER_LEDGER, f"this primary serves ledger {self.ledger.ledger_id!r}; the "
                                     f"standby {sess.node} holds ledger {lid!r} (another swarm's?)", env.seq))
            self._end(sess, "holds another ledger")
            return
        try:
            sess.shipper = replica_link.Shipper(self.log, lid, hello, max_frame_bytes=self.max_frame_bytes)
        except (replication.BacklogTruncated, replication.Diverged) as exc:
            self._start_copy(sess, str(exc))
            return
        self._stream_from(sess, pos[1], now)

    def _stream_from(self, sess: _Session, seq: int, now: float) -> None:
        """``sess`` holds every turn up to ``seq`` (fsynced): count that, ship the rest."""
        sess.acked = seq
        self.tracker.ack(sess.node, protocol.ReplAck(self.epoch, seq))
        assert sess.shipper is not None
        sess.outbox.extend(sess.shipper.messages())  # the backlog holds every committed turn
        self._flush(sess)
        self._membership(now)
        self._recompute_durable()

    def _on_ack(self, sess: _Session, msg: protocol.ReplAck, now: float) -> None:
        if msg.epoch != self.epoch or msg.seq > self.log.position[1]:
            self._end(sess, f"REPL_ACK ({msg.epoch}, {msg.seq}) this primary (epoch {self.epoch}, at "
                      f"{self.log.position[1]}) never sent")
            return
        if msg.seq > sess.acked:
            sess.acked = msg.seq
            self.tracker.ack(sess.node, msg)
            self._membership(now)
            self._recompute_durable()

    # --- shipping ---
    def _send(self, sess: _Session, msg: protocol.Message) -> None:
        sess.outbox.append(msg)
        self._flush(sess)

    def _flush(self, sess: _Session) -> None:
        """Send ``sess``'s outbox until empty or the socket pushes back. A send on the ROUTER
        outside run()'s own pass (the actor's ``sink``, a copy task) may consume ZMQ_FD's edge
        for a REPL_ACK already queued, and no later frame raises another while it is unread:
        run()'s wait would sleep to its next tick (up to 250 ms per confirm), so after such sends
        EVENTS is checked here and the wait woken when a frame is queued (not from inside run()'s
        pass: it checks EVENTS before it waits again; with nothing queued the next frame raises the
        edge itself, and run() needs no pass for this send), or when the socket pushed back."""
        outside = not self._in_pass
        self._send_outbox(sess)
        if outside and (self.transport.readable() or (sess.outbox and not sess.ended)):
            self.transport.wake()

    def _send_outbox(self, sess: _Session) -> None:
        while sess.outbox and not sess.ended:
            status = self.transport.send(sess.rid, sess.outbox[0])
            if status == SENT:
                sess.outbox.popleft()
                sess.last_sent_mono = time.monotonic()
            elif status == UNROUTABLE:
                self._end(sess, "its connection is gone")
                return
            else:  # AGAIN: the socket is at its high-water mark; retried on the next pass
                if len(sess.outbox) > MAX_OUTBOX_MESSAGES:
                    self._end(sess, f"more than {MAX_OUTBOX_MESSAGES} messages wait for it (too slow)")
                return

    def _ship_pending(self) -> None:
        if self._pending:
            turns = list(self._pending)
            self._pending.clear()
            for sess in list(self.sessions.values()):
                if sess.shipper is not None:
                    sess.outbox.extend(sess.shipper.messages(turns))
        for sess in list(self.sessions.values()):
            if sess.outbox:
                self._flush(sess)

    # --- the copy ---
    def _start_copy(self, sess: _Session, why: str) -> None:
        sess.shipper = None
        sess.copies += 1
        self.counters["copies"] += 1
        self._send(sess, protocol.Error(replica_link.NEED_COPY, f"seed again from a copy: {why}"))
        log.info("standby_copy_started", standby=sess.node, reason=why)
        copy = sess.copy = _Copy(self.copies_dir / f"{sess.node}-{os.urandom(4).hex()}", started_mono=time.monotonic())
        copy.task = asyncio.get_running_loop().create_task(self._take_copy(sess, copy))
        self._copy_tasks.add(copy.task)
        copy.task.add_done_callback(self._copy_tasks.discard)
        self._membership(time.monotonic())

    async def _take_copy(self, sess: _Session, copy: _Copy) -> None:
        try:
            self.copies_dir.mkdir(parents=True, exist_ok=True)
            info = await asyncio.to_thread(replication.take_copy, self.ledger, copy.dir)
        except Exception as exc:  # noqa: BLE001 - the standby retries; the primary serves on
            log.error("standby_copy_failed", standby=sess.node, error=f"{type(exc).__name__}: {exc}")
            self._end(sess, "the copy failed")
            return
        if sess.ended or sess.copy is not copy or self._stopping:
            shutil.rmtree(copy.dir, ignore_errors=True)
            return
        copy.position = tuple(info["position"])
        path = copy.dir / "data.mdb"
        copy.total = path.stat().st_size
        copy.fd = os.open(path, os.O_RDONLY)
        log.info("standby_copy_taken", standby=sess.node, bytes=copy.total, position=list(copy.position))
        self._pump_copy(sess)

    def _pump_copy(self, sess: _Session) -> None:
        copy = sess.copy
        if copy is None or copy.fd is None:
            return
        while copy.sent < copy.total and copy.sent - copy.acked < COPY_WINDOW_CHUNKS * self.chunk_bytes:
            data = os.pread(copy.fd, min(self.chunk_bytes, copy.total - copy.sent), copy.sent)
            if not data:
                self._end(sess, "the copy file ended early")
                return
            sess.outbox.append(protocol.ReplCopyChunk(copy.position[0], copy.position[1], copy.sent, copy.total, data))
            copy.sent += len(data)
        self._flush(sess)

    def _drop_copy(self, copy: _Copy) -> None:
        # a take_copy still running in its thread is not cancelled (a thread cannot be): its
        # task sees the copy dropped and removes the directory; run() waits for it before the
        # caller may close the ledger it reads
        if copy.fd is not None:
            os.close(copy.fd)
            copy.fd = None
        shutil.rmtree(copy.dir, ignore_errors=True)

    def _on_copy_ack(self, sess: _Session, msg: protocol.ReplCopyAck, now: float) -> None:
        copy = sess.copy
        if copy is None or copy.fd is None or not copy.acked <= msg.offset <= copy.sent:
            self._end(sess, f"REPL_COPY_ACK {msg.offset} outside the copy's window")
            return
        copy.acked = msg.offset
        if copy.acked < copy.total:
            self._pump_copy(sess)
            return
        # installed and fsynced at the standby: stream from the copy's position
        sess.copy = None
        self._drop_copy(copy)
        epoch, seq = copy.position
        log.info("standby_copy_installed", standby=sess.node, bytes=copy.total, position=[epoch, seq],
                 seconds=round(now - copy.started_mono, 3))
        hello = protocol.Hello(role=protocol.Role.STANDBY.value, info={replica_link.INFO_LEDGER_ID: self.ledger.ledger_id,
                                                          replica_link.INFO_EPOCH: epoch, replica_link.INFO_SEQ: seq})
        try:
            sess.shipper = replica_link.Shipper(self.log, self.ledger.ledger_id, hello, max_frame_bytes=self.max_frame_bytes)
        except (replication.BacklogTruncated, replication.Diverged) as exc:  # it took longer than the backlog lasts: again
            self._start_copy(sess, str(exc))
            return
        self._stream_from(sess, seq, now)

    # --- sessions, liveness, lag ---
    def _end(self, sess: _Session, reason: str, *, membership: bool = True) -> None:
        if sess.ended:
            return
        sess.ended = True
        self.codec.close_channel(sess.rid)  # frames to its routing id are signed again
        if self.sessions.get(sess.rid) is sess:
            del self.sessions[sess.rid]
        if self.by_node.get(sess.node) is sess:
            del self.by_node[sess.node]
        if sess.copy is not None:
            self._drop_copy(sess.copy)
            sess.copy = None
        self.codec.close_channel(sess.rid)
        log.info("standby_disconnected", standby=sess.node, reason=reason, acked=sess.acked)
        if membership:
            self._membership(time.monotonic())

    def _tick(self, now: float) -> None:
        for sess in list(self.sessions.values()):
            if now - sess.last_recv_mono > self.silence_s:
                self._end(sess, f"silent for {now - sess.last_recv_mono:.2f}s")
            elif now - sess.last_sent_mono >= self.hb_s and not sess.outbox:
                self._send(sess, protocol.Heartbeat())
            elif sess.outbox:
                self._flush(sess)

    def lag_out_s(self) -> float:
        """A standby whose oldest unacknowledged turn is older than this leaves the in-sync set."""
        return self.silence_s

    def _lag(self, acked: int, now: float) -> tuple[int, int, float]:
        """(turns, bytes, seconds) a standby at ``acked`` is behind the last turn."""
        last = self.log.position[1]
        if acked >= last or not self._turns:
            return 0, 0, 0.0
        turns = self._turns
        first = turns[0][0]
        if not first <= acked + 1 <= turns[-1][0]:  # older than what is kept
            return last - acked, self._bytes_total, now - turns[0][1]
        _, at, before = turns[acked + 1 - first]
        return last - acked, self._bytes_total - before, now - at

    def _in_sync(self, sess: _Session, now: float) -> bool:
        if sess.ended or sess.shipper is None or sess.copy is not None:
            return False
        lag_turns, _, lag_s = self._lag(sess.acked, now)
        if sess.node in self._want:  # stays while the lag is within the bound
            return lag_turns <= LAG_OUT_TURNS and lag_s <= self.lag_out_s()
        return sess.acked >= self.log.position[1]  # joins once it holds the last turn

    def _membership(self, now: float) -> None:
        if self.mode == "async":
            return
        want = frozenset(s.node for s in self.by_node.values() if self._in_sync(s, now))
        if want != self._want:
            log.info("standby_sync_set_wanted", members=sorted(want), listed=sorted(self.members))
            self._want = want
        if self._writing is None and self._want != self.members and now >= self._retry_at_mono \
                and self._loop is not None:
            target = self._writing = self._want
            self._retry_at_mono = 0.0
            self._loop.create_task(self._write_members(target))

    async def _write_members(self, target: frozenset[str]) -> None:
        try:
            await asyncio.to_thread(self.on_members, sorted(target))
        except Exception as exc:  # noqa: BLE001 - etcd down: retry; nothing counts meanwhile
            self._write_failures += 1
            delay = backoff_delay_s(self._write_failures, 0.1, 2.0)
            self._retry_at_mono = time.monotonic() + delay
            log.warning("standby_sync_set_write_failed", members=sorted(target), error=str(exc)[:300],
                        retry_in_s=round(delay, 3))
            self._writing = None
            self.transport.wake()
            return
        self._write_failures, self._retry_at_mono = 0, 0.0
        gone = self.members - target
        self.members, self._writing = target, None
        for node in gone:  # its acknowledgements no longer count (a live session's come back with it)
            if node not in self.by_node:
                self.tracker.drop(node)
        log.info("standby_sync_set", members=sorted(target))
        self._recompute_durable()
        self._membership(time.monotonic())
        self.transport.wake()

    def status(self) -> dict[str, Any]:
        """``{"standbys": [{"node", "seq", "lag_turns", "lag_bytes", "lag_s", "in_sync",
        "copying"}], "durable_seq", "last_seq", "members", "mode", "endpoint"}``: lag in
        turns, bytes of write sets and seconds since the oldest unacknowledged turn's commit."""
        now = time.monotonic()
        out = []
        for sess in sorted(self.by_node.values(), key=lambda s: s.node):
            lt, lb, ls = self._lag(sess.acked, now)
            copying = None
            if sess.copy is not None:
                copying = {"bytes": sess.copy.total, "acked_bytes": sess.copy.acked,
                           "position": list(sess.copy.position)}
            out.append({"node": sess.node, "seq": sess.acked, "lag_turns": lt, "lag_bytes": lb,
                        "lag_s": round(ls, 3), "in_sync": sess.node in self.members, "copying": copying})
        return {"standbys": out, "durable_seq": self.durable_seq(), "last_seq": self.log.position[1],
                "members": sorted(self.members), "mode": self.mode, "endpoint": self.endpoint,
                "copies": self.counters["copies"]}
