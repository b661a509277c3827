"""A peer's session with the broker: one DEALER socket, HELLO/WELCOME, heartbeats,
the one disconnect rule, and reconnection with capped, jittered backoff.

Used by the worker, the producer's AsyncClient, the completion service, the relay
(both sides) and the admin CLI. Its codec (:func:`make_codec`) offers session MACs in
every HELLO: once the broker's WELCOME agrees, frames carry a 32-byte HMAC tag instead
of an Ed25519 signature (``common/wire/envelope.py``; an older broker: signatures). The
link owns its socket: only the coroutines of one session (one event loop, one thread) touch it; other threads hand work to that loop
(``loop.call_soon_threadsafe``) rather than calling the link.

Delivery contract: :meth:`BrokerLink.send` queues a message for the *current*
session only. When a session ends, unsent messages are discarded and the owner
re-sends whatever it still needs from ``on_connect`` (owners keep their own
pending state: unconfirmed SUBMITs, unconfirmed COMPLETEs, held leases). This is
the at-least-once pattern; the broker deduplicates.

The one disconnect rule (docs/architecture.md, layer 2): the broker is gone when nothing
arrived for ``heartbeat_interval_s x liveness``, on any socket error, or on an
invalid envelope from it. Then the DEALER is closed (LINGER 0) and rebuilt.

A broker pair (docs/ha.md, "Peers"): ``broker_endpoint`` may list several endpoints
(comma-separated). The link talks to one at a time, the first one first. A standby
answers HELLO with ``Error(NOT_PRIMARY, primary=ENDPOINT)``: the link connects to that
endpoint at once (listed or not: the broker there must prove the same pinned keys; one
immediate redirect in a row, a second one waits the backoff), and with ``primary = ""``
(an election) it tries the next endpoint after the backoff. A refused connect, no
WELCOME in time, or a broker gone by the disconnect rule: the next endpoint of the
list (after the backoff). With a list, a session also ends as soon as its TCP
connection closes (a ZeroMQ monitor event: the broker process died), not after the
silence. The codec keeps its replay memory per endpoint (``EnvelopeCodec.replay_scope``:
every broker of a pair signs as the one service identity). A WELCOME whose
``broker_epoch`` differs from the last session's is counted and logged
(``broker_epoch_changed``: a restart or a failover); the owners' ``on_connect`` resends
what they hold either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.config import PeerSettings
from ccsq.common.wire.endpoints import check_endpoint, split_endpoints, split_tcp
from ccsq.common.wire.envelope import Envelope, EnvelopeCodec
from ccsq.common.wire.errors import ConfigError, DecodeError
from ccsq.common.wire.frames import FRAME_SLACK_BYTES, encode_fitting
from ccsq.common.wire.keys import (
    AuthorizedKeys,
    curve_client_setup,
    load_curve_public,
    load_curve_secret,
    load_private_key,
    public_key_b64,
)
from ccsq.common.runtime.log import get_logger
from ccsq.common.wire.policy import BROKER_KEY_MISMATCH, CURVE_REFUSED, refusal_final

log = get_logger("ccsq.peer")


def refusal_fix(settings: PeerSettings, role: str, refusal: protocol.Error) -> str:
    """One sentence: why the broker refused this peer and what to change (for logs,
    :class:`~ccsq.common.wire.errors.Unauthorized` and the CLI)."""
    peer = settings.peer_id
    try:
        entry = f'[peers.{peer}] role = "{role}" public_key = "{public_key_b64(load_private_key(Path(settings.private_key)))}"'
    except Exception:  # noqa: BLE001 - the key loaded at start; this is only a hint
        entry = f'[peers.{peer}] role = "{role}" public_key = "<this peer\'s public key>"'
    if refusal.code == protocol.REJECT_UNKNOWN_SENDER:
        fix = f"add to the broker's authorized_keys: {entry}; then reload the broker (SIGHUP) and start this peer again"
    elif refusal.code == protocol.REJECT_BAD_SIGNATURE and (owner := _key_owner(settings)) not in (None, peer):
        # another peer's key: registering it for this peer too would let that peer act as this one
        own = Path(settings.private_key).with_name(f"{peer}.key")
        fix = (f"this is {owner}'s key ({settings.private_key}); use {own}: set private_key = \"{own}\" in "
               f"{settings.config_path or 'its config'} (do not list {owner}'s public key for {peer!r})")
    elif refusal.code == protocol.REJECT_BAD_SIGNATURE:
        fix = (f"the private key {settings.private_key} does not match the public key the broker holds for {peer!r}: "
               f"set it in the broker's authorized_keys: {entry} (then SIGHUP the broker), or use the matching private key")
    elif refusal.code == CURVE_REFUSED:
        try:
            import zmq as _zmq

            curve_pub = _zmq.curve_public(peer_curve_secret(settings)).decode()
        except Exception:  # noqa: BLE001 - only a hint
            curve_pub = "<this peer's CURVE public key>"
        fix = (f'add curve_public_key = "{curve_pub}" to [peers.{peer}] in the broker\'s authorized_keys.toml, then '
               "reload the broker (SIGHUP) and start this peer again")
    elif refusal.code == BROKER_KEY_MISMATCH:
        return (f"the broker at {settings.broker_endpoint} answered as someone this peer does not trust "
                f"({refusal.message}): its public key (or broker_id = {settings.broker_id!r}) in "
                f"{settings.authorized_keys or 'authorized_keys'} does not match the running broker's; copy the "
                "broker's authorized_keys.toml (or its [peers.<broker_id>] entry) to this host, then start this peer again")
    elif refusal.code == protocol.REJECT_ROLE:
        fix = (f"peer id {peer!r} is authorized for another role than {role!r}: "
               f"use the id and key of a peer with role {role!r}, or change its role in the broker's authorized_keys")
    else:
        fix = "check this peer's id and key against the broker's authorized_keys"
    return f"the broker refused peer {peer!r} ({refusal.code}: {refusal.message}); {fix}"


def _key_owner(settings: PeerSettings) -> str | None:
    """The peer id whose public key in this peer's copy of authorized_keys matches this
    peer's private key (None when none does or a file cannot be read: only a hint)."""
    try:
        from cryptography.hazmat.primitives import serialization

        raw = serialization.Encoding.Raw
        mine = load_private_key(Path(settings.private_key)).public_key().public_bytes(raw, serialization.PublicFormat.Raw)
        keys = AuthorizedKeys(Path(settings.authorized_keys))
        for pid in keys.ids():
            entry = keys.get(pid)
            if entry is not None and entry.public_key.public_bytes(raw, serialization.PublicFormat.Raw) == mine:
                return pid
    except Exception:  # noqa: BLE001 - only a hint
        return None
    return None


