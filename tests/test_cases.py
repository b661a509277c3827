"""The failure cases of shared/cases/CASES.md against a whole real swarm.

Every test here runs the real processes of ``tests/swarm.py`` (``ccsq-brokerd``,
``ccsq-workerd``, the completion service writing SQLite) plus the producer
``Client``, injects the fault with real signals (SIGKILL, SIGSTOP/SIGCONT),
names its case id in its docstring and asserts the case's expected values and
the common invariant: every accepted item ends in one terminal state, the
results table holds it at most once, the ledger balances, and every duplicate
execution is matched by a gap-register event.

Durations are the cases' durations scaled down (each test says by how much) to
keep the suite fast; the ratios that matter (job / lease, freeze / silence
window) are kept. Other tests for the same cases, at the level of one process
against scripted peers: tests/test_broker.py, tests/test_worker_daemon.py.
"""

from __future__ import annotations

import datetime
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib

from ccsq.brokerd.ledger.store import Ledger, data_paths
from ccsq.common.runtime.faults import env_for
from tests.swarm import Swarm, wait_until


# --- helpers ---------------------------------------------------------------------------
def ts(event: dict) -> float:
    """Wall-clock UNIX seconds of a structlog JSON event."""
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def events(swarm: Swarm, proc: str, name: str, **fields: Any) -> list[dict]:
    return [e for e in swarm.procs.procs[proc].events()
            if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())]


def window(rep: dict, gid: str) -> int:
    return next(w["count"] for w in rep["windows"] if w["id"] == gid)


def retune(path: Path, **over: Any) -> None:
    """Override keys of one generated config file (e.g. one worker's handler)."""
    cfg = tomllib.loads(path.read_text())
    cfg.update(over)
    path.write_text(tomli_w.dumps(cfg))


def ledger_record(swarm: Swarm, item_id: str) -> dict:
    """The broker's record of an item, read from its ledger (read-only, the broker may run)."""
    ledger = Ledger(data_paths(swarm.root / "broker-data")[0], readonly=True)
    try:
        with ledger.read() as view:
            return view.get(item_id) or {}
    finally:
        ledger.close()


def assert_landed_once(swarm: Swarm, item_ids: list[str]) -> list[dict]:
    """Each item is in the results table exactly once, delivered once."""
    rows = wait_until(lambda: (r := swarm.results()) and len(r) >= len(item_ids) and r, 30, "result rows")
    by_id = {r["item_id"]: r for r in rows}
    assert len(rows) == len(by_id) and set(item_ids) <= set(by_id)
    assert all(by_id[i]["deliveries"] == 1 for i in item_ids)
    return rows


# --- C01 --------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_c01_dispatch_to_a_departed_worker_is_kept_ready_for_a_live_one(tmp_path: Path) -> None:
    """C01 (second half) with the whole swarm: the broker dispatches to a worker that
    was SIGKILLed a second earlier and that it still believes alive (silence window
    60 s, no heartbeat due). ROUTER_MANDATORY makes that send fail (unroutable): the
    session ends, the item is released, never sent, still ready in the ledger with
    no attempt counted; a live worker started later gets it; acknowledged once.
    (The first half, 50 replies to a stopped producer, is
    tests/test_broker.py::test_full_producer_channel_delays_never_drops.)"""
    with Swarm(tmp_path / "s", workers=2, broker={"heartbeat_interval_s": 30.0, "liveness": 2, "lease_ttl_s": 90.0}) as swarm:
        swarm.start_broker()
        swarm.start_worker(1)
        swarm.start_completion()
        swarm.procs.kill("worker-1")
        time.sleep(1.0)  # the fault as scripted: the worker left a second before the dispatch
        with swarm.client() as client:
            r = client.submit(b"for whoever is alive", "echo")
            gone = wait_until(lambda: events(swarm, "broker", "peer_disconnected", peer="worker-1"), 10,
                              "the broker to find worker-1 gone")
            assert gone[0]["reason"] == "unroutable (socket gone)"
            rep = wait_until(lambda: (x := swarm.report())["states"]["ready"] == 1 and x, 10, "the item ready again")
            assert rep["states"]["leased"] == 0 and rep["counters"]["released"] >= 1 and rep["counters"]["routed"] >= 1
            swarm.start_worker(2)
            st = client.wait([r.item_id], timeout_s=30)[r.item_id]
        assert (st.state, st.attempt) == ("acknowledged", 1)  # released, never sent: no attempt counted
        assert events(swarm, "worker-2", "job_started", item_id=r.item_id)
        assert_landed_once(swarm, [r.item_id])
        rep = swarm.report()
    assert rep["balanced"] and window(rep, "G2") == 0 and rep["counters"]["retried"] == 0


