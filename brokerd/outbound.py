"""Outbound frames of the broker actor: every reply, DISPATCH, RESULT and heartbeat
leaves through :class:`Outbound` (never blocking, never dropping silently).

A peer whose pipe is full (ZeroMQ high-water mark) gets its messages queued on its
session (``Session.unsent``, in order) and sent by :meth:`Outbound.flush` on later
turns; nothing new is sent to it before its queue is empty. A queue over
:data:`MAX_UNSENT_PER_PEER` or an unroutable socket ends the session (the one
disconnect rule). A message that can never be sent is *unsendable*: the leases of
a DISPATCH go back to the ledger (released, or dead-lettered when too large), a
reply that confirmed something is simply lost (the peer resends on its next
session: at-least-once).

Also here: the size estimates the frame splitter uses for reply items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from ccsq.brokerd import transport as tp
from ccsq.brokerd.peers import PeerStatus, PeerTable, Session
from ccsq.common.wire import protocol as p
from ccsq.common.wire.errors import DecodeError

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.common.wire.envelope import Envelope

log = structlog.get_logger("ccsq.brokerd")

MAX_UNSENT_PER_PEER = 10_000  # messages queued for one peer whose pipe is full
UNSENT_RETRY_S = 0.01  # how soon the actor tries a full pipe again


class Outbound:
    """Sends to peers over the transport. ``end_session(sess, reason)`` is the one
    disconnect rule; ``defer(op, item_id, token, why)`` queues a ledger op for the next
    transaction (for the leases of a DISPATCH never sent); ``unblocked()`` is called
    when a peer's queue has emptied (dispatch and delivery may go on)."""

    def __init__(self, transport: tp.Transport, peers: PeerTable, max_frame_bytes: int, *,
                 end_session: Callable[[Session, str], None], defer: Callable[[str, str, int, str], None],
                 unblocked: Callable[[], None]) -> None:
        self.transport = transport
        self.peers = peers
        self.max_frame_bytes = max_frame_bytes
        self._end_session = end_session
        self._defer = defer
        self._unblocked = unblocked

    def reply_budget(self) -> int:
        """Bytes one reply frame may carry (the frame limit less room for the envelope)."""
        return max(self.max_frame_bytes - 8192, self.max_frame_bytes // 2)

    def any_unsent(self) -> bool:
        return any(s.unsent for s in self.peers.by_id.values())

    def open_mac(self, rid: bytes, env: Envelope) -> bytes:
        """A HELLO was accepted on ``rid``: when it offered session MACs, frames to ``rid``
        after the WELCOME carry them (the codec decides). Returns the broker's X25519 public
        key for WELCOME ``mac_x25519``, or b"" (the session stays signed)."""
        return self.transport.codec.open_session_mac(env, rid)

    def reinstate_session(self, sender: str, session: int) -> bool:
        """A verified HELLO of ``sender`` was refused: its live ``session`` keeps verifying."""
        return self.transport.codec.reinstate_session(sender, session)

    def close_mac(self, rid: bytes) -> None:
        """The session on ``rid`` ended: frames to it are signed again."""
        self.transport.codec.close_channel(rid)

    def send_raw(self, rid: bytes, msg: p.Message) -> None:
        """Best effort to a routing id without a session (errors to strangers, BYE at shutdown)."""
        try:
            self.transport.send(rid, msg)
        except DecodeError:
            pass

    def send(self, rid: bytes, msg: p.Message) -> None:
        """Send to the session bound to ``rid`` now, or queue it behind its unsent messages."""
        sess = self.peers.by_routing(rid)
        if sess is None:
            # The session ended after this reply was made: whatever it confirmed is
            # durable; the peer re-sends on its next session (at-least-once).
            self._unsendable(msg, "no session")
            return
        if sess.unsent:
            if len(sess.unsent) >= MAX_UNSENT_PER_PEER:
                self._end_session(sess, "send queue overflow")
                self._unsendable(msg, "send queue overflow")
                return
            sess.unsent.append(msg)
            return
        self._try_send(sess, msg, queue_on_again=True)

    def offer(self, sess: Session, msg: p.Message) -> None:
        """Send ``msg`` (a heartbeat) only if nothing waits for ``sess`` and its pipe has room."""
        if not sess.unsent:
            self._try_send(sess, msg, queue_on_again=False)

    def flush(self) -> None:
        """Send what waits for peers whose pipe has room again, in order."""
        for sess in [s for s in self.peers.by_id.values() if s.unsent]:
            while sess.unsent and sess.status is PeerStatus.CONNECTED:
                if not self._try_send(sess, sess.unsent[0], queue_on_again=False):
                    break
                if sess.unsent:  # (ending the session cleared it)
                    sess.unsent.popleft()
            if not sess.unsent:
                self._unblocked()

    def drop_unsent(self, sess: Session) -> None:
        """The session ended: its unsent DISPATCHes are released (never sent); the rest is lost."""
        for msg in sess.unsent:
            if isinstance(msg, p.Dispatch):
                for t in msg.tasks:
                    self._defer("release", t.item_id, t.token, "dispatch never sent")
        sess.unsent.clear()

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
                sess.unsent.append(msg)
            return False
        self._end_session(sess, "unroutable (socket gone)")
        self._unsendable(msg, "unroutable")
        return False

    def _unsendable(self, msg: p.Message, why: str, *, dead: bool = False) -> None:
        """A message that cannot be sent: the leases of a DISPATCH go back (never sent)."""
        if isinstance(msg, p.Dispatch):
            op = "dead" if dead else "release"
            for t in msg.tasks:
                self._defer(op, t.item_id, t.token, "payload_too_large" if dead else f"dispatch {why}")


# --- size estimates of reply items (for the one frame splitter, common/wire/frames.py) ---
def blob_size(b: p.Blob | None) -> int:
    return 0 if b is None or b.inline is None else len(b.inline)


def params_size(params: dict) -> int:
    n = 0
    for k, v in params.items():
        n += len(k) + (len(v) if type(v) is str or isinstance(v, (str, bytes)) else 9)
    return n


def status_size(s: p.ItemStatus) -> int:
    return 200 + len(s.error) + blob_size(s.result)


def task_size(t: p.Task) -> int:
    return 260 + len(t.kind) + blob_size(t.payload) + params_size(t.params)


def delivery_size(d: p.Delivery) -> int:
    return 320 + len(d.key) + len(d.kind) + blob_size(d.result) + params_size(d.params)
