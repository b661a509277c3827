"""Planted defects: each is the broker's real code with one rule broken, switched on by
``python -m tests.sim --plant NAME``; the simulation must find every one within its
default budget (``__main__.PLANT_SEEDS`` x ``PLANT_ITEMS``; tests/test_sim.py checks a few
in CI and, marked soak, every one; docs/simulation.md lists what each needed).

A plant rewrites one line of the real method's source (:func:`_rewrite`), so it breaks
exactly the rule it names and fails loudly if that line ever changes (update the plant
with the code). :func:`apply` returns a function that undoes it.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable

from ccsq.brokerd import actor as actor_mod
from ccsq.brokerd import delivery as delivery_mod
from ccsq.brokerd import relaying as relaying_mod
from ccsq.brokerd.ledger import rules as rules_mod
from ccsq.brokerd.ledger import store as store_mod
from ccsq.common.wire import federation as fed_mod


def _rewrite(cls: type, name: str, old: str, new: str) -> Callable[[], None]:
    """Replace ``cls.name`` by its own source with ``old`` -> ``new`` (exactly once), compiled in
    its module's namespace. Returns the undo."""
    fn = cls.__dict__[name]
    src = textwrap.dedent(inspect.getsource(fn))
    if src.count(old) != 1:
        raise RuntimeError(f"plant: {cls.__name__}.{name} no longer contains {old!r} exactly once: update tests/sim/plants.py")
    module = inspect.getmodule(fn)
    ns: dict = {}
    exec(compile(src.replace(old, new), f"<plant {cls.__name__}.{name}>", "exec"), module.__dict__, ns)
    setattr(cls, name, ns[name])
    return lambda: setattr(cls, name, fn)


def _rewrite_fn(module, name: str, old: str, new: str) -> Callable[[], None]:
    """:func:`_rewrite` for a module-level function (callers look it up in its module at each call)."""
    fn = getattr(module, name)
    src = textwrap.dedent(inspect.getsource(fn))
    if src.count(old) != 1:
        raise RuntimeError(f"plant: {module.__name__}.{name} no longer contains {old!r} exactly once: update tests/sim/plants.py")
    ns: dict = {}
    exec(compile(src.replace(old, new), f"<plant {module.__name__}.{name}>", "exec"), module.__dict__, ns)
    setattr(module, name, ns[name])
    return lambda: setattr(module, name, fn)


def _sim_relay():
    from tests.sim import relay

    return relay.SimRelay


T = rules_mod.LedgerTxn