# --- C02 ---------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_c02_frozen_broker_worker_reconnects_and_resumes_its_lease(tmp_path: Path) -> None:
    """C02 with the whole swarm, scaled 1:5 (silence window heartbeat 0.2 s x liveness 5
    = 1 s; the broker is frozen with SIGSTOP for 2 s while a worker holds a lease;
    lease_ttl 5 s). The worker notices within interval x liveness, rebuilds its
    socket and reconnects listing the lease; the broker resumes it; the item is
    completed once and acknowledged once, with no lease expiry (G2 = 0)."""
    with Swarm(tmp_path / "s", handler="sleep", broker={"lease_ttl_s": 5.0}) as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            r = client.submit(b"job", "sleep", params={"seconds": 2.5})
            wait_until(lambda: events(swarm, "worker-1", "job_started", item_id=r.item_id), 20, "job started")
            frozen_at = time.time()
            swarm.procs.signal("broker", signal.SIGSTOP)
            try:
                time.sleep(2.0)  # the fault itself: a frozen broker
            finally:
                swarm.procs.signal("broker", signal.SIGCONT)
            st = client.wait([r.item_id], timeout_s=30)[r.item_id]
        assert (st.state, st.attempt) == ("acknowledged", 1)
        lost = events(swarm, "worker-1", "session_lost")[0]
        assert 0.0 < ts(lost) - frozen_at <= 1.0 + 0.5, ts(lost) - frozen_at
        resumed = [e for e in events(swarm, "worker-1", "session_started") if ts(e) > ts(lost)]
        assert resumed and resumed[0]["resumed"] == 1 and resumed[0]["released"] == 0
        assert len(events(swarm, "worker-1", "job_started", item_id=r.item_id)) == 1
        assert_landed_once(swarm, [r.item_id])
        rep = swarm.report()
    assert rep["balanced"] and rep["counters"]["acknowledged"] == 1 and window(rep, "G2") == 0