def id_in_use_message(settings: PeerSettings, link: BrokerLink) -> str:
    """One sentence for a link that stopped because another live process holds its peer
    id (``link.replaced``): the id, the holder the broker named, and the fix (exit 78)."""
    fix = ("give each process its own peer id and key (`ccsq keygen --id NAME`, then add it to "
           "authorized_keys.toml), or stop the other process")
    if link.in_use_by:
        said = link.in_use_by.split(": give each process its own peer id", 1)[0]  # the broker's own fix: said once, below
        return f"another live process uses peer id {settings.peer_id!r}: the broker said: {said}; {fix}"
    return (f"another live process uses peer id {settings.peer_id!r} (an older broker let its newer session replace "
            f"this one); {fix}")


#: How long ending a session waits for its reader/writer/heartbeat tasks to finish
#: before closing the socket under them.
SESSION_TEARDOWN_S = 1.0
#: A link that has not reached the broker for this long logs ``broker_unreachable`` (warning:
#: endpoint, cause, fix), then again every BROKER_UNREACHABLE_REPEAT_S while it stays so; the
#: attempts in between stay ``broker_link_lost`` at info (a broker restart is not worth a warning).
BROKER_UNREACHABLE_WARN_AFTER_S = 10.0
BROKER_UNREACHABLE_REPEAT_S = 60.0

class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    STOPPED = "stopped"


class LinkLost(Exception):
    """Internal: the current session ended (reason in args[0]). ``rotate``: the broker at
    this endpoint is unreachable or gone (try the next endpoint of the list); False when it
    answered and is alive (a refusal to retry there, or it ended our session)."""

    def __init__(self, reason: str, *, rotate: bool = True) -> None:
        super().__init__(reason)
        self.rotate = rotate


class NotPrimary(LinkLost):
    """Internal: the broker answered HELLO with NOT_PRIMARY (a standby); ``primary`` is the
    endpoint it named ("" during an election)."""

    def __init__(self, reason: str, primary: str) -> None:
        super().__init__(reason, rotate=True)
        self.primary = primary


#: ZeroMQ handshake outcomes watched on a CURVE link (a wrong pinned key fails at once).
CURVE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

#: ZeroMQ connection events watched on every link while it waits for WELCOME: a refused
#: TCP/IPC connect (CONNECT_RETRIED before any CONNECTED: nothing listens, fail fast) and a
#: ZMTP security-mechanism mismatch (curve on one side only: say so, not "broker down").
CONNECT_EVENTS = CURVE_FAILED_EVENTS | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
#: With a list of brokers (a pair, docs/ha.md) the link also watches its connection close: a
#: broker process that died (its host's kernel closes the TCP connection) ends the session
#: at once, so the link moves to the next broker without waiting heartbeat x liveness.
PAIR_EVENTS = CONNECT_EVENTS | zmq.EVENT_DISCONNECTED
#: With a list of brokers: an attempt whose TCP connection is not established within this
#: (or ``hello_timeout_s`` if shorter) moves on to the next broker (a live host's TCP
#: handshake takes milliseconds; a cut one never answers, and a redirect to it by a standby
#: that still sees its key would otherwise cost ``hello_timeout_s`` per attempt).
PAIR_CONNECT_TIMEOUT_S = 0.5


