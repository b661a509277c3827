"""Ledger unit tests on real LMDB files (no broker process)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import lmdb
import pytest

from ccsq.brokerd import gaps
from ccsq.brokerd.ledger import maintenance, schema
from ccsq.brokerd.ledger.rules import backoff_ms
from ccsq.brokerd.ledger.store import FULL_MODES, Ledger, LedgerError, Policy
from ccsq.common.wire import protocol

S = protocol.ItemState
ACCEPTED, FENCED = protocol.Outcome.ACCEPTED.value, protocol.Outcome.FENCED.value


def blob(data: bytes = b"x") -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def item(key: str, kind: str = "echo", **kw) -> protocol.SubmitItem:
    return protocol.SubmitItem(key, kind, blob(key.encode()), **kw)


def open_ledger(path: Path, **policy) -> Ledger:
    return Ledger(path, map_size_bytes=1 << 20, max_map_size_bytes=8 << 20, policy=Policy(**policy), rng=random.Random(7))


@pytest.fixture
def ledger(tmp_path):
    led = open_ledger(tmp_path / "l", retry_backoff_base_s=0.0, max_attempts=3)
    yield led
    led.close()


def submit(led: Ledger, *items: protocol.SubmitItem, now_ms: int = 1_000) -> list[protocol.SubmitResult]:
    txn = led.begin()
    out = [txn.submit(i, now_ms) for i in items]
    txn.commit()
    return out


def lease_all(led: Ledger, worker: str = "w1", now_ms: int = 2_000, kinds=None, limit: int = 100) -> list[protocol.Task]:
    txn = led.begin()
    ids, _ = txn.scan_ready(kinds, limit, now_ms)
    tasks = [t for t in (txn.lease(i, worker, now_ms, 5_000) for i in ids) if t]
    txn.commit()
    return tasks


def check_balance(led: Ledger) -> dict:
    with led.read() as v:
        assert v.balanced(), (v.counters(), v.states())
        return v.states()


def test_submit_dedup_and_dedup_window(tmp_path):
    led = open_ledger(tmp_path / "l", dedup_window_s=10.0)
    a, b = submit(led, item("k1"), item("k1"))
    assert not a.duplicate and b.duplicate and b.item_id == a.item_id
    (c,) = submit(led, item("k1"), now_ms=1_000 + 11_000)  # window passed: a new item, G5
    assert not c.duplicate and c.item_id != a.item_id
    with led.read() as v:
        assert v.counter("received") == 2 and v.counter("duplicate_submits") == 1
        assert v.gap_counts()[gaps.G5_DEDUP_WINDOW_PASSED] == 1
        assert v.gap_counts()[gaps.G9_SUBMIT_RETRIED] == 1
    check_balance(led)
    led.close()


def test_bad_items_are_refused_without_a_record(ledger):
    res = submit(ledger, item("k", kind=""), item("k2", kind="a\0b"), item("k3", priority=1 << 40), item("", kind="x"))
    assert [r.error for r in res] == ["MALFORMED"] * 4
    (late,) = submit(ledger, item("k4", deadline_ts=0.5), now_ms=1_000)
    assert late.error == "DEADLINE_EXCEEDED"
    assert check_balance(ledger)["ready"] == 0


def test_dispatch_order_priority_then_not_before_then_arrival(ledger):
    ids = [r.item_id for r in submit(ledger, item("a"), item("b", priority=5), item("c"), item("d", priority=5))]
    tasks = lease_all(ledger, limit=10)
    assert [t.item_id for t in tasks] == [ids[1], ids[3], ids[0], ids[2]]
    assert all(t.attempt == 1 for t in tasks)
    assert len({t.token for t in tasks}) == 4 and sorted(t.token for t in tasks) == [t.token for t in tasks]


def test_kinds_filter_and_backoff_skip(tmp_path):
    led = open_ledger(tmp_path / "l", retry_backoff_base_s=10.0, max_attempts=5)
    submit(led, item("a", kind="ocr"), item("b", kind="echo"))
    (t,) = lease_all(led, kinds=["ocr"])
    txn = led.begin()
    assert txn.expire_lease(t.item_id, t.token, 3_000) == S.READY.value
    rec = txn.get(t.item_id)
    assert 3_000 <= rec["nb_ms"] <= 3_000 + 10_000
    ids, hint = txn.scan_ready(["ocr"], 10, 3_000)
    if rec["nb_ms"] > 3_000:
        assert ids == [] and hint == rec["nb_ms"]  # backing off: skipped, with a wake-up hint
    ids, _ = txn.scan_ready(["ocr"], 10, rec["nb_ms"])
    assert ids == [t.item_id]
    txn.commit()
    check_balance(led)
    led.close()


def test_backoff_is_capped_full_jitter():
    pol = Policy(retry_backoff_base_s=0.5, retry_backoff_max_s=4.0)
    rng = random.Random(1)
    assert all(0 <= backoff_ms(1, pol, rng) <= 500 for _ in range(100))
    assert all(0 <= backoff_ms(20, pol, rng) <= 4000 for _ in range(100))
    assert max(backoff_ms(20, pol, rng) for _ in range(200)) > 2000


def test_complete_accept_duplicate_fenced_and_late(ledger):
    """C04 at the ledger level: the first valid completion wins, a replay is a
    duplicate, a stale token is fenced (G4)."""
    (r,) = submit(ledger, item("k"))
    (t1,) = lease_all(ledger, "A")
    txn = ledger.begin()
    assert txn.expire_lease(t1.item_id, t1.token, 3_000) == S.READY.value
    txn.commit()
    (t2,) = lease_all(ledger, "B", now_ms=4_000)
    assert t2.attempt == 2 and t2.token > t1.token
    txn = ledger.begin()
    res = lambda t: protocol.TaskResult(t.item_id, t.token, blob(b"r"), "echo", "1")  # noqa: E731
    assert txn.complete(res(t1), 5_000) == FENCED
    assert txn.complete(res(t2), 5_000) == ACCEPTED
    assert txn.complete(res(t2), 5_001) == protocol.Outcome.DUPLICATE.value
    assert txn.complete(res(t1), 5_002) == FENCED
    assert txn.complete(protocol.TaskResult("nope", 1, blob(), "echo", "1"), 5_002) == protocol.Outcome.UNKNOWN.value
    txn.commit()
    with ledger.read() as v:
        assert v.counter("completed") == 1 and v.counter("fenced_completions") == 2
        assert v.gap_counts()[gaps.G4_FENCED_COMPLETION] == 2
        assert v.item_status(r.item_id).result == blob(b"r")
    check_balance(ledger)


def test_late_result_after_expiry_accepted_when_nobody_holds_it(ledger):
    submit(ledger, item("k"))
    (t,) = lease_all(ledger)
    txn = ledger.begin()
    txn.expire_lease(t.item_id, t.token, 3_000)
    assert txn.complete(protocol.TaskResult(t.item_id, t.token, blob(), "echo", "1"), 3_100) == ACCEPTED
    txn.commit()
    with ledger.read() as v:
        assert v.get(t.item_id)["state"] == S.COMPLETED.value
        assert v.gap_counts()[gaps.G8_LATE_RESULT_ACCEPTED] == 1
    assert check_balance(ledger)["ready"] == 0


def _expire(led: Ledger, t: protocol.Task, now_ms: int) -> None:
    txn = led.begin()
    assert txn.expire_lease(t.item_id, t.token, now_ms) == S.READY.value
    txn.commit()


@pytest.mark.parametrize("reason", ["fatal", "handler_error", "released", "store_unavailable", "payload_missing"])
def test_a_stale_fail_from_the_same_worker_leaves_its_new_lease_alone(ledger, reason):
    """w1's lease expires and the item is leased to w1 again; a FAIL that w1 sends late for
    its first attempt (the old token) is fenced, whatever its reason: the new attempt stays
    leased with its own token and completes, never killed, requeued or dead-lettered by the
    old report. (Found by no test before: with the token check in LedgerTxn.fail removed,
    the holder check alone lets the same worker's stale token through.)"""
    (r,) = submit(ledger, item("k"))
    (t1,) = lease_all(ledger, "w1", now_ms=2_000)
    _expire(ledger, t1, 8_000)
    (t2,) = lease_all(ledger, "w1", now_ms=9_000)
    assert t2.token > t1.token and t2.attempt == 2
    txn = ledger.begin()
    for sender in ("w1", ""):  # from the holder itself, and with the sender unknown
        late = protocol.TaskFailure(t1.item_id, t1.token, reason, reason != "fatal", "late report of attempt 1")
        assert txn.fail(late, 9_100, sender) == FENCED
    rec = txn.get(r.item_id)
    assert (rec["state"], rec["token"], rec["attempt"], rec["worker"]) == (S.LEASED.value, t2.token, 2, "w1")
    assert txn.complete(protocol.TaskResult(t2.item_id, t2.token, blob(b"r2"), "echo", "1"), 9_200, "w1") == ACCEPTED
    txn.commit()
    with ledger.read() as v:
        assert v.counter("fenced_failures") == 2 and v.counter("failed") == 0 and v.counter("dead") == 0
        assert v.item_status(r.item_id).result == blob(b"r2")
        assert v.gap_counts()[gaps.G7_DEAD_LETTERED] == 0
    check_balance(ledger)


def test_a_late_complete_with_an_older_token_is_fenced_while_ready_again(ledger):
    """Lease, expire, lease, expire, then a COMPLETE with the *first* token: the item is
    ready again but its token is the second one, so the first is stale (another attempt
    ran since) and is fenced (G4), from the same worker too; only the second token's late
    result is accepted (G8). (The hypothesis state machine found an older token accepted
    here only at max_examples=400.)"""
    (r,) = submit(ledger, item("k"))
    (t1,) = lease_all(ledger, "w1", now_ms=2_000)
    _expire(ledger, t1, 8_000)
    (t2,) = lease_all(ledger, "w1", now_ms=9_000)
    _expire(ledger, t2, 15_000)
    res = lambda t, data: protocol.TaskResult(t.item_id, t.token, blob(data), "echo", "1")  # noqa: E731
    txn = ledger.begin()
    for sender in ("w1", ""):
        assert txn.complete(res(t1, b"attempt 1"), 15_100, sender) == FENCED
    rec = txn.get(r.item_id)
    assert (rec["state"], rec["token"]) == (S.READY.value, t2.token)
    assert txn.complete(res(t2, b"attempt 2"), 15_200, "w1") == ACCEPTED
    assert txn.complete(res(t1, b"attempt 1"), 15_300, "w1") == FENCED
    txn.commit()
    with ledger.read() as v:
        assert v.item_status(r.item_id).result == blob(b"attempt 2")
        assert v.get(r.item_id)["completed_token"] == t2.token
        assert v.counter("fenced_completions") == 3 and v.counter("late_results_accepted") == 1
        assert v.gap_counts()[gaps.G4_FENCED_COMPLETION] == 3 and v.gap_counts()[gaps.G8_LATE_RESULT_ACCEPTED] == 1
    check_balance(ledger)


def test_fail_variants(ledger):
    submit(ledger, item("r"), item("rel"), item("fatal"))
    tasks = {t.item_id: t for t in lease_all(ledger)}
    ids = list(tasks)
    txn = ledger.begin()
    f = lambda t, reason, retry: protocol.TaskFailure(t.item_id, t.token, reason, retry, "boom")  # noqa: E731
    assert txn.fail(f(tasks[ids[0]], "handler_error", True), 3_000) == "accepted"
    assert txn.fail(f(tasks[ids[0]], "handler_error", True), 3_000) == "duplicate"
    assert txn.fail(f(tasks[ids[1]], "released", True), 3_000) == "accepted"
    assert txn.fail(f(tasks[ids[2]], "fatal", False), 3_000) == "accepted"
    r0, r1, r2 = (txn.get(i) for i in ids)
    assert (r0["state"], r0["attempt"]) == ("ready", 1)
    assert (r1["state"], r1["attempt"]) == ("ready", 0)  # released: attempt not counted
    assert (r2["state"], r2["error"]) == ("dead", "fatal")
    txn.commit()
    with ledger.read() as v:
        c = v.counters()
        assert (c["failed"], c["retried"], c["released"], c["dead"]) == (2, 1, 1, 1)
    check_balance(ledger)


def test_attempts_survive_reopen_and_dead_letter_worker_lost(tmp_path):
    """C07b at the ledger level: the attempt count lives in the record."""
    path = tmp_path / "l"
    led = open_ledger(path, max_attempts=5, retry_backoff_base_s=0.0)
    (r,) = submit(led, item("poison", max_attempts=2))
    for n in (1, 2):
        (t,) = lease_all(led, now_ms=2_000 * n)
        assert t.attempt == n
        led.close()
        led = open_ledger(path, max_attempts=5, retry_backoff_base_s=0.0)
        with led.read() as v:
            assert list(v.leased_items()) == [(r.item_id, t.token, "w1")]
        txn = led.begin()
        state = txn.expire_lease(t.item_id, t.token, 2_000 * n + 1)
        txn.commit()
    assert state == S.DEAD.value
    with led.read() as v:
        rec = v.get(r.item_id)
        assert (rec["error"], rec["attempt"]) == ("worker_lost", 2)
        assert v.gap_counts()[gaps.G7_DEAD_LETTERED] == 1 and v.gap_counts()[gaps.G2_LEASE_EXPIRED] == 1
    txn = led.begin()
    assert txn.replay_dead(r.item_id, 9_000)
    txn.commit()
    assert check_balance(led)["ready"] == 1
    led.close()


def test_deadline_expiry_scan(ledger):
    (a, b) = submit(ledger, item("a", deadline_ts=5.0), item("b", deadline_ts=50.0))
    txn = ledger.begin()
    maintenance.expire_deadlines(txn, 6_000, 100)
    txn.commit()
    with ledger.read() as v:
        assert v.get(a.item_id)["state"] == S.EXPIRED.value and v.get(b.item_id)["state"] == S.READY.value
        assert v.gap_counts()[gaps.G6_DEADLINE_EXPIRED] == 1
    # a ready item past its deadline is expired when a dispatch scan reaches it, never leased
    assert lease_all(ledger, now_ms=60_000) == []
    assert check_balance(ledger)["expired"] == 2


def test_ack_idempotent_and_purge_keeps_counts(tmp_path):
    led = open_ledger(tmp_path / "l", retention_s=1.0, dedup_window_s=5.0)
    (r,) = submit(led, item("k"))
    (t,) = lease_all(led)
    txn = led.begin()
    txn.complete(protocol.TaskResult(t.item_id, t.token, blob(), "echo", "1"), 2_500)
    assert txn.ack(r.item_id, 3_000) is True
    assert txn.ack(r.item_id, 3_000) is False
    assert txn.ack("missing", 3_000) is None
    txn.commit()
    txn = led.begin()
    assert maintenance.purge(txn, 3_500, 100) == 0  # retention not reached
    assert maintenance.purge(txn, 10_000, 100) == 2  # the item and its idempotency key
    txn.commit()
    with led.read() as v:
        assert v.get(r.item_id) is None and v.item_status(r.item_id).state == "unknown"
        assert v.state_count("acknowledged") == 1 and v.counter("purged") == 1
    check_balance(led)
    led.close()


def test_events_are_trimmed_per_window(ledger, monkeypatch):
    monkeypatch.setattr(gaps, "EVENTS_KEPT_PER_WINDOW", 3)
    submit(ledger, item("k"))
    txn = ledger.begin()
    for i in range(10):
        txn.event(gaps.G2_LEASE_EXPIRED, f"i{i}", 1_000 + i, "x")
    txn.commit()
    txn = ledger.begin()
    maintenance.purge(txn, 2_000, 1000)
    txn.commit()
    with ledger.read() as v:
        recent = v.recent_events(gaps.G2_LEASE_EXPIRED, 100)
        assert [e["item_id"] for e in recent] == ["i9", "i8", "i7"]
        assert v.gap_counts()[gaps.G2_LEASE_EXPIRED] == 10


def test_map_full_aborts_whole_txn_then_grow(tmp_path):
    """C08 at the ledger level: a full map raises, the aborted txn leaves nothing."""
    led = Ledger(tmp_path / "l", map_size_bytes=1 << 20, max_map_size_bytes=4 << 20)
    big = b"z" * 8000
    n_ok = 0
    with pytest.raises(lmdb.MapFullError):
        while True:
            txn = led.begin()
            try:
                for j in range(10):
                    big_blob = protocol.Blob(hashlib.sha256(big).hexdigest(), len(big), big)
                    txn.submit(protocol.SubmitItem(f"k{n_ok}-{j}", "echo", big_blob), 1_000)
                txn.commit()
            finally:
                txn.abort()  # no-op after commit; the broker actor does the same on MapFullError
            n_ok += 1
    with led.read() as v:
        assert v.counter("received") == n_ok * 10 and v.balanced()
    assert led.grow_map() and led.map_size_bytes() == 2 << 20
    submit(led, item("after-grow"))
    assert led.grow_map() and not led.grow_map()  # capped at the max
    led.close()


def test_readonly_open_requires_existing_ledger(tmp_path):
    with pytest.raises(LedgerError):
        Ledger(tmp_path / "none", readonly=True)


def test_blob_refs_for_reconcile(tmp_path):
    """Only claim-store references (not inline blobs) are listed, with the item's state."""
    from ccsq.brokerd.gap_report import iter_blob_refs

    led = Ledger(tmp_path / "ledger", map_size_bytes=1 << 20)
    ref = protocol.Blob("a" * 64, 100_000, None)
    (r1, r2) = submit(led, protocol.SubmitItem("by-ref", "echo", ref), item("inline"))
    (t1, _t2) = lease_all(led)
    txn = led.begin()
    txn.complete(protocol.TaskResult(t1.item_id, t1.token, protocol.Blob("b" * 64, 20_000, None), "echo", "1"), 3_000)
    txn.commit()
    led.close()
    refs = sorted(iter_blob_refs(tmp_path))
    assert refs == sorted([(r1.item_id, "completed", "a" * 64), (r1.item_id, "completed", "b" * 64)])


def test_a_token_is_honoured_only_from_the_worker_it_was_leased_to(ledger):
    """Tokens are a sequence: another authorized worker quoting one (current or just expired)
    is fenced, never accepted; a late result accepted after expiry records who produced it."""
    submit(ledger, item("a"), item("b"))
    ta, tb = lease_all(ledger, worker="w1")
    txn = ledger.begin()
    assert txn.complete(protocol.TaskResult(ta.item_id, ta.token, blob(b"forged"), "echo", "1"), 2_100, "w2") == FENCED
    assert txn.fail(protocol.TaskFailure(ta.item_id, ta.token, "fatal", False, "forged"), 2_100, "w2") == FENCED
    assert txn.complete(protocol.TaskResult(ta.item_id, ta.token, blob(b"real"), "echo", "1"), 2_200, "w1") == ACCEPTED
    txn.expire_lease(tb.item_id, tb.token, 3_000)  # b is ready again, same token: a late result would be accepted ...
    assert txn.complete(protocol.TaskResult(tb.item_id, tb.token, blob(b"forged"), "echo", "1"), 3_100, "w2") == FENCED
    assert txn.complete(protocol.TaskResult(tb.item_id, tb.token, blob(b"late"), "echo", "1"), 3_200, "w1") == ACCEPTED
    txn.commit()
    with ledger.read() as v:
        assert v.get(ta.item_id)["worker_done"] == "w1"
        assert v.get(tb.item_id)["worker_done"] == "w1"  # ... from its holder only, and says who did the work
        assert v.item_status(ta.item_id).result == blob(b"real") and v.item_status(tb.item_id).result == blob(b"late")
        assert v.counter("fenced_completions") == 2 and v.counter("fenced_failures") == 1
        assert v.gap_counts()[gaps.G8_LATE_RESULT_ACCEPTED] == 1
        assert any("reported by w2" in e["detail"] for e in v.recent_events(gaps.G4_FENCED_COMPLETION, 10))
    check_balance(ledger)


def _rewrite_record(led: Ledger, item_id: str, **fields) -> None:
    """Write an item record as an older broker left it (raw msgpack, fields set or, with None, removed)."""
    with led.env.begin(write=True) as raw:
        rec = schema.unpack_item(raw.get(item_id.encode(), db=led.db["items"]), item_id)
        for name, value in fields.items():
            if value is None:
                rec.pop(name, None)
            else:
                rec[name] = value
        raw.put(item_id.encode(), schema.pack_item(rec), db=led.db["items"])


def test_records_of_older_brokers_keep_their_token_holder(ledger):
    """``worker`` now names the holder of the latest token after the lease ends; records an
    older broker wrote (``worker`` cleared, the holder in ``token_worker``; or neither field
    kept) are still fenced by their holder, and a new lease drops ``token_worker``."""
    submit(ledger, item("a"), item("b"), item("c"))
    ta, tb, tc = lease_all(ledger, worker="w1")
    txn = ledger.begin()
    for t in (ta, tb):
        txn.expire_lease(t.item_id, t.token, 3_000)
    txn.commit()
    with ledger.read() as v:
        assert v.get(ta.item_id)["worker"] == "w1" and "token_worker" not in v.get(ta.item_id)  # kept, one field
    _rewrite_record(ledger, ta.item_id, worker="", token_worker="w1")  # the layout before: ready, holder aside
    _rewrite_record(ledger, tc.item_id, token_worker=None)  # the layout before token_worker: leased, worker only
    txn = ledger.begin()
    for t in (ta, tc):
        forged = protocol.TaskResult(t.item_id, t.token, blob(b"forged"), "echo", "1")
        assert txn.complete(forged, 3_100, "w2") == FENCED
    assert txn.complete(protocol.TaskResult(ta.item_id, ta.token, blob(b"late"), "echo", "1"), 3_200, "w1") == ACCEPTED
    assert txn.complete(protocol.TaskResult(tc.item_id, tc.token, blob(b"ok"), "echo", "1"), 3_200, "w1") == ACCEPTED
    txn.commit()
    _rewrite_record(ledger, tb.item_id, worker="", token_worker="w1")
    (tb2,) = lease_all(ledger, worker="w2", now_ms=4_000)
    with ledger.read() as v:
        assert v.get(ta.item_id)["worker_done"] == "w1" and v.get(tc.item_id)["worker_done"] == "w1"
        assert v.get(tb.item_id)["worker"] == "w2" and "token_worker" not in v.get(tb.item_id)
        assert any("leased to w1, reported by w2" in e["detail"] for e in v.recent_events(gaps.G4_FENCED_COMPLETION, 10))
    txn = ledger.begin()
    assert txn.complete(protocol.TaskResult(tb.item_id, tb2.token, blob(b"x"), "echo", "1"), 4_100, "w1") == FENCED
    assert txn.complete(protocol.TaskResult(tb.item_id, tb2.token, blob(b"x"), "echo", "1"), 4_100, "w2") == ACCEPTED
    txn.commit()
    check_balance(ledger)


def test_transact_grows_a_full_map_then_sheds_work(tmp_path):
    """Ledger.transact: a step that hits MDB_MAP_FULL is run again in a fresh transaction,
    first after doubling the map, then (at the maximum) in each smaller mode; nothing of an
    aborted run is kept, and a step that never fits gets None."""
    led = Ledger(tmp_path / "l", map_size_bytes=1 << 20, max_map_size_bytes=2 << 20)
    runs = []

    def step(size_by_mode):
        def run(txn, mode):
            runs.append((mode, led.map_size_bytes()))
            txn.submit(item(f"{mode}{len(runs)}"), 1_000)
            txn.txn.put(b"test-filler", b"y" * size_by_mode.get(mode, 0), db=led.db["meta"])  # ~1.5 MiB: needs the grown map
            txn.commit()
            return len(runs)
        return run

    assert led.transact(step({"normal": 1_500_000})) == ("normal", 2)
    assert runs == [("normal", 1 << 20), ("normal", 2 << 20)]  # grown once, same mode
    runs.clear()
    assert led.transact(step({"normal": 3 << 20, "refuse": 3 << 20, "minimal": 3 << 20})) == ("acks", 4)
    assert runs == [(mode, 2 << 20) for mode in FULL_MODES]  # at the maximum: one smaller mode per run
    runs.clear()
    assert led.transact(step({mode: 3 << 20 for mode in FULL_MODES})) == ("acks", None)
    assert [m for m, _ in runs] == list(FULL_MODES)
    with led.read() as v:
        assert v.counter("received") == 2 and v.balanced()  # one item per committed run, none from aborted ones
    led.close()


def test_records_and_blobs_of_format_1_still_read_and_format_2_is_compact(ledger):
    """Issue 15: item records are written as an array of their core fields plus a map of
    the rest (no ``id``), blobs as ``[sha, size, inline]`` (an inline payload LZ4-compressed
    when that pays). Records and blobs an older broker wrote (long-named maps) read the same, move on
    through every transition, and a claim-check reference is listed from either format."""
    import msgpack

    ref = b"s3://bucket/payloads/000000000001.png#" + b"x" * 990
    data = protocol.Blob(hashlib.sha256(ref).hexdigest(), len(ref), ref)
    claim = protocol.Blob(hashlib.sha256(b"big").hexdigest(), 1 << 20, None)
    (ra, rb, rc) = submit(ledger, protocol.SubmitItem("a", "echo", data), protocol.SubmitItem("b", "echo", claim),
                          item("c", params={"n": 1}))
    with ledger.env.begin() as raw:
        rec2 = raw.get(ra.item_id.encode(), db=ledger.db["items"])
        blob2 = raw.get(ra.item_id.encode(), db=ledger.db["payloads"])
    assert len(rec2) < 80 and len(blob2) < 200  # format 1: ~210 and ~1,130 bytes
    # the same items as a format-1 broker wrote them
    with ledger.env.begin(write=True) as raw:
        for r, b in ((ra, data), (rb, claim)):
            rec = schema.unpack_item(raw.get(r.item_id.encode(), db=ledger.db["items"]), r.item_id)
            raw.put(r.item_id.encode(), msgpack.packb(dict(rec), use_bin_type=True), db=ledger.db["items"])
            raw.put(r.item_id.encode(), msgpack.packb(schema.blob_to_wire(b), use_bin_type=True), db=ledger.db["payloads"])
    with ledger.read() as v:
        a, c = v.get(ra.item_id), v.get(rc.item_id)
        assert v.payload(ra.item_id) == data and v.payload(rb.item_id) == claim
        assert a["id"] == ra.item_id and a["state"] == "ready" and a["deadline_ms"] is None and a["worker"] == ""
        assert c["id"] == rc.item_id and c["params"] == {"n": 1} and c["max_runtime_s"] == 0.0 and c["attempt"] == 0
        assert set(a) == set(c) and "completed_token" not in c
        assert [(i, sha) for i, _state, sha in v.blob_refs()] == [(rb.item_id, claim.sha256)]
    tasks = {t.item_id: t for t in lease_all(ledger)}
    assert tasks[ra.item_id].payload == data and tasks[rb.item_id].payload == claim
    txn = ledger.begin()
    for t in tasks.values():
        assert txn.complete(protocol.TaskResult(t.item_id, t.token, blob(b"r"), "echo", "1"), 3_000, "w1") == ACCEPTED
        assert txn.ack(t.item_id, 3_100) is True
    txn.commit()
    with ledger.read() as v:
        a = v.get(ra.item_id)
        assert a["state"] == "acknowledged" and a["worker_done"] == "w1" and a["acked_ms"] == 3_100 and a["attempt"] == 1
        assert v.item_status(ra.item_id).result == blob(b"r")
    check_balance(ledger)


def test_records_a_transaction_wrote_read_back_from_memory_and_purges_forget_them(ledger):
    """A write transaction hands out the records, payloads and results it wrote without an
    LMDB read (issue 15), as copies (a caller's change is not written until it puts the
    record), and a purge in the same transaction forgets them."""
    txn = ledger.begin()
    rid = txn.submit(item("a"), 1_000).item_id
    assert txn.payload(rid) == blob(b"a")
    rec = txn.get(rid)
    rec["state"] = "dead"  # not written: the transaction's copy stays as it was put
    assert txn.get(rid)["state"] == "ready" and txn.get(rid)["id"] == rid
    task = txn.lease(rid, "w1", 2_000, 30_000)
    assert task.payload == blob(b"a") and txn.get(rid)["worker"] == "w1"
    assert txn.dead_letter(rid, task.token, "fatal", "boom", 2_100)
    assert txn.purge_dead(rid, 2_200)
    assert txn.get(rid) is None and txn.result(rid) is None
    txn.commit()
    with ledger.read() as v:
        assert v.get(rid) is None
    check_balance(ledger)


def test_record_cache_holds_committed_records_of_items_not_done(ledger):
    """The broker's record cache (``Ledger.cache_records``, issue 15): filled at commit only
    (a transition takes its record out, so an aborted one leaves nothing changed in it), the
    same records LMDB holds, the oldest entries go first, done or purged items leave it;
    payloads and results ride along."""
    ledger.cache_records(2, ready_max=3)
    ra, rb, rc = submit(ledger, item("a"), item("b"), item("c"))
    cache = ledger.record_cache
    assert list(cache) == [rb.item_id, rc.item_id]  # a went first
    assert cache[rc.item_id][2] == blob(b"c")  # its payload
    txn = ledger.begin()
    assert txn.lease(rb.item_id, "w1", 2_000, 5_000) is not None
    txn.abort()
    assert rb.item_id not in cache  # (taken by the aborted lease; read from LMDB again)
    txn = ledger.begin()
    assert txn.get(rb.item_id)["state"] == "ready" and txn.get(rb.item_id)["token"] == 0
    tb = txn.lease(rb.item_id, "w1", 2_000, 5_000)
    assert tb.payload == blob(b"b")
    txn.commit()
    with ledger.read() as v:
        assert v.get(rb.item_id) == cache[rb.item_id][0] and cache[rb.item_id][0]["state"] == "leased"
    txn = ledger.begin()
    assert txn.complete(protocol.TaskResult(rb.item_id, tb.token, blob(b"r"), "echo", "1"), 3_000, "w1") == "accepted"
    txn.commit()
    assert cache[rb.item_id][3] == blob(b"r")
    txn = ledger.begin()
    assert txn.delivery(rb.item_id, False).result == blob(b"r")
    assert txn.ack(rb.item_id, 3_100) is True
    assert txn.dead_letter_ready(rc.item_id, "cancelled", "test", 3_100)
    txn.commit()
    assert rb.item_id not in cache and rc.item_id not in cache  # done (acknowledged, dead)
    txn = ledger.begin()
    assert txn.replay_dead(rc.item_id, 3_200)
    txn.commit()
    assert rc.item_id in cache
    txn = ledger.begin()
    assert txn.dead_letter_ready(rc.item_id, "cancelled", "test", 3_300) and txn.purge_dead(rc.item_id, 3_300)
    txn.commit()
    assert rc.item_id not in cache
    with ledger.read() as v:
        assert v.get(rc.item_id) is None and v.get(rb.item_id)["state"] == "acknowledged"
    check_balance(ledger)


def test_a_backup_larger_than_ten_mib_is_marked_and_restores_with_a_new_id_prefix(tmp_path):
    """`ccsq backup` marks its copy (the first writer takes a new item id prefix). A
    compacted copy has no free page: the mark must not run out of map (py-lmdb's default
    map is 10 MiB; a 12 MiB copy failed the backup with MapFullError)."""
    def big(path: Path) -> Ledger:
        return Ledger(path, map_size_bytes=64 << 20, policy=Policy(), rng=random.Random(7))

    led = big(tmp_path / "l")
    try:
        data = [random.Random(i).randbytes(1024) for i in range(12_000)]  # ~12 MiB, incompressible
        for start in range(0, len(data), 1000):
            submit(led, *(protocol.SubmitItem(f"big-{i}", "echo", blob(d)) for i, d in enumerate(data[start:start + 1000], start)))
        before = led.id_prefix
        out = led.backup(tmp_path / "copy")
        assert out["bytes"] > 10 << 20
    finally:
        led.close()
    restored = big(tmp_path / "copy")
    try:
        assert restored.restored_from == before and restored.id_prefix != before
        # every item not done in the copy may run again: G13 counts all 12,000, the newest 1000 kept as events
        assert restored.restore_reruns == 12_000
        with restored.read() as v:
            assert v.gap_counts()["G13"] == 12_000 and len(v.recent_events("G13", 5000)) == 1000
        (r,) = submit(restored, item("after-restore"))
        assert r.item_id.startswith(restored.id_prefix)
    finally:
        restored.close()
    again = big(tmp_path / "copy")  # a restore once: the second start keeps the prefix
    try:
        assert again.restored_from == "" and again.id_prefix == restored.id_prefix
        with again.read() as v:
            assert v.gap_counts()["G13"] == 12_000  # counted once
    finally:
        again.close()


def test_record_cache_keeps_in_flight_records_when_the_queue_is_deeper_than_half_of_it(ledger):
    """Issue 24: in a queue deeper than the cache, each new ready record went in and pushed
    out the oldest entries, the records of leased and completed items that COMPLETE, the
    delivery and ACK read a few turns later (at 100,000 queued most of them were unpacked
    from LMDB again). Ready records are kept only while at most half the cache is ready."""
    ledger.cache_records(4)  # ready records kept while at most 2 items are ready
    (ra,) = submit(ledger, item("a"))
    assert list(ledger.record_cache) == [ra.item_id]  # a shallow queue: kept for its lease
    txn = ledger.begin()
    ta = txn.lease(ra.item_id, "w1", 2_000, 5_000)
    txn.commit()
    assert ledger.record_cache[ra.item_id][0]["state"] == "leased"
    deep = submit(ledger, *(item(f"q{i}") for i in range(6)))  # 6 ready: deeper than half the cache
    cache = ledger.record_cache
    assert ra.item_id in cache and not any(r.item_id in cache for r in deep)  # the leased one stays
    txn = ledger.begin()
    assert txn.complete(protocol.TaskResult(ra.item_id, ta.token, blob(b"r"), "echo", "1"), 3_000, "w1") == "accepted"
    txn.commit()
    assert cache[ra.item_id][0]["state"] == "completed" and cache[ra.item_id][3] == blob(b"r")
    submit(ledger, *(item(f"more{i}") for i in range(6)))
    assert list(cache) == [ra.item_id]  # still there for its delivery and ACK
    check_balance(ledger)


def test_idempotency_keys_are_indexed_by_a_17_byte_digest(ledger):
    """Issue 24: the keys index took each key's own bytes (the producer's derived keys are
    64 hex characters in random order), so its branch pages held ~56 entries and a commit
    of 100 submits into 100,000 keys rewrote ~160 pages. Entries are now 0xFF + BLAKE2b-128
    (schema.key_index), in keys and keytime alike; dedup and the purges go by them."""
    long_key = "k" * 400
    ra, rb = submit(ledger, item(long_key), item("b" * 64))
    with ledger.read() as v:
        keys = [k for k, _ in v.txn.cursor(db=v.db["keys"])]
        times = [schema.parse_timed(k)[1] for k, _ in v.txn.cursor(db=v.db["keytime"])]
        assert sorted(keys) == sorted(times) == sorted([schema.key_index(long_key), schema.key_index("b" * 64)])
        assert all(len(k) == 17 and k[:1] == b"\xff" for k in keys)
        assert v.key_entry(long_key)[:2] == (ra.item_id, 1_000)
    (dup,) = submit(ledger, item(long_key), now_ms=2_000)
    assert dup.duplicate and dup.item_id == ra.item_id
    txn = ledger.begin()
    assert txn.dead_letter_ready(rb.item_id, "cancelled", "test", 2_000) and txn.purge_dead(rb.item_id, 2_000)
    txn.commit()
    with ledger.read() as v:
        assert v.key_entry("b" * 64) is None  # purging a dead item forgets its key
    check_balance(ledger)


def test_raw_idempotency_keys_of_an_older_ledger_still_dedup_and_age_out(tmp_path):
    """A ledger written before issue 24 holds raw keys (UTF-8 bytes) in keys and keytime;
    this version looks them up too while any are left (Ledger.legacy_keys), writes new
    keys as digests, and the purge of expired keys removes either form."""
    led = open_ledger(tmp_path / "l", dedup_window_s=10.0)
    (old,) = submit(led, item("old-key"), now_ms=1_000)
    with led.env.begin(write=True) as t:  # rewrite the entry as an older version wrote it
        keys, keytime = led.db["keys"], led.db["keytime"]
        digest = schema.key_index("old-key")
        t.put(b"old-key", t.get(digest, db=keys), db=keys)
        t.delete(digest, db=keys)
        t.delete(schema.timed_key(1_000, digest), db=keytime)
        t.put(schema.timed_key(1_000, b"old-key"), b"", db=keytime)
    led.close()
    led = open_ledger(tmp_path / "l", dedup_window_s=10.0)
    try:
        assert led.legacy_keys
        (dup,) = submit(led, item("old-key"), now_ms=2_000)
        assert dup.duplicate and dup.item_id == old.item_id
        (new,) = submit(led, item("new-key"), now_ms=2_000)
        txn = led.begin()
        assert maintenance.purge_keys(txn, 11_500, 100) == 1  # the raw one, older than the window
        txn.commit()
        with led.read() as v:
            assert [k for k, _ in v.txn.cursor(db=v.db["keys"])] == [schema.key_index("new-key")]
        (again,) = submit(led, item("old-key"), now_ms=11_500)
        assert not again.duplicate and again.item_id != old.item_id  # a new item: its key had aged out
    finally:
        led.close()
    led = open_ledger(tmp_path / "l", dedup_window_s=10.0)
    try:
        assert not led.legacy_keys  # none left: one lookup per SUBMIT again
    finally:
        led.close()


def test_the_records_a_job_makes_are_the_classes_own_made_without_their_init(ledger):
    """The broker builds the Task, Delivery, SubmitResult and ItemOutcome of every job with the
    codec's trusted constructors (no frozen ``__init__``): each must be the class's own object,
    equal to the one its ``__init__`` makes; a changed field list falls back to the class (slow,
    caught here)."""
    for made, cls in ((schema.trusted_task, protocol.Task), (schema.trusted_delivery, protocol.Delivery),
                      (schema.trusted_submit_result, protocol.SubmitResult), (schema.trusted_outcome, protocol.ItemOutcome)):
        assert made is not cls, f"{cls.__name__}'s fields changed: update its trusted constructor in ledger/schema.py"
    [new] = submit(ledger, item("k1", params={"t": 1.5}, deadline_ts=9e9, max_runtime_s=2.0))
    [dup] = submit(ledger, item("k1"))
    assert type(new) is protocol.SubmitResult and new == protocol.SubmitResult("k1", new.item_id)
    assert dup == protocol.SubmitResult("k1", new.item_id, duplicate=True)
    [task] = lease_all(ledger)
    assert type(task) is protocol.Task
    assert task == protocol.Task(new.item_id, task.token, "echo", blob(b"k1"), {"t": 1.5}, 1, 2.0, 9e9)
    txn = ledger.begin()
    res = protocol.TaskResult(new.item_id, task.token, blob(b"ok"), handler="h", handler_version="1")
    assert txn.complete(res, 3_000, "w1") == protocol.Outcome.ACCEPTED.value
    txn.commit()
    with ledger.read() as view:
        d = view.delivery(new.item_id, False)
    assert type(d) is protocol.Delivery
    assert d == protocol.Delivery(new.item_id, "k1", "echo", blob(b"ok"), {"t": 1.5}, 1, "h", "1", 3.0)
    assert protocol.encode_body(d) == protocol.encode_body(protocol.Delivery(*(getattr(d, f) for f in d.__slots__)))
