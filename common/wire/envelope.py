"""Signed envelopes: the two frames every ccsq message travels in.

Frames (after any ROUTER identity)::

    frame 0: msgpack([version, type, sender, session, seq, ts_ms, body])
    frame 1: Ed25519 signature (64 bytes) over exactly frame 0, or, within a session
             that agreed on session MACs, HMAC-SHA256 (32 bytes) over exactly frame 0

Session MACs (docs/security.md): a peer codec built with ``session_macs=True`` puts an
ephemeral X25519 public key into its HELLO's ``info`` (:data:`MAC_OFFER_INFO`); a broker
codec with ``session_macs=True`` answers it (:meth:`EnvelopeCodec.open_session_mac`, its
key goes into WELCOME ``mac_x25519``). Both derive two HMAC keys (one per direction) with
HKDF-SHA256 over the X25519 shared secret, bound to the peer id, the broker id, both
session ids and both public keys. HELLO and WELCOME are always signed; every other frame
of that session carries the 32-byte tag. Peers without the feature never offer (or never
answer) and keep signing; a signature is accepted from anyone at any time. The length of
frame 1 tells the two apart, so this codec alone decides sign vs MAC.

Decoding untrusted frames follows a fixed order so that no expensive work is
done on unbounded or unauthenticated input (case C09): frame count and size
first, then only the six header fields with hard msgpack limits, version,
sender lookup, signature; after that (the sender is authenticated) type, role,
staleness, replay, and last the body, parsed with the same limits and checked
against the strict schema. Every rejection is a
:class:`~ccsq.common.wire.errors.DecodeError` whose ``code`` is a ``REJECT_*`` reason.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ccsq.common.wire import protocol
from ccsq.common.wire.errors import AuthError, DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, PeerKey

#: Bytes of a session MAC tag (HMAC-SHA256) in frame 1; a signature is protocol.SIGNATURE_BYTES.
MAC_BYTES = 32
#: HELLO ``info`` key of a session-MAC offer: the peer's ephemeral X25519 public key, base64.
MAC_OFFER_INFO = "mac_x25519"
_HKDF_LABEL = "ccsq session mac v1"
#: Messages that are always signed: they open a session and carry the key exchange.
_SIGNED_ALWAYS = frozenset({protocol.MsgType.HELLO, protocol.MsgType.WELCOME})


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    """A verified message: who sent it, in which session, and the typed message."""

    sender: str
    role: protocol.Role
    session: int
    seq: int
    ts_ms: int
    message: protocol.Message


@dataclasses.dataclass(slots=True)
class MacSession:
    """The HMAC keys of one session: ``rx`` verifies frames of ``remote`` in its session
    ``remote_session``; ``tx`` tags this side's frames to it. ``peer_key`` is the
    remote's authorized entry when the session opened (a re-keyed peer is refused)."""

    remote: str
    remote_session: int
    rx: bytes
    tx: bytes
    peer_key: PeerKey | None


def derive_session_keys(shared: bytes, peer_id: str, broker_id: str, peer_session: int, broker_session: int,
                        peer_x25519: bytes, broker_x25519: bytes) -> tuple[bytes, bytes]:
    """``(peer -> broker key, broker -> peer key)``, 32 bytes each: HKDF-SHA256 over the
    X25519 shared secret, its info binding both ids, both session ids and both public keys."""
    info = msgpack.packb([_HKDF_LABEL, peer_id, broker_id, peer_session, broker_session, peer_x25519, broker_x25519],
                         use_bin_type=True)
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=info).derive(shared)
    return okm[:32], okm[32:]


def _x25519_public(raw: object) -> X25519PublicKey | None:
    """An X25519 public key from a HELLO offer (base64 text) or WELCOME field (raw bytes); None if invalid."""
    try:
        if isinstance(raw, str):
            raw = base64.b64decode(raw, validate=True)
        if not isinstance(raw, bytes) or len(raw) != 32:
            return None
        return X25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error):
        return None