def curve_mismatch_hint(settings: PeerSettings, endpoint: str | None = None) -> str:
    """One sentence for a ZMTP mechanism mismatch: which side has CURVE on, and the fix.
    ``endpoint``: the broker endpoint tried (default ``settings.broker_endpoint``)."""
    where = settings.config_path or "this peer's config"
    endpoint = endpoint or settings.broker_endpoint
    if settings.curve:
        return (f"CURVE mismatch: this peer has curve = true but the broker at {endpoint} runs without "
                f"CURVE: set curve = true in the broker's brokerd.toml (docs/security.md), or curve = false in {where}")
    return (f"CURVE mismatch: the broker at {endpoint} requires CURVE (curve = true) but {where} has "
            "curve = false: set curve = true there with broker_curve_public_key and curve_secret_key "
            "(`ccsq init` writes them; docs/security.md)")


def peer_curve_secret(settings: PeerSettings) -> bytes:
    """This peer's own CURVE secret key (``curve_secret_key``, needed with curve = true:
    the broker's ZAP allow-list admits only listed keys); ConfigError naming the fix."""
    if not settings.curve_secret_key:
        raise ConfigError(
            f"{settings.config_path or 'config'}: curve = true needs curve_secret_key (this peer's CURVE key; "
            f"`ccsq keygen --curve --out keys --id {settings.peer_id or 'PEER'}` writes it and prints the "
            "curve_public_key line for authorized_keys.toml)")
    return load_curve_secret(Path(settings.curve_secret_key))


async def unresolved_host(endpoint: str) -> str | None:
    """A sentence naming the host when a ``tcp://`` endpoint's host name does not resolve
    (a typo, or DNS or /etc/hosts lacks it: ZeroMQ reports that as a retried connect, like
    a refused one), else None. Resolves in the loop's executor, never on the loop."""
    if not endpoint.startswith("tcp://"):
        return None
    try:
        host, port = split_tcp(endpoint)
        await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return (f"the host {host!r} of {endpoint} does not resolve ({exc.strerror}): "
                "check the name in broker_endpoint, DNS or /etc/hosts")
    except (OSError, ValueError):
        return None
    return None


def make_codec(settings: PeerSettings) -> EnvelopeCodec:
    """Build this peer's codec from its settings (keys loaded, and the broker's
    CURVE public key checked when ``curve`` is on; ConfigError on problems)."""
    if settings.curve:
        try:
            load_curve_public(Path(settings.broker_curve_public_key))
        except ConfigError as exc:  # name the file and key: the fix is in this peer's config or next to it
            raise ConfigError(f"{settings.config_path or 'config'}: broker_curve_public_key: {exc}") from None
        peer_curve_secret(settings)
    where = settings.config_path or "config"
    try:  # name the file and key, as for the CURVE keys: a missing or open key file is fixed in this config
        private = load_private_key(Path(settings.private_key))
    except ConfigError as exc:
        raise ConfigError(f"{where}: private_key: {exc}") from None
    try:
        authorized = AuthorizedKeys(Path(settings.authorized_keys))
    except ConfigError as exc:
        raise ConfigError(f"{where}: authorized_keys: {exc}") from None
    return EnvelopeCodec(
        settings.peer_id,
        private,
        authorized,
        max_frame_bytes=settings.max_frame_bytes,
        max_clock_skew_s=settings.max_clock_skew_s,
        require_hello=False,
        session_macs=True,  # HMAC tags instead of signatures once the broker's WELCOME agrees (docs/security.md)
    )


