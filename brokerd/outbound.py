"""Outbound frames of the broker actor: every reply, DISPATCH, RESULT and heartbeat
leaves through :class:`Outbound` (never blocking, never dropping silently).

A peer whose pipe is full (ZeroMQ high-water mark) gets its messages queued on its
session (``Session.unsent``, in order) and sent by :meth:`Outbound.flush` on later
turns; nothing new is sent to it before its queue is empty. A queue over
:data:`MAX_UNSENT_PER_PEER` or an unroutable socket ends the session (the one
disconnect rule). A message that can never be sent is *unsendable*: the leases of
a DISPATCH go back to the ledger (released; dead-lettered only for a task that alone
cannot fit any frame), a reply that confirmed something is simply lost (the peer
resends on its next session: at-least-once). A frame that comes out over
``max_frame_bytes`` once encoded is never unsendable: it is split in halves and each
sent in its place, in order (``common/wire/frames.py``).

Also here: the sizes the frame splitter uses for reply items (their exact encoded
bytes), and :func:`dispatch_refusal`, the SUBMIT-time refusal of an item that could
never fit a DISPATCH.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from ccsq.brokerd.transport import AGAIN, SENT, FrameTransport
from ccsq.brokerd.peers import PeerStatus, PeerTable, Session
from ccsq.common.wire import federation as fed
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.frames import FrameBudget, encoded_size, halves, params_bound, text_bound, too_large

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

    def __init__(self, transport: FrameTransport, peers: PeerTable, max_frame_bytes: int, *,
                 end_session: Callable[[Session, str], None], defer: Callable[[str, str, int, str], None],
                 unblocked: Callable[[], None]) -> None:
        self.transport = transport
        self.peers = peers
        self.max_frame_bytes = max_frame_bytes
        self.budget = FrameBudget(max_frame_bytes)
        self._end_session = end_session
        self._defer = defer
        self._unblocked = unblocked

    def reply_budget(self) -> int:
        """Bytes the records of one reply frame may carry (:attr:`FrameBudget.room_bytes`)."""
        return self.budget.room_bytes

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

    def send_raw(self, rid: bytes, msg: protocol.Message) -> None:
        """Best effort to a routing id without a session (errors to strangers, BYE at shutdown)."""
        try:
            self.transport.send(rid, msg)
        except DecodeError:
            pass

    def send(self, rid: bytes, msg: protocol.Message) -> None:
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

    def offer(self, sess: Session, msg: protocol.Message) -> None:
        """Send ``msg`` (a heartbeat) only if nothing waits for ``sess`` and its pipe has room."""
        if not sess.unsent:
            self._try_send(sess, msg, queue_on_again=False)

    def flush(self) -> None:
        """Send what waits for peers whose pipe has room again, in order."""
        for sess in [s for s in self.peers.by_id.values() if s.unsent]:
            while sess.unsent and sess.status is PeerStatus.CONNECTED:
                if not self._try_send(sess, sess.unsent[0], queue_on_again=False, head=True):
                    break
                if sess.unsent:  # (ending the session cleared it)
                    sess.unsent.popleft()
            if not sess.unsent:
                self._unblocked()

    def drop_unsent(self, sess: Session) -> None:
        """The session ended: its unsent DISPATCHes are released (never sent); the rest is lost."""
        for msg in sess.unsent:
            if isinstance(msg, protocol.Dispatch):
                for t in msg.tasks:
                    self._defer("release", t.item_id, t.token, "dispatch never sent")
        sess.unsent.clear()

    def _try_send(self, sess: Session, msg: protocol.Message, *, queue_on_again: bool, head: bool = False) -> bool:
        """Send ``msg`` now; True when it is done with (sent, or unsendable). ``head``: it is
        ``sess.unsent[0]`` (flush), where the halves of a split take its place."""
        try:
            r = self.transport.send(sess.routing_id, msg)
        except DecodeError as exc:
            parts = halves(msg) if too_large(exc) else None
            if parts is None:  # one record that alone cannot fit any frame (refused at SUBMIT since)
                log.error("reply_too_large", peer=sess.peer_id, type=msg.TYPE.name, error=str(exc))
                self._unsendable(msg, "too large", dead=True)
                return True
            log.info("frame_split", peer=sess.peer_id, type=msg.TYPE.name, error=str(exc))
            return self._send_split(sess, parts, queue_on_again=queue_on_again, head=head)
        if r == SENT:
            return True
        if r == AGAIN:
            if queue_on_again:
                sess.unsent.append(msg)
            return False
        self._end_session(sess, "unroutable (socket gone)")
        self._unsendable(msg, "unroutable")
        return False

    def _send_split(self, sess: Session, parts: tuple[protocol.Message, protocol.Message], *, queue_on_again: bool, head: bool) -> bool:
        """The two halves of a frame that came out too large, sent (or queued) in its place, in order."""
        if head:  # flush: the halves replace the head of the queue; the first is tried now
            sess.unsent.popleft()
            sess.unsent.extendleft(reversed(parts))
            return self._try_send(sess, parts[0], queue_on_again=False, head=True)
        for part in parts:
            if sess.status is not PeerStatus.CONNECTED:
                self._unsendable(part, "no session")
            elif sess.unsent:
                sess.unsent.append(part)
            elif not self._try_send(sess, part, queue_on_again=queue_on_again) and not queue_on_again:
                return False  # (a heartbeat offer: nothing splits there)
        return True

    def _unsendable(self, msg: protocol.Message, why: str, *, dead: bool = False) -> None:
        """A message that cannot be sent: the leases of a DISPATCH go back (never sent)."""
        if isinstance(msg, protocol.Dispatch):
            op = "dead" if dead else "release"
            for t in msg.tasks:
                self._defer(op, t.item_id, t.token, "payload_too_large" if dead else f"dispatch {why}")


# --- sizes of reply items (for the one frame splitter, common/wire/frames.py) ---
def blob_size(b: protocol.Blob | None) -> int:
    return 0 if b is None or b.inline is None else len(b.inline)


def status_size(s: protocol.ItemStatus) -> int:
    return encoded_size(s)


def task_size(t: protocol.Task) -> int:
    return encoded_size(t)


def delivery_size(d: protocol.Delivery) -> int:
    return encoded_size(d)


#: msgpack bytes of a Task / Delivery map besides its strings, bytes and params, over-counted:
#: map headers, every field name (the extension ones included), the blob's map with its
#: 64-character digest, every number at its widest (9 bytes)
_TASK_FIXED_BOUND = 320  # counted: 204 (every string empty)
_DELIVERY_FIXED_BOUND = 360  # counted: 209


def task_size_bound(t: protocol.Task) -> int:
    """An upper bound of :func:`task_size` (bytes) from lengths alone, nothing packed: lets the
    frame splitter skip exact sizing when a DISPATCH surely fits one frame."""
    inline = t.payload.inline
    return (_TASK_FIXED_BOUND + text_bound(t.item_id) + text_bound(t.kind) + params_bound(t.params)
            + (0 if inline is None else len(inline)) + len(t.origin) + len(t.origin_sig))


def delivery_size_bound(d: protocol.Delivery) -> int:
    """An upper bound of :func:`delivery_size` (bytes) from lengths alone (as :func:`task_size_bound`)."""
    inline = d.result.inline
    return (_DELIVERY_FIXED_BOUND + text_bound(d.item_id) + text_bound(d.key) + text_bound(d.kind)
            + text_bound(d.handler) + text_bound(d.handler_version) + params_bound(d.params)
            + (0 if inline is None else len(inline)) + len(d.proof) + len(d.proof_sig))


def _params_into(params: protocol.Params, texts: list[str]) -> int:
    """:func:`~ccsq.common.wire.frames.params_bound` of ``params`` less its strings' bytes,
    whose texts go on ``texts`` (counted once for a whole record list by :func:`_texts_bound`)."""
    n = 5
    for k, v in params.items():
        texts.append(k)
        if isinstance(v, str):
            texts.append(v)
            n += 10
        elif isinstance(v, bytes):
            n += 10 + len(v)
        else:
            n += 14
    return n


def _texts_bound(texts: list[str]) -> int:
    """Bytes the strings ``texts`` take packed, less their 5-byte headers, at most: their
    length when all of them are ASCII (one check for the whole list), else 4 bytes a character."""
    s = "".join(texts)
    return len(s) if s.isascii() else 4 * len(s)


def tasks_bound(tasks: list[protocol.Task]) -> int:
    """An upper bound (bytes) of the :func:`task_size` sum of ``tasks`` in one pass: the sum of
    their :func:`task_size_bound` when every string is ASCII, else every string counted at 4
    bytes a character (a DISPATCH's size bound for ``frames.split_bounded``)."""
    n = len(tasks) * (_TASK_FIXED_BOUND + 10)  # + item_id's and kind's 5-byte headers
    texts: list[str] = []
    add = texts.append
    for t in tasks:
        inline = t.payload.inline
        if inline is not None:
            n += len(inline)
        add(t.item_id)
        add(t.kind)
        n += len(t.origin) + len(t.origin_sig) + (_params_into(t.params, texts) if t.params else 5)
    return n + _texts_bound(texts)


def deliveries_bound(deliveries: list[protocol.Delivery]) -> int:
    """An upper bound (bytes) of the :func:`delivery_size` sum of ``deliveries`` in one pass (as
    :func:`tasks_bound`: the sum of their :func:`delivery_size_bound` when every string is ASCII)."""
    n = len(deliveries) * (_DELIVERY_FIXED_BOUND + 25)  # + the 5-byte headers of its five strings
    texts: list[str] = []
    add = texts.append
    for d in deliveries:
        inline = d.result.inline
        if inline is not None:
            n += len(inline)
        add(d.item_id)
        add(d.key)
        add(d.kind)
        add(d.handler)
        add(d.handler_version)
        n += len(d.proof) + len(d.proof_sig) + (_params_into(d.params, texts) if d.params else 5)
    return n + _texts_bound(texts)


_MAX_INT = (1 << 63) - 1  # every number of a record at its widest (9 bytes)
_SIG = b"\0" * protocol.SIGNATURE_BYTES


def largest_task(item: protocol.SubmitItem, *, id_len: int, swarm_id: str, relayed: bool, federated: bool) -> protocol.Task:
    """The largest DISPATCH record ``item`` can become: its id at ``id_len`` characters, every
    number at its widest, and (when this broker hands items to relays, ``federated``, and the
    item did not come by relay, which is never relayed on: max_hops) the origin record and
    signature a DISPATCH to a relay carries (``fed.origin_record``)."""
    item_id = "x" * id_len
    origin = b""
    if federated and not relayed:
        rec = {"id": item_id, "kind": item.kind, "params": item.params, "deadline_ms": _MAX_INT,
               "priority": _MAX_INT, "max_runtime_s": item.max_runtime_s}
        origin = fed.origin_record(swarm_id, rec, item.payload, _MAX_INT, fed.MAX_HOPS)
    return protocol.Task(item_id, _MAX_INT, item.kind, item.payload, item.params, _MAX_INT, float(item.max_runtime_s),
                  float(item.deadline_ts or 0.0), origin, _SIG if origin else b"")


def _task_bound(item: protocol.SubmitItem, id_len: int, swarm_id: str) -> int:
    """An upper bound (bytes) of ``encoded_size(largest_task(item, ...))`` from lengths alone:
    every string at 4 bytes a character, params and kind counted twice (task and origin)."""
    n = 1024 + 2 * id_len + 4 * len(swarm_id) + 8 * len(item.kind) + blob_size(item.payload)
    for k, v in item.params.items():
        n += 2 * (14 + 4 * len(k) + (5 + 4 * len(v) if isinstance(v, str) else 5 + len(v) if isinstance(v, bytes) else 0))
    return n


def dispatch_refusals(items: list[protocol.SubmitItem], budget: FrameBudget, *, id_len: int, swarm_id: str, relayed: bool,
                      federated: bool) -> list[str] | None:
    """:func:`dispatch_refusal` of every item of a SUBMIT frame: None when every one surely fits
    (its :func:`_task_bound`, computed here in one loop, fits the frame's room: the common
    case, nothing encoded), else a list with each item's reason ("" when it fits)."""
    room = budget.room_bytes
    base = 1024 + 2 * id_len + 4 * len(swarm_id)
    out: list[str] | None = None
    for i, item in enumerate(items):
        inline = item.payload.inline
        n = base + 8 * len(item.kind) + (0 if inline is None else len(inline))
        for k, v in item.params.items():
            n += 2 * (14 + 4 * len(k) + (5 + 4 * len(v) if isinstance(v, str) else 5 + len(v) if isinstance(v, bytes) else 0))
        if n <= room:
            continue
        why = dispatch_refusal(item, budget, id_len=id_len, swarm_id=swarm_id, relayed=relayed, federated=federated)
        if why:
            if out is None:
                out = [""] * len(items)
            out[i] = why
    return out


def dispatch_refusal(item: protocol.SubmitItem, budget: FrameBudget, *, id_len: int, swarm_id: str, relayed: bool,
                     federated: bool) -> str:
    """"" when ``item`` fits a DISPATCH frame on its own, else why not (the broker refuses
    it at SUBMIT with PAYLOAD_TOO_LARGE, before it is accepted: an accepted item always
    fits a frame, so a DISPATCH that comes out too large is split, never dead-lettered).

    ``federated``: this broker hands items to relays (``trusted_swarms`` set), so a DISPATCH
    may carry the item's origin record too (its params a second time); without federation
    only the task itself counts. The reason names the cause, params or the inline payload,
    and its fix."""
    if _task_bound(item, id_len, swarm_id) <= budget.room_bytes:
        return ""  # surely fits: nothing encoded
    with_origin = federated and not relayed
    n = encoded_size(largest_task(item, id_len=id_len, swarm_id=swarm_id, relayed=relayed, federated=federated))
    if budget.fits(n):
        return ""
    copies = 2 if with_origin else 1  # the params are in the task, and again in the origin record
    params_n = copies * encoded_size(item.params)
    payload_n = blob_size(item.payload)  # the origin record holds its digest, not its bytes
    where = "a DISPATCH to a relay (origin record included)" if with_origin else "a DISPATCH"
    head = (f"item would take {n} bytes in {where}, over the {budget.room_bytes} bytes a frame holds "
            f"(max_frame_bytes={budget.max_frame_bytes}): ")
    params_why = (f"its params are too large ({params_n} bytes"
                  + (", counted twice: in the task and in its origin record" if with_origin else "")
                  + "); lower params (send large data as the payload, which can go by reference)")
    payload_why = (f"its inline payload is too large ({payload_n} bytes); send the payload by reference: "
                   "lower inline_max_bytes so it goes through the claim store")
    if params_n >= payload_n:
        return head + params_why + ("; and " + payload_why if payload_n > budget.room_bytes // 4 else "")
    return head + payload_why + ("; and " + params_why if params_n > budget.room_bytes // 4 else "")