def _limits(max_frame_bytes: int) -> dict:
    return dict(
        raw=False,
        strict_map_key=True,
        use_list=True,
        max_bin_len=max_frame_bytes,
        max_str_len=max_frame_bytes,
        max_array_len=min(protocol.MAX_ARRAY_LEN, max_frame_bytes),
        max_map_len=min(protocol.MAX_MAP_LEN, max_frame_bytes),
        max_ext_len=0,
    )


class _HeaderReader:
    """Reads the envelope ``[version, type, sender, session, seq, ts_ms, body]``
    in two steps: the six small header fields first (so an unknown sender or a
    bad signature is refused before the body is parsed at all: a 1 MiB body of
    empty arrays costs ~0.3 s to parse), then the body after verification."""

    __slots__ = ("_u", "_size")

    def __init__(self, payload: bytes, max_frame_bytes: int) -> None:
        self._size = len(payload)
        self._u = msgpack.Unpacker(max_buffer_size=max(1, len(payload)), **_limits(max_frame_bytes))
        self._u.feed(payload)

    def header(self) -> list:
        try:
            if self._u.read_array_header() != 7:
                raise DecodeError("envelope must be a 7-element array", code=protocol.REJECT_MALFORMED)
            return [self._u.unpack() for _ in range(6)]
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"invalid msgpack header: {type(exc).__name__}: {exc}", code=protocol.REJECT_MALFORMED) from None

    def body(self) -> object:
        try:
            body = self._u.unpack()
        except Exception as exc:
            raise DecodeError(f"invalid msgpack body: {type(exc).__name__}: {exc}", code=protocol.REJECT_MALFORMED) from None
        if self._u.tell() != self._size:
            raise DecodeError(f"{self._size - self._u.tell()} trailing bytes after the envelope", code=protocol.REJECT_MALFORMED)
        return body


