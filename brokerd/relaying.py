"""The broker's side of federation (docs/federation.md; the records, signatures and
trust file, the wire format shared with the relay, are ``common/wire/federation.py``).

A relay holds one session per side of its link: on the *upstream* broker it is leased
work like a worker (``dispatch.py``); on the *downstream* broker it submits like a
producer and gets the results back itself (``delivery.py`` ``plan_routed``). This
module checks what a relay brings into this ledger (origin records of SUBMITs,
downstream proofs of COMPLETEs), notes the federation gap events (F1-F4,
``brokerd/gaps.py``) and computes the heartbeat info relays get (free capacity,
deadline pressure). Everything here runs inside the actor's transaction; in-memory
effects go on the :class:`~ccsq.brokerd.actor.Batch`, except the result routes
(hints: delivery checks the ledger state).

:class:`Federation` is this broker's federation identity (swarm id, signing key, trust
file), owned by the actor: it signs the origin records of DISPATCHes to relays and the
proofs of RESULTs to them. Which results are owed to which relay is delivery state,
``brokerd/delivery.py`` ``DeliveryTracker`` (``route``, ``routed_all``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ccsq.brokerd import gaps
from ccsq.brokerd.clock import SYSTEM_CLOCK, Clock
from ccsq.common.wire import federation as fed
from ccsq.common.wire import protocol
from ccsq.common.wire.keys import load_private_key

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.actor import Batch
    from ccsq.brokerd.delivery import DeliveryTracker
    from ccsq.brokerd.ledger import Ledger, LedgerTxn
    from ccsq.brokerd.peers import PeerTable, Session
    from ccsq.common.wire.keys import AuthorizedKeys

FORECAST_EVERY_S = 5.0  # deadline pressure for upstream relays is recomputed at most this often


@dataclasses.dataclass
class Federation:
    """This broker's federation identity (owned by the actor): its signing key (read on
    first use), swarm id and trust file; ``trust`` None: federation off."""

    private_key_path: str
    swarm_id: str
    trust: fed.TrustedSwarms | None
    _key: Ed25519PrivateKey | None = None

    @classmethod
    def from_config(cls, cfg: Any, ledger_id: str) -> Federation:
        trust = fed.TrustedSwarms(Path(cfg.trusted_swarms)) if cfg.trusted_swarms else None
        return cls(cfg.private_key, cfg.swarm_id or ledger_id, trust)

    @property
    def enabled(self) -> bool:
        """Relayed items and results are accepted only with a trust file."""
        return self.trust is not None

    def sign(self, data: bytes) -> bytes:
        if self._key is None:
            self._key = load_private_key(Path(self.private_key_path))
        return self._key.sign(data)

    def sign_task(self, txn: Any, task: protocol.Task, default_max_attempts: int) -> protocol.Task:
        """``task`` (leased to an upstream relay) with this broker's signed origin record."""
        rec = txn.get(task.item_id)
        record = fed.origin_record(self.swarm_id, rec, task.payload, rec["max_attempts"] or default_max_attempts)
        return dataclasses.replace(task, origin=record, origin_sig=self.sign(record))

    def sign_delivery(self, rec: Mapping[str, Any], d: protocol.Delivery) -> protocol.Delivery:
        """``d`` (a RESULT to the downstream relay that submitted it) with this broker's signed proof."""
        proof = fed.result_proof(self.swarm_id, rec["origin"], d.item_id, d.result)
        return dataclasses.replace(d, proof=proof, proof_sig=self.sign(proof))


def scan_for_relay(txn: Any, kinds: list[str] | None, limit: int, now_ms: int) -> tuple[list[str], int | None]:
    """Ready items a relay may lease: like ``scan_ready`` but never an item that itself
    arrived by relay (max_hops). Looks a little deeper to step over such items."""
    ids, hint = txn.scan_ready(kinds, min(limit * 4, 4096), now_ms)
    out = []
    for item_id in ids:
        rec = txn.get(item_id)
        if rec is not None and not rec.get("origin"):
            out.append(item_id)
            if len(out) >= limit:
                break
    return out, hint


