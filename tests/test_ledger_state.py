"""A hypothesis state machine over the ledger: submit, lease, complete, fail, expire,
ack, purge and reopen in any order; the balance equation and a simple model are
checked after every step."""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ccsq.brokerd.ledger import maintenance
from ccsq.brokerd.ledger.store import Ledger, Policy
from ccsq.common.wire import protocol

MAX_ATTEMPTS = 3
RETENTION_S = 5.0


def _blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ccsq-ledger-sm-"))
        self.ledger = self._open()
        self.now_ms = 1_000_000
        self.model: dict[str, dict] = {}  # item id -> {state, token, attempt, max}
        self.by_key: dict[str, str] = {}
        self.tokens_seen: dict[str, list[int]] = {}
        self.purged: set[str] = set()

    def _open(self) -> Ledger:
        policy = Policy(max_attempts=MAX_ATTEMPTS, retry_backoff_base_s=0.0, retention_s=RETENTION_S, dedup_window_s=1e6)
        return Ledger(self.dir, map_size_bytes=1 << 20, max_map_size_bytes=1 << 24, policy=policy, rng=random.Random(0))

    def teardown(self) -> None:
        self.ledger.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _tick(self) -> int:
        self.now_ms += 1_000
        return self.now_ms

    def _ids(self, state: str) -> list[str]:
        return sorted(i for i, m in self.model.items() if m["state"] == state)

    # --- rules ---
    @rule(key=st.sampled_from([f"k{i}" for i in range(12)]), kind=st.sampled_from(["a", "b"]), max_attempts=st.integers(0, 2))
    def submit(self, key: str, kind: str, max_attempts: int) -> None:
        txn = self.ledger.begin()
        r = txn.submit(protocol.SubmitItem(key, kind, _blob(key.encode()), max_attempts=max_attempts), self._tick())
        txn.commit()
        if key in self.by_key:
            assert r.duplicate and r.item_id == self.by_key[key]
        else:
            assert not r.duplicate and not r.error
            self.by_key[key] = r.item_id
            self.model[r.item_id] = {"state": "ready", "token": 0, "attempt": 0, "max": max_attempts or MAX_ATTEMPTS}

    @rule(limit=st.integers(1, 3), kind=st.sampled_from([None, "a", "b"]))
    def lease(self, limit: int, kind: str | None) -> None:
        now = self._tick()
        txn = self.ledger.begin()
        ids, _ = txn.scan_ready([kind] if kind else None, limit, now)
        tasks = [txn.lease(i, "w", now, 10_000) for i in ids]
        txn.commit()
        assert len(ids) == min(limit, sum(1 for i in self._ids("ready") if kind is None or txn_kind(self, i) == kind))
        for t in tasks:
            assert t is not None
            m = self.model[t.item_id]
            assert m["state"] == "ready" and t.token > max(self.tokens_seen.get(t.item_id, [0]))
            m.update(state="leased", token=t.token, attempt=m["attempt"] + 1)
            assert t.attempt == m["attempt"]
            self.tokens_seen.setdefault(t.item_id, []).append(t.token)

    @precondition(lambda self: self.tokens_seen)
    @rule(data=st.data())
    def complete(self, data) -> None:
        item_id = data.draw(st.sampled_from(sorted(self.tokens_seen)))
        self.complete_with(item_id, data.draw(st.sampled_from(self.tokens_seen[item_id])))

    @precondition(lambda self: self._stale())
    @rule(data=st.data())
    def complete_stale(self, data) -> None:
        """A late COMPLETE with a token older than the item's current one (an attempt that
        ran before the last lease): drawn on purpose, as a random token rarely is."""
        item_id = data.draw(st.sampled_from(self._stale()))
        self.complete_with(item_id, data.draw(st.sampled_from(self.tokens_seen[item_id][:-1])))

    def complete_with(self, item_id: str, token: int) -> None:
        m = self.model[item_id]
        txn = self.ledger.begin()
        out = txn.complete(protocol.TaskResult(item_id, token, _blob(b"r"), "h", "1"), self._tick(), "w")
        txn.commit()
        if item_id in self.purged:
            assert out == "unknown"
        elif m["state"] in ("completed", "acknowledged") and m.get("done_token") == token:
            assert out == "duplicate"
        elif m["token"] == token and (m["state"] == "leased" or m["state"] == "ready"):
            assert out == "accepted"
            m.update(state="completed", done_token=token)
        else:
            assert out == "fenced", (m, token)

    def _stale(self) -> list[str]:
        """Items ready or leased again after an earlier lease (they have a stale token, and
        its late report could still change them). Stale tokens of items done already are
        drawn by :meth:`complete`."""
        return sorted(i for i, ts in self.tokens_seen.items()
                      if len(ts) > 1 and self.model[i]["state"] in ("ready", "leased"))

    @precondition(lambda self: self._ids("leased"))
    @rule(data=st.data(), how=st.sampled_from(["handler_error", "released", "fatal"]))
    def fail(self, data, how: str) -> None:
        item_id = data.draw(st.sampled_from(self._ids("leased")))
        m = self.model[item_id]
        txn = self.ledger.begin()
        out = txn.fail(protocol.TaskFailure(item_id, m["token"], how, how != "fatal"), self._tick(), "w")
        txn.commit()
        assert out == "accepted"
        m["fail_token"] = m["token"]
        if how == "released":
            m.update(state="ready", attempt=m["attempt"] - 1)
        elif how == "fatal" or m["attempt"] >= m["max"]:
            m["state"] = "dead"
        else:
            m["state"] = "ready"

    @precondition(lambda self: self._stale())
    @rule(data=st.data(), how=st.sampled_from(["handler_error", "released", "fatal"]))
    def fail_stale(self, data, how: str) -> None:
        """A late FAIL from the same worker with a token older than the item's current one:
        fenced (a replay of the last accepted failure: duplicate); the item is unchanged."""
        item_id = data.draw(st.sampled_from(self._stale()))
        self.fail_with(item_id, data.draw(st.sampled_from(self.tokens_seen[item_id][:-1])), how)

    def fail_with(self, item_id: str, token: int, how: str) -> None:
        m = self.model[item_id]
        txn = self.ledger.begin()
        out = txn.fail(protocol.TaskFailure(item_id, token, how, how != "fatal"), self._tick(), "w")
        txn.commit()
        assert out == ("duplicate" if m.get("fail_token") == token else "fenced"), (m, token)

    @precondition(lambda self: self._ids("ready"))
    @rule(data=st.data(), cycles=st.integers(1, 3), end=st.sampled_from(["expire", "release"]),
          late=st.sampled_from(["", "complete", "fail"]))
    def lease_and_expire(self, data, cycles: int, end: str, late: str) -> None:
        """One ready item leased and its lease ended at once (expired, or given back
        unsent: attempt not counted), up to ``cycles`` times while it is ready again; then,
        if ``late``, the first attempt's COMPLETE or FAIL arrives late. A bias toward the
        lease / expire cycles that leave an item ready with stale tokens (a random walk
        over all the rules reached "ready again, first token reported" only at
        max_examples=400)."""
        item_id = data.draw(st.sampled_from(self._ids("ready")))
        for _ in range(cycles):
            if self.model[item_id]["state"] != "ready":
                break
            self.lease_and_expire_one(item_id, release=end == "release")
        tokens = self.tokens_seen.get(item_id, [])
        if late and len(tokens) > 1:
            if late == "complete":
                self.complete_with(item_id, tokens[0])
            else:
                self.fail_with(item_id, tokens[0], "fatal")

    def lease_and_expire_one(self, item_id: str, *, release: bool = False) -> None:
        m = self.model[item_id]
        now = self._tick()
        txn = self.ledger.begin()
        t = txn.lease(item_id, "w", now, 10_000)
        txn.commit()
        if t is None:  # not due yet (a backoff): nothing happened
            assert m["state"] == "ready"
            return
        assert t.token > max(self.tokens_seen.get(item_id, [0]))
        m.update(state="leased", token=t.token, attempt=m["attempt"] + 1)
        self.tokens_seen.setdefault(item_id, []).append(t.token)
        txn = self.ledger.begin()
        if release:
            assert txn.release(item_id, t.token, self._tick())
            txn.commit()
            m.update(state="ready", attempt=m["attempt"] - 1)
            return
        new = txn.expire_lease(item_id, t.token, self._tick())
        txn.commit()
        m["state"] = "dead" if m["attempt"] >= m["max"] else "ready"
        assert new == m["state"]

    @precondition(lambda self: self._ids("leased"))
    @rule(data=st.data())
    def expire(self, data) -> None:
        item_id = data.draw(st.sampled_from(self._ids("leased")))
        m = self.model[item_id]
        txn = self.ledger.begin()
        new = txn.expire_lease(item_id, m["token"], self._tick())
        txn.commit()
        m["state"] = "dead" if m["attempt"] >= m["max"] else "ready"
        assert new == m["state"]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def ack(self, data) -> None:
        item_id = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[item_id]
        txn = self.ledger.begin()
        out = txn.ack(item_id, self._tick())
        txn.commit()
        if m["state"] == "completed":
            assert out is True
            m["state"] = "acknowledged"
        elif m["state"] == "acknowledged" and item_id not in self.purged:
            assert out is False
        else:
            assert out is None

    @rule()
    def purge(self) -> None:
        self.now_ms += int(RETENTION_S * 1000) + 1
        txn = self.ledger.begin()
        maintenance.purge(txn, self.now_ms, 10_000)
        txn.commit()
        self.purged |= set(self._ids("acknowledged"))

    @rule()
    def reopen(self) -> None:
        self.ledger.close()
        self.ledger = self._open()

    # --- invariants ---
    @invariant()
    def balanced_and_matches_model(self) -> None:
        with self.ledger.read() as v:
            states = v.states()
            assert v.counter("received") == sum(states.values()) == len(self.model)
            for s in ("ready", "leased", "completed", "acknowledged", "dead"):
                assert states[s] == len(self._ids(s)), (s, states)
            leased = {i: t for i, t, _w in v.leased_items()}
            assert leased == {i: self.model[i]["token"] for i in self._ids("leased")}


def txn_kind(machine: LedgerMachine, item_id: str) -> str:
    with machine.ledger.read() as v:
        return v.get(item_id)["kind"]


LedgerMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLedgerStateMachine = LedgerMachine.TestCase


def test_stale_tokens_after_two_lease_expire_cycles() -> None:
    """The steps the machine must find within its budget, spelled out: lease, expire,
    lease, expire, then a COMPLETE and a FAIL with the first token (fenced, the item
    still ready with the second), then the second token's late result (accepted)."""
    m = LedgerMachine()
    try:
        m.submit(key="k0", kind="a", max_attempts=0)
        (item_id,) = m.model
        for _ in range(2):
            m.lease_and_expire_one(item_id)
            m.balanced_and_matches_model()
        first, second = m.tokens_seen[item_id]
        m.complete_with(item_id, first)
        m.balanced_and_matches_model()
        assert m.model[item_id]["state"] == "ready"
        txn = m.ledger.begin()
        assert txn.fail(protocol.TaskFailure(item_id, first, "fatal", False), m._tick(), "w") == "fenced"
        txn.commit()
        m.complete_with(item_id, second)
        m.balanced_and_matches_model()
        assert m.model[item_id]["state"] == "completed"
    finally:
        m.teardown()