# --- C03 ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefetch", [0, 1])  # 1: what `ccsq init` swarms run with
def test_c03_lease_shorter_than_the_job(tmp_path: Path, prefetch: int) -> None:
    """C03, scaled 1:2 (lease_ttl 1 s, heartbeat 0.25 s, a job of 3 x lease_ttl, a
    second idle worker). Delivered once, the idle worker gets nothing, completed
    once. Control: SIGSTOP the busy worker: the item is re-leased to the idle worker
    once (attempt 2), not before lease_ttl and not after lease_ttl + one heartbeat
    interval after the last heartbeat (<= the SIGSTOP); once the stopped worker
    resumes, its late result (if it reports one) is fenced: still one result row,
    and the duplicate execution is the one G2 event. With prefetch the frozen worker still
    has credit when its lease expires: the item must not go back to it (a silent worker gets
    no DISPATCH), else each re-lease there burns an attempt and can dead-letter the item
    as worker_lost while the idle worker waits (tester)."""
    lease_s, hb_s, job_s = 1.0, 0.25, 3.0
    with Swarm(tmp_path / "s", workers=2, handler="sleep",
               broker={"lease_ttl_s": lease_s, "heartbeat_interval_s": hb_s, "liveness": 5},
               worker={"prefetch": prefetch}) as swarm:
        swarm.start_all(workers=2)
        workers = ("worker-1", "worker-2")
        with swarm.client() as client:
            r1 = client.submit(b"long job", "sleep", params={"seconds": job_s})
            st = client.wait([r1.item_id], timeout_s=60)[r1.item_id]
            assert (st.state, st.attempt) == ("acknowledged", 1)
            starts = {w: len(events(swarm, w, "job_started", item_id=r1.item_id)) for w in workers}
            assert sorted(starts.values()) == [0, 1], starts
            idle = next(w for w in workers if starts[w] == 0)
            assert not events(swarm, idle, "dispatched")  # the idle worker got nothing
            assert window(swarm.report(), "G2") == 0

            # control: the busy worker freezes
            r2 = client.submit(b"frozen job", "sleep", params={"seconds": job_s})
            first = wait_until(lambda: [w for w in workers if events(swarm, w, "job_started", item_id=r2.item_id)],
                               20, "the control job to start")
            busy, idle = first[0], next(w for w in workers if w != first[0])
            stopped_at = time.time()
            swarm.procs.signal(busy, signal.SIGSTOP)
            try:
                (again,) = wait_until(lambda: events(swarm, idle, "job_started", item_id=r2.item_id), 20,
                                      "the re-lease to the idle worker")
                (expired,) = events(swarm, "broker", "lease_expired", item=r2.item_id)
            finally:
                swarm.procs.signal(busy, signal.SIGCONT)
            assert again["attempt"] == 2
            waited_s = ts(expired) - stopped_at  # the last extension was at most one interval before the stop
            # (+0.6 s: the broker notices an expiry at its next turn, late on a loaded 2-core machine;
            # a lease still extended after the stop would expire a whole lease later)
            assert lease_s - hb_s - 0.05 <= waited_s <= lease_s + hb_s + 0.6, waited_s
            st = client.wait([r2.item_id], timeout_s=60)[r2.item_id]
        assert (st.state, st.attempt) == ("acknowledged", 2)
        assert len(events(swarm, idle, "job_started", item_id=r2.item_id)) == 1
        assert len(events(swarm, busy, "job_started", item_id=r2.item_id)) == 1
        assert_landed_once(swarm, [r1.item_id, r2.item_id])
        rep = swarm.report()
    assert rep["balanced"] and rep["counters"]["acknowledged"] == 2 and window(rep, "G2") == 1  # the one duplicate execution


# --- C04 ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_c04_completion_after_the_lease_moved_on_is_fenced(tmp_path: Path) -> None:
    """C04 with the whole swarm: worker A (echo handler on kind ``sleep``: instant)
    stores its result and dies before its COMPLETE leaves (crash point
    worker.after_result_stored, SIGKILL). Its lease expires (lease_ttl 1 s), worker B
    (the real sleep handler, 8 s: A restarts well within it, under load too) gets the item as attempt 2. A restarts and replays
    its journaled COMPLETE: confirmed to A but fenced (stale token), counted and
    written to the gap register (G4). B's result is the one recorded, the
    completion service receives it once, the results table holds it once."""
    with Swarm(tmp_path / "s", workers=2, handler="sleep", broker={"lease_ttl_s": 1.0},
               worker={"kinds": ["sleep"]}) as swarm:
        retune(swarm.configs["workerd-0"], handler="echo")  # worker-1
        swarm.start_broker()
        swarm.start_completion()
        swarm.start_worker(1, env=env_for("worker.after_result_stored"))
        with swarm.client() as client:
            r = client.submit(b"A's answer", "sleep", params={"seconds": 8.0})
            assert swarm.procs.wait_exit("worker-1", timeout_s=30) == -signal.SIGKILL
            swarm.start_worker(2)
            (b_start,) = wait_until(lambda: events(swarm, "worker-2", "job_started", item_id=r.item_id), 20,
                                    "B to get the item")
            assert b_start["attempt"] == 2
            swarm.start_worker(1)  # A comes back with its finished result in the journal
            fenced = wait_until(lambda: events(swarm, "worker-1", "report_fenced", item_id=r.item_id), 20,
                                "A's replayed COMPLETE to be fenced")
            st = client.wait([r.item_id], timeout_s=30)[r.item_id]
        assert (st.state, st.attempt) == ("acknowledged", 2)
        (b_done,) = events(swarm, "worker-2", "job_completed", item_id=r.item_id)
        assert ts(fenced[0]) < ts(b_done)  # A replayed while B still ran
        (row,) = assert_landed_once(swarm, [r.item_id])
        assert b'"slept_s": 8.0' in row["result"]  # B's result, not A's echo
        rep = swarm.report()
    counts = rep["counters"]
    assert rep["balanced"] and counts["completed"] + counts["acknowledged"] >= 1 and counts["fenced_completions"] == 1
    assert window(rep, "G4") == 1 and window(rep, "G2") == 1