def _takes(session: Any, kind: str) -> bool:
    """Whether a worker session takes ``kind`` (no kinds listed = every kind)."""
    return not session.kinds or kind in session.kinds


def capacity(worker_sessions: list, draining: set[str], kind_states: dict[str, dict[str, int]],
             kinds: tuple[str, ...]) -> dict[str, int]:
    """Free worker capacity per kind: credit of healthy, non-draining workers that take the
    kind, minus the items of that kind already waiting (this swarm's own work first)."""
    out = {}
    for kind in kinds:
        takers = [s for s in worker_sessions if s.healthy and s.peer_id not in draining and _takes(s, kind)]
        ready = kind_states.get(kind, {}).get(protocol.ItemState.READY.value, 0)
        out[fed.CAP_PREFIX + kind] = max(0, sum(s.credit for s in takers) - ready)
        out[fed.WORKERS_PREFIX + kind] = len(takers)
    return out


def deadline_pressure(forecast: list[dict], kinds: tuple[str, ...]) -> dict[str, int]:
    """``late:<kind>`` = 1 when the queue forecast (``brokerd.gap_report.queue_forecast``) of a
    kind with a deadline says it will not drain in time here (late, or stalled: no rate)."""
    by_kind = {q["kind"]: q for q in forecast}
    out = {}
    for kind in kinds:
        q = by_kind.get(kind)
        late = q is not None and q.get("nearest_deadline_ms") is not None and q.get("verdict") in ("late", "stalled")
        out[fed.LATE_PREFIX + kind] = int(late)
    return out


def relay_sessions(peers: PeerTable, side: str) -> list[Session]:
    """Relay sessions on ``side`` (``fed.UPSTREAM``: this broker leases to them;
    ``fed.DOWNSTREAM``: they submit here)."""
    return [s for s in peers.sessions(protocol.Role.RELAY) if fed.relay_side(s) == side]


