"""The worker journal's log format (format 2) and its reading of format-1 journals: one
log row per transaction, replay in order, compaction to one snapshot row, all or nothing
on a failed commit; and a real worker that resumes from a format-1 file or after a SIGKILL
between the journal commit of a whole batch and its report."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path

import msgpack
import pytest

from ccsq.common.runtime.faults import env_for
from ccsq.common.storage.claimstore import sha256_hex
from ccsq.common.wire import protocol
from ccsq.workerd import worker_journal
from ccsq.workerd.worker_journal import EntryState, Journal, encode_report
from tests.worker_harness import (WorkerBroker, Workers, broker, stop_with_empty_journal, task,  # noqa: F401 (fixtures)
                                     wait_until, workers)


def _result(item_id: str, token: int, data: bytes = b"out") -> protocol.TaskResult:
    return protocol.TaskResult(item_id, token, protocol.Blob(sha256_hex(data), len(data), data), "echo", "1", 0.01)


def _state(j: Journal) -> dict[tuple[str, int], tuple[EntryState, object]]:
    return {(e.item_id, e.token): (e.state, e.report) for e in j.entries()}


def _rows(directory: Path, table: str) -> int:
    db = sqlite3.connect(directory / "journal.sqlite3")
    try:
        return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        db.close()


def _write_format1(directory: Path, rows: list[tuple[str, int, str, str, bytes | None]]) -> None:
    """A journal as the format-1 worker wrote it: table entries, one row per lease."""
    directory.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(directory / "journal.sqlite3")
    db.execute(worker_journal._LEGACY_SCHEMA)
    for n, (item_id, token, kind, state, report) in enumerate(rows):
        db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)", (item_id, token, kind, state, report, 1000.0 + n))
    db.commit()
    db.close()


def test_log_replays_in_order_and_compacts_to_one_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_journal, "COMPACT_ROWS", 4)
    j = Journal.open(tmp_path / "j")
    j.hold([("a", 1, "echo"), ("b", 2, "echo"), ("c", 3, "echo")])
    j.mark_started(("a", 1), ("b", 2))
    j.hold([("a", 1, "other")])  # a known lease: ignored
    j.record(_result("a", 1), "echo")
    assert _rows(tmp_path / "j", "log") == 4  # one row per transaction
    j.mark_started(("c", 3))  # the 5th transaction replaces the log by one snapshot
    assert _rows(tmp_path / "j", "log") == 1
    j.record(protocol.TaskFailure("b", 2, "timeout", True, "slow"), "echo")
    j.mark_started(("a", 1))  # not held any more: no change
    stored = protocol.TaskResult("d", 4, protocol.Blob("ab" * 32, 5000, None), "echo", "1", 0.5)
    j.record(stored, "echo")  # a result in the claim store: no inline bytes
    want = {("d", 4): (EntryState.FINISHED, stored),("a", 1): (EntryState.FINISHED, _result("a", 1)),
            ("b", 2): (EntryState.FAILED, protocol.TaskFailure("b", 2, "timeout", True, "slow")),
            ("c", 3): (EntryState.STARTED, None)}
    assert _state(j) == want
    j.close()
    j = Journal.open(tmp_path / "j")
    assert _state(j) == want
    assert [e.item_id for e in j.entries()] == ["a", "b", "c", "d"]  # first write first
    j.forget([("a", 1), ("b", 2), ("c", 3), ("d", 4)])
    assert j.entries() == [] and _rows(tmp_path / "j", "log") == 0  # nothing left: an empty log
    j.close()
    assert Journal.open(tmp_path / "j").entries() == []


def test_a_failed_commit_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal.open(tmp_path / "j")
    j.hold([("a", 1, "echo"), ("b", 2, "echo")])
    j.record(_result("a", 1), "echo")
    before = _state(j)

    def broken(self: Journal) -> None:
        raise sqlite3.OperationalError("disk I/O error")
    monkeypatch.setattr(Journal, "_compact", broken)
    with pytest.raises(sqlite3.OperationalError):
        j.forget([("a", 1), ("b", 2)])  # empties the journal: compaction fails
    assert _state(j) == before
    with pytest.raises(ValueError):
        j.apply([(worker_journal.OpKind.FORGET, [("a", 1)]), ("bogus", [])])
    assert _state(j) == before
    j.close()
    assert _state(Journal.open(tmp_path / "j")) == before


def test_format1_journal_is_read_and_then_compacted_away(tmp_path: Path) -> None:
    d = tmp_path / "j"
    _write_format1(d, [
        ("done", 5, "echo", "finished", encode_report(_result("done", 5))),
        ("held", 6, "echo", "held", None),
        ("lost", 7, "echo", "started", None),
        ("bad", 8, "echo", "failed", encode_report(protocol.TaskFailure("bad", 8, "fatal", False, "no"))),
    ])
    j = Journal.open(d)
    want = {("done", 5): (EntryState.FINISHED, _result("done", 5)), ("held", 6): (EntryState.HELD, None),
            ("lost", 7): (EntryState.STARTED, None),
            ("bad", 8): (EntryState.FAILED, protocol.TaskFailure("bad", 8, "fatal", False, "no"))}
    assert _state(j) == want
    j.forget([("lost", 7)])  # a log row on top of the format-1 rows
    j.close()
    j = Journal.open(d)
    del want[("lost", 7)]
    assert _state(j) == want and _rows(d, "entries") == 4
    j.forget([("done", 5), ("held", 6), ("bad", 8)])
    assert j.entries() == [] and _rows(d, "entries") == 0 and _rows(d, "log") == 0
    j.close()


@pytest.mark.timeout(60)
def test_worker_resumes_a_format1_journal(broker: WorkerBroker, workers: Workers, tmp_path: Path) -> None:  # noqa: F811
    """A journal left by the format-1 worker: the finished result is re-sent as is (never
    re-run), the held lease given back released, the started one dropped; confirmed, the
    journal ends empty."""
    _write_format1(tmp_path / "journal", [
        ("done", 5, "echo", "finished", encode_report(_result("done", 5, b"old result"))),
        ("held", 6, "echo", "held", None),
        ("lost", 7, "echo", "started", None),
    ])
    proc = workers.start()
    (hello,) = broker.wait_for(protocol.Hello)
    assert sorted((r.item_id, r.token) for r in hello.msg.leases) == [("done", 5), ("held", 6)]
    (done,) = broker.wait_for(protocol.Complete)
    assert [(r.item_id, r.token, r.result.inline) for r in done.msg.results] == [("done", 5, b"old result")]
    (fail,) = broker.wait_for(protocol.Fail)
    assert [(f.item_id, f.reason) for f in fail.msg.failures] == [("held", "released")]
    events = workers.log_events(1)
    assert "job_started" not in [e["event"] for e in events]
    assert [e["item_id"] for e in events if e["event"] == "job_lost_in_crash"] == ["lost"]
    wait_until(lambda: not any(s.msg.leases for s in broker.of(protocol.Heartbeat) if s.mono > fail.mono),
               10, "heartbeats without the leases")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert _rows(tmp_path / "journal", "entries") == 0
    j = Journal.open(tmp_path / "journal")
    assert j.entries() == []
    j.close()


@pytest.mark.timeout(60)
def test_sigkill_after_a_batch_is_journaled_resends_each_result_once(broker: WorkerBroker, workers: Workers,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    """A batch of 6 is journaled in one commit, then SIGKILL before any COMPLETE (crash
    point worker.after_result_stored): the restarted worker re-sends all 6 results, each
    once, and runs none of them again."""
    proc = workers.start(env=env_for("worker.after_result_stored"), max_batch=8, max_wait_ms=200.0, prefetch=8)
    broker.wait_for(protocol.Hello)
    broker.dispatch(*[task(f"b{n}", "echo", payload=b"r%d" % n, token=10 + n) for n in range(6)])
    assert proc.wait(20) == -signal.SIGKILL
    assert not broker.of(protocol.Complete)
    proc = workers.start(max_batch=8, prefetch=8)
    (hello,) = broker.wait_for(protocol.Hello, n=2)[1:]
    assert sorted((r.item_id, r.token) for r in hello.msg.leases) == [(f"b{n}", 10 + n) for n in range(6)]
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) >= 6, 10, "6 results")
    # all confirmed: a heartbeat lists no lease (a second COMPLETE would have come before)
    wait_until(lambda: any(not s.msg.leases for s in broker.of(protocol.Heartbeat) if s.mono > hello.mono), 10,
               "a heartbeat without leases")
    got = sorted((r.item_id, r.token, r.result.inline) for s in broker.of(protocol.Complete) for r in s.msg.results)
    assert got == [(f"b{n}", 10 + n, b"r%d" % n) for n in range(6)]
    assert "job_started" not in [e["event"] for e in workers.log_events(2)]
    stop_with_empty_journal(proc, tmp_path)


@pytest.mark.timeout(60)
def test_a_tampered_inline_payload_fails_alone_in_its_frame(broker: WorkerBroker, workers: Workers) -> None:  # noqa: F811
    """Inline payloads are verified on the loop for a whole DISPATCH frame: the one whose
    bytes do not match its SHA-256 is reported payload_missing (the item's fault), its
    frame mates run."""
    workers.start(max_batch=4, prefetch=4)
    broker.wait_for(protocol.Hello)
    good = [task(f"g{n}", "echo", payload=b"ok%d" % n, token=n + 1) for n in range(3)]
    bad = protocol.Task(item_id="bad", token=9, kind="echo", payload=protocol.Blob(sha256_hex(b"other"), 3, b"abc"), params={},
                 attempt=1)
    broker.dispatch(good[0], bad, *good[1:])
    (fail,) = broker.wait_for(protocol.Fail)
    assert [(f.item_id, f.reason, f.retryable) for f in fail.msg.failures] == [("bad", "payload_missing", False)]
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) >= 3, 10, "3 results")
    got = sorted((r.item_id, r.result.inline) for s in broker.of(protocol.Complete) for r in s.msg.results)
    assert got == [(f"g{n}", b"ok%d" % n) for n in range(3)]


@pytest.mark.timeout(60)
def test_sigkill_after_confirmation_never_runs_a_confirmed_job_again(broker: WorkerBroker, workers: Workers,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    """SIGKILL once a batch's COMPLETE is confirmed (its forget may still be in the lazy
    write, or already in the log): the restarted worker runs none of them again; it may
    re-send a confirmed report at most once (the broker answers duplicate), and the
    half-confirmed frame's other jobs are not lost."""
    proc = workers.start(max_batch=8, max_wait_ms=200.0, prefetch=8)
    broker.wait_for(protocol.Hello)
    broker.dispatch(*[task(f"c{n}", "echo", payload=b"c%d" % n, token=20 + n) for n in range(6)])
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) >= 6, 10, "6 results")
    before = len(broker.of(protocol.Complete))
    proc.kill()
    assert proc.wait(20) == -signal.SIGKILL
    proc = workers.start(max_batch=8, prefetch=8)
    (hello,) = broker.wait_for(protocol.Hello, n=2)[1:]
    # re-sends of reports not yet forgotten come at once; once confirmed, heartbeats list no lease
    wait_until(lambda: any(not s.msg.leases for s in broker.of(protocol.Heartbeat) if s.mono > hello.mono), 10,
               "a heartbeat without leases")
    again = [r.item_id for s in broker.of(protocol.Complete)[before:] for r in s.msg.results]
    assert len(again) == len(set(again)) and set(again) <= {f"c{n}" for n in range(6)}
    assert "job_started" not in [e["event"] for e in workers.log_events(2)]
    stop_with_empty_journal(proc, tmp_path)