#: name -> (what it breaks, how to plant it)
PLANTS: dict[str, tuple[str, Callable[[], Callable[[], None]]]] = {
    "skip_fencing": (
        "LedgerTxn.complete accepts a result whatever its token (the fencing check removed)",
        lambda: _rewrite(T, "complete", 'if ((st == _LEASED and rec["token"] == res.token) or late) and not self._not_holder(rec, sender):',
                         'if st in (_LEASED, _READY):'),
    ),
    "stale_fail": (
        "LedgerTxn.fail accepts a FAIL with a stale token from the worker that holds the item again (token check removed)",
        lambda: _rewrite(T, "fail", 'if rec["state"] != _LEASED or rec["token"] != f.token or self._not_holder(rec, sender):',
                         'if rec["state"] != _LEASED or self._not_holder(rec, sender):'),
    ),
    "late_old_token": (
        "a late COMPLETE with an older token is accepted while the item is ready again (lease, expire, lease, expire, complete)",
        lambda: _rewrite(T, "complete", 'late = st == _READY and rec["token"] == res.token and res.token != 0',
                         'late = st == _READY and res.token != 0'),
    ),
    "count_attempt_twice": (
        "LedgerTxn.lease counts an attempt twice",
        lambda: _rewrite(T, "lease", 'rec["attempt"] += 1', 'rec["attempt"] += 2'),
    ),
    "no_dedup": (
        "LedgerTxn.submit forgets the idempotency key (a re-sent SUBMIT makes a second item)",
        lambda: _rewrite(T, "submit", "if found is not None:\n", "if False:\n"),
    ),
    "no_gap_event": (
        "LedgerTxn.expire_lease requeues an item without its G2 event",
        lambda: _rewrite(T, "expire_lease", "self.event(gaps.G2_LEASE_EXPIRED,", "(lambda *a: None)(gaps.G2_LEASE_EXPIRED,"),
    ),
    "resubmit_counted": (
        "LedgerTxn.submit counts a re-sent (duplicate) SUBMIT as received (the accounting equation drifts)",
        lambda: _rewrite(T, "submit", 'self.bump("duplicate_submits")', 'self.bump("duplicate_submits"); self.bump("received")'),
    ),
    "forget_redelivery": (
        "DeliveryTracker.session_ended forgets the redeliveries owed when a completion session ends",
        lambda: _rewrite(delivery_mod.DeliveryTracker, "session_ended", "if self._sent_to.get(item_id) == peer_id:", "if False:"),
    ),
    "lose_lease_timers": (
        "Broker._recover does not restore the lease timers of leased items at a restart",
        lambda: _rewrite(actor_mod.Broker, "_recover", "self.leases.add(item_id, token, worker, expires)", "pass"),
    ),
    "hello_replay_after_restart": (
        "Broker._recover does not load the HELLOs accepted before a restart into the replay guard (a replayed HELLO is taken for new)",
        lambda: _rewrite(actor_mod.Broker, "_recover", "self.codec.restore_hellos(hellos)", "pass"),
    ),
    "confirm_before_fsync": (
        "Broker._transact sends the turn's replies before the commit (and its fsync)",
        lambda: _rewrite(actor_mod.Broker, "_transact", "        if txn.changed:\n",
                         "        for rid, msg in batch.replies:\n            self._send(rid, msg)\n"
                         "        batch.replies = []\n        if txn.changed:\n"),
    ),
    "ledger_no_sync": (
        "the ledger's LMDB environment is opened with sync=False (commits not fsynced)",
        lambda: _rewrite(store_mod.Ledger, "_open_env", "\n        sync=True,", "\n        sync=False,"),
    ),
    "origin_unchecked": (
        "the downstream broker does not verify a relayed item's origin signature (common/wire/federation.py check_origin)",
        lambda: _rewrite_fn(fed_mod, "check_origin", "key.verify(item.origin_sig, item.origin)", "pass"),
    ),
    "no_f1_event": (
        "Relaying.note_lease_lost writes no F1 event when a relay's lease expires upstream",
        lambda: _rewrite(relaying_mod.Relaying, "note_lease_lost", "txn.event(gaps.F1_RELAY_LEASE_LOST,",
                         "(lambda *a: None)(gaps.F1_RELAY_LEASE_LOST,"),
    ),
    "routes_lost_at_restart": (
        "DeliveryTracker.recover_routes forgets at a restart which completed items are owed to a relay "
        "(their results go to the downstream's completion service)",
        lambda: _rewrite(delivery_mod.DeliveryTracker, "recover_routes", 'if rec is not None and rec.get("reply_to"):',
                         "if False:"),
    ),
    "purged_origin_taken": (
        "LedgerTxn.submit answers a relayed item whose earlier copy was purged as a dedup hit (the relay is then "
        "refused ORIGIN_KEY_TAKEN; the defect the simulation found)",
        lambda: _rewrite(T, "submit", "purged = origin is not None and self.record(item_id) is None", "purged = False"),
    ),
    "relay_ack_before_confirm": (
        "the simulated relay ACKs a downstream RESULT once it sent the COMPLETE, before the upstream confirmed it",
        lambda: _rewrite(_sim_relay(), "_ack", "all(r.state == RETURNED for r in", "all(r.state in (RESULTED, RETURNED) for r in"),
    ),
    "relay_send_before_journal": (
        "the simulated relay sends each step's message before its journal write is fsynced (synced at the next tick)",
        lambda: _rewrite(_sim_relay(), "_write", "\n    fn()", "\n    self.unsynced.append((keys, fn))"),
    ),
}


#: plants of the relay (a federated world; their default budget is ``__main__.RELAY_PLANT_SEEDS``)
RELAY_PLANTS = ("origin_unchecked", "no_f1_event", "routes_lost_at_restart", "purged_origin_taken",
                "relay_ack_before_confirm", "relay_send_before_journal")


def apply(name: str) -> Callable[[], None]:
    """Switch plant ``name`` on; returns its undo. KeyError for an unknown name."""
    return PLANTS[name][1]()
