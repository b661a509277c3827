"""The broker's one ROUTER socket: bind, wait for input, drain frames, send without blocking.

Only the broker actor's task uses it. Sends never block: :meth:`Transport.send`
returns :data:`SENT`, :data:`AGAIN` (the peer's pipe is at its high-water mark:
keep the message and retry) or :data:`UNROUTABLE` (no such peer:
ROUTER_MANDATORY makes this an error instead of a silent drop).

Connections whose ZeroMQ handshake fails (a plain client at a CURVE broker, a CURVE
client at a plain one, a wrong server key, garbage) never reach the codec: a socket
monitor (:class:`HandshakeWatch`, its own thread) counts them by reason (metric
``ccsq_handshake_failed``) and logs ``handshake_failed`` at most once per
:data:`HANDSHAKE_LOG_INTERVAL_S` per reason. ZAP refusals (a CURVE key not listed) are
the ZAP handler's (``ccsq_zap_refused``, ``curve_peer_refused``).
"""

from __future__ import annotations

import asyncio
import errno
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, cast

import structlog
import zmq

from ccsq.common.wire import protocol
from ccsq.common.wire.endpoints import is_loopback_endpoint
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import CcsqError, ConfigError, ExitCode
from ccsq.common.wire import frames
from ccsq.common.wire.keys import curve_server_setup

SENT = "sent"
AGAIN = "again"
UNROUTABLE = "unroutable"

