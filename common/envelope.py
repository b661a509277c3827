"""Signed envelopes: the two frames every ccsq message travels in.

Frames (after any ROUTER identity)::

    frame 0: msgpack([version, type, sender, session, seq, ts_ms, body])
    frame 1: Ed25519 signature (64 bytes) over exactly frame 0

Decoding untrusted frames follows a fixed order so that no expensive work is
done on unbounded input (case C09): frame count and size first, then msgpack
with hard limits, version, sender lookup, signature, role, replay/staleness,
and last the strict body schema. Every rejection is a
:class:`~ccsq.common.errors.DecodeError` whose ``code`` is a ``REJECT_*`` reason.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import OrderedDict

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ccsq.common import protocol as p
from ccsq.common.errors import AuthError, DecodeError
from ccsq.common.keys import AuthorizedKeys


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    """A verified message: who sent it, in which session, and the typed message."""

    sender: str
    role: p.Role
    session: int
    seq: int
    ts_ms: int
    message: p.Message


def unpack_limited(data: bytes, max_frame_bytes: int) -> object:
    """msgpack-decode ``data`` with explicit limits on every length (no huge allocations)."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=max_frame_bytes,
            max_str_len=max_frame_bytes,
            max_array_len=min(p.MAX_ARRAY_LEN, max_frame_bytes),
            max_map_len=min(p.MAX_MAP_LEN, max_frame_bytes),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"invalid msgpack: {type(exc).__name__}: {exc}", code=p.REJECT_MALFORMED) from None


class ReplayGuard:
    """Per sender: the current session and its last sequence number, plus a few
    recently retired sessions that may not come back (replay of an old session)."""

    RETIRED_PER_SENDER = 16

    def __init__(self) -> None:
        self._current: dict[str, tuple[int, int]] = {}
        self._retired: dict[str, OrderedDict[int, None]] = {}

    def check(self, sender: str, session: int, seq: int, is_hello: bool) -> None:
        cur = self._current.get(sender)
        if cur is not None and cur[0] == session:
            if seq <= cur[1]:
                raise AuthError(f"replayed sequence {seq} (last {cur[1]}) from {sender}", code=p.REJECT_REPLAY)
            return
        retired = self._retired.get(sender)
        if retired is not None and session in retired:
            raise AuthError(f"message from retired session of {sender}", code=p.REJECT_REPLAY)
        if not is_hello:
            raise AuthError(f"{sender}: session must open with HELLO", code=p.REJECT_NO_SESSION)

    def accept(self, sender: str, session: int, seq: int) -> None:
        cur = self._current.get(sender)
        if cur is not None and cur[0] != session:
            retired = self._retired.setdefault(sender, OrderedDict())
            retired[cur[0]] = None
            while len(retired) > self.RETIRED_PER_SENDER:
                retired.popitem(last=False)
        self._current[sender] = (session, seq)


