"""The broker's one ROUTER socket: bind, wait for input, drain frames, send without blocking.

Only the broker actor's task uses it. Sends never block: :meth:`Transport.send`
returns :data:`SENT`, :data:`AGAIN` (the peer's pipe is at its high-water mark:
keep the message and retry) or :data:`UNROUTABLE` (no such peer:
ROUTER_MANDATORY makes this an error instead of a silent drop).
"""

from __future__ import annotations

import asyncio
import errno

import zmq

from ccsq.common import protocol as p
from ccsq.common.envelope import EnvelopeCodec
from ccsq.common.errors import CcsqError
from ccsq.common.keys import curve_server_setup

SENT = "sent"
AGAIN = "again"
UNROUTABLE = "unroutable"

#: Bytes allowed above max_frame_bytes at the ZeroMQ level, so a frame just over
#: the limit reaches the codec and is rejected with a typed error and a counter.
#: A frame larger still makes ZeroMQ drop that connection before reading it all.
FRAME_SLACK_BYTES = 4096
#: A connection that has not finished the ZeroMQ (or CURVE) handshake by then is dropped.
HANDSHAKE_IVL_MS = 5000


class EndpointInUse(CcsqError):
    """The endpoint is already bound by another process (another broker?): transient, retry later."""

    code = "ENDPOINT_IN_USE"


def normalize_endpoint(endpoint: str) -> str:
    """``tcp://HOST:0`` means an ephemeral port (ZeroMQ spells it ``*``)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


class Transport:
    """ROUTER socket bound to ``endpoint``; frames are ``[routing_id, payload, sig]``.

    ``curve_secret_key``: the broker's Z85 CURVE secret key; when given, the
    ROUTER is a CURVE server and only CURVE clients can talk to it (encrypted)."""

    def __init__(
        self,
        endpoint: str,
        codec: EnvelopeCodec,
        *,
        sndhwm: int,
        max_frame_bytes: int,
        curve_secret_key: bytes | None = None,
    ) -> None:
        self.codec = codec
        self.curve = curve_secret_key is not None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if curve_secret_key is not None:
            curve_server_setup(self.sock, curve_secret_key)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + FRAME_SLACK_BYTES)
        try:
            self.sock.bind(normalize_endpoint(endpoint))
        except zmq.ZMQError as exc:
            self.close()
            if exc.errno == errno.EADDRINUSE:
                raise EndpointInUse(f"endpoint {endpoint} is already in use (another broker running?)") from None
            raise
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.fd = self.sock.getsockopt(zmq.FD)
        self._waiter: asyncio.Future | None = None
        self.sent_again = 0  # sends refused with EAGAIN (peer pipe full)
        self.sent_unroutable = 0
        self.drained_all = True  # the last drain() emptied the queue

    async def wait_readable(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for input. ZMQ_FD is edge-triggered, so EVENTS is
        checked before sleeping and after every wake-up."""
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return True
        if timeout_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(self.fd, wake)
        timer = loop.call_later(timeout_s, wake)
        try:
            await fut
        finally:
            self._waiter = None
            timer.cancel()
            loop.remove_reader(self.fd)
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def wake(self) -> None:
        """End a pending :meth:`wait_readable` now (e.g. on SIGTERM)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

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

    def send(self, routing_id: bytes, msg: p.Message) -> str:
        """Encode (sign) and send ``msg`` to ``routing_id`` without blocking.

        Raises DecodeError (code PAYLOAD_TOO_LARGE) if the message exceeds max_frame_bytes."""
        frames = self.codec.encode(msg)
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
        self.sock.close(linger=linger_ms)
        self.ctx.term()