#: Bytes allowed above max_frame_bytes at the ZeroMQ level (the one slack of
#: common/wire/frames.py), so a frame just over the limit reaches the codec and is
#: rejected with a typed error and a counter. A frame larger still makes ZeroMQ drop
#: that connection before reading it all.
FRAME_SLACK_BYTES = frames.FRAME_SLACK_BYTES
#: A connection that has not finished the ZeroMQ (or CURVE) handshake by then is dropped.
HANDSHAKE_IVL_MS = 5000
_log = structlog.get_logger("ccsq.brokerd")
#: Bytes one connection may have queued in the broker (ZeroMQ receive pipe) before
#: ZeroMQ stops reading its socket (back-pressure over TCP: nothing is dropped).
INBOUND_BYTES_PER_CONNECTION = 16 << 20
#: The actor takes at most this many frames per turn (MAX_FRAMES_PER_TURN in actor.py):
#: a longer per-connection queue cannot make the broker faster.
RCVHWM_MAX = 256
RCVHWM_MIN = 4
#: A refused CURVE key is logged at most once per this many seconds.
ZAP_LOG_INTERVAL_S = 60.0
#: A failed ZeroMQ handshake is logged at most once per this many seconds per reason.
HANDSHAKE_LOG_INTERVAL_S = 60.0
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def rcvhwm_for(max_frame_bytes: int) -> int:
    """Receive high-water mark (messages per connection) so that one connection
    queues at most about :data:`INBOUND_BYTES_PER_CONNECTION` of full-size frames:
    16 MiB // (max_frame_bytes + slack), within [4, 256]. Default 1 MiB frames: 15."""
    per_msg = max_frame_bytes + FRAME_SLACK_BYTES + protocol.SIGNATURE_BYTES
    return max(RCVHWM_MIN, min(RCVHWM_MAX, INBOUND_BYTES_PER_CONNECTION // per_msg))


class EndpointInUse(CcsqError):
    """The endpoint is already bound by another process (another broker?): transient, retry later (exit 75)."""

    code = "ENDPOINT_IN_USE"
    exit_code = ExitCode.TEMPFAIL


def normalize_endpoint(endpoint: str) -> str:
    """``tcp://HOST:0`` means an ephemeral port (ZeroMQ spells it ``*``)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


def check_exposure(cfg, authorized, config_path: str) -> None:
    """Refuse (ConfigError) what would let strangers cost the broker memory or
    silently shut every peer out: an endpoint beyond loopback without CURVE
    (unless ``allow_insecure_bind = true``); CURVE with no ``curve_public_key``
    in authorized_keys.toml (the ZAP allow-list would refuse every peer); a
    malformed ``metrics_listen``. ``cfg`` is a BrokerConfig, ``authorized`` its
    AuthorizedKeys."""
    from ccsq.brokerd.metrics import broker_listen
    from ccsq.common.runtime.metrics_exporter import parse_listen

    bound = getattr(cfg, "bind", "") or cfg.endpoint  # what the ROUTER binds (bind, else endpoint)
    if not cfg.curve and not cfg.allow_insecure_bind and not is_loopback_endpoint(bound):
        raise ConfigError(
            f"{config_path}: {'bind' if bound != cfg.endpoint else 'endpoint'} {bound} is reachable beyond this host but "
            "curve = false: anyone who "
            "reaches the port could connect and make the broker queue frames. Set curve = true (with "
            "curve_secret_key; `ccsq init` writes the keys, peers need curve = true and their curve_secret_key, "
            "authorized_keys.toml their curve_public_key), or bind 127.0.0.1, or set allow_insecure_bind = true "
            "to accept unauthenticated connections (docs/security.md)")
    if cfg.curve and not authorized.curve_keys:
        raise ConfigError(
            f"{config_path}: curve = true but {cfg.authorized_keys} lists no curve_public_key, so every peer would "
            "be refused at the handshake; add curve_public_key = \"<Z85>\" to each peer's entry "
            "(`ccsq keygen --curve --out keys --id PEER` prints it)")
    parse_listen(broker_listen(cfg.metrics_listen, cfg.metrics_port), where=f"{config_path}: metrics_listen")


class FrameTransport(Protocol):
    """The seam between the broker actor and the network: what :class:`~ccsq.brokerd.actor.Broker`
    uses of a transport. Frames come in as ``[routing_id, payload, signature_or_tag]``
    lists (:meth:`drain`, handed to ``Broker.turn``) and go out through :meth:`send`, which
    encodes with :attr:`codec` and answers :data:`SENT`, :data:`AGAIN` or :data:`UNROUTABLE`.
    :class:`Transport` (the ZeroMQ ROUTER) is the daemon's; the deterministic simulation
    (``tests/sim``, docs/simulation.md) calls ``Broker.turn`` itself and implements :meth:`send`."""

    codec: EnvelopeCodec
    endpoint: str
    drained_all: bool
    sent_again: int
    sent_unroutable: int

    async def wait_readable(self, timeout_s: float) -> bool: ...

    def wake(self) -> None: ...

    def drain(self, max_messages: int, max_bytes: int = 1 << 62) -> list[list[bytes]]: ...

    def send(self, routing_id: bytes, msg: protocol.Message) -> str: ...


async def sleep_until_events(sock: zmq.Socket, timeout_s: float, events: int = zmq.POLLIN, *,
                             fut: asyncio.Future | None = None, fd: int | None = None) -> bool:
    """Sleep until ``sock``'s ZMQ_FD signals, ``timeout_s`` passed or ``fut`` (a future the caller
    may resolve to end the wait early) is done; then whether ``sock`` has ``events`` (POLLIN: a
    message to read; POLLOUT: room to send). ZMQ_FD is edge-triggered: callers check EVENTS
    before sleeping (an edge consumed earlier raises no new one). The one such wait of the broker's
    sockets (:meth:`Transport.wait_readable`, the standby's DEALER)."""
    loop = asyncio.get_running_loop()
    if fut is None:
        fut = loop.create_future()
    if fd is None:
        fd = cast(int, sock.getsockopt(zmq.FD))  # ZMQ_FD is an int option

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, wake)
    timer = loop.call_later(timeout_s, wake)
    try:
        await fut
    finally:
        timer.cancel()
        loop.remove_reader(fd)
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & events)