def test_a_snapshot_keeps_format1_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot taken while format-1 entries are live keeps their report bytes as they
    were (decoded by the strict codec on the next open) and deletes the format-1 rows."""
    monkeypatch.setattr(worker_journal, "COMPACT_ROWS", 1)
    d = tmp_path / "j"
    _write_format1(d, [("done", 5, "echo", "finished", encode_report(_result("done", 5)))])
    j = Journal.open(d)
    j.hold([("x", 1, "echo")])  # the first log row
    j.mark_started(("x", 1))  # the second write: a snapshot
    assert _rows(d, "entries") == 0 and _rows(d, "log") == 1
    j.close()
    j = Journal.open(d)
    assert _state(j) == {("done", 5): (EntryState.FINISHED, _result("done", 5)), ("x", 1): (EntryState.STARTED, None)}
    j.close()


def _log_ops(directory: Path) -> list[list]:
    """The journal's log rows in order, each the msgpack list of ``[op, rows]`` it holds (read while the
    worker runs: the file is SQLite in WAL mode)."""
    db = sqlite3.connect(directory / "journal.sqlite3", timeout=5)
    try:
        return [msgpack.unpackb(raw, raw=False) for (raw,) in db.execute("SELECT ops FROM log ORDER BY seq")]
    finally:
        db.close()


@pytest.mark.timeout(60)
def test_a_lease_a_free_slot_takes_is_journaled_held_and_started_in_one_commit(
        broker: WorkerBroker, workers: Workers, tmp_path: Path) -> None:  # noqa: F811
    """A DISPATCH that an idle lane takes at once is journaled held AND started in ONE commit (the
    handler waits for one fsync, not two); one that arrives while the slot is busy is held only (it
    waits for the slot). SIGKILL while the first runs: the restarted worker names the first in HELLO
    info "lost" (its attempt counts) and gives the waiting one back released (no attempt)."""
    proc = workers.start(handler="sleep", prefetch=2)
    broker.wait_for(protocol.Hello)
    broker.dispatch(task("run", "sleep", params={"seconds": 60.0}, token=1))
    broker.wait_for(protocol.Heartbeat, lambda m: m.busy == 1)
    broker.dispatch(task("wait", "sleep", params={"seconds": 0.0}, token=2))

    def row_of(item_id: str) -> list | None:
        return next((ops for ops in _log_ops(tmp_path / "journal")
                     if any(op == "h" and any(r[0] == item_id for r in rows) for op, rows in ops)), None)

    wait_until(lambda: row_of("wait"), 10, "the second lease held")
    assert row_of("run") == [["h", [["run", 1, "sleep"]]], ["s", [["run", 1]]]]  # one transaction
    assert row_of("wait") == [["h", [["wait", 2, "sleep"]]]]
    proc.kill()
    assert proc.wait(20) == -signal.SIGKILL
    workers.start(handler="sleep", prefetch=2)
    (hello,) = broker.wait_for(protocol.Hello, n=2)[1:]
    assert protocol.parse_lost_info(hello.msg.info.get(protocol.LOST_INFO)) == {("run", 1)}
    (fail,) = broker.wait_for(protocol.Fail)
    assert [(f.item_id, f.reason) for f in fail.msg.failures] == [("wait", "released")]


@pytest.mark.timeout(60)
def test_a_partial_batch_that_may_wait_for_more_is_held_only(broker: WorkerBroker, workers: Workers,  # noqa: F811
                                                            tmp_path: Path) -> None:
    """With max_wait_ms > 0 a partial batch may wait in the queue for more: only whole batches are
    journaled started with their hold. max_batch 4: a frame of 3 is held only; then, the lane
    idle again, a frame of 4 is held and started in one commit."""
    workers.start(handler="sleep", max_batch=4, max_wait_ms=300.0, prefetch=4)
    broker.wait_for(protocol.Hello)

    def results() -> int:
        return sum(len(s.msg.results) for s in broker.of(protocol.Complete))

    broker.dispatch(*[task(f"p{n}", "sleep", params={"seconds": 0.0}, token=n + 1) for n in range(3)])
    wait_until(lambda: results() >= 3, 20, "3 results")
    broker.dispatch(*[task(f"q{n}", "sleep", params={"seconds": 0.0}, token=n + 11) for n in range(4)])
    wait_until(lambda: results() >= 7, 20, "7 results")
    holds = [[op for op in ops if op[0] in "hs"] for ops in _log_ops(tmp_path / "journal") if any(op[0] == "h" for op in ops)]
    assert holds[0] == [["h", [[f"p{n}", n + 1, "sleep"] for n in range(3)]]]
    assert holds[1] == [["h", [[f"q{n}", n + 11, "sleep"] for n in range(4)]], ["s", [[f"q{n}", n + 11] for n in range(4)]]]