class BrokerLink:
    """One peer's connection to the broker.

    ``hello()`` builds the HELLO for each new session (so it can list held
    leases); ``heartbeat()`` builds each HEARTBEAT; ``on_message(env)`` gets every
    verified message except WELCOME and HEARTBEAT; ``on_connect(welcome)`` runs
    once per session after WELCOME; ``on_disconnect(reason)`` when it ends.
    """

    # --- state owned by this link ---
    settings: PeerSettings
    codec: EnvelopeCodec
    state: LinkState
    ready: asyncio.Event
    heartbeat_interval_s: float  # from the broker's WELCOME
    liveness: int  # from the broker's WELCOME
    broker_epoch: int
    endpoints: tuple[str, ...]  # broker_endpoint's entries, tried in order (a broker pair: docs/ha.md)
    endpoint: str  # the endpoint of the current (or next) attempt: an entry, or the primary a standby named
    epoch_changes: int  # WELCOMEs whose broker_epoch differed from the session before (restart or failover)
    sessions: int  # sessions opened so far
    last_recv_mono: float
    last_refusal: protocol.Error | None  # the broker's ERROR answer to our last HELLO, if any
    replaced: bool  # another live process holds (or took) our peer id: the link stopped for good
    in_use_by: str | None  # the broker's REJECT_ID_IN_USE sentence (id, live holder), while refused
    instance: str  # HELLO info INSTANCE_INFO: this link's process instance, "<host>/<pid>/<hex>"
    refused: protocol.Error | None  # the broker refused this peer for good (policy.refusal_final): the link stopped
    _outbox: asyncio.Queue[protocol.Message]

    def __init__(
        self,
        settings: PeerSettings,
        *,
        hello: Callable[[], protocol.Hello],
        heartbeat: Callable[[], protocol.Heartbeat] | None = None,
        on_message: Callable[[Envelope], Awaitable[None] | None],
        on_connect: Callable[[protocol.Welcome], Awaitable[None] | None] | None = None,
        on_disconnect: Callable[[str], None] | None = None,
        codec: EnvelopeCodec | None = None,
        send_timeout_s: float = 5.0,
        on_heartbeat: Callable[[protocol.Heartbeat], None] | None = None,
    ) -> None:
        self.settings = settings
        self.codec = codec or make_codec(settings)
        self._curve_server_key = load_curve_public(Path(settings.broker_curve_public_key)) if settings.curve else None
        self._curve_secret = peer_curve_secret(settings) if settings.curve else None
        self._hello = hello
        self._heartbeat = heartbeat or (lambda: protocol.Heartbeat())
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_heartbeat = on_heartbeat  # the broker's heartbeats (a relay reads capacity in info)
        self.send_timeout_s = send_timeout_s
        self.state = LinkState.CONNECTING
        self.ready = asyncio.Event()
        self.heartbeat_interval_s = 1.0
        self.liveness = 5
        self.broker_epoch = 0
        self.endpoints = split_endpoints(settings.broker_endpoint)
        self._endpoint_index = 0  # the entry of endpoints tried last (or now)
        self.endpoint = self.endpoints[0]
        self._redirected = False  # the last attempt followed a NOT_PRIMARY answer at once
        self.epoch_changes = 0
        self.sessions = 0
        self.last_recv_mono = time.monotonic()
        self.last_refusal = None
        self.replaced = False  # set when another live process holds our peer id (for good)
        self.in_use_by = None
        self.instance = f"{socket.gethostname()[:64]}/{os.getpid()}/{secrets.token_hex(4)}"
        self._in_use_until_mono: float | None = None  # refused ID_IN_USE since: give up when refused after this
        self._in_use_retry = False  # the last handshake was refused ID_IN_USE: retry soon, not by backoff
        self.connect_problem: str | None = None  # why the last attempts got no WELCOME (refused, CURVE mismatch)
        self.refused_since_mono: float | None = None  # connects refused (nothing listens) without a break since then
        self._unresolved: str | None = None  # why the endpoint's host name does not resolve, during that streak
        self.curve_mismatch = False  # the last CURVE handshake failed: CURVE on one side only or a wrong key (connect_problem says which)
        self.refused = None
        self._hello_role = ""
        self._outbox = asyncio.Queue()
        self._stopping = False
        self._stopped_ev = asyncio.Event()  # set by stop(); ends run()
        self._ctx = zmq.asyncio.Context.instance()
        self.log = log.bind(peer=settings.peer_id)

    # --- API for owners ---
    @property
    def in_use_until_mono(self) -> float | None:
        """While the broker refuses our HELLO with ID_IN_USE: when the holder's session
        would lapse (the link retries until then, then stops with ``replaced``); else None."""
        return self._in_use_until_mono

    def send(self, msg: protocol.Message) -> bool:
        """Queue ``msg`` for the current session; False (not queued) when not connected."""
        if self.state is not LinkState.READY:
            return False
        self._outbox.put_nowait(msg)
        return True

    async def stop(self, reason: str = "shutdown") -> None:
        """Say BYE (best effort, bounded) and end :meth:`run`."""
        self._stopping = True
        if self.state is LinkState.READY:
            self._outbox.put_nowait(protocol.Bye(reason=reason))
            deadline = time.monotonic() + 1.0
            while not self._outbox.empty() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        self._stopped_ev.set()

    async def run(self) -> None:
        """Connect, serve sessions and reconnect until :meth:`stop`."""
        attempt = 0
        stop_ev = self._stopped_ev
        failing_since = time.monotonic()  # no session since then
        warned_mono: float | None = None
        while not self._stopping:
            lost = await self._one_session()
            reason = str(lost)
            was_ready = self.state is LinkState.READY
            self.state = LinkState.CONNECTING
            self.ready.clear()
            if was_ready:
                attempt = 0
                failing_since, warned_mono = time.monotonic(), None
                if self._on_disconnect:
                    self._on_disconnect(reason)
            if self._stopping:
                break
            delay = backoff_delay_s(attempt, 0.05, self.settings.reconnect_backoff_max_s)
            if self._next_endpoint(lost):
                delay = 0.0  # a standby named the primary: go there now (no backoff)
            if self._in_use_retry and self._in_use_until_mono is not None:
                # the holder's session lapses by then unless it is alive: poll until just after it
                self._in_use_retry = False
                poll_s = backoff_delay_s(attempt, 0.05, min(self.settings.reconnect_backoff_max_s, 1.0))
                delay = max(0.0, min(poll_s, self._in_use_until_mono - time.monotonic() + 0.02))
            attempt += 1
            self.log.info("broker_link_lost", reason=reason, reconnect_in_s=round(delay, 3), next_endpoint=self.endpoint)
            now = time.monotonic()
            if now - failing_since >= BROKER_UNREACHABLE_WARN_AFTER_S and (
                    warned_mono is None or now - warned_mono >= BROKER_UNREACHABLE_REPEAT_S):
                warned_mono = now
                self.log.warning(
                    "broker_unreachable", endpoint=self.settings.broker_endpoint, down_for_s=round(now - failing_since, 1),
                    cause=self.connect_problem or reason,
                    fix=f"check that ccsq-brokerd runs (systemctl status ccsq-brokerd) and that broker_endpoint in "
                        f"{self.settings.config_path or 'this peer config'} is the endpoint of its brokerd.toml")
            try:
                await asyncio.wait_for(stop_ev.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
        self.state = LinkState.STOPPED

    def _next_endpoint(self, lost: LinkLost) -> bool:
        """Choose the endpoint of the next attempt after a session (or attempt) ended with
        ``lost``; True when it is to be tried at once (a standby named the primary, and the
        attempt before was not itself such a redirect: two standbys naming each other, or a
        stale primary, cost the backoff, never a busy loop)."""
        redirected, self._redirected = self._redirected, False
        if isinstance(lost, NotPrimary) and lost.primary:
            try:
                check_endpoint(lost.primary, bind=False, where="NOT_PRIMARY primary")
            except ConfigError as exc:
                self.log.warning("broker_not_primary_bad_endpoint", endpoint=self.endpoint, error=str(exc)[:300])
            else:
                self.log.info("broker_not_primary", endpoint=self.endpoint, primary=lost.primary)
                if lost.primary in self.endpoints:
                    self._endpoint_index = self.endpoints.index(lost.primary)
                self.endpoint = lost.primary
                self._redirected = not redirected
                return not redirected
        elif isinstance(lost, NotPrimary):
            self.log.info("broker_not_primary", endpoint=self.endpoint, primary="",
                          note="no primary during an election: next endpoint after the backoff")
        if not lost.rotate:
            return False  # the broker there answered and lives: retry the same endpoint
        if self.endpoint in self.endpoints:
            self._endpoint_index = (self.endpoints.index(self.endpoint) + 1) % len(self.endpoints)
        self.endpoint = self.endpoints[self._endpoint_index]
        return False

    # --- one session ---
    async def _one_session(self) -> LinkLost:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_frame_bytes + FRAME_SLACK_BYTES)
        if self._curve_server_key is not None:
            curve_client_setup(sock, self._curve_server_key, self._curve_secret)
        pair = len(self.endpoints) > 1 or self.endpoint not in self.endpoints
        monitor = sock.get_monitor_socket(PAIR_EVENTS if pair else CONNECT_EVENTS)
        sock.connect(self.endpoint)
        self.codec.replay_scope(self.endpoint)  # each broker of a pair: its own sessions (docs/ha.md)
        self.codec.new_session()
        self._outbox = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        try:
            await self._handshake_watched(sock, monitor)
            self.sessions += 1
            self.state = LinkState.READY
            self.ready.set()
            self.log.info("broker_link_ready", session=self.codec.session, broker_epoch=self.broker_epoch,
                          session_mac=self.codec.mac_active, endpoint=self.endpoint)
            tasks = [
                asyncio.create_task(self._reader(sock), name="link-reader"),
                asyncio.create_task(self._writer(sock), name="link-writer"),
                asyncio.create_task(self._ticker(), name="link-heartbeat"),
                asyncio.create_task(self._stopped_ev.wait(), name="link-stop"),
            ]
            if pair and monitor is not None:
                tasks.append(asyncio.create_task(self._closed_watch(monitor), name="link-closed-watch"))
            if self._on_connect:
                res = self._on_connect(self._welcome)
                if asyncio.iscoroutine(res):
                    await res
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if isinstance(exc, LinkLost):
                    return exc
                if exc is not None:
                    raise exc
            return LinkLost("stopped", rotate=False)
        except LinkLost as exc:
            return exc
        except zmq.ZMQError as exc:
            return LinkLost(f"socket error: {exc}")
        finally:
            for t in tasks:
                t.cancel()
            # Bounded: a task whose ZeroMQ send is still pending may take the socket's
            # close to finish; the session must end (and a new one start) regardless.
            if tasks:
                await asyncio.wait(tasks, timeout=SESSION_TEARDOWN_S)
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            stuck = [t for t in tasks if not t.done()]
            if stuck:
                await asyncio.wait(stuck, timeout=SESSION_TEARDOWN_S)
            for t in tasks:
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved: the reason is already returned or logged

    async def _handshake_watched(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket | None) -> None:
        """:meth:`_handshake`, ended at once with ``curve_handshake_failed`` when the
        CURVE handshake fails (wrong pinned broker key, or a broker without CURVE)."""
        if monitor is None:
            return await self._handshake(sock)
        hello = asyncio.ensure_future(self._handshake(sock))
        failed = asyncio.ensure_future(monitor.recv_multipart())
        # a list (a broker pair): a host that has not even accepted the TCP connection within
        # PAIR_CONNECT_TIMEOUT_S is gone or cut off; try the next broker instead of waiting out hello_timeout_s
        pair = len(self.endpoints) > 1 or self.endpoint not in self.endpoints
        connect_by = time.monotonic() + min(PAIR_CONNECT_TIMEOUT_S, self.settings.hello_timeout_s) if pair else None
        try:
            while True:
                left = None if connect_by is None else max(0.0, connect_by - time.monotonic())
                await asyncio.wait({hello, failed}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if not hello.done() and not failed.done():  # the deadline passed: one more look at queued events
                    await asyncio.wait({hello, failed}, timeout=0.02, return_when=asyncio.FIRST_COMPLETED)
                if not hello.done() and not failed.done():  # no TCP connection in time
                    self.connect_problem = (f"no TCP connection to {self.endpoint} within "
                                            f"{min(PAIR_CONNECT_TIMEOUT_S, self.settings.hello_timeout_s):g} s "
                                            "(the host is gone or cut off)")
                    raise LinkLost(self.connect_problem)
                if hello.done():
                    self.connect_problem = None
                    self.refused_since_mono = None
                    self.curve_mismatch = False
                    if isinstance(exc := hello.exception(), NotPrimary):
                        self.connect_problem = (f"the broker at {self.endpoint} is a standby (NOT_PRIMARY); primary: "
                                                f"{exc.primary or 'none named (an election is on)'}")
                    return hello.result()
                event = parse_monitor_message(failed.result())
                if event["event"] == zmq.EVENT_CONNECTED:
                    self.refused_since_mono = None  # something listens; WELCOME may still be slow
                    connect_by = None  # connected: WELCOME has hello_timeout_s
                elif event["event"] == zmq.EVENT_DISCONNECTED:  # a list only (PAIR_EVENTS)
                    raise LinkLost(f"connection to {self.endpoint} closed before WELCOME")
                elif event["event"] == zmq.EVENT_CONNECT_RETRIED:
                    if self.refused_since_mono is None:
                        self.refused_since_mono = time.monotonic()
                        self._unresolved = await unresolved_host(self.endpoint)  # once per streak, off the loop
                    self.connect_problem = self._unresolved or f"connection to {self.endpoint} refused (nothing listens there)"
                    if len(self.endpoints) > 1 or self.endpoint not in self.endpoints:
                        # a list (a broker pair): the next broker now, not after hello_timeout_s
                        raise LinkLost(self.connect_problem)
                else:
                    break
                failed = asyncio.ensure_future(monitor.recv_multipart())
            name = getattr(event["event"], "name", str(event["event"]))
            if (event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
                hint = curve_mismatch_hint(self.settings, self.endpoint)
                if self.connect_problem != hint:
                    self.log.error("curve_mismatch", endpoint=self.endpoint, curve=self.settings.curve,
                                   hint=hint)
                self.connect_problem = hint
                self.curve_mismatch = True
                raise LinkLost(hint)
            if self._curve_secret is None:
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    # a CURVE broker often closes a plain peer's connection before libzmq can
                    # name the mechanism mismatch: still a configuration error, said at once
                    hint = curve_mismatch_hint(self.settings, self.endpoint) + " (or this endpoint is not a ccsq broker)"
                    if self.connect_problem != hint:
                        self.log.error("curve_mismatch", endpoint=self.endpoint, curve=False,
                                       zmq_event=name, hint=hint)
                    self.connect_problem = hint
                    self.curve_mismatch = True
                    raise LinkLost(hint)
                raise LinkLost(f"handshake with {self.endpoint} failed ({name})")
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self._curve_secret is not None:
                # the broker's ZAP allow-list refused our CURVE key: for good, like UNKNOWN_SENDER
                self.refused = self.last_refusal = protocol.Error(CURVE_REFUSED, "the broker's CURVE allow-list does not list "
                                                                          "this peer's CURVE public key")
                self._stopping = True
                self.log.error("broker_refused_peer", code=CURVE_REFUSED, message=self.refused.message,
                               fix=refusal_fix(self.settings, self._hello_role, self.refused))
                raise LinkLost(f"CURVE handshake with {self.endpoint} refused (ZAP): {CURVE_REFUSED}")
            # libzmq often reports a mechanism mismatch as NO_DETAIL too (the plain broker closes
            # first): name both causes, each a configuration fix, never "broker down"
            self.connect_problem = (
                f"CURVE handshake with {self.endpoint} failed ({name}): either a "
                + curve_mismatch_hint(self.settings, self.endpoint)
                + f"; or broker_curve_public_key ({self.settings.broker_curve_public_key}) is not the broker's key")
            self.curve_mismatch = True
            self.log.error(
                "curve_handshake_failed", endpoint=self.endpoint, zmq_event=name,
                broker_curve_public_key=self.settings.broker_curve_public_key,
                hint="the pinned broker CURVE public key is wrong, the broker does not run with curve = true, or "
                     "this peer's curve_public_key is not in the broker's authorized_keys.toml (ZAP refused it)",
            )
            raise LinkLost(f"CURVE handshake with {self.endpoint} failed ({name}): check broker_curve_public_key")
        finally:
            for fut in (hello, failed):
                if not fut.done():
                    fut.cancel()
                    try:
                        await fut
                    except (asyncio.CancelledError, Exception):
                        pass

    async def _handshake(self, sock: zmq.asyncio.Socket) -> None:
        hello = self._hello()
        hello = dataclasses.replace(hello, info={**hello.info, protocol.INSTANCE_INFO: self.instance})
        self._hello_role = hello.role
        frames = self.codec.encode(hello)
        try:
            await asyncio.wait_for(sock.send_multipart(frames), timeout=self.settings.hello_timeout_s)
        except asyncio.TimeoutError:
            raise LinkLost(f"broker at {self.endpoint} not reachable (HELLO not sent within "
                           f"{self.settings.hello_timeout_s:g} s)") from None
        deadline = time.monotonic() + self.settings.hello_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkLost(f"no WELCOME from {self.endpoint} within hello_timeout_s")
            try:
                raw = await asyncio.wait_for(sock.recv_multipart(copy=True), timeout=left)
            except asyncio.TimeoutError:
                raise LinkLost(f"no WELCOME from {self.endpoint} within hello_timeout_s") from None
            env = self._decode(raw, answer_to_hello=True)
            msg = env.message
            if isinstance(msg, protocol.Welcome):
                self._welcome = msg
                self.heartbeat_interval_s = msg.heartbeat_interval_s
                self.liveness = msg.liveness
                if self.sessions and msg.broker_epoch != self.broker_epoch:
                    # a broker restart or a failover (docs/ha.md): the owners' on_connect resends
                    # what they hold (leases in HELLO, SUBMITs, COMPLETEs, ACKs) either way
                    self.epoch_changes += 1
                    self.log.info("broker_epoch_changed", endpoint=self.endpoint, broker_epoch=msg.broker_epoch,
                                  previous=self.broker_epoch)
                self.broker_epoch = msg.broker_epoch
                self.last_recv_mono = time.monotonic()
                self.last_refusal = None
                self._in_use_until_mono, self.in_use_by = None, None
                return
            if isinstance(msg, protocol.Error):
                self.last_refusal = msg
                if msg.code == protocol.REJECT_ID_IN_USE:
                    self._id_in_use(msg)
                    raise LinkLost(f"broker refused HELLO: {msg.code}: {msg.message}", rotate=False)
                if msg.code == protocol.REJECT_NOT_PRIMARY:  # a standby: the primary is elsewhere (docs/ha.md)
                    raise NotPrimary(f"broker at {self.endpoint} is not the primary: {msg.message}", msg.primary)
                if refusal_final(msg.code):  # by error type (Unauthorized), the one failure policy
                    # for good: reconnecting cannot help until authorized_keys changes
                    self.refused = msg
                    self._stopping = True
                    self.log.error("broker_refused_peer", code=msg.code, message=msg.message,
                                   fix=refusal_fix(self.settings, self._hello_role, msg))
                else:
                    self.log.warning("broker_refused_hello", code=msg.code, message=msg.message, endpoint=self.endpoint)
                raise LinkLost(f"broker refused HELLO: {msg.code}: {msg.message}", rotate=False)

    def _id_in_use(self, msg: protocol.Error) -> None:
        """The broker refused our HELLO: another live session holds our peer id. Retry until
        just after that session would lapse (``msg.retry_in_s``: a crashed predecessor's
        window); refused again after that, the holder is alive: stop for good (``replaced``)."""
        now = time.monotonic()
        self.in_use_by = msg.message
        if self._in_use_until_mono is None:
            wait_s = msg.retry_in_s if msg.retry_in_s > 0 else self.heartbeat_interval_s * self.liveness
            self._in_use_until_mono = now + wait_s
            self._in_use_retry = True
            self.log.warning("peer_id_in_use_waiting", message=msg.message, wait_s=round(wait_s, 3))
        elif now < self._in_use_until_mono:
            self._in_use_retry = True
        else:
            self.replaced = True
            self._stopping = True
            self.log.error("peer_id_in_use", message=msg.message)

    def _decode(self, raw: list[bytes], *, answer_to_hello: bool = False) -> Envelope:
        try:
            return self.codec.decode(raw, bound_sender=self.settings.broker_id)
        except DecodeError as exc:
            if answer_to_hello and exc.code in (protocol.REJECT_BAD_SIGNATURE, protocol.REJECT_UNKNOWN_SENDER,
                                                protocol.REJECT_FORGED_ORIGIN):
                # the answer to our HELLO is not from the broker we pin: for good (a session
                # would take leases whose every message we then refuse)
                self.refused = self.last_refusal = protocol.Error(BROKER_KEY_MISMATCH, f"{exc.code}: {exc}")
                self._stopping = True
                self.log.error("broker_key_mismatch", code=exc.code, message=str(exc)[:300],
                               fix=refusal_fix(self.settings, self._hello_role, self.refused))
            # one disconnect rule: an invalid envelope from the broker ends the session
            raise LinkLost(f"invalid envelope from broker: {exc.code}: {exc}") from None

    async def _reader(self, sock: zmq.asyncio.Socket) -> None:
        silence_s = self.heartbeat_interval_s * self.liveness
        while True:
            try:
                raw = await asyncio.wait_for(sock.recv_multipart(copy=True), timeout=silence_s)
            except asyncio.TimeoutError:
                raise LinkLost(f"broker at {self.endpoint} silent for {silence_s:.2f}s") from None
            except zmq.ZMQError as exc:
                raise LinkLost(f"socket error: {exc}") from None
            self.last_recv_mono = time.monotonic()
            env = self._decode(raw)
            if isinstance(env.message, protocol.Heartbeat) and self._on_heartbeat is not None:
                self._on_heartbeat(env.message)
            if isinstance(env.message, (protocol.Heartbeat, protocol.Welcome)):
                continue
            if isinstance(env.message, protocol.Error) and env.message.code == protocol.ERROR_REPLACED:
                # another live process uses our peer id: reconnecting would only fight it
                self.replaced = True
                self._stopping = True
                self.log.error("peer_id_in_use", message=env.message.message)
                raise LinkLost(f"replaced: another process uses peer id {self.settings.peer_id}")
            if isinstance(env.message, protocol.Error) and env.message.code == protocol.REJECT_NO_SESSION:
                # the broker ended this session (one disconnect rule): start a new one now
                raise LinkLost(f"broker has no session for us: {env.message.message}", rotate=False)
            res = self._on_message(env)
            if asyncio.iscoroutine(res):
                await res

    async def _writer(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = await self._outbox.get()
            try:  # a frame over max_frame_bytes goes as several (common/wire/frames.py)
                parts = encode_fitting(msg, self.codec.encode)
            except DecodeError as exc:  # one record that alone cannot fit any frame: never sent,
                # so its owner resends it (and the broker's lease ends it); the link goes on
                self.log.error("frame_unsendable", type=msg.TYPE.name, error=str(exc)[:300])
                continue
            for _, frames in parts:
                try:
                    await asyncio.wait_for(sock.send_multipart(frames), timeout=self.send_timeout_s)
                except asyncio.TimeoutError:
                    raise LinkLost("send timed out (broker not reading)") from None
                except zmq.ZMQError as exc:
                    raise LinkLost(f"socket error: {exc}") from None
            if isinstance(msg, protocol.Bye):
                raise LinkLost("bye sent")

    async def _closed_watch(self, monitor: zmq.asyncio.Socket) -> None:
        """A session of a broker pair: end it when its TCP connection closes (the broker
        process died or closed it): the disconnect rule, without waiting for the silence."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                raise LinkLost(f"connection to {self.endpoint} closed (the broker process is gone)")

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            self._outbox.put_nowait(self._heartbeat())
