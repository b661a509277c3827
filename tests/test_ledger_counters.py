"""The ledger's flow counters and per-state counts are kept per transaction and folded into
meta when read or at commit (rules.py ``LedgerTxn.bump`` / ``_move``): over a random sequence
of turns (submit, duplicate submit, lease, complete, late and fenced complete, fail, release,
lease expiry, ack) they must equal what a per-operation count of the outcomes says, read in
the middle of a turn and after every commit, and the state indexes must hold exactly the
items in each state."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path

from ccsq.brokerd.ledger import schema
from ccsq.brokerd.ledger.store import Ledger, Policy
from ccsq.common.wire import protocol

S = protocol.ItemState
RESULT = protocol.Blob(hashlib.sha256(b"ok").hexdigest(), 2, b"ok")


def _item(key: str, kind: str) -> protocol.SubmitItem:
    data = key.encode()
    return protocol.SubmitItem(key, kind, protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data))


def _indexed(ledger: Ledger) -> dict[str, set[str]]:
    """Item ids per state as the state indexes hold them."""
    out: dict[str, set[str]] = {}
    with ledger.read() as view:
        txn, db = view.txn, ledger.db
        out[S.READY.value] = {v.decode() for _k, v in txn.cursor(db=db["ready"])}
        out[S.LEASED.value] = {k.decode() for k, _v in txn.cursor(db=db["leased"])}
        out[S.COMPLETED.value] = {v.decode() for _k, v in txn.cursor(db=db["completed"])}
        out[S.DEAD.value] = {k.decode() for k, _v in txn.cursor(db=db["dead"])}
        out[S.ACKNOWLEDGED.value] = {schema.parse_timed(k)[1].decode() for k, _v in txn.cursor(db=db["acked"])}
    return out


def test_counters_folded_per_turn_equal_a_count_per_operation(tmp_path: Path) -> None:
    rng = random.Random(24)
    policy = Policy(max_attempts=2, retry_backoff_base_s=0.0, dedup_window_s=1e6)
    ledger = Ledger(tmp_path / "ledger", map_size_bytes=1 << 22, policy=policy, rng=random.Random(0))
    ledger.cache_records(64)  # the broker's record cache on (small: records go in and out of it)
    want: Counter[str] = Counter()
    state: dict[str, tuple[str, str]] = {}  # item id -> (kind, state)
    tokens: dict[str, int] = {}  # item id -> its latest token
    keys: list[str] = []
    now_ms = 1_000_000
    try:
        for _turn in range(120):
            now_ms += 10
            txn = ledger.begin()
            for _op in range(rng.randint(1, 12)):
                ids = {st: [i for i, (_k, s) in state.items() if s == st] for st in (
                    S.READY.value, S.LEASED.value, S.COMPLETED.value)}
                op = rng.choice(["submit", "submit", "dup", "lease", "lease", "complete", "complete", "late", "fenced",
                                 "fail", "release", "expire", "ack", "ack"])
                if op == "submit" or (op == "dup" and not keys):
                    key, kind = f"key-{len(keys)}", rng.choice(["a", "b"])
                    r = txn.submit(_item(key, kind), now_ms)
                    assert not r.duplicate and not r.error
                    keys.append(key)
                    state[r.item_id] = (kind, S.READY.value)
                    want["received"] += 1
                elif op == "dup":
                    r = txn.submit(_item(rng.choice(keys), "a"), now_ms)
                    assert r.duplicate
                    want["duplicate_submits"] += 1
                elif op == "lease" and ids[S.READY.value]:
                    item_id = rng.choice(ids[S.READY.value])
                    task = txn.lease(item_id, "w1", now_ms, 60_000)
                    assert task is not None
                    tokens[item_id] = task.token
                    state[item_id] = (state[item_id][0], S.LEASED.value)
                    want["routed"] += 1
                elif op in ("complete", "late") and ids[S.LEASED.value]:
                    item_id = rng.choice(ids[S.LEASED.value])
                    if op == "late":  # its lease expired (ready again, same token), then the result comes
                        assert txn.expire_lease(item_id, tokens[item_id], now_ms) in (S.READY.value, S.DEAD.value)
                        after = txn.record(item_id)["state"]  # type: ignore[index]
                        want["retried" if after == S.READY.value else "dead"] += 1
                        state[item_id] = (state[item_id][0], after)
                        if after == S.DEAD.value:
                            continue
                        want["late_results_accepted"] += 1
                    res = protocol.TaskResult(item_id, tokens[item_id], RESULT, "echo", "1")
                    assert txn.complete(res, now_ms, "w1") == protocol.Outcome.ACCEPTED.value
                    state[item_id] = (state[item_id][0], S.COMPLETED.value)
                    want["completed"] += 1
                elif op == "fenced" and tokens:
                    item_id = rng.choice(sorted(tokens))
                    res = protocol.TaskResult(item_id, tokens[item_id] + 1000, RESULT, "echo", "1")
                    assert txn.complete(res, now_ms, "w1") == protocol.Outcome.FENCED.value
                    want["fenced_completions"] += 1
                elif op == "fail" and ids[S.LEASED.value]:
                    item_id = rng.choice(ids[S.LEASED.value])
                    f = protocol.TaskFailure(item_id, tokens[item_id], protocol.FailReason.HANDLER_ERROR.value, True, "boom")
                    assert txn.fail(f, now_ms, "w1") == protocol.Outcome.ACCEPTED.value
                    after = txn.record(item_id)["state"]  # type: ignore[index]
                    want["failed"] += 1
                    want["retried" if after == S.READY.value else "dead"] += 1
                    state[item_id] = (state[item_id][0], after)
                elif op == "release" and ids[S.LEASED.value]:
                    item_id = rng.choice(ids[S.LEASED.value])
                    assert txn.release(item_id, tokens[item_id], now_ms)
                    state[item_id] = (state[item_id][0], S.READY.value)
                    want["released"] += 1
                elif op == "expire" and ids[S.LEASED.value]:
                    item_id = rng.choice(ids[S.LEASED.value])
                    after = txn.expire_lease(item_id, tokens[item_id], now_ms)
                    want["retried" if after == S.READY.value else "dead"] += 1
                    state[item_id] = (state[item_id][0], after)
                elif op == "ack" and ids[S.COMPLETED.value]:
                    item_id = rng.choice(ids[S.COMPLETED.value])
                    assert txn.ack(item_id, now_ms) is True
                    assert txn.ack(item_id, now_ms) is False  # idempotent: counted once
                    state[item_id] = (state[item_id][0], S.ACKNOWLEDGED.value)
                    want["acknowledged"] += 1
                if rng.random() < 0.3:  # read in the middle of a turn: what it did so far counts
                    name = rng.choice(schema.COUNTERS)
                    assert txn.counter(name) == want[name], name
                    per_state = Counter(s for _k, s in state.values())
                    st = rng.choice(schema.STATES)
                    assert txn.state_count(st) == per_state[st], st
            txn.commit()
            with ledger.read() as view:
                got = view.counters()
                assert {k: v for k, v in got.items() if v} == dict(+want)
                assert view.states() == {s: n for s, n in Counter(s for _k, s in state.values()).items()} | {
                    s: 0 for s in schema.STATES if s not in {s for _k, s in state.values()}}
                per_kind: dict[str, Counter[str]] = {}
                for kind, s in state.values():
                    per_kind.setdefault(kind, Counter())[s] += 1
                assert view.kind_states() == {k: dict(c) for k, c in per_kind.items()}
                assert view.balanced()
            indexed = _indexed(ledger)
            for st, members in indexed.items():
                assert members == {i for i, (_k, s) in state.items() if s == st}, st
        assert want["late_results_accepted"] and want["acknowledged"] and want["fenced_completions"]
    finally:
        ledger.close()
