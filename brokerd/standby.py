"""A broker as standby (docs/ha.md): follow the primary's ledger until it is time to promote.

:func:`run_standby` is what ``ccsq-brokerd`` runs while another broker holds the swarm's
primary key in etcd (haprim's role loop in brokerd/main.py calls it, and campaigns when
it returns :attr:`StandbyOutcome.PROMOTE`). It

- keeps a :class:`~ccsq.brokerd.ledger.replication.ReplicaLedger` in the broker's own
  ledger directory (``data_dir/ledger``), so once promoted the broker opens it as its
  :class:`~ccsq.brokerd.ledger.store.Ledger`;
- binds the broker's peer endpoint (``bind`` or ``endpoint``, the same ROUTER, codec and
  CURVE setup as a primary) and answers every verified frame of a peer that is not a
  standby with ERROR ``NOT_PRIMARY`` naming the primary's peer endpoint from etcd ("" while
  none holds the key), so producers, workers, completion services, relays and admins go
  there at once;
- connects (one DEALER, CURVE client with the service CURVE key when ``curve = true``) to
  the primary's ``repl_endpoint`` from etcd's ``/ccsq/<swarm>/primary`` value, signs with
  its node key (``ha_node_id`` / ``ha_node_key``, role ``standby`` in the primary's
  authorized keys), applies every REPL_TURNS turn in its own fsynced LMDB transaction and
  acknowledges what it applied (REPL_ACK), one acknowledgement per batch it drained;
- seeds from a consistent copy when the primary answers ``NEED_COPY`` (its ledger is
  empty, lags beyond the primary's backlog, or holds a tail the primary never wrote:
  the deposed-primary case): the chunks go to ``data_dir/ledger.incoming``, fsynced, and
  only then replace the ledger directory; the old one is moved aside to
  ``data_dir/ledger.discarded`` (logged; the previous discarded one is removed), so
  until the new copy is complete the old ledger stays whole;
- follows a new primary after a failover (the key's new value; a WELCOME of a higher
  epoch), and returns PROMOTE once the primary key is vacant, it holds a ledger (no copy
  half-installed) and it is listed in ``/ccsq/<swarm>/sync`` (``ha_mode = async``: any
  standby with a ledger).

The one disconnect rule on the link: the primary is gone when nothing arrived for
``heartbeat_interval_s x liveness``; then the DEALER is closed and rebuilt (capped,
jittered backoff, common/wire/backoff.py) to whatever etcd names then.

Errors: :class:`~ccsq.common.wire.errors.ConfigError` (exit 78) when the ledger here is
another ledger than the primary's (another swarm's primary: the sentence names the
directory, both ledger ids and the keys to fix); :class:`~ccsq.brokerd.transport.EndpointInUse`
(75) when the peer endpoint is taken.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, cast

import structlog
import zmq

from ccsq.brokerd import replica as replica_link
from ccsq.brokerd.election import EtcdUnavailable, _b64, _unb64
from ccsq.brokerd.ledger import replication
from ccsq.brokerd.ledger.store import data_paths
from ccsq.brokerd.replserver import OTHER_LEDGER
from ccsq.brokerd.transport import Transport, sleep_until_events
from ccsq.common.wire import frames
from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import AuthError, ConfigError, DecodeError
from ccsq.common.wire.keys import (AuthorizedKeys, PeerKey, curve_client_setup, load_curve_secret,
                                   load_private_key)

log = structlog.get_logger("ccsq.brokerd")

#: Config defaults of the node identity (docs/ha.md) for a config without those keys.
DEFAULT_NODE_ID, DEFAULT_NODE_KEY = "broker-1", "keys/broker-1.key"
INCOMING, DISCARDED = "ledger.incoming", "ledger.discarded"


class StandbyOutcome(enum.Enum):
    PROMOTE = "promote"  # the primary key is vacant and this node may campaign
    STOPPED = "stopped"  # stop_event was set


def sync_key(swarm_id: str) -> str:
    return f"/ccsq/{swarm_id}/sync"


def primary_value(election: Any) -> dict[str, Any] | None:
    """The JSON value of the primary key (``epoch``, ``endpoint``, ``repl_endpoint``,
    ``node``, ``ledger_id``, ...) or None when vacant. Raises ``EtcdUnavailable``."""
    kvs = election._post("/kv/range", {"key": _b64(election.key)}).get("kvs") or []
    return json.loads(_unb64(kvs[0]["value"])) if kvs else None


def sync_members(election: Any) -> list[str]:
    """The node ids of ``/ccsq/<swarm>/sync`` (``[]`` when absent)."""
    kvs = election._post("/kv/range", {"key": _b64(sync_key(election.swarm_id))}).get("kvs") or []
    if not kvs:
        return []
    try:
        return [str(m) for m in json.loads(_unb64(kvs[0]["value"])).get("members", [])]
    except (ValueError, AttributeError):
        return []


class _LinkKeys:
    """The standby's view of the link's signers: its authorized keys plus the swarm's
    service identity (``peer_id``, role broker: the key every broker of the swarm shares,
    so the primary's REPL_TURNS verify with this host's own service key)."""

    def __init__(self, authorized: AuthorizedKeys, service: PeerKey) -> None:
        self.authorized, self.service = authorized, service

    def get(self, peer_id: str) -> PeerKey | None:
        return self.service if peer_id == self.service.peer_id else self.authorized.get(peer_id)

    def __contains__(self, peer_id: str) -> bool:
        return self.get(peer_id) is not None


class _Etcd:
    """What the watcher thread last read from etcd (read in the loop)."""

    def __init__(self) -> None:
        self.primary: dict[str, Any] | None = None
        self.members: list[str] = []
        self.read_at = 0.0
        self.ok = False
        self.changed: asyncio.Event | None = None


class _Incoming:
    """A copy being received into ``data_dir/ledger.incoming``."""

    def __init__(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        self.path, self.fd, self.offset = path, os.open(path / "data.mdb", os.O_WRONLY | os.O_CREAT, 0o600), 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Restart(Exception):
    """End this session and connect again (to whatever etcd names then)."""


class StandbyNode:
    """The state of one :func:`run_standby` (see the module)."""

    def __init__(self, cfg: Any, election: Any) -> None:
        self.cfg, self.election = cfg, election
        self.node = getattr(cfg, "ha_node_id", DEFAULT_NODE_ID)
        self.mode = getattr(cfg, "ha_mode", "sync")
        self.data_dir = Path(cfg.data_dir)
        self.ledger_dir = data_paths(self.data_dir)[0]
        self.hb_s, self.liveness = float(cfg.heartbeat_interval_s), int(cfg.liveness)
        self.silence_s = self.hb_s * self.liveness
        self.max_frame_bytes = int(cfg.max_frame_bytes)
        service_key = load_private_key(Path(cfg.private_key))
        self.authorized = AuthorizedKeys(Path(cfg.authorized_keys))
        service = PeerKey(cfg.peer_id, protocol.Role.BROKER, service_key.public_key())
        self.link_codec = EnvelopeCodec(self.node, load_private_key(Path(getattr(cfg, "ha_node_key", DEFAULT_NODE_KEY))),
                                        _LinkKeys(self.authorized, service),  # type: ignore[arg-type]
                                        max_frame_bytes=self.max_frame_bytes, max_clock_skew_s=cfg.max_clock_skew_s,
                                        require_hello=False, session_macs=True)  # offered in each HELLO
        self.curve_secret = load_curve_secret(Path(cfg.curve_secret_key)) if cfg.curve else None
        self.replica: replication.ReplicaLedger | None = None
        self.force_copy = False
        self.etcd = _Etcd()
        self.applied_turns = 0
        self.copies = 0
        self.discards = 0
        self.session_epoch = 0

    # --- the ledger here ---
    def open_replica(self) -> None:
        try:
            self.replica = replication.ReplicaLedger(self.ledger_dir, map_size_bytes=self.cfg.map_size_bytes,
                                            max_map_size_bytes=self.cfg.max_map_size_bytes)
        except replication.NotSeeded as exc:
            self.replica = None
            log.info("standby_ledger_empty", ledger_dir=str(self.ledger_dir), reason=str(exc))
        except replication.Diverged as exc:  # a `ccsq backup` restore copy: not this primary's history
            self.replica = None
            self.force_copy = True
            log.warning("standby_ledger_refused", ledger_dir=str(self.ledger_dir), reason=str(exc))

    def check_ledger_id(self, primary_ledger_id: str) -> None:
        if self.replica is not None and primary_ledger_id and primary_ledger_id != self.replica.ledger_id:
            raise ConfigError(
                f"{self.cfg.config_path or 'brokerd.toml'}: this standby's ledger {self.ledger_dir} holds ledger "
                f"{self.replica.ledger_id!r}, but the primary of {self.election.key} (etcd ha_etcd_endpoints) serves "
                f"ledger {primary_ledger_id!r}: it points at another swarm's primary. Fix ha_swarm_id / "
                "ha_etcd_endpoints to name this ledger's swarm, or move the data_dir aside to seed this broker "
                "from that primary")

    def install_copy(self, inc: _Incoming, epoch: int, seq: int) -> replication.ReplicaLedger:
        """The whole copy is in ``inc``: fsync it, move the old ledger aside, put it in place."""
        os.fsync(inc.fd)
        inc.close()
        _fsync_dir(inc.path)
        if self.replica is not None:
            self.replica.close()
            self.replica = None
        if self.ledger_dir.exists() and any(self.ledger_dir.iterdir()):
            aside = self.data_dir / DISCARDED
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(self.ledger_dir, aside)
            self.discards += 1
            log.warning("standby_ledger_discarded", moved_to=str(aside),
                        reason="replaced by the primary's copy (it lagged beyond the backlog or held a tail the "
                        "primary never wrote)")
        elif self.ledger_dir.exists():
            self.ledger_dir.rmdir()
        os.rename(inc.path, self.ledger_dir)
        _fsync_dir(self.data_dir)
        self.open_replica()
        if self.replica is None or self.replica.position[1] != seq:
            raise replication.ReplicationError(f"the installed copy is at {self.replica and self.replica.position}, "
                                      f"the primary announced ({epoch}, {seq})")
        self.force_copy = False
        self.copies += 1
        log.info("standby_seeded", position=list(self.replica.position), ledger_id=self.replica.ledger_id)
        return self.replica

    # --- etcd ---
    def watch(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """The watcher thread: the primary key's value, and /sync while vacant."""
        failures = 0
        while not stop.is_set():
            try:
                value = primary_value(self.election)
                members = sync_members(self.election) if value is None else self.etcd.members
                failures = 0
                ok = True
            except EtcdUnavailable as exc:
                failures += 1
                value, members, ok = self.etcd.primary, self.etcd.members, False
                log.warning("standby_etcd_unavailable", error=str(exc)[:200])
            loop.call_soon_threadsafe(self._etcd_read, value, members, ok)
            if not ok:
                stop.wait(backoff_delay_s(failures, 0.1, 2.0))
            elif value is None:
                stop.wait(0.1)
            else:
                try:
                    self.election.wait_vacant(min(1.0, self.silence_s))
                except EtcdUnavailable:
                    stop.wait(0.2)

    def _etcd_read(self, value: dict[str, Any] | None, members: list[str], ok: bool) -> None:
        e = self.etcd
        changed = (value != e.primary) or (members != e.members) or (ok != e.ok)
        e.primary, e.members, e.ok, e.read_at = value, members, ok, time.monotonic()
        if changed and e.changed is not None:
            e.changed.set()

    def may_promote(self) -> bool:
        if not self.etcd.ok or self.etcd.primary is not None or self.replica is None:
            return False
        return self.mode == "async" or self.node in self.etcd.members

    # --- the link to the primary ---
    def hello(self) -> protocol.Hello:
        if self.replica is None or self.force_copy:
            empty: protocol.Params = {replica_link.INFO_LEDGER_ID: "", replica_link.INFO_EPOCH: 0, replica_link.INFO_SEQ: 0}
            return protocol.Hello(role=protocol.Role.STANDBY.value, info=empty)
        return replica_link.standby_hello(self.replica)

    async def session(self, ctx: zmq.Context, primary: dict[str, Any]) -> None:
        """One session with ``primary``; returns (or raises :class:`_Restart`) when it ends.

        The DEALER is a plain (not asyncio) socket read and written without blocking: one wait
        for its descriptor per batch (:func:`_readable`), then every queued message taken at once
        (up to 512), and the REPL_ACK sent as soon as the batch is fsynced. (zmq.asyncio's
        ``poll``/``recv`` went through the event loop once per message: CPU and latency on every
        turn the standby acknowledges, which a sync primary's confirms wait for.)"""
        endpoint = str(primary.get("repl_endpoint") or "")
        if not endpoint:
            raise _Restart(f"the primary's etcd value names no repl_endpoint: {primary}")
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 1_000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes + frames.FRAME_SLACK_BYTES)
        if self.curve_secret is not None:
            curve_client_setup(sock, zmq.curve_public(self.curve_secret), self.curve_secret)
        sock.connect(endpoint)
        codec = self.link_codec
        codec.new_session()
        inc: _Incoming | None = None
        try:
            await _send(sock, codec.encode(self.hello()), self.silence_s)
            last_sent = last_recv = time.monotonic()
            welcome = None
            standby: replica_link.Standby | None = None
            while True:
                if self.etcd.primary != primary:
                    raise _Restart("the primary key changed")
                batch: list[list[bytes]] = []
                if await _readable(sock, min(self.hb_s, 0.25)):
                    while len(batch) < 512:
                        try:
                            batch.append(sock.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                now = time.monotonic()
                ack: protocol.ReplAck | None = None
                out: list[protocol.Message] = []
                turns: list[replication.WriteSet] = []  # applied together (one transaction, one fsync)
                for raw in batch:
                    try:
                        env = codec.decode(raw)
                    except DecodeError as exc:
                        raise _Restart(f"invalid frame from the primary: {exc}") from None
                    if env.role is not protocol.Role.BROKER:
                        raise _Restart(f"frame from {env.sender} of role {env.role.value} on the replication link")
                    last_recv = now
                    msg = env.message
                    if isinstance(msg, protocol.Welcome):
                        welcome, self.session_epoch = msg, msg.broker_epoch
                        if int(primary.get("epoch", msg.broker_epoch)) != msg.broker_epoch:
                            raise _Restart(f"WELCOME of epoch {msg.broker_epoch}, etcd names epoch {primary.get('epoch')}")
                        standby = replica_link.Standby(self.replica, msg) if self.replica is not None else None
                        log.info("standby_following", primary=endpoint, epoch=msg.broker_epoch,
                                 position=list(self.replica.position) if self.replica else None)
                    elif welcome is None:
                        why = f": {msg.code}: {msg.message}" if isinstance(msg, protocol.Error) else ""
                        raise _Restart(f"{type(msg).__name__} before WELCOME{why}")
                    elif isinstance(msg, protocol.ReplTurns):
                        if standby is None:
                            raise _Restart("REPL_TURNS while this standby holds no ledger")
                        try:
                            turns.extend(standby.write_sets(msg))
                        except replication.ReplicationError as exc:
                            raise _Restart(str(exc)) from None
                        continue
                    if turns:  # whatever else came: the turns before it first
                        ack = self.apply(turns) or ack
                        turns = []
                    if isinstance(msg, (protocol.Welcome, protocol.ReplTurns)):
                        pass
                    elif isinstance(msg, protocol.Error):
                        if msg.code == replica_link.NEED_COPY:
                            log.info("standby_copy_needed", reason=msg.message)
                            if inc is not None:
                                inc.close()
                            inc = _Incoming(self.data_dir / INCOMING)
                            standby = None
                        elif msg.code == OTHER_LEDGER:
                            raise ConfigError(
                                f"{self.cfg.config_path or 'brokerd.toml'}: the primary of {self.election.key} refused "
                                f"this standby: {msg.message}. Fix ha_swarm_id / ha_etcd_endpoints, or move "
                                f"{self.ledger_dir} aside to seed this broker from that primary")
                        else:
                            raise _Restart(f"the primary refused: {msg.code}: {msg.message}")
                    elif isinstance(msg, protocol.ReplCopyChunk):
                        if inc is None or msg.offset != inc.offset:
                            raise _Restart(f"copy chunk at {msg.offset} out of order")
                        os.pwrite(inc.fd, msg.data, msg.offset)
                        inc.offset += len(msg.data)
                        if inc.offset < msg.total:
                            out.append(protocol.ReplCopyAck(inc.offset))
                        else:
                            replica = self.install_copy(inc, msg.epoch, msg.seq)
                            inc = None
                            standby = replica_link.Standby(replica, welcome)
                            out.append(protocol.ReplCopyAck(msg.total))
                    elif isinstance(msg, protocol.Bye):
                        raise _Restart(f"the primary said BYE: {msg.reason}")
                if turns:
                    ack = self.apply(turns) or ack
                if ack is not None:
                    out.append(ack)
                if not out and now - last_sent >= self.hb_s:
                    out.append(protocol.Heartbeat())
                for m in out:
                    await _send(sock, codec.encode(m), self.silence_s)
                if out:
                    last_sent = now
                if now - last_recv > self.silence_s:
                    raise _Restart(f"the primary was silent for {now - last_recv:.2f}s")
                if self.may_promote() or self.stop_requested():
                    return
        finally:
            if inc is not None:
                inc.close()
                shutil.rmtree(inc.path, ignore_errors=True)
            sock.close(linger=0)

    def apply(self, turns: list[replication.WriteSet]) -> protocol.ReplAck | None:
        """Apply ``turns`` in one fsynced transaction; the REPL_ACK to send (None: nothing new)."""
        assert self.replica is not None
        try:
            n = self.replica.apply_many(turns)
        except replication.Diverged as exc:
            self.force_copy = True
            raise _Restart(f"diverged: {exc}") from None
        except replication.ReplicationError as exc:
            raise _Restart(str(exc)) from None
        if not n:
            return None
        self.applied_turns += n
        return protocol.ReplAck(self.session_epoch, self.replica.position[1])

    def stop_requested(self) -> bool:
        return self._stop_event is not None and self._stop_event.is_set()

    _stop_event: asyncio.Event | None = None


async def _readable(sock: zmq.Socket, timeout_s: float, *, events: int = zmq.POLLIN) -> bool:
    """Wait up to ``timeout_s`` until ``sock`` has ``events`` (POLLIN: a message to read;
    POLLOUT: room to send). ZMQ_FD is edge-triggered: EVENTS is checked before sleeping and
    after the wake-up. Yields to the loop either way (its other tasks: the peers' endpoint, etcd's
    news), however fast the primary sends."""
    if cast(int, sock.getsockopt(zmq.EVENTS)) & events:
        await asyncio.sleep(0)
        return True
    return await sleep_until_events(sock, timeout_s, events)


async def _send(sock: zmq.Socket, frames: list[bytes], timeout_s: float) -> None:
    """Send ``frames`` on ``sock``, waiting (up to ``timeout_s``) while its high-water mark is
    reached. Raises :class:`_Restart` when it stays full: the primary reads nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Restart(f"the link to the primary stayed full for {timeout_s:.2f}s") from None
            await _readable(sock, left, events=zmq.POLLOUT)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _answer_peers(node: StandbyNode, transport: Transport) -> None:
    """The peer endpoint while standby: ERROR NOT_PRIMARY to every verified frame of a
    peer that is not a standby (a frame that does not verify gets nothing)."""
    while True:
        await transport.wait_readable(1.0)
        for raw in transport.drain(64):
            rid, body = raw[0], raw[1:]
            ref = 0
            try:
                env = transport.codec.decode(body)
                role, ref = env.role, env.seq
            except AuthError as exc:
                if exc.code not in (protocol.REJECT_NO_SESSION, protocol.REJECT_REPLAY):
                    continue  # not authenticated: no answer
                role = None
            except DecodeError:
                continue
            if role is protocol.Role.STANDBY:
                transport.send(rid, protocol.Error(protocol.REJECT_ROLE, "this broker is a standby too: a standby connects to "
                                            "the primary's ha_repl_endpoint", ref))
                continue
            primary = str((node.etcd.primary or {}).get("endpoint") or "")
            where = f"the primary is {primary}" if primary else "no primary holds the key now (an election is on)"
            transport.send(rid, protocol.Error(protocol.REJECT_NOT_PRIMARY, f"broker {node.node} is a standby, not the primary: "
                                        f"{where}", ref, primary=primary))


async def run_standby(cfg: Any, election: Any, stop_event: asyncio.Event) -> StandbyOutcome:
    """Follow the primary until ``stop_event`` (STOPPED) or until this node may take over
    (PROMOTE: the primary key vacant, this node listed in /sync or async mode, a whole
    ledger here; the caller campaigns and opens ``data_dir/ledger`` as its Ledger).
    Raises ConfigError (78) for a ledger of another swarm, EndpointInUse (75)."""
    node = StandbyNode(cfg, election)
    node._stop_event = stop_event
    node.data_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(node.data_dir / INCOMING, ignore_errors=True)  # a copy a crash interrupted
    node.open_replica()
    peer_codec = EnvelopeCodec(cfg.peer_id, load_private_key(Path(cfg.private_key)), node.authorized,
                               max_frame_bytes=node.max_frame_bytes, max_clock_skew_s=cfg.max_clock_skew_s,
                               require_hello=True)
    transport = Transport(cfg.bind or cfg.endpoint, peer_codec, sndhwm=cfg.sndhwm, max_frame_bytes=node.max_frame_bytes,
                          curve_secret_key=node.curve_secret, curve_allow=node.authorized.curve_allowed)
    (node.data_dir / "endpoint").write_text(transport.endpoint + "\n")
    loop = asyncio.get_running_loop()
    node.etcd.changed = asyncio.Event()
    watch_stop = threading.Event()
    watcher = threading.Thread(target=node.watch, args=(loop, watch_stop), name="ccsq-standby-etcd", daemon=True)
    watcher.start()
    answering = loop.create_task(_answer_peers(node, transport))
    ctx = zmq.Context()
    failures = 0
    log.info("standby_started", node=node.node, ledger_dir=str(node.ledger_dir), mode=node.mode,
             position=list(node.replica.position) if node.replica else None, peer_endpoint=transport.endpoint)
    try:
        while True:
            if stop_event.is_set():
                return StandbyOutcome.STOPPED
            if node.may_promote() and node.replica is not None:
                log.info("standby_promoting", node=node.node, position=list(node.replica.position))
                return StandbyOutcome.PROMOTE
            primary = node.etcd.primary
            if primary is None or not node.etcd.ok:
                node.etcd.changed.clear()
                await _wait_any(stop_event, node.etcd.changed, 1.0)
                continue
            node.check_ledger_id(str(primary.get("ledger_id") or ""))
            started = time.monotonic()
            try:
                await node.session(ctx, primary)
                continue
            except _Restart as exc:
                log.info("standby_session_ended", reason=str(exc), primary=primary.get("repl_endpoint"))
            except (OSError, zmq.ZMQError) as exc:
                log.warning("standby_session_failed", error=f"{type(exc).__name__}: {exc}")
            except replication.ReplicationError as exc:  # e.g. an installed copy not at the announced position
                node.force_copy = True
                log.error("standby_seed_failed", error=f"{type(exc).__name__}: {exc}")
            failures = 0 if time.monotonic() - started > node.silence_s else failures + 1
            if failures:
                node.etcd.changed.clear()
                await _wait_any(stop_event, node.etcd.changed, backoff_delay_s(failures, 0.05, 2.0))
    finally:
        watch_stop.set()
        answering.cancel()
        try:
            await answering
        except asyncio.CancelledError:
            pass
        transport.close()
        ctx.term()
        if node.replica is not None:
            node.replica.close()
        watcher.join(timeout=2.0)


async def _wait_any(stop_event: asyncio.Event, changed: asyncio.Event, timeout_s: float) -> None:
    waits = [asyncio.ensure_future(stop_event.wait()), asyncio.ensure_future(changed.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