# --- C05 ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_c05_no_absolute_ack_deadline_but_max_runtime_is_enforced(tmp_path: Path) -> None:
    """C05, lease_ttl 0.3 s and heartbeat 0.06 s (liveness 10): a job running
    30 x lease_ttl while its worker heartbeats normally is completed once, with zero
    redeliveries (no lease expiry, no retry) and its connection is never closed by
    the broker. Separately (concurrently, second slot), a job over its declared
    max_runtime_s (1 s of work, cap 0.3 s, max_attempts 2) is stopped, recorded as
    failed(timeout), retried once per policy, and ends dead (timeout) after
    max_attempts: never retried forever."""
    lease_s = 0.3
    with Swarm(tmp_path / "s", handler="sleep",
               broker={"lease_ttl_s": lease_s, "heartbeat_interval_s": 0.06, "liveness": 10},
               worker={"slots": 2}) as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            long = client.submit(b"long", "sleep", params={"seconds": 30 * lease_s})
            wait_until(lambda: events(swarm, "worker-1", "job_started", item_id=long.item_id), 20, "long job started")
            slow = client.submit(b"slow", "sleep", params={"seconds": 1.0}, max_runtime_s=0.3, max_attempts=2)
            done = client.wait([long.item_id, slow.item_id], timeout_s=60)
        assert (done[long.item_id].state, done[long.item_id].attempt) == ("acknowledged", 1)
        assert (done[slow.item_id].state, done[slow.item_id].attempt, done[slow.item_id].error) == ("dead", 2, "timeout")
        assert len(events(swarm, "worker-1", "job_started", item_id=long.item_id)) == 1
        assert len(events(swarm, "worker-1", "job_timed_out", item_id=slow.item_id)) == 2
        assert not events(swarm, "broker", "peer_disconnected", peer="worker-1")
        assert not events(swarm, "broker", "lease_expired")
        assert not events(swarm, "worker-1", "session_lost")
        assert_landed_once(swarm, [long.item_id])
        rep = swarm.report()
    assert rep["balanced"] and rep["counters"]["acknowledged"] == 1 and rep["counters"]["dead"] == 1
    assert window(rep, "G2") == 0 and rep["counters"]["retried"] == 1 and rep["counters"]["failed"] == 2


# --- C07 ---------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_c07a_worker_sigkilled_mid_job_item_comes_back_as_attempt_2(tmp_path: Path) -> None:
    """C07a: SIGKILL the worker once mid-job; restarted, it does not claim the job it
    died in, so the broker expires that lease at once (G2 event, the one duplicate
    execution) and the item comes back with attempt 2: completed once, never lost."""
    with Swarm(tmp_path / "s", handler="sleep", broker={"lease_ttl_s": 30.0}) as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            r = client.submit(b"job", "sleep", params={"seconds": 1.0})
            wait_until(lambda: events(swarm, "worker-1", "job_started", item_id=r.item_id), 20, "job started")
            swarm.procs.kill("worker-1")
            swarm.start_worker(1)
            st = client.wait([r.item_id], timeout_s=30)[r.item_id]
        assert (st.state, st.attempt) == ("acknowledged", 2)
        assert [e["attempt"] for e in events(swarm, "worker-1", "job_started", item_id=r.item_id)] == [1, 2]
        assert events(swarm, "worker-1", "job_lost_in_crash", item_id=r.item_id)
        assert_landed_once(swarm, [r.item_id])
        rep = swarm.report()
    assert rep["balanced"] and rep["counters"]["acknowledged"] == 1 and window(rep, "G2") == 1