class ReplayGuard:
    """Per sender: the current session, its last sequence number and the
    timestamp of its HELLO, plus the sessions retired within the staleness
    window, which may not come back (replay of an old session's HELLO).

    Retired sessions older than ``window_ms`` need no memory: their HELLO is
    refused as STALE anyway. If one sender retires more than
    ``RETIRED_PER_SENDER`` sessions inside the window, the oldest are forgotten
    and their newest HELLO timestamp becomes a floor: a new session must open
    with a HELLO stamped later than that, so forgetting never opens a replay hole.
    Memory is bounded by (authorized senders x RETIRED_PER_SENDER).

    Across a restart (:meth:`restore`, the broker's persisted memory): the newest HELLO
    that opened a session of a sender before the restart may not open one again, nor may
    a HELLO stamped earlier than it, until a new session of that sender opened here.
    """

    RETIRED_PER_SENDER = 1024

    def __init__(self, window_ms: int = 120_000) -> None:
        self.window_ms = window_ms
        self._current: dict[str, tuple[int, int, int]] = {}  # sender -> (session, last seq, hello ts_ms)
        self._retired: dict[str, OrderedDict[int, int]] = {}  # sender -> {session: hello ts_ms}, oldest first
        self._floor_ms: dict[str, int] = {}
        self._last_retired: dict[str, tuple[int, int, int]] = {}  # sender -> the session its newest HELLO retired
        self._loose: set[str] = set()  # senders whose next new session need not be newer than the current one
        self._restored: dict[str, tuple[int, int]] = {}  # sender -> (session, hello ts_ms) accepted before a restart

    def restore(self, sender: str, session: int, hello_ts_ms: int) -> None:
        """Before any frame: ``session`` of ``sender``, opened by a HELLO stamped
        ``hello_ts_ms``, was accepted before this process started (the broker's ledger keeps
        the newest per sender). Its HELLO is REPLAY from now on, and so is any HELLO of
        ``sender`` stamped earlier, as if that session were current; its other frames are
        NO_SESSION (the peer reconnects). Kept until ``sender`` opens a new session here."""
        self._restored[sender] = (session, hello_ts_ms)

    def loosen(self) -> None:
        """A peer opened a new session of its own (a new socket): the remote (the broker) may
        answer from a new session whose timestamps are older than its current one's (it
        restarted after its wall clock was stepped back); retired sessions stay refused."""
        self._loose.update(self._current)

    def check(self, sender: str, session: int, seq: int, is_hello: bool, ts_ms: int = 0) -> None:
        """Raise AuthError (REPLAY / NO_SESSION) unless (session, seq) is new for ``sender``."""
        cur = self._current.get(sender)
        if cur is not None and cur[0] == session:
            if seq <= cur[1]:
                raise AuthError(f"replayed sequence {seq} (last {cur[1]}) from {sender}", code=protocol.REJECT_REPLAY)
            return
        retired = self._retired.get(sender)
        if retired is not None and session in retired:
            raise AuthError(f"message from retired session of {sender}", code=protocol.REJECT_REPLAY)
        if not is_hello:
            raise AuthError(f"{sender}: session must open with HELLO", code=protocol.REJECT_NO_SESSION)
        if cur is not None and ts_ms < cur[2] and sender not in self._loose:
            # a HELLO older than the current session's: a delayed HELLO of a socket its peer
            # already gave up on must not replace the live session that followed it
            raise AuthError(f"{sender}: HELLO older than its current session's", code=protocol.REJECT_REPLAY)
        if ts_ms <= self._floor_ms.get(sender, -1):
            raise AuthError(f"{sender}: new session older than a forgotten one (replay?)", code=protocol.REJECT_REPLAY)
        before = self._restored.get(sender) if self._restored else None
        if before is not None:
            if session == before[0]:
                raise AuthError(f"{sender}: HELLO of a session already accepted before this broker restarted (a replay)",
                                code=protocol.REJECT_REPLAY)
            if ts_ms < before[1]:
                raise AuthError(f"{sender}: HELLO older than the last one accepted from it before this broker restarted "
                                f"(a replay, or its clock stepped back by up to {before[1] - ts_ms} ms)", code=protocol.REJECT_REPLAY)

    def accept(self, sender: str, session: int, seq: int, ts_ms: int = 0) -> None:
        if self._loose:
            self._loose.discard(sender)  # the first frame after the loosening decided which session goes on
        cur = self._current.get(sender)
        if cur is not None and cur[0] == session:
            self._current[sender] = (session, seq, cur[2])
            return
        before = self._restored.pop(sender, None) if self._restored else None
        if before is not None:  # the session before the restart is retired like one of this run
            self._retired.setdefault(sender, OrderedDict())[before[0]] = before[1]
        if cur is not None:
            self._last_retired[sender] = cur
            retired = self._retired.setdefault(sender, OrderedDict())
            retired[cur[0]] = cur[2]
            horizon = ts_ms - self.window_ms
            while retired:
                old_session, old_ts = next(iter(retired.items()))
                if old_ts >= horizon and len(retired) <= self.RETIRED_PER_SENDER:
                    break
                del retired[old_session]
                if old_ts >= horizon:
                    self._floor_ms[sender] = max(self._floor_ms.get(sender, -1), old_ts)
        self._current[sender] = (session, seq, ts_ms)

    def reinstate(self, sender: str, session: int) -> bool:
        """The HELLO just accepted for ``sender`` was refused above the codec (its peer id
        is held by the live ``session``): ``session`` is current again, with the sequence
        number it had, and the refused HELLO's session is retired (it may not come back).
        False (nothing changed) when ``session`` is not the one that HELLO retired."""
        last, cur = self._last_retired.get(sender), self._current.get(sender)
        if last is None or cur is None or last[0] != session:
            return False
        retired = self._retired.setdefault(sender, OrderedDict())
        retired.pop(session, None)
        retired[cur[0]] = cur[2]
        self._current[sender] = last
        del self._last_retired[sender]
        return True


