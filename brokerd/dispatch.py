"""Dispatch: ready items leased to lease holders that asked for work (pull, by credit).

A lease holder (a worker, or a relay on the upstream side of its link) gets DISPATCH
frames only while it has credit, is healthy, is not draining and has nothing unsent.
A dispatch pass runs inside the actor's transaction (:meth:`Dispatcher.plan`): it
leases items in the ledger (a new fencing token each) and puts the DISPATCH replies
and the in-memory effects (lease timers, credit, the round-robin step, when the next
pass may find work) on the :class:`~ccsq.brokerd.actor.Batch`, applied after commit.

:attr:`Dispatcher.at_mono` says when a pass may find work: 0.0 the next turn, a time
when the earliest retry backoff ends, ``inf`` not until an event (a SUBMIT, a FAIL, an
expiry, new credit, a reconnect) calls :meth:`Dispatcher.wake`. It changes through
:meth:`Dispatcher.schedule` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ccsq.brokerd.clock import SYSTEM_CLOCK, Clock
from ccsq.brokerd.outbound import task_size, tasks_bound
from ccsq.brokerd.relaying import Federation, relay_sessions, scan_for_relay
from ccsq.common.wire import federation as fed
from ccsq.common.wire import protocol
from ccsq.common.wire.frames import split_bounded

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.actor import Batch
    from ccsq.brokerd.ledger import LedgerTxn
    from ccsq.brokerd.peers import LeaseTimers, PeerTable, Session
    from ccsq.common.wire.config import BrokerConfig

LEASE_BUDGET_CHECK_EVERY = 32  # leases between two looks at the dispatch slice's clock


class Dispatcher:
    """Leases ready items to lease holders with credit, round-robin, within
    ``cfg.slice_budget_ms`` per pass."""

    def __init__(self, cfg: BrokerConfig, peers: PeerTable, leases: LeaseTimers, fed_state: Federation,
                 reply_budget: Callable[[], int], *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.cfg = cfg
        self.clock = clock
        self.peers = peers
        self.leases = leases
        self.fed = fed_state
        self.reply_budget = reply_budget  # bytes a DISPATCH frame may carry
        self._at_mono = self.clock.monotonic_s()
        self._rr = 0  # round-robin start among takers (advanced after each commit of a pass)

    @property
    def at_mono(self) -> float:
        """When a dispatch pass may find work (monotonic seconds; inf: not until :meth:`wake`)."""
        return self._at_mono

    def schedule(self, at_mono: float) -> None:
        """The one setter of :attr:`at_mono`."""
        self._at_mono = at_mono

    def wake(self) -> None:
        """Something happened that may make work dispatchable: look on the next turn."""
        self.schedule(0.0)

    def takers(self) -> list[Session]:
        """Workers and upstream relays that may get a DISPATCH now: not one whose lease expired
        unextended and that has sent nothing since (frozen, cut off: the item would go back to
        it on the credit it has left, expire again and count another attempt, up to a dead
        letter ``worker_lost``, while another worker idles; C03). Relays only with federation
        on (``trusted_swarms``): without it their results are refused, and an item was sized
        at SUBMIT for a DISPATCH without an origin record (``outbound.dispatch_refusal``)."""
        relays = relay_sessions(self.peers, fed.UPSTREAM) if self.fed.enabled else []
        holders = self.peers.sessions(protocol.Role.WORKER) + relays
        return [s for s in holders
                if s.credit > 0 and s.healthy and not s.unsent and s.peer_id not in self.peers.draining
                and s.lease_lost_recv_mono != s.last_recv_mono]

    def plan(self, txn: LedgerTxn, batch: Batch, now: float, now_ms: int) -> None:
        """One dispatch pass in the turn's transaction (``now``: monotonic, ``now_ms``: wall)."""
        if now < self._at_mono:
            return
        takers = self.takers()
        if not takers:
            return
        if txn.state_count(protocol.ItemState.READY.value) == 0:
            batch.effects.append(lambda: self.schedule(float("inf")))
            return
        budget_end = self.clock.monotonic_s() + self.cfg.slice_budget_ms / 1000.0
        k = self._rr % len(takers)
        takers = takers[k:] + takers[:k]
        # this swarm's own workers first, relays after them (stable: round-robin within each):
        # a relay gets only what the local workers with credit left (RabbitMQ federated queues)
        takers.sort(key=lambda s: s.role is protocol.Role.RELAY)
        batch.effects.append(self._advance_round_robin)  # after commit: a retried step starts at the same taker
        ttl_ms = self.leases.ttl_ms
        next_at = float("inf")
        exhausted = False
        for sess in takers:
            if self.clock.monotonic_s() > budget_end:
                exhausted = True
                break
            limit = min(sess.credit, self.cfg.max_batch_items)
            relay = sess.role is protocol.Role.RELAY  # never an item that came by relay (max_hops); signed
            ids, hint = (scan_for_relay(txn, list(sess.kinds) or None, limit, now_ms) if relay
                         else txn.scan_ready(list(sess.kinds) or None, limit, now_ms))
            if hint is not None:
                next_at = min(next_at, now + max(0, hint - now_ms) / 1000.0)
            tasks = []
            for n, item_id in enumerate(ids):
                if n % LEASE_BUDGET_CHECK_EVERY == LEASE_BUDGET_CHECK_EVERY - 1 and self.clock.monotonic_s() > budget_end:
                    exhausted = True  # the slice's time is up: the next turn goes on
                    break
                task = txn.lease(item_id, sess.peer_id, now_ms, ttl_ms)
                if task is not None:
                    tasks.append(self.fed.sign_task(txn, task, self.cfg.max_attempts) if relay else task)
            if len(ids) == limit and sess.credit > len(tasks):
                exhausted = True  # some were expired or more may be waiting
            if not tasks:
                continue
            batch.crash("broker.after_lease_commit")
            batch.effects.append(lambda s=sess, ts=tasks: self._leased(s, ts))
            for chunk in split_bounded(tasks, size_of=task_size, bound=tasks_bound, budget_bytes=self.reply_budget(),
                                       max_items=self.cfg.max_batch_items):
                batch.replies.append((sess.routing_id, protocol.Dispatch(chunk)))
        at = 0.0 if exhausted else next_at
        batch.effects.append(lambda: self.schedule(at))

    def _leased(self, sess: Session, tasks: list[protocol.Task]) -> None:
        """After commit: lease timers for ``tasks``; they spend the taker's credit."""
        self.leases.add_many(tasks, sess.peer_id, self.leases.expiry(self.clock.monotonic_s()))
        sess.credit -= len(tasks)

    def _advance_round_robin(self) -> None:
        self._rr += 1