@pytest.mark.timeout(150)
def test_c07b_poison_job_dead_lettered_others_complete_attempts_survive_restart(tmp_path: Path) -> None:
    """C07b end to end: the real ``fail`` handler with ``kill_worker`` SIGKILLs every
    worker that runs it (worker-1 serves kind ``fail`` and is restarted each time, as
    systemd would); 20 normal jobs (kind ``echo``, worker-2) are submitted behind it.
    The broker is SIGKILLed and restarted while attempt 2 is leased: attempt 3 is
    still attempt 3. After max_attempts (3) the poison is dead-lettered with reason
    worker_lost; all 20 others are acknowledged once; each redelivery waited for the
    jittered exponential backoff the ledger scheduled (not-before honoured, delay
    within the doubling cap)."""
    base_s, cap_s = 0.4, 2.0
    with Swarm(tmp_path / "s", workers=2, handler="fail",
               broker={"lease_ttl_s": 30.0, "retry_backoff_base_s": base_s, "retry_backoff_max_s": cap_s},
               worker={"kinds": ["fail"]}) as swarm:
        retune(swarm.configs["workerd-1"], handler="echo", kinds=["echo"])  # worker-2
        swarm.start_all(workers=2)
        with swarm.client() as client:
            poison = client.submit(b"poison", "fail", params={"kill_worker": True}, max_attempts=3, priority=9)
            normal = client.submit_many([(f"normal {i}".encode(), "echo") for i in range(20)])
            not_before_ms: dict[int, int] = {}  # attempt -> the not-before its requeue got
            for attempt in (1, 2, 3):
                wait_until(lambda: not swarm.procs.procs["worker-1"].running, 30, f"attempt {attempt} to kill worker-1")
                if attempt == 2:  # attempt 2 is leased to a dead worker: restart the broker under it
                    swarm.procs.kill("broker")
                    assert ledger_record(swarm, poison.item_id)["attempt"] == 2
                    swarm.start_broker()
                if attempt >= 2:  # the backoff scheduled before this attempt is still in the record
                    rec = ledger_record(swarm, poison.item_id)
                    assert (rec["state"], rec["attempt"]) == ("leased", attempt)
                    not_before_ms[attempt] = rec["nb_ms"]
                # the poison may kill the new process before its readiness is even seen
                swarm.start_worker(1, wait=attempt == 3)
            st = client.wait([poison.item_id], timeout_s=30)[poison.item_id]
            assert (st.state, st.error, st.attempt) == ("dead", "worker_lost", 3)
            done = client.wait([r.item_id for r in normal], timeout_s=60)
        assert {s.state for s in done.values()} == {"acknowledged"}
        starts = events(swarm, "worker-1", "job_started", item_id=poison.item_id)
        assert [e["attempt"] for e in starts] == [1, 2, 3]
        expiries = events(swarm, "broker", "lease_expired", item=poison.item_id)
        assert len(expiries) == 3 and expiries[-1]["now"] == "dead"
        for n in (1, 2):  # expiry n scheduled a jittered backoff within the doubling cap; it was honoured
            # at_ms: the broker's wall ms the expiry was decided at (the log line's own ts is
            # written after the turn's fsync, up to a commit later under load)
            expired_s, nb_s, started_s = expiries[n - 1]["at_ms"] / 1000, not_before_ms[n + 1] / 1000, ts(starts[n])
            assert 0 <= nb_s - expired_s <= min(cap_s, base_s * 2 ** (n - 1)), (n, nb_s - expired_s)
            assert started_s >= nb_s - 0.01, (n, started_s, nb_s)
        assert_landed_once(swarm, [r.item_id for r in normal])
        rep = swarm.report()
    assert rep["balanced"] and rep["counters"]["dead"] == 1 and rep["counters"]["acknowledged"] == 20 and rep["epoch"] == 2
    assert window(rep, "G2") == 2 and window(rep, "G7") == 1