class EnvelopeCodec:
    """Encodes this peer's messages and verifies everyone else's.

    ``max_frame_bytes`` bounds frame 0; ``max_clock_skew_s`` bounds |now - ts|.
    One codec instance belongs to one task (it keeps sequence numbers).
    ``require_hello`` makes the codec insist every sender's session opens with
    HELLO (the broker); peers that only talk to the broker accept the broker's
    session as it comes.
    """

    def __init__(
        self,
        peer_id: str,
        private_key: Ed25519PrivateKey,
        authorized: AuthorizedKeys,
        *,
        max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
        max_clock_skew_s: float = 60.0,
        require_hello: bool = True,
    ) -> None:
        self.peer_id = peer_id
        self._key = private_key
        self.authorized = authorized
        self.max_frame_bytes = max_frame_bytes
        self.max_clock_skew_s = max_clock_skew_s
        self.require_hello = require_hello
        self.session = 0
        self._seq = 0
        self._replay = ReplayGuard()
        self.new_session()

    def new_session(self) -> int:
        """Start a new session (a new socket): fresh random session id, seq from 1."""
        self.session = secrets.randbits(63)
        self._seq = 0
        return self.session

    def encode(self, msg: p.Message) -> list[bytes]:
        """Return ``[payload, signature]`` for ``msg``. Raises PayloadTooLarge-coded
        DecodeError if the payload would exceed ``max_frame_bytes``."""
        self._seq += 1
        payload = msgpack.packb(
            [p.PROTOCOL_VERSION, int(msg.TYPE), self.peer_id, self.session, self._seq, int(time.time() * 1000), p.encode_body(msg)],
            use_bin_type=True,
        )
        if len(payload) > self.max_frame_bytes:
            raise DecodeError(
                f"outgoing {msg.TYPE.name} is {len(payload)} bytes, over max_frame_bytes={self.max_frame_bytes}",
                code="PAYLOAD_TOO_LARGE",
            )
        return [payload, self._key.sign(payload)]

    def decode(self, frames: list[bytes], *, bound_sender: str | None = None) -> Envelope:
        """Verify and decode ``[payload, signature]`` from an untrusted peer.

        ``bound_sender``: the peer id already bound to this connection (ROUTER
        identity); a different sender id is ``FORGED_ORIGIN``.
        Raises :class:`DecodeError` / :class:`AuthError` with a ``REJECT_*`` code.
        """
        if len(frames) != 2:
            raise DecodeError(f"expected 2 frames, got {len(frames)}", code=p.REJECT_FRAMING)
        payload, signature = frames
        if len(payload) > self.max_frame_bytes:
            raise DecodeError(
                f"frame of {len(payload)} bytes over max_frame_bytes={self.max_frame_bytes}", code=p.REJECT_OVERSIZE
            )
        if len(signature) != p.SIGNATURE_BYTES:
            raise DecodeError(f"signature frame must be {p.SIGNATURE_BYTES} bytes", code=p.REJECT_FRAMING)
        head = unpack_limited(payload, self.max_frame_bytes)
        if not isinstance(head, list) or len(head) != 7:
            raise DecodeError("envelope must be a 7-element array", code=p.REJECT_MALFORMED)
        version, msg_type, sender, session, seq, ts_ms, body = head
        if version != p.PROTOCOL_VERSION:
            raise DecodeError(f"unknown protocol version {version!r}", code=p.REJECT_VERSION)
        if not (isinstance(msg_type, int) and isinstance(sender, str) and isinstance(session, int)
                and isinstance(seq, int) and isinstance(ts_ms, int)) or isinstance(msg_type, bool):
            raise DecodeError("envelope header has wrong types", code=p.REJECT_MALFORMED)
        peer = self.authorized.get(sender)
        if peer is None:
            raise AuthError(f"unknown sender {sender!r}", code=p.REJECT_UNKNOWN_SENDER)
        if bound_sender is not None and sender != bound_sender:
            raise AuthError(f"connection bound to {bound_sender!r} claims to be {sender!r}", code=p.REJECT_FORGED_ORIGIN)
        try:
            peer.public_key.verify(signature, payload)
        except InvalidSignature:
            raise AuthError(f"bad signature from {sender!r}", code=p.REJECT_BAD_SIGNATURE) from None
        try:
            mtype = p.MsgType(msg_type)
        except ValueError:
            raise DecodeError(f"unknown message type {msg_type}", code=p.REJECT_UNKNOWN_TYPE) from None
        if mtype not in p.ROLE_MAY_SEND[peer.role]:
            raise AuthError(f"role {peer.role.value} may not send {mtype.name}", code=p.REJECT_ROLE)
        if abs(time.time() * 1000 - ts_ms) > self.max_clock_skew_s * 1000:
            raise AuthError(f"timestamp outside max_clock_skew_s={self.max_clock_skew_s}", code=p.REJECT_STALE)
        self._replay.check(sender, session, seq, mtype == p.MsgType.HELLO or not self.require_hello)
        message = p.decode_body(mtype, body)
        self._replay.accept(sender, session, seq)
        return Envelope(sender, peer.role, session, seq, ts_ms, message)