class Relaying:
    """What relays bring into this broker's ledger, and what they are told."""

    def __init__(self, fed_state: Federation, peers: PeerTable, authorized: AuthorizedKeys, ledger: Ledger,
                 delivery: DeliveryTracker, rejects: collections.Counter, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.fed = fed_state
        self.clock = clock
        self.peers = peers
        self.authorized = authorized
        self.ledger = ledger
        self.delivery = delivery
        self.rejects = rejects  # the intake's counters (refused frames and items, by code)
        self._forecast: tuple[float, list[dict[str, Any]]] | None = None  # (monotonic when computed, queue forecast)

    def submit(self, txn: LedgerTxn, batch: Batch, sess: Session, item: protocol.SubmitItem, now_ms: int,
               refuse: str) -> protocol.SubmitResult:
        """A relay's SUBMIT: only items whose origin signature verifies; the item records its
        origin and the relay, and its idempotency key is the origin (a resubmission is G9)."""
        origin, why = fed.check_origin(item, self.fed.trust, self.fed.swarm_id)
        if origin is None:
            self._refused(txn, batch, fed.ORIGIN_REJECTED, sess.peer_id, item.key, why)
            txn.event(gaps.F4_RELAYED_ITEM_REFUSED, item.key[:200], now_ms, f"from {sess.peer_id}: {why[:200]}")
            return protocol.SubmitResult(item.key, "", error=fed.ORIGIN_REJECTED, message=why)
        res = txn.submit(item, now_ms, refuse=refuse, origin=origin, reply_to=sess.peer_id)
        rec = (txn.record(res.item_id) or {}) if res.duplicate else {}  # read only
        if res.duplicate and rec.get("origin") != origin:
            # a producer took this origin key first: never hand the relay someone else's item
            why = f"key {item.key[:120]} belongs to an item that did not come by relay"
            self._refused(txn, batch, fed.ORIGIN_KEY_TAKEN, sess.peer_id, item.key, why)
            return protocol.SubmitResult(item.key, "", error=fed.ORIGIN_KEY_TAKEN, message=why)
        if res.duplicate:
            txn.event(gaps.F3_RELAYED_RESUBMIT, res.item_id, now_ms, f"origin {origin['swarm']}:{origin['item_id']} from {sess.peer_id}")
            if rec.get("state") == protocol.ItemState.ACKNOWLEDGED.value:
                # the upstream leased it again after an earlier relay took this result home and
                # it was fenced there: deliver the (still stored) result once more (G3)
                self.delivery.route(sess.peer_id, res.item_id)
                self.delivery.set_possible(True)  # at once, like the route: this turn's delivery may take it
        return res

    def complete(self, txn: LedgerTxn, batch: Batch, sess: Session, r: protocol.TaskResult, now_ms: int) -> str:
        """A relay's COMPLETE counts only with the downstream broker's valid proof."""
        why = fed.check_proof(r, self.fed.trust, self.fed.swarm_id)
        if why:
            self._refused(txn, batch, fed.RESULT_REJECTED, sess.peer_id, r.item_id, why)
            return protocol.Outcome.REJECTED.value
        before = txn.get(r.item_id) or {}
        outcome = txn.complete(r, now_ms, sess.peer_id)
        late = outcome == protocol.Outcome.ACCEPTED.value and before.get("state") == protocol.ItemState.READY.value
        if outcome == protocol.Outcome.FENCED.value or late:
            txn.event(gaps.F2_RELAYED_RESULT_LATE, r.item_id, now_ms, f"token {r.token} from {sess.peer_id}: {outcome}")
        return outcome

    def note_lease_lost(self, txn: LedgerTxn, item_id: str, holder: str, now_ms: int, new_state: str) -> None:
        """Gap F1 when a lease that ended (``new_state``: "" if it did not) was a relay's."""
        key = self.authorized.get(holder)
        if new_state and key is not None and key.role is protocol.Role.RELAY:
            txn.event(gaps.F1_RELAY_LEASE_LOST, item_id, now_ms, f"lease of relay {holder}: item now {new_state}")

    def heartbeat_info(self) -> dict[str, dict]:
        """Heartbeat.info per relay session: to downstream relays the free worker capacity of
        their kinds; to upstream relays their credit here (``credit``) and how many CREDIT
        frames were applied (``credit_msgs``: the relay resyncs the credit it may still be
        dispatched on, and withdraws what its downstream no longer backs), and to those of
        policy ``deadline`` whether this swarm's drain forecast misses a kind's nearest
        deadline (recomputed at most every FORECAST_EVERY_S)."""
        relays = relay_sessions(self.peers, fed.DOWNSTREAM)
        upstream = relay_sessions(self.peers, fed.UPSTREAM)
        pressed = [s for s in upstream if s.info_hello.get(fed.POLICY) == "deadline"]
        credits = {s.peer_id: {fed.CREDIT_INFO: s.credit, fed.CREDIT_MSGS_INFO: s.credit_msgs} for s in upstream}
        if not relays and not pressed:
            return credits
        with self.ledger.read() as view:
            kind_states = view.kind_states()
            workers = self.peers.sessions(protocol.Role.WORKER)
            out = {s.peer_id: capacity(workers, self.peers.draining, kind_states, s.kinds) for s in relays}
            if pressed:
                now = self.clock.monotonic_s()
                forecast = self._forecast
                if forecast is None or now - forecast[0] >= FORECAST_EVERY_S:
                    from ccsq.brokerd.gap_report import queue_forecast

                    forecast = self._forecast = (now, queue_forecast(kind_states, view.samples(), view.nearest_deadlines(),
                                                                     self.clock.wall_ms()))
                out.update({s.peer_id: deadline_pressure(forecast[1], s.kinds) for s in pressed})
        for peer_id, info in credits.items():
            out[peer_id] = {**out.get(peer_id, {}), **info}
        return out

    def _refused(self, txn: LedgerTxn, batch: Batch, code: str, peer: str, item: str, why: str) -> None:
        """A relayed item or result refused: counted in the ledger and (after commit) in memory."""
        txn.count_reject(code)
        batch.effects.append(lambda: self.rejects.update([code]))
        batch.log("warning", "relayed_rejected", code=code, peer=peer, item=item[:120], reason=why[:300])
