"""ADMIN commands answered by the broker actor (inside the turn's transaction).

Each command is a method ``cmd_<name>(txn, batch, args) -> dict`` returning a
JSON-like document; the reply is ``AdminReply(req, ok, body=msgpack(doc))``.
Unknown commands and bad arguments give ``ok=False`` with ``error``. To add a
command, add a method; :attr:`AdminCommands.COMMANDS` lists them.

Commands: ``status``; ``items_show`` (``item_id``); ``dlq_list`` (``limit``);
``dlq_replay`` (``item_id``, or ``all=true``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgpack

from ccsq.common import protocol as p
from ccsq.common.errors import CcsqError

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.actor import Batch, Broker
    from ccsq.brokerd.ledger import LedgerTxn
    from ccsq.brokerd.peers import Session

LEASES_LISTED_PER_PEER = 100


class AdminError(CcsqError):
    """A bad admin request; the message says which argument."""

    code = "ADMIN"


class AdminCommands:
    COMMANDS = ("status", "items_show", "dlq_list", "dlq_replay")

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def handle(self, txn: LedgerTxn, batch: Batch, sess: Session, msg: p.Admin) -> p.AdminReply:
        if msg.command not in self.COMMANDS:
            return p.AdminReply(msg.req, False, error=f"unknown command {msg.command!r}; known: {list(self.COMMANDS)}")
        try:
            doc = getattr(self, f"cmd_{msg.command}")(txn, batch, msg.args)
        except AdminError as exc:
            return p.AdminReply(msg.req, False, error=str(exc))
        return p.AdminReply(msg.req, True, body=msgpack.packb(doc, use_bin_type=True))

    # --- commands ---
    def cmd_status(self, txn: LedgerTxn, batch: Batch, args: dict) -> dict[str, Any]:
        b = self.broker
        now = time.monotonic()
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
                    "busy": s.busy,
                    "done": s.done,
                    "info": s.info,
                    "leases": len(held),
                    "lease_list": [
                        {"item_id": lz.item_id, "token": lz.token, "expires_in_s": round(lz.expires_mono - now, 3)}
                        for lz in held[:LEASES_LISTED_PER_PEER]
                    ],
                    "in_flight": len(s.in_flight),
                    "pending_sends": len(s.pending),
                    "connected_s": round(now - s.connected_mono, 3),
                    "last_seen_s": round(now - s.last_recv_mono, 3),
                }
            )
        oldest = txn.oldest_ready_created_ms()
        states = txn.states()
        counters = txn.counters()
        return {
            "broker": {
                "peer_id": b.cfg.peer_id,
                "epoch": b.epoch,
                "ledger_id": b.ledger.ledger_id,
                "endpoint": b.transport.endpoint,
                "uptime_s": round(now - b._started_mono, 3),  # noqa: SLF001 - the actor's own field
            },
            "peers": peers,
            "backlog": txn.kind_states(),
            "oldest_ready_age_s": None if oldest is None else round(time.time() - oldest / 1000.0, 3),
            "counters": counters,
            "states": states,
            "balanced": counters["received"] == sum(states.values()),
            "gaps": txn.gap_counts(),
            "rejects": dict(b.rejects),
            "send": {"again": b.transport.sent_again, "unroutable": b.transport.sent_unroutable},
            "ledger": {
                "map_size_bytes": b.ledger.map_size_bytes(),
                "max_map_size_bytes": b.ledger.max_map_size_bytes,
                "used_bytes": b.ledger.used_bytes(txn.txn),
            },
            "leases_in_memory": len(b.leases),
            "in_flight_deliveries": len(b.delivered),
        }

    def cmd_items_show(self, txn: LedgerTxn, batch: Batch, args: dict) -> dict[str, Any]:
        item_id = _str_arg(args, "item_id")
        rec = txn.get(item_id)
        if rec is None:
            raise AdminError(f"no item {item_id!r}")
        lease = self.broker.leases.get(item_id)
        return {"item": rec, "lease_in_memory": None if lease is None else {"token": lease.token, "worker": lease.worker}}

    def cmd_dlq_list(self, txn: LedgerTxn, batch: Batch, args: dict) -> dict[str, Any]:
        limit = args.get("limit", 100)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise AdminError("limit must be an integer 1..10000")
        return {"items": txn.dead_items(limit)}

    def cmd_dlq_replay(self, txn: LedgerTxn, batch: Batch, args: dict) -> dict[str, Any]:
        now_ms = int(time.time() * 1000)
        if args.get("all") is True:
            ids = [rec["id"] for rec in txn.dead_items(10_000)]
        else:
            ids = [_str_arg(args, "item_id")]
        replayed = [i for i in ids if txn.replay_dead(i, now_ms)]
        if replayed:
            batch.effects.append(self.broker._wake_dispatch)  # noqa: SLF001
        return {"replayed": replayed, "not_dead": [i for i in ids if i not in replayed]}


def _str_arg(args: dict, name: str) -> str:
    v = args.get(name)
    if not isinstance(v, str) or not v:
        raise AdminError(f"argument {name!r} (a non-empty string) is required")
    return v
