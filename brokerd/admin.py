"""ADMIN commands answered by the broker actor (inside the turn's transaction),
and the ledger queries they share with the offline (read-only) path.

Each command is a method ``cmd_<name>(txn, batch, sess, args) -> dict`` returning
a JSON-like document; the reply is ``AdminReply(req, ok, body=msgpack(doc))``.
Unknown commands and bad arguments give ``ok=False`` with ``error``. To add a
command, add a method and list it in :attr:`AdminCommands.COMMANDS`.

Commands (arguments are scalars, see :class:`ccsq.common.wire.protocol.Admin`):

- ``status``: peers (slots, credit, leases, draining), backlog per kind and state,
  oldest ready item, counters, balance, gap counts, ledger use.
- ``items_show`` (``item_id``): the item's ledger record.
- ``dlq_list`` (``limit`` 1..1000, default 100): dead items, oldest id first.
- ``dlq_replay`` / ``dlq_purge`` (``item_id``, or ``all=true``: up to 1000 per call,
  ``more`` says whether to call again): replay makes dead items ready with a fresh
  attempt budget (G10 event); purge deletes them (G11 event).
- ``drain`` (``worker``, ``undo``): stop (or resume) dispatching to a worker; its
  leases finish normally. The worker must be in the authorized keys; the drain
  is written to the ledger (meta ``d:<worker>``) and survives a broker restart.
- ``dead_letter`` (``item_id`` or ``item_ids`` comma-separated, ``reason``
  ``payload_missing``/``operator``, ``message``): dead-letter *ready* items
  (``ccsq reconcile --apply``), G7 events.
- ``items_cancel`` (``item_ids`` comma-separated, or ``kind``: its ready items, up to
  1000 per call, ``more`` says whether to call again): the ledger transition of the
  protocol's CANCEL: a *ready* item becomes dead with reason ``cancelled`` (G7 event);
  a leased, completed or terminal item is left as it is and reported with its state.

- ``failover`` (``timeout_s``, default 10; ``to``, a standby node id): a replicated primary's planned switchover
  (docs/ha.md); answered by the actor (``Broker._failover_start``), not by this class:
  it is no ledger command. A single broker refuses it.

``status`` has an ``ha`` section (``BrokerView.ha_status``: ``role`` single | primary,
``epoch``, and for a primary its mode, confirms held, standbys' lag).

``status``, ``items_show`` and ``dlq_list`` build their ledger part with the
module functions :func:`ledger_status`, :func:`item_doc` and :func:`dlq_doc`,
which ``ccsq ... --offline`` calls on a read-only snapshot: both paths give the
same answer by construction (tests/test_admin_cli.py checks it).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from ccsq.brokerd.clock import SYSTEM_CLOCK, Clock
from ccsq.brokerd.ledger import reader_report
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import AdminFailed

if TYPE_CHECKING:  # pragma: no cover
    import collections

    from ccsq.brokerd.actor import Batch
    from ccsq.brokerd.ledger import Ledger, LedgerTxn, LedgerView
    from ccsq.brokerd.peers import LeaseTimers, PeerTable, Session
    from ccsq.common.wire.config import BrokerConfig
    from ccsq.common.wire.keys import AuthorizedKeys

LEASES_LISTED_PER_PEER = 100
MAX_ITEMS_PER_COMMAND = 1000  # keeps one admin command within the actor's turn budget and one frame
DEAD_LETTER_REASONS = ("payload_missing", "operator")
#: Keys of ``status`` that come from the ledger alone (identical online and offline).
LEDGER_STATUS_KEYS = ("ledger_id", "epoch", "counters", "states", "balanced", "backlog", "gaps", "oldest_ready_created_ms", "dead",
                      "dead_listed", "draining")


#: A bad admin request (the message says which argument): the one class of the exception
#: tree, :class:`~ccsq.common.wire.errors.AdminFailed`, under the name the commands use.


# --- ledger queries (online inside the broker's transaction, offline on a read snapshot) ---
def ledger_status(view: LedgerView) -> dict[str, Any]:
    """The ledger part of ``status`` (keys :data:`LEDGER_STATUS_KEYS`, plus
    ``oldest_ready_age_s`` which depends on the wall clock)."""
    counters, states = view.counters(), view.states()
    oldest = view.oldest_ready_created_ms()
    return {
        "ledger_id": view.ledger.ledger_id,
        "epoch": view.epoch(),
        "counters": counters,
        "states": states,
        "balanced": counters["received"] == sum(states.values()),
        "backlog": view.kind_states(),
        "gaps": view.gap_counts(),
        "oldest_ready_created_ms": oldest,
        "oldest_ready_age_s": None if oldest is None else round(max(0.0, time.time() - oldest / 1000.0), 3),
        "dead": states["dead"],
        "dead_listed": view.dead_listed(),
        "draining": view.draining(),
    }


def item_doc(view: LedgerView, item_id: str) -> dict[str, Any]:
    """``{"item": record}`` for ``items show``; AdminFailed if there is no such item
    (never submitted, or purged)."""
    rec = view.get(item_id)
    if rec is None:
        raise AdminFailed(f"no item {item_id!r} in the ledger (never submitted, or purged after retention)")
    return {"item": rec}


def dlq_doc(view: LedgerView, limit: int) -> dict[str, Any]:
    """``{"items": [dead records], "total": dead items still listed, "purged": dead items purged}``."""
    listed = view.dead_listed()
    return {"items": view.dead_items(limit), "total": listed, "purged": view.state_count("dead") - listed}


def limit_arg(args: dict, default: int = 100) -> int:
    limit = args.get("limit", default)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_ITEMS_PER_COMMAND:
        raise AdminFailed(f"limit must be an integer 1..{MAX_ITEMS_PER_COMMAND}")
    return limit


@dataclasses.dataclass(frozen=True)
class BrokerView:
    """What admin commands may read and do of the broker actor, and nothing else (the
    actor builds it: ``Broker._admin_view``). ``peers`` and ``leases`` are for reading;
    the drain set changes through ``set_draining(worker, draining)`` only, after commit."""

    cfg: BrokerConfig
    endpoint: str
    ledger: Ledger
    peers: PeerTable
    leases: LeaseTimers
    authorized: AuthorizedKeys
    rejects: collections.Counter  # refused frames by code, since start
    reply_budget: Callable[[], int]  # bytes one reply frame may carry
    uptime_s: Callable[[], float]
    send_counts: Callable[[], dict[str, int]]  # {"again", "unroutable"}: sends the transport could not make
    ledger_full_since_ms: Callable[[], int]  # 0: not full
    deliveries_in_flight: Callable[..., int]  # (peer_id=None) -> results sent, not yet acknowledged
    wake_dispatch: Callable[[], None]
    set_draining: Callable[[str, bool], None]
    clock: Clock = SYSTEM_CLOCK  # the actor's (ledger timestamps of the commands that change state)
    noise: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # reconnect noise by code
    ha_status: Callable[[], dict] | None = None  # the "ha" section: role single|primary, epoch, ... (docs/ha.md)


class AdminCommands:
    COMMANDS = ("status", "items_show", "dlq_list", "dlq_replay", "dlq_purge", "drain", "dead_letter", "items_cancel")

    def __init__(self, broker: BrokerView) -> None:
        self.broker = broker

    def handle(self, txn: LedgerTxn, batch: Batch, sess: Session, msg: protocol.Admin) -> protocol.AdminReply:
        if msg.command not in self.COMMANDS:
            return protocol.AdminReply(msg.req, False, error=f"unknown command {msg.command!r}; known: {list(self.COMMANDS)}")
        try:
            doc = getattr(self, f"cmd_{msg.command}")(txn, batch, sess, msg.args)
        except AdminFailed as exc:
            return protocol.AdminReply(msg.req, False, error=str(exc))
        body = msgpack.packb(doc, use_bin_type=True)
        if len(body) > self.broker.reply_budget():
            return protocol.AdminReply(msg.req, False, error=f"reply of {len(body)} bytes is over the frame limit: ask for fewer (--limit)")
        return protocol.AdminReply(msg.req, True, body=body)

    # --- read-only commands ---
    def cmd_status(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        b = self.broker
        now = b.clock.monotonic_s()
        peers = []
        for s in b.peers.sessions():
            held = b.leases.held_by(s.peer_id)
            peers.append(
                {
                    "peer_id": s.peer_id,
                    "role": s.role.value,
                    "slots": s.slots,
                    "credit": s.credit,
                    "kinds": list(s.kinds),
                    "healthy": s.healthy,
                    **(b.peers.store_health(s) if s.role is protocol.Role.WORKER else {}),
                    "draining": s.peer_id in b.peers.draining,
                    "busy": s.busy,
                    "done": s.acked if s.role is protocol.Role.COMPLETION else s.done,  # a completion peer: items it acknowledged
                    "info": s.info,
                    "leases": len(held),
                    "lease_list": [
                        {"item_id": lz.item_id, "token": lz.token, "expires_in_s": round(lz.expires_mono - now, 3)}
                        for lz in held[:LEASES_LISTED_PER_PEER]
                    ],
                    "in_flight": b.deliveries_in_flight(s.peer_id),
                    "pending_sends": len(s.unsent),
                    "connected_s": round(now - s.connected_mono, 3),
                    "last_seen_s": round(now - s.last_recv_mono, 3),
                }
            )
        return {
            "source": "broker",
            **ledger_status(txn),
            "broker": {
                "peer_id": b.cfg.peer_id,
                "endpoint": b.endpoint,
                "uptime_s": round(b.uptime_s(), 3),
            },
            "peers": peers,
            "rejects": dict(b.rejects),
            "reconnect_noise": dict(b.noise),  # frames of sessions that had ended here: not refusals
            "send": b.send_counts(),
            "ledger": {
                "map_size_bytes": b.ledger.map_size_bytes(),
                "max_map_size_bytes": b.ledger.max_map_size_bytes,
                "used_bytes": b.ledger.used_bytes(txn.txn),
                "full_since_ms": b.ledger_full_since_ms(),  # 0: not full; else completions may not fit
                **({"full_advice": _ledger_full_advice()} if b.ledger_full_since_ms() else {}),
            },
            "leases_in_memory": len(b.leases),
            "in_flight_deliveries": b.deliveries_in_flight(),
            "readers": reader_report(b.ledger, txn, b.clock.wall_ms(), warn_age_s=b.cfg.reader_warn_age_s),
            **({"ha": b.ha_status()} if b.ha_status is not None else {}),
        }

    def cmd_items_show(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        item_id = _str_arg(args, "item_id")
        doc = item_doc(txn, item_id)
        lease = self.broker.leases.get(item_id)
        doc["lease_in_memory"] = None if lease is None else {"token": lease.token, "worker": lease.worker}
        return doc

    def cmd_dlq_list(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        return dlq_doc(txn, limit_arg(args))

    # --- commands that change state (this transaction; effects after commit) ---
    def cmd_dlq_replay(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        ids, more = self._dead_ids(txn, args)
        now_ms = self.broker.clock.wall_ms()
        done = [i for i in ids if txn.replay_dead(i, now_ms, who=sess.peer_id)]
        if done:
            batch.effects.append(self.broker.wake_dispatch)
        return {"replayed": done, "not_dead": [i for i in ids if i not in done], "more": more,
                "unknown": [i for i in ids if i not in done and txn.get(i) is None]}

    def cmd_dlq_purge(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        ids, more = self._dead_ids(txn, args)
        now_ms = self.broker.clock.wall_ms()
        done = [i for i in ids if txn.purge_dead(i, now_ms, who=sess.peer_id)]
        return {"purged": done, "not_dead": [i for i in ids if i not in done], "more": more,
                "unknown": [i for i in ids if i not in done and txn.get(i) is None]}

    def cmd_drain(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        worker = _str_arg(args, "worker")
        undo = args.get("undo", False) is True
        b = self.broker
        key = b.authorized.get(worker)
        if (key is None or key.role is not protocol.Role.WORKER) and not (undo and worker in b.peers.draining):
            what = ("no peer of that id in the authorized keys" if key is None
                    else f"the authorized keys list it as a {key.role.value}, not a worker")
            raise AdminFailed(f"unknown worker {worker!r}: {what} "
                             f"(known workers: {', '.join(self._worker_ids()) or 'none'})")
        txn.set_draining(worker, not undo)  # durable: a restarted broker keeps the drain
        batch.effects.append(lambda: b.set_draining(worker, not undo))
        s = b.peers.get(worker)
        return {
            "worker": worker,
            "draining": not undo,
            "connected": s is not None and s.role is protocol.Role.WORKER,
            "leases": len(b.leases.held_by(worker)),
        }

    def cmd_dead_letter(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        if isinstance(args.get("item_ids"), str):
            ids = [i for i in args["item_ids"].split(",") if i]
        else:
            ids = [_str_arg(args, "item_id")]
        if not ids or len(ids) > MAX_ITEMS_PER_COMMAND:
            raise AdminFailed(f"give 1..{MAX_ITEMS_PER_COMMAND} item ids")
        reason = args.get("reason", "operator")
        if reason not in DEAD_LETTER_REASONS:
            raise AdminFailed(f"reason must be one of {list(DEAD_LETTER_REASONS)}")
        message = str(args.get("message", ""))[:300] or f"dead-lettered by {sess.peer_id}"
        now_ms = self.broker.clock.wall_ms()
        done = [i for i in ids if txn.dead_letter_ready(i, reason, message, now_ms)]
        return {"dead": done, "not_ready": [i for i in ids if i not in done], "reason": reason}

    def cmd_items_cancel(self, txn: LedgerTxn, batch: Batch, sess: Session, args: dict) -> dict[str, Any]:
        """``{"cancelled": [ids], "not_ready": {id: state}, "unknown": [ids], "more": bool}``:
        the same transition as a producer's CANCEL (only a ready item; a running one is its
        worker's to finish)."""
        more = False
        if isinstance(args.get("kind"), str) and "item_ids" not in args:
            kind = _str_arg(args, "kind")
            ids = txn.ready_ids(kind, MAX_ITEMS_PER_COMMAND + 1)
            more, ids = len(ids) > MAX_ITEMS_PER_COMMAND, ids[:MAX_ITEMS_PER_COMMAND]
        else:
            if not isinstance(args.get("item_ids"), str):
                raise AdminFailed("give 'item_ids' (comma-separated) or 'kind'")
            ids = [i for i in args["item_ids"].split(",") if i]
            if not ids or len(ids) > MAX_ITEMS_PER_COMMAND:
                raise AdminFailed(f"give 1..{MAX_ITEMS_PER_COMMAND} item ids")
        now_ms = self.broker.clock.wall_ms()
        message = f"cancelled by {sess.peer_id} (ccsq items cancel)"
        out: dict[str, Any] = {"cancelled": [], "not_ready": {}, "unknown": [], "more": more}
        for i in ids:
            if txn.dead_letter_ready(i, protocol.FailReason.CANCELLED.value, message, now_ms):
                out["cancelled"].append(i)
            else:
                rec = txn.get(i)
                if rec is None:
                    out["unknown"].append(i)
                else:
                    out["not_ready"][i] = rec["state"]
        if out["cancelled"]:
            batch.log("info", "items_cancelled", count=len(out["cancelled"]), by=sess.peer_id, first=out["cancelled"][0])
        return out

    def _worker_ids(self) -> list[str]:
        authorized = self.broker.authorized
        return sorted(i for i in authorized.ids() if (k := authorized.get(i)) is not None and k.role is protocol.Role.WORKER)[:20]

    def _dead_ids(self, txn: LedgerTxn, args: dict) -> tuple[list[str], bool]:
        if args.get("all") is True:
            recs = txn.dead_items(MAX_ITEMS_PER_COMMAND + 1)
            return [r["id"] for r in recs[:MAX_ITEMS_PER_COMMAND]], len(recs) > MAX_ITEMS_PER_COMMAND
        return [_str_arg(args, "item_id")], False


def _str_arg(args: dict, name: str) -> str:
    v = args.get(name)
    if not isinstance(v, str) or not v:
        raise AdminFailed(f"argument {name!r} (a non-empty string) is required")
    return v


def _ledger_full_advice() -> str:
    from ccsq.brokerd.actor import LEDGER_FULL_ADVICE  # the actor imports this module

    return LEDGER_FULL_ADVICE
