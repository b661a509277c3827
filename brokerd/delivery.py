"""Result delivery: the one owner of what the broker has sent and not yet had acknowledged.

A completed item's result goes to a completion service (or, for an item a relay
submitted, back to that relay) in ``RESULT`` frames, within the receiver's credit.
Until the receiver ACKs it the item is *in flight*; if the receiver's session ends
first, the item becomes deliverable again and its next delivery is a *redelivery*
(gap G3, counted in the ledger with ``note_redelivery``).

:class:`DeliveryTracker` owns all in-memory delivery state (the ledger owns the
durable part: the completed index and each record's ``completed_epoch``):

- in flight: item id -> the peer it was sent to, and per peer its item ids;
- routes: per downstream relay, the completed items it submitted whose result is owed
  to it (never to a completion service) until acknowledged (:meth:`route`;
  :meth:`recover_routes` rebuilds them from the ledger's ``reply_to`` at start);
- redeliver: item ids whose next delivery is a redelivery;
- the scan floor: every completed-index entry below ``floor_cseq`` is in flight, so
  a scan starts there instead of skipping every in-flight item again; a session end
  resets it to 0 (its items are deliverable again), and a scan that began before a
  reset may not raise it (``generation`` tells);
- ``possible``: whether a delivery pass may find work (False until an event).

Planning (:meth:`DeliveryTracker.plan`, :meth:`plan_routed`) runs inside the actor's
transaction and only reads the tracker; what changes it is queued on the
:class:`~ccsq.brokerd.actor.Batch` and applied after commit (:meth:`sent`,
:meth:`advance_floor`, :meth:`set_possible`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ccsq.brokerd.outbound import deliveries_bound, delivery_size
from ccsq.brokerd.peers import PeerStatus
from ccsq.common.wire import protocol
from ccsq.common.wire.frames import split_bounded

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.actor import Batch
    from ccsq.brokerd.ledger import LedgerTxn, LedgerView
    from ccsq.brokerd.peers import Session
    from ccsq.brokerd.relaying import Federation

DELIVER_PER_TURN = 128  # results sent to completion services in one turn


class DeliveryTracker:
    """Deliveries in flight (sent, not acknowledged), redeliveries owed, results routed
    to relays, the scan floor."""

    def __init__(self, epoch: int, fed_state: Federation, max_batch_items: int,
                 reply_budget: Callable[[], int]) -> None:
        self.epoch = epoch  # a result completed under an older epoch may have been delivered
        self.fed = fed_state  # signs the proofs of routed results
        self.max_batch_items = max_batch_items
        self.reply_budget = reply_budget  # bytes a RESULT frame may carry
        self._sent_to: dict[str, str] = {}  # item id -> peer id (in flight)
        self._by_peer: dict[str, set[str]] = {}  # peer id -> item ids in flight to it
        self._redeliver: set[str] = set()
        self._floor_cseq = 0
        self._floor_generation = 0  # bumped by every reset of the floor
        self._possible = True
        self._routed: dict[str, set[str]] = {}  # downstream relay peer id -> completed items owed to it
        self.routed_all: set[str] = set()  # every routed item id (read: the actor and plan skip them)

    # --- queries ---
    @property
    def possible(self) -> bool:
        """Whether a delivery pass may find work (set by :meth:`set_possible` only)."""
        return self._possible

    def count(self, peer_id: str | None = None) -> int:
        """Deliveries in flight, all or to ``peer_id``."""
        if peer_id is None:
            return len(self._sent_to)
        return len(self._by_peer.get(peer_id, ()))

    def redelivery(self, item_id: str, rec: Mapping[str, Any] | None, why: str) -> tuple[bool, str]:
        """Whether the next delivery of ``item_id`` is a redelivery (G3) and why: its last
        receiver's session ended before ACK (``why``), or it completed under an older
        broker epoch (it may have been delivered before the restart)."""
        if item_id in self._redeliver:
            return True, why
        if rec is not None and rec.get("completed_epoch", self.epoch) < self.epoch:
            return True, "completed before a broker restart: may have been delivered"
        return False, why

    # --- changes (the actor calls these outside a transaction, or after its commit) ---
    def set_possible(self, possible: bool) -> None:
        """The one setter of :attr:`possible`."""
        self._possible = possible

    def sent(self, sess: Session, deliveries: list[protocol.Delivery]) -> bool:
        """After commit: ``deliveries`` went to ``sess``. False (and nothing in flight) when
        the session ended between the scan and the commit: the items are then owed a
        redelivery."""
        if sess.status is PeerStatus.GONE:
            self._redeliver.update(d.item_id for d in deliveries)
            self._reset_floor()
            self.set_possible(True)
            return False
        held = self._by_peer.setdefault(sess.peer_id, set())
        sent_to, peer_id = self._sent_to, sess.peer_id
        ids = [d.item_id for d in deliveries]
        for item_id in ids:
            sent_to[item_id] = peer_id
        held.update(ids)
        if self._redeliver:
            self._redeliver.difference_update(ids)
        return True

    def route(self, peer_id: str, item_id: str) -> None:
        """``item_id``'s result is owed to the relay ``peer_id`` (a hint, set inside the
        transaction so this turn's delivery skips it too; :meth:`plan_routed` checks the
        ledger state)."""
        self._routed.setdefault(peer_id, set()).add(item_id)
        self.routed_all.add(item_id)

    def unroute(self, item_id: str) -> None:
        """``item_id`` is owed to no relay any more."""
        if item_id in self.routed_all:
            self.routed_all.discard(item_id)
            for ids in self._routed.values():
                ids.discard(item_id)

    def recover_routes(self, view: LedgerView) -> int:
        """At start: every completed item with a ``reply_to`` is owed to that relay.
        Returns how many are."""
        ids, _ = view.completed_ids(lambda _i: False, 1 << 62)
        for item_id in ids:
            rec = view.get(item_id)
            if rec is not None and rec.get("reply_to"):
                self.route(rec["reply_to"], item_id)
        return len(self.routed_all)

    def acknowledged(self, item_id: str) -> None:
        """After commit: ``item_id`` was acknowledged; nothing more is owed for it (no
        delivery, no route)."""
        self.unroute(item_id)
        peer = self._sent_to.pop(item_id, None)
        self._redeliver.discard(item_id)
        if peer is not None:
            held = self._by_peer.get(peer)
            if held is not None:
                held.discard(item_id)
                if not held:
                    del self._by_peer[peer]

    def acknowledged_many(self, item_ids: list[str]) -> None:
        """:meth:`acknowledged` of every id of one ACK frame."""
        routed, sent_to, redeliver, by_peer = self.routed_all, self._sent_to, self._redeliver, self._by_peer
        for item_id in item_ids:
            if item_id in routed:
                self.unroute(item_id)
            peer = sent_to.pop(item_id, None)
            if peer is not None:
                held = by_peer.get(peer)
                if held is not None:
                    held.discard(item_id)
                    if not held:
                        del by_peer[peer]
        if redeliver:
            redeliver.difference_update(item_ids)

    def session_ended(self, peer_id: str) -> None:
        """The session of ``peer_id`` ended: its unacknowledged deliveries are owed a
        redelivery (G3) and deliverable again."""
        held = self._by_peer.pop(peer_id, set())
        for item_id in held:
            if self._sent_to.get(item_id) == peer_id:
                del self._sent_to[item_id]
                self._redeliver.add(item_id)
                self._reset_floor()
        if held:
            self.set_possible(True)

    def advance_floor(self, cseq: int, generation: int) -> None:
        """After commit: entries below ``cseq`` are all in flight, unless the floor was
        reset since the scan (generation) and made some deliverable again."""
        if generation == self._floor_generation:
            self._floor_cseq = max(self._floor_cseq, cseq)

    def _reset_floor(self) -> None:
        self._floor_cseq = 0
        self._floor_generation += 1

    # --- planning (inside the transaction: reads only; changes go on the batch) ---
    def plan(self, txn: LedgerTxn, batch: Batch, takers: list[Session], on_sent: Callable[[Session, list[protocol.Delivery]], None],
             now_ms: int) -> bool:
        """Results for completion services ``takers`` (connected, with credit, nothing
        unsent), oldest completion first, up to :data:`DELIVER_PER_TURN`; replies and
        ``on_sent`` go on ``batch``. Returns whether more may be waiting."""
        planned: set[str] = set()
        more = False
        floor = self._floor_cseq
        budget = DELIVER_PER_TURN
        routed = self.routed_all  # results of relayed items go to their relay only
        sent_to = self._sent_to
        for sess in takers:
            limit = min(sess.credit, self.max_batch_items, budget)
            if limit <= 0:
                more = True
                break
            ids, floor = txn.completed_ids(lambda i: i in sent_to or i in planned or i in routed, limit, floor)
            if len(ids) == limit:
                more = True
            if not ids:
                continue
            budget -= len(ids)
            deliveries = []
            planned.update(ids)
            record, delivery, owed = txn.record, txn.delivery, self.redelivery
            for item_id in ids:
                rec = record(item_id)  # (read only)
                redelivery, why = owed(item_id, rec, "completion session ended before ACK")
                if redelivery:
                    txn.note_redelivery(item_id, now_ms, why)
                deliveries.append(delivery(item_id, redelivery, rec))
            self._queue(batch, sess, deliveries, on_sent)
        batch.effects.append(lambda f=floor, g=self._floor_generation: self.advance_floor(f, g))
        return more

    def plan_routed(self, txn: LedgerTxn, batch: Batch, relays: list[Session],
                    on_sent: Callable[[Session, list[protocol.Delivery]], None], now_ms: int) -> bool:
        """Completed relayed items to the downstream ``relays`` that submitted them (when
        connected with credit and nothing unsent; kept otherwise), each with this
        broker's signed proof. Returns whether more are waiting."""
        more = False
        for sess in relays:
            ids = self._routed.get(sess.peer_id)
            if not ids or sess.credit <= 0 or sess.unsent:
                continue
            limit = min(sess.credit, self.max_batch_items)
            todo = [i for i in ids if i not in self._sent_to]
            if len(todo) > limit:
                more, todo = True, todo[:limit]
            deliveries = []
            for item_id in todo:
                rec = txn.record(item_id)  # read only
                if rec is None or rec["state"] not in (protocol.ItemState.COMPLETED.value, protocol.ItemState.ACKNOWLEDGED.value):
                    batch.effects.append(lambda i=item_id: self.unroute(i))
                    continue
                if rec["state"] == protocol.ItemState.ACKNOWLEDGED.value:  # its upstream leased the item again
                    redelivery, why = True, "acknowledged result asked for again by a relay (its upstream leased the item again)"
                else:
                    redelivery, why = self.redelivery(item_id, rec, "relay session ended before ACK")
                if redelivery:
                    txn.note_redelivery(item_id, now_ms, why)
                deliveries.append(self.fed.sign_delivery(rec, txn.delivery(item_id, redelivery, rec)))
            if deliveries:
                self._queue(batch, sess, deliveries, on_sent)
        return more

    def _queue(self, batch: Batch, sess: Session, deliveries: list[protocol.Delivery],
               on_sent: Callable[[Session, list[protocol.Delivery]], None]) -> None:
        batch.effects.append(lambda s=sess, ds=deliveries: on_sent(s, ds))
        for chunk in split_bounded(deliveries, size_of=delivery_size, bound=deliveries_bound,
                                   budget_bytes=self.reply_budget(), max_items=self.max_batch_items):
            batch.replies.append((sess.routing_id, protocol.Result(chunk)))