class Transport:
    """ROUTER socket bound to ``endpoint``; frames are ``[routing_id, payload, sig]``.

    ``curve_secret_key``: the broker's Z85 CURVE secret key; when given, the
    ROUTER is a CURVE server and only CURVE clients can talk to it (encrypted).
    ``curve_allow``: the ZAP decision for a client's Z85 CURVE public key
    (``AuthorizedKeys.curve_allowed``); a ZAP handler thread on this socket's
    context asks it during every CURVE handshake, and a refused client is
    dropped before any of its frames are queued. Required with CURVE.
    The receive high-water mark is :func:`rcvhwm_for` ``(max_frame_bytes)``."""

    def __init__(
        self,
        endpoint: str,
        codec: EnvelopeCodec,
        *,
        sndhwm: int,
        max_frame_bytes: int,
        curve_secret_key: bytes | None = None,
        curve_allow: Callable[[bytes], bool] | None = None,
    ) -> None:
        if curve_secret_key is not None and curve_allow is None:
            raise ValueError("a CURVE broker needs curve_allow (the ZAP allow-list)")
        self.codec = codec
        self.curve = curve_secret_key is not None
        self.ctx = zmq.Context()
        self.auth = None
        if curve_secret_key is not None:
            assert curve_allow is not None  # refused above without one
            self.auth = _start_zap(self.ctx, curve_allow)
        self.rcvhwm = rcvhwm_for(max_frame_bytes)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if curve_secret_key is not None:
            curve_server_setup(self.sock, curve_secret_key)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + FRAME_SLACK_BYTES)
        try:
            self.sock.bind(normalize_endpoint(endpoint))
        except zmq.ZMQError as exc:
            self.close()
            if exc.errno == errno.EADDRINUSE:
                raise EndpointInUse(f"endpoint {endpoint} is already in use (another broker running?)") from None
            raise
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.handshakes = HandshakeWatch(self.sock, curve=self.curve)
        self.fd = cast(int, self.sock.getsockopt(zmq.FD))  # ZMQ_FD is an int option
        self._waiter: asyncio.Future | None = None
        self._woken = False  # wake() came while no wait_readable was pending: the next one returns at once
        self.sent_again = 0  # sends refused with EAGAIN (peer pipe full)
        self.sent_unroutable = 0
        self.drained_all = True  # the last drain() emptied the queue

    async def wait_readable(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for input, or until :meth:`wake`. ZMQ_FD is edge-triggered,
        so EVENTS is checked before sleeping and after every wake-up. Returns at once when
        :meth:`wake` was called since the last wait began (a wake between two waits is not lost)."""
        woken, self._woken = self._woken, False
        if self.readable():
            return True
        if timeout_s <= 0 or woken:
            return False
        fut = self._waiter = asyncio.get_running_loop().create_future()
        try:
            return await sleep_until_events(self.sock, timeout_s, fut=fut, fd=self.fd)
        finally:
            self._waiter = None

    def wake(self) -> None:
        """End a pending :meth:`wait_readable` now (e.g. on SIGTERM), or, when none is pending (the
        waiting task is between two waits: in its pass, or asleep elsewhere), the next one. Loop
        thread only."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        else:
            self._woken = True

    def readable(self) -> bool:
        """Whether a message is queued now (ZMQ_FD's EVENTS; after a send from outside the
        waiting task's pass, a queued message raises no new edge: :meth:`wake` it)."""
        return bool(cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def drain(self, max_messages: int, max_bytes: int = 1 << 62) -> list[list[bytes]]:
        """Receive up to ``max_messages`` queued multipart messages without blocking,
        stopping early once they hold ``max_bytes`` (at least one message is taken).
        Sets :attr:`drained_all`: False when a limit, not an empty queue, ended it."""
        out: list[list[bytes]] = []
        size = 0
        self.drained_all = False
        while len(out) < max_messages and size < max_bytes:
            try:
                msg = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self.drained_all = True
                break
            out.append(msg)
            size += sum(len(part) for part in msg)
        return out

    def send(self, routing_id: bytes, msg: protocol.Message) -> str:
        """Encode (sign, or tag with the session MAC of ``routing_id``) and send ``msg`` to
        ``routing_id`` without blocking.

        Raises DecodeError (code PAYLOAD_TOO_LARGE) if the message exceeds max_frame_bytes."""
        frames = self.codec.encode(msg, channel=routing_id)
        try:
            self.sock.send_multipart([routing_id, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.sent_again += 1
            return AGAIN
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                self.sent_unroutable += 1
                return UNROUTABLE
            raise
        return SENT

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; ``linger_ms`` bounds how long queued sends (BYE) may still go out."""
        if getattr(self, "handshakes", None) is not None:
            self.handshakes.stop(self.sock)
        self.sock.close(linger=linger_ms)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.ctx.term()


class HandshakeWatch:
    """Counts and logs (rate-limited) connections whose ZeroMQ handshake failed on the
    ROUTER (see the module doc). ``failures``: reason -> connections since start (read by
    the metrics; written only by this watch's thread)."""

    def __init__(self, sock: zmq.Socket, *, curve: bool) -> None:
        self.curve = curve
        self.failures: collections.Counter = collections.Counter()
        self._logged: dict[str, float] = {}
        self._stop = threading.Event()
        self._mon = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
        self._thread = threading.Thread(target=self._run, name="handshake-watch", daemon=True)
        self._thread.start()

    def reason(self, event: int, value: int) -> str:
        """A short reason for one failed handshake (the metric's label)."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "plain_client" if self.curve else "curve_client"  # the other security mechanism
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "auth"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return "protocol"
        return "no_detail"  # e.g. a plain client that closed first, a wrong CURVE server key at the client

    def _run(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        try:
            while not self._stop.is_set():
                if not self._mon.poll(200):
                    continue
                ev = parse_monitor_message(self._mon.recv_multipart())
                if ev["event"] == zmq.EVENT_MONITOR_STOPPED:
                    break
                why = self.reason(ev["event"], ev["value"])
                self.failures[why] += 1
                now = time.monotonic()
                if now - self._logged.get(why, -1e9) >= HANDSHAKE_LOG_INTERVAL_S:
                    self._logged[why] = now
                    hint = {"plain_client": "a client without CURVE at this CURVE broker (a stranger, or a peer "
                                            "with curve = false: set curve = true there)",
                            "curve_client": "a CURVE client at this broker without CURVE (set curve = true in "
                                            "brokerd.toml, or curve = false at the peer)"}.get(
                        why, "a connection whose ZeroMQ handshake failed (a plain client that closed first, a wrong "
                             "broker CURVE key at the peer, a scanner, or a peer that went away mid-handshake)")
                    _log.warning("handshake_failed", reason=why, zmq_event=getattr(ev["event"], "name", str(ev["event"])),
                                 failed_total=self.failures[why], hint=hint,
                                 note=f"logged at most once per {HANDSHAKE_LOG_INTERVAL_S:.0f} s per reason")
        except zmq.ZMQError:
            pass
        finally:
            self._mon.close(linger=0)

    def stop(self, sock: zmq.Socket) -> None:
        self._stop.set()
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._thread.join(timeout=2.0)


class _AllowList:
    """pyzmq credentials provider: the ZAP thread calls :meth:`callback` per CURVE handshake."""

    def __init__(self, allow: Callable[[bytes], bool]) -> None:
        self.allow = allow
        self.refused = 0
        self._logged: dict[bytes, float] = {}  # key -> when it was last logged (monotonic s)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = bool(self.allow(key))
        if not ok:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged.get(key, -1e9) >= ZAP_LOG_INTERVAL_S:
                if len(self._logged) > 1024:
                    self._logged.clear()
                self._logged[key] = now
                _log.warning("curve_peer_refused", client_curve_key=key.decode("ascii", "replace"), refused_total=self.refused,
                             hint="not a curve_public_key in authorized_keys.toml (add it and send SIGHUP, or it is a stranger)")
        return ok


def _start_zap(ctx: zmq.Context, allow: Callable[[bytes], bool]):
    """Start pyzmq's ZAP handler (a thread) on ``ctx`` admitting the CURVE keys ``allow`` accepts."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("ccsq.brokerd.zap"))
    auth.start()
    auth.allow_list = _AllowList(allow)  # type: ignore[attr-defined]
    auth.configure_curve_callback("*", credentials_provider=auth.allow_list)  # type: ignore[attr-defined]
    return auth