@pytest.mark.timeout(120)
def test_c07c_a_lease_the_dead_worker_never_journaled_is_released_without_an_attempt(tmp_path: Path) -> None:
    """Issue 27, defect 5: a prefetched item behind a job that dies running. Worker-1 runs a
    5 s job (max_attempts 1) and dies (SIGKILL, crash point worker.dispatch_before_hold) as
    the DISPATCH of a second item (max_attempts 1) arrives, before its hold is journaled.
    Restarted, it names the running job in HELLO info ``lost`` and does not know the
    second at all: the broker counts the attempt of the lost one only (dead-lettered
    worker_lost, as C07b needs) and releases the second uncounted (it used to be
    dead-lettered worker_lost without ever running); it runs once and is acknowledged."""
    with Swarm(tmp_path / "s", handler="sleep", broker={"lease_ttl_s": 30.0}, worker={"prefetch": 2}) as swarm:
        swarm.start_broker()
        swarm.start_completion()
        swarm.start_worker(1, env=env_for("worker.dispatch_before_hold", after_n=2))
        with swarm.client() as client:
            running = client.submit(b"running", "sleep", params={"seconds": 5.0}, max_attempts=1)
            wait_until(lambda: events(swarm, "worker-1", "job_started", item_id=running.item_id), 20, "the job to run")
            behind = client.submit(b"behind", "sleep", params={"seconds": 0.0}, max_attempts=1)
            assert swarm.procs.wait_exit("worker-1", timeout_s=30) == -signal.SIGKILL
            assert ledger_record(swarm, behind.item_id)["state"] == "leased"  # dispatched, never held there
            swarm.start_worker(1)
            st = client.wait([running.item_id, behind.item_id], timeout_s=30)
        assert (st[running.item_id].state, st[running.item_id].error) == ("dead", "worker_lost")
        assert (st[behind.item_id].state, st[behind.item_id].attempt) == ("acknowledged", 1)
        assert events(swarm, "worker-1", "job_lost_in_crash", item_id=running.item_id)
        assert len(events(swarm, "worker-1", "job_started", item_id=behind.item_id)) == 1
        assert events(swarm, "broker", "lease_released", item=behind.item_id)
        assert_landed_once(swarm, [behind.item_id])
        rep = swarm.report()
    assert rep["balanced"] and rep["counters"]["dead"] == 1 and rep["counters"]["acknowledged"] == 1


def test_two_live_workers_with_one_peer_id_the_newcomer_stops(tmp_path: Path) -> None:
    """Two live processes sharing a peer id must not fight over the session: the live
    one keeps it; the newcomer is refused ID_IN_USE, retries for one liveness window
    and exits 78 (configuration error) naming the id; work still completes exactly once."""
    import shutil

    import tomli_w
    import tomllib

    from ccsq.tools.procs import bin_path

    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        first = swarm.start_worker(1)
        twin_cfg = tmp_path / "s" / "workerd-1-twin.toml"
        doc = tomllib.loads(swarm.configs["workerd-0"].read_text())  # worker-1
        doc["journal_dir"] = "worker-1-twin-journal"
        twin_cfg.write_text(tomli_w.dumps(doc))
        twin = swarm.procs.start("worker-1-twin", [bin_path("ccsq-workerd"), "--config", str(twin_cfg)])
        assert swarm.procs.wait_exit("worker-1-twin", timeout_s=30) == 78
        assert twin.count("peer_id_in_use") == 1 and twin.count("broker_link_ready") == 0
        assert "worker-1" in swarm.procs.tail("worker-1-twin", 5)
        assert first.running and first.count("peer_id_in_use") == 0
        swarm.start_completion()
        with swarm.client() as client:
            ids = [client.submit(f"doc {i}".encode(), "echo").item_id for i in range(5)]
            states = client.wait(ids, timeout_s=60)
        assert {s.state for s in states.values()} == {"acknowledged"}
        rep = swarm.report()
        assert rep["counters"]["received"] == rep["counters"]["acknowledged"] == 5 and rep["balanced"]
        assert len(swarm.results()) == 5
        shutil.rmtree(tmp_path / "s" / "worker-1-twin-journal", ignore_errors=True)