def _system_wall_ms() -> int:
    return int(time.time() * 1000)


def _refused(message: str, code: str, sender: str, hello_fresh: bool) -> AuthError:
    """An AuthError that names the claimed sender (at most 64 chars) for refusals and rate
    limits; ``answerable`` when the frame looks like a real peer's HELLO (type HELLO, a
    fresh timestamp), the only unauthenticated frame the broker may answer."""
    err = AuthError(message, code=code)
    err.sender = sender[:64]
    err.answerable = hello_fresh
    return err


class EnvelopeCodec:
    """Encodes this peer's messages and verifies everyone else's.

    ``max_frame_bytes`` bounds frame 0; ``max_clock_skew_s`` bounds |now - ts|.
    One codec instance belongs to one task (it keeps sequence numbers).
    ``require_hello`` makes the codec insist every sender's session opens with
    HELLO (the broker); peers that only talk to the broker accept the broker's
    session as it comes. ``session_macs``: a peer codec offers session MACs in its
    HELLO and uses them once the WELCOME answers; a broker codec answers offers
    (:meth:`open_session_mac`). Off, the codec signs every frame (as before MACs).
    ``wall_ms``: the clock of the timestamps it writes and checks (wall ms; default the
    system's; the broker's simulation passes its own, tests/sim).
    """

    def __init__(
        self,
        peer_id: str,
        private_key: Ed25519PrivateKey,
        authorized: AuthorizedKeys,
        *,
        max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES,
        max_clock_skew_s: float = 60.0,
        require_hello: bool = True,
        session_macs: bool = False,
        wall_ms: Callable[[], int] | None = None,
    ) -> None:
        self.peer_id = peer_id
        self._wall_ms = wall_ms or _system_wall_ms
        self._key = private_key
        self.authorized = authorized
        self.max_frame_bytes = max_frame_bytes
        self.max_clock_skew_s = max_clock_skew_s
        self.require_hello = require_hello
        self.session_macs = session_macs
        self.session = 0
        self._seq = 0
        self._replay = ReplayGuard(window_ms=int(2 * max_clock_skew_s * 1000))
        self._replay_scope: Hashable = None  # the remote the replay memory above is of (see replay_scope)
        self._replay_scopes: OrderedDict[Hashable, ReplayGuard] = OrderedDict()  # the other remotes', newest last
        self._offer: X25519PrivateKey | None = None  # our HELLO's ephemeral key, until WELCOME
        self._rx: dict[str, MacSession] = {}  # remote id -> the MAC session its tagged frames verify against
        self._tx: dict[Hashable, MacSession] = {}  # channel (broker: routing id; peer: None) -> MAC session
        self.new_session()

    def new_session(self) -> int:
        """Start a new session (a new socket): fresh random session id, seq from 1, no MAC keys."""
        self.session = secrets.randbits(63)
        self._seq = 0
        if not self.require_hello:  # a peer's new socket: its broker may have restarted meanwhile
            self._replay.loosen()
        self._offer = None
        self._rx.clear()
        self._tx.clear()
        return self.session

    #: Most remotes whose replay memory :meth:`replay_scope` keeps besides the current one.
    REPLAY_SCOPES_MAX = 64

    def replay_scope(self, scope: Hashable) -> None:
        """Keep the replay memory (sessions and sequence numbers seen) separately per remote:
        ``scope`` names the one this codec talks to from now on. A peer of a broker pair
        (docs/ha.md) talks to several broker processes that all sign as the one service
        identity, each with sessions of its own: going from the standby to the primary must
        not retire the standby's session, or the standby's next answer (NOT_PRIMARY naming
        the primary) would be refused as a replay. The first scope named takes the memory
        built so far; at most :data:`REPLAY_SCOPES_MAX` others are kept (the oldest forgotten:
        its remote's next frames are checked as a new remote's). Call it before
        :meth:`new_session`."""
        if scope == self._replay_scope:
            return
        if self._replay_scope is None and not self._replay_scopes:
            self._replay_scope = scope  # the first remote: the memory so far is its own
            return
        self._replay_scopes[self._replay_scope] = self._replay
        guard = self._replay_scopes.pop(scope, None)
        self._replay = guard or ReplayGuard(window_ms=self._replay.window_ms)
        self._replay_scope = scope
        while len(self._replay_scopes) > self.REPLAY_SCOPES_MAX:
            self._replay_scopes.popitem(last=False)

    @property
    def mac_active(self) -> bool:
        """Whether this peer codec tags its frames to the broker (its session agreed on MACs)."""
        return None in self._tx

    def open_session_mac(self, env: Envelope, channel: Hashable) -> bytes:
        """Broker side: ``env`` is a HELLO the broker accepted on ``channel`` (its routing id).
        When it offered session MACs and this codec takes part, derive the session's keys:
        frames of (sender, session) may then carry tags, and :meth:`encode` to ``channel``
        tags (except WELCOME). Returns this side's X25519 public key for WELCOME
        ``mac_x25519``, or b"" (no offer, or an invalid one: the session stays signed)."""
        hello = env.message
        if not self.session_macs or not isinstance(hello, protocol.Hello):
            return b""
        peer_pub = _x25519_public(hello.info.get(MAC_OFFER_INFO))
        if peer_pub is None:
            return b""
        eph = X25519PrivateKey.generate()
        try:
            shared = eph.exchange(peer_pub)
        except ValueError:  # a low-order point: no shared secret
            return b""
        mine = eph.public_key().public_bytes_raw()
        up, down = derive_session_keys(shared, env.sender, self.peer_id, env.session, self.session,
                                       peer_pub.public_bytes_raw(), mine)
        self.close_channel(channel)
        mac = MacSession(env.sender, env.session, rx=up, tx=down, peer_key=self.authorized.get(env.sender))
        self._rx[env.sender] = mac
        self._tx[channel] = mac
        return mine

    def restore_hellos(self, hellos: dict[str, tuple[int, int]]) -> None:
        """Broker side, before the first frame: ``{peer id: (session, hello ts_ms)}``, the newest
        HELLO that opened a session of each peer before this broker started (its ledger,
        ``LedgerView.last_hellos``). Such a HELLO, replayed, and any HELLO signed before it are
        REPLAY (:meth:`ReplayGuard.restore`): a restarted broker takes no captured HELLO for new."""
        for sender, (session, ts_ms) in hellos.items():
            self._replay.restore(sender, session, ts_ms)

    def reinstate_session(self, sender: str, session: int) -> bool:
        """Broker side: a HELLO of ``sender`` was verified but refused (its peer id is held
        by the live ``session``, REJECT_ID_IN_USE): that session's frames verify again
        (:meth:`ReplayGuard.reinstate`)."""
        return self._replay.reinstate(sender, session)

    def close_channel(self, channel: Hashable) -> None:
        """Broker side: the session on ``channel`` ended; frames to it are signed again.
        Its tagged frames still verify (and are then refused for having no session, as
        a signed frame would be) until the sender opens a new session."""
        self._tx.pop(channel, None)

    def _offer_mac(self, msg: protocol.Hello) -> protocol.Hello:
        self._offer = X25519PrivateKey.generate()
        offer = base64.b64encode(self._offer.public_key().public_bytes_raw()).decode("ascii")
        return dataclasses.replace(msg, info={**msg.info, MAC_OFFER_INFO: offer})

    def _welcomed(self, sender: str, session: int, welcome: protocol.Welcome) -> None:
        """Peer side: a verified WELCOME answers our HELLO; with ``mac_x25519`` the session uses MACs."""
        offer, self._offer = self._offer, None
        if offer is None:
            return
        broker_pub = _x25519_public(welcome.mac_x25519)
        if broker_pub is None:
            return
        try:
            shared = offer.exchange(broker_pub)
        except ValueError:
            return
        up, down = derive_session_keys(shared, self.peer_id, sender, self.session, session,
                                       offer.public_key().public_bytes_raw(), broker_pub.public_bytes_raw())
        mac = MacSession(sender, session, rx=down, tx=up, peer_key=self.authorized.get(sender))
        self._rx[sender] = mac
        self._tx[None] = mac

    def encode(self, msg: protocol.Message, *, channel: Hashable = None) -> list[bytes]:
        """Return ``[payload, signature or tag]`` for ``msg``: tagged when the session on
        ``channel`` agreed on MACs (HELLO and WELCOME are always signed). Raises
        PayloadTooLarge-coded DecodeError if the payload would exceed ``max_frame_bytes``."""
        if self.session_macs and type(msg) is protocol.Hello:
            msg = self._offer_mac(msg)
        self._seq += 1
        payload = msgpack.packb(
            [protocol.PROTOCOL_VERSION, int(msg.TYPE), self.peer_id, self.session, self._seq, self._wall_ms(), protocol.encode_body(msg)],
            use_bin_type=True,
        )
        if len(payload) > self.max_frame_bytes:
            raise DecodeError(
                f"outgoing {msg.TYPE.name} is {len(payload)} bytes, over max_frame_bytes={self.max_frame_bytes}",
                code="PAYLOAD_TOO_LARGE",
            )
        mac = self._tx.get(channel) if self._tx else None
        if mac is not None and msg.TYPE not in _SIGNED_ALWAYS:
            return [payload, hmac.digest(mac.tx, payload, "sha256")]
        return [payload, self._key.sign(payload)]

    def _fresh(self, ts_ms: int) -> bool:
        """``ts_ms`` is within ``max_clock_skew_s`` of this host's clock."""
        return abs(self._wall_ms() - ts_ms) <= self.max_clock_skew_s * 1000

    def _hello_fresh(self, msg_type: int, ts_ms: int) -> bool:
        return msg_type == protocol.MsgType.HELLO and self._fresh(ts_ms)

    def decode(self, frames: list[bytes], *, bound_sender: str | None = None) -> Envelope:
        """Verify and decode ``[payload, signature or tag]`` from an untrusted peer.

        ``bound_sender``: the peer id already bound to this connection (ROUTER
        identity); a different sender id is ``FORGED_ORIGIN``.
        Raises :class:`DecodeError` / :class:`AuthError` with a ``REJECT_*`` code.
        """
        if len(frames) != 2:
            raise DecodeError(f"expected 2 frames, got {len(frames)}", code=protocol.REJECT_FRAMING)
        payload, signature = frames
        if len(payload) > self.max_frame_bytes:
            raise DecodeError(
                f"frame of {len(payload)} bytes over max_frame_bytes={self.max_frame_bytes}", code=protocol.REJECT_OVERSIZE
            )
        tagged = len(signature) == MAC_BYTES
        if not tagged and len(signature) != protocol.SIGNATURE_BYTES:
            raise DecodeError(f"signature frame must be {protocol.SIGNATURE_BYTES} bytes (or a {MAC_BYTES}-byte session MAC)",
                              code=protocol.REJECT_FRAMING)
        reader = _HeaderReader(payload, self.max_frame_bytes)
        version, msg_type, sender, session, seq, ts_ms = reader.header()
        if version != protocol.PROTOCOL_VERSION:
            raise DecodeError(f"unknown protocol version {version!r}", code=protocol.REJECT_VERSION)
        if not (type(msg_type) is int and type(sender) is str and type(session) is int
                and type(seq) is int and type(ts_ms) is int):
            raise DecodeError("envelope header has wrong types", code=protocol.REJECT_MALFORMED)
        peer = self.authorized.get(sender)
        if peer is None:
            raise _refused(f"unknown sender {sender[:64]!r}", protocol.REJECT_UNKNOWN_SENDER, sender, self._hello_fresh(msg_type, ts_ms))
        if bound_sender is not None and sender != bound_sender:
            raise AuthError(f"connection bound to {bound_sender!r} claims to be {sender!r}", code=protocol.REJECT_FORGED_ORIGIN)
        if tagged:
            self._verify_mac(peer, sender, session, msg_type, ts_ms, payload, signature)
        else:
            try:
                peer.public_key.verify(signature, payload)
            except InvalidSignature:
                raise _refused(f"bad signature from {sender!r}", protocol.REJECT_BAD_SIGNATURE, sender,
                               self._hello_fresh(msg_type, ts_ms)) from None
        # --- authenticated from here on: the sender signed (or, in its session, tagged) exactly these bytes ---
        try:
            mtype = protocol.MsgType(msg_type)
        except ValueError:
            raise DecodeError(f"unknown message type {msg_type}", code=protocol.REJECT_UNKNOWN_TYPE) from None
        if mtype not in protocol.ROLE_MAY_SEND[peer.role]:
            raise AuthError(f"role {peer.role.value} may not send {mtype.name}", code=protocol.REJECT_ROLE)
        if not self._fresh(ts_ms):
            raise AuthError(f"timestamp outside max_clock_skew_s={self.max_clock_skew_s}", code=protocol.REJECT_STALE)
        is_hello = mtype == protocol.MsgType.HELLO or not self.require_hello
        self._replay.check(sender, session, seq, is_hello, ts_ms)
        message = protocol.decode_body(mtype, reader.body())
        self._replay.accept(sender, session, seq, ts_ms)
        if mtype == protocol.MsgType.WELCOME and self._offer is not None:
            self._welcomed(sender, session, message)  # type: ignore[arg-type]
        return Envelope(sender, peer.role, session, seq, ts_ms, message)

    def _verify_mac(self, peer: PeerKey, sender: str, session: int, msg_type: int, ts_ms: int, payload: bytes,
                    tag: bytes) -> None:
        """Check a 32-byte session tag (before anything else is trusted). No MAC session for
        (sender, session): NO_SESSION (a restarted broker, or a session never opened: the
        peer should send HELLO; the broker answers it like a stranger, rate-limited). A tag
        that does not verify, or a sender whose key changed since: BAD_SIGNATURE."""
        if msg_type in _SIGNED_ALWAYS:
            raise DecodeError("HELLO and WELCOME must be signed, not tagged", code=protocol.REJECT_FRAMING)
        mac = self._rx.get(sender)
        if mac is None or mac.remote_session != session:
            raise _refused(f"no session MAC key for session {session} of {sender!r}: open a session with HELLO",
                           protocol.REJECT_NO_SESSION, sender, self._fresh(ts_ms))
        if not hmac.compare_digest(hmac.digest(mac.rx, payload, "sha256"), tag):
            raise _refused(f"bad session MAC from {sender!r}", protocol.REJECT_BAD_SIGNATURE, sender, False)
        if mac.peer_key is not peer:  # authorized_keys was reloaded: still the same key?
            if mac.peer_key is None or not _same_key(mac.peer_key, peer):
                raise _refused(f"the key of {sender!r} changed since its session began", protocol.REJECT_BAD_SIGNATURE,
                               sender, False)
            mac.peer_key = peer


def _same_key(a: PeerKey, b: PeerKey) -> bool:
    if a.public_key is b.public_key:
        return True
    try:
        return a.public_key.public_bytes_raw() == b.public_key.public_bytes_raw()
    except AttributeError:  # not an Ed25519PublicKey (a test's stand-in): treat as changed
        return False
