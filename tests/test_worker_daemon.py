"""The real ``ccsq-workerd`` process against a scripted broker (``tests/worker_harness.py``:
a raw ZeroMQ ROUTER with the real EnvelopeCodec that answers HELLO, heartbeats the worker,
records every message, sends the DISPATCHes a test asks for and confirms the reports; no
ledger, no leases, nothing but what each test scripts)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from ccsq.common.wire import protocol
from ccsq.common.storage.claimstore import sha256_hex
from ccsq.common.wire.errors import ExitCode
from ccsq.common.runtime.faults import env_for
from tests.worker_harness import HB_S, LIVENESS, WorkerBroker, Workers, stop_with_empty_journal, task, wait_until
from tests.worker_harness import broker, workers  # noqa: F401 (fixtures)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_c06_heartbeats_flow_while_a_cpu_bound_handler_runs(broker: WorkerBroker, workers: Workers) -> None:
    """C06: a handler burns pure-Python CPU for 3 x (heartbeat_interval x liveness);
    the broker sees no heartbeat gap over 1.5 x interval, every heartbeat lists the
    lease, the loop-lag probe stays small, and the item completes once; credit
    starts at slots + prefetch and one credit comes back after the COMPLETE."""
    burn_s = 3 * HB_S * LIVENESS
    workers.start(handler="sleep")
    (hello,) = broker.wait_for(protocol.Hello)
    assert hello.msg.credit == 2 and hello.msg.slots == 1 and hello.msg.kinds == ["sleep"]
    broker.dispatch(task("c06", "sleep", params={"seconds": burn_s, "burn": True}))
    (done,) = broker.wait_for(protocol.Complete, timeout_s=30)
    assert json.loads(done.msg.results[0].result.inline)["burn"] is True
    assert done.msg.results[0].runtime_s >= burn_s
    beats = [s for s in broker.of(protocol.Heartbeat) if s.mono > hello.mono]
    during = [s for s in beats if s.mono <= done.mono]
    assert len(during) >= burn_s / HB_S - 1
    assert max(_gaps([hello.mono] + [s.mono for s in during] + [done.mono])) <= 1.5 * HB_S
    running = [s for s in during if s.msg.busy == 1]
    assert len(running) >= (burn_s / HB_S) - 2
    assert all(s.msg.leases == [protocol.LeaseRef("c06", 1)] for s in running)
    assert max(s.msg.info["loop_lag_max_ms"] for s in beats) < 150.0  # on the loop it would be ~1800
    credit = broker.wait_for(protocol.Credit)
    assert credit[0].msg.credit == 1 and credit[0].mono >= done.mono
    assert len(broker.of(protocol.Complete)) == 1


@pytest.mark.timeout(60)
def test_c10_cuda_required_on_a_cpu_host_exits_gpu_unavailable(workers: Workers, tmp_path: Path) -> None:
    """C10: provider = "cuda" where CUDA cannot load: refuse to start with the named
    exit code and a one-line reason (no silent CPU inference)."""
    proc = workers.start(provider="cuda")
    assert proc.wait(30) == ExitCode.GPU_UNAVAILABLE
    out = (tmp_path / "worker-run1.log").read_text()
    last = out.strip().splitlines()[-1]
    assert last.startswith("ccsq-workerd: provider 'cuda' required but not usable: CUDAExecutionProvider"), out
    assert any(e["event"] == "gpu_unavailable" for e in workers.log_events(1))


@pytest.mark.timeout(60)
def test_c10_cpu_fallback_is_announced_in_hello(broker: WorkerBroker, workers: Workers, tmp_path: Path) -> None:
    """C10: with allow_cpu_fallback the worker starts on CPU and says so in HELLO
    (and tells systemd READY=1 once loaded, as its Type=notify unit expects)."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(20)
    workers.start(provider="cuda", allow_cpu_fallback=True, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    ready = notify.recv(4096).decode()
    notify.close()
    assert ready.startswith("READY=1\nSTATUS=handler echo on CPUExecutionProvider"), ready
    (hello,) = broker.wait_for(protocol.Hello)
    info = hello.msg.info
    assert info["cpu_fallback"] is True and info["provider"] == "CPUExecutionProvider"
    assert info["requested_provider"] == "cuda" and "CUDAExecutionProvider" in info["fallback_reason"]
    assert info["handler"] == "echo" and info["host"]
    events = {e["event"]: e for e in workers.log_events(1)}
    assert "CUDAExecutionProvider" in events["gpu_fallback_to_cpu"]["reason"]
    assert events["handler_ready"]["provider"] == "CPUExecutionProvider"


@pytest.mark.timeout(60)
def test_restart_resends_journaled_result_without_rerunning(broker: WorkerBroker, workers: Workers,
                                                            tmp_path: Path) -> None:
    """SIGKILL right after the result is stored (crash point worker.after_result_stored,
    before COMPLETE): the restarted worker lists the lease in HELLO and resends the
    same result from its journal; the handler does not run again."""
    proc = workers.start(env=env_for("worker.after_result_stored"))
    broker.wait_for(protocol.Hello)
    broker.dispatch(task("j1", "echo", payload=b"journal me", token=7))
    assert proc.wait(20) == -signal.SIGKILL
    assert not broker.of(protocol.Complete)
    proc = workers.start()
    (hello,) = broker.wait_for(protocol.Hello, n=2)[1:]
    assert hello.msg.leases == [protocol.LeaseRef("j1", 7)]
    assert hello.msg.credit == 2  # a finished result holds no slot
    (done,) = broker.wait_for(protocol.Complete)
    (res,) = done.msg.results
    assert (res.item_id, res.token, res.result.inline) == ("j1", 7, b"journal me")
    assert [e["event"] for e in workers.log_events(1)].count("job_started") == 1
    events = [e["event"] for e in workers.log_events(2)]
    assert "job_started" not in events and "journal_recovered" in events
    # confirmed -> forgotten: after a clean stop the journal is empty
    wait_until(lambda: not any(s.msg.leases for s in broker.of(protocol.Heartbeat) if s.mono > done.mono),
               10, "heartbeats without the lease")
    stop_with_empty_journal(proc, tmp_path)


@pytest.mark.timeout(60)
def test_poison_job_that_kills_the_worker_is_not_claimed_after_restart(broker: WorkerBroker, workers: Workers,
                                                                       tmp_path: Path) -> None:
    """C07b from the worker side: a job kills its worker mid-handler. The restarted
    worker neither re-runs it nor claims it (its HELLO lists no lease, it sends no
    FAIL), so the broker expires the lease at once as worker_lost, which consumes
    the attempt and dead-letters the poison job after max_attempts. A job that was
    only prefetched (never started) is given back as released instead."""
    proc = workers.start(handler="fail")
    broker.wait_for(protocol.Hello)
    broker.dispatch(task("poison", "fail", params={"kill_worker": True}, token=3), task("next", "fail", token=4))
    assert proc.wait(20) == -signal.SIGKILL
    proc = workers.start(handler="fail")
    (hello,) = broker.wait_for(protocol.Hello, n=2)[1:]
    assert hello.msg.leases == [protocol.LeaseRef("next", 4)] and hello.msg.credit == 2
    (fail,) = broker.wait_for(protocol.Fail)
    assert [(f.item_id, f.reason, f.retryable) for f in fail.msg.failures] == [("next", "released", True)]
    events = workers.log_events(2)
    assert [e["item_id"] for e in events if e["event"] == "job_lost_in_crash"] == ["poison"]
    assert "job_started" not in [e["event"] for e in events]
    stop_with_empty_journal(proc, tmp_path)


@pytest.mark.timeout(60)
def test_c02_broker_goes_silent_worker_reconnects_with_held_lease(broker: WorkerBroker, workers: Workers) -> None:
    """C02 from the worker side: the broker freezes while the worker holds a lease;
    the worker notices within interval x liveness, reconnects on a new socket and
    lists the lease in its HELLO; the item completes once."""
    workers.start(handler="sleep")
    broker.wait_for(protocol.Hello)
    broker.dispatch(task("c02", "sleep", params={"seconds": 2.5}, token=5))
    broker.wait_for(protocol.Heartbeat, lambda m: m.busy == 1)
    frozen_at = time.time()
    broker.silent = True
    time.sleep(1.5)  # the scripted fault itself: a frozen broker, not a wait for a condition
    broker.silent = False
    (first, second) = broker.wait_for(protocol.Hello, n=2)
    assert second.ident != first.ident  # a rebuilt DEALER socket
    assert second.msg.leases == [protocol.LeaseRef("c02", 5)]
    noticed_s = second.env.ts_ms / 1000 - frozen_at
    assert 0.3 <= noticed_s <= HB_S * LIVENESS + 0.4, noticed_s
    assert second.msg.credit == 1  # one slot + prefetch, one held
    (done,) = broker.wait_for(protocol.Complete, timeout_s=20)
    assert done.ident == second.ident and done.msg.results[0].token == 5
    # three heartbeats later, still no second COMPLETE (the confirmed one is forgotten)
    wait_until(lambda: len([s for s in broker.of(protocol.Heartbeat) if s.mono > done.mono]) >= 3, 10, "3 heartbeats")
    assert len(broker.of(protocol.Complete)) == 1


@pytest.mark.timeout(60)
def test_failures_are_typed_and_resent_until_confirmed(broker: WorkerBroker, workers: Workers, tmp_path: Path) -> None:
    """Handler error -> retryable handler_error; PermanentHandlerError -> fatal; a payload
    the claim store does not hold -> store_unavailable; an unconfirmed FAIL is resent."""
    workers.start(handler="fail", slots=2, prefetch=2)
    broker.wait_for(protocol.Hello)
    broker.drop_confirmations = 1
    missing = protocol.Blob(sha256_hex(b"never stored"), 12, None)
    broker.dispatch(
        task("soft", "fail"),
        task("hard", "fail", params={"permanent": True}),
        protocol.Task("gone", 1, "fail", missing, {}, 1),
    )
    by_id: dict[str, list[protocol.TaskFailure]] = {}
    wait_until(lambda: len({f.item_id for s in broker.of(protocol.Fail) for f in s.msg.failures}) == 3, 10, "3 failures")
    for s in broker.of(protocol.Fail):
        for f in s.msg.failures:
            by_id.setdefault(f.item_id, []).append(f)
    assert (by_id["soft"][0].reason, by_id["soft"][0].retryable) == ("handler_error", True)
    assert "HandlerError" in by_id["soft"][0].message
    assert (by_id["hard"][0].reason, by_id["hard"][0].retryable) == ("fatal", False)
    # a blob missing in this worker's store: requeued uncounted (only reconcile dead-letters it, G7)
    assert (by_id["gone"][0].reason, by_id["gone"][0].retryable) == ("store_unavailable", True)
    # the first FAIL frame went unconfirmed: it is sent again on the timer
    wait_until(lambda: sum(len(s.msg.failures) for s in broker.of(protocol.Fail)) >= 4, 10, "a resent FAIL")
    total_credit = lambda: sum(s.msg.credit for s in broker.of(protocol.Credit))  # noqa: E731
    wait_until(lambda: total_credit() == 3, 10, "3 credits back")


@pytest.mark.timeout(60)
def test_max_runtime_exceeded_fails_at_once_and_holds_the_slot(broker: WorkerBroker, workers: Workers) -> None:
    """C05 (second half): a job over its max_runtime_s is reported failed(timeout,
    retryable) at once; its slot stays lost (no credit back) until the thread returns."""
    workers.start(handler="sleep")
    broker.wait_for(protocol.Hello)
    sent = time.monotonic()
    broker.dispatch(task("slow", "sleep", params={"seconds": 1.5}, max_runtime_s=0.3))
    (fail,) = broker.wait_for(protocol.Fail)
    (f,) = fail.msg.failures
    assert (f.reason, f.retryable) == ("timeout", True)
    assert fail.mono - sent < 1.2
    # a heartbeat sent between the overrun and FAIL_ACK still lists the lease (held, then
    # unconfirmed): wait for one without it while the slot is still lost
    broker.wait_for(protocol.Heartbeat, lambda m: m.info["lost_slots"] == 1 and not m.healthy and m.leases == [])
    (credit,) = broker.wait_for(protocol.Credit)
    assert credit.mono - sent >= 1.4 and credit.msg.credit == 1
    assert not broker.of(protocol.Complete)


@pytest.mark.timeout(60)
def test_sigterm_finishes_running_gives_back_queued_says_bye(broker: WorkerBroker, workers: Workers) -> None:
    """SIGTERM: no new credit, the running item finishes (COMPLETE), the prefetched one
    is given back at once (FAIL released, retryable), BYE, exit 0."""
    proc = workers.start(handler="sleep")
    broker.wait_for(protocol.Hello)
    broker.dispatch(task("run", "sleep", params={"seconds": 1.0}), task("queued", "sleep", params={"seconds": 1.0}))
    broker.wait_for(protocol.Heartbeat, lambda m: m.busy == 1 and len(m.leases) == 2)
    proc.send_signal(signal.SIGTERM)
    (fail,) = broker.wait_for(protocol.Fail)
    assert [(f.item_id, f.reason, f.retryable) for f in fail.msg.failures] == [("queued", "released", True)]
    (done,) = broker.wait_for(protocol.Complete)
    assert done.msg.results[0].item_id == "run"
    broker.wait_for(protocol.Bye)
    assert proc.wait(20) == 0
    assert not broker.of(protocol.Credit)


@pytest.mark.timeout(60)
def test_leases_released_in_welcome_are_dropped_and_never_reported(broker: WorkerBroker, workers: Workers) -> None:
    """After a reconnect the broker's WELCOME releases both held leases: the queued
    one is dropped at once, the running one finishes quietly; neither is reported,
    neither is listed again, and the credit comes back to slots + prefetch."""
    workers.start(handler="sleep")
    broker.wait_for(protocol.Hello)
    # "a" runs long enough to still be running at the new WELCOME, even on a loaded machine
    broker.dispatch(task("a", "sleep", params={"seconds": 3.0}), task("b", "sleep", params={"seconds": 1.0}))
    broker.wait_for(protocol.Heartbeat, lambda m: m.busy == 1 and len(m.leases) == 2)
    broker.release_on_hello = {"a", "b"}
    broker.silent = True
    time.sleep(HB_S * LIVENESS + 0.2)  # the scripted fault: long enough for the worker to give up the session
    broker.silent = False
    (_, second) = broker.wait_for(protocol.Hello, n=2)
    assert {r.item_id for r in second.msg.leases} == {"a", "b"} and second.msg.credit == 0
    wait_until(lambda: sum(s.msg.credit for s in broker.of(protocol.Credit) if s.mono > second.mono) == 2, 10,
               "credit back to slots + prefetch")
    later = broker.wait_for(protocol.Heartbeat, lambda m: m.busy == 0 and m.done == 0, timeout_s=10)
    assert all(s.msg.leases == [] for s in broker.of(protocol.Heartbeat) if s.mono > second.mono + 0.05)
    assert later and not broker.of(protocol.Complete) and not broker.of(protocol.Fail)


@pytest.mark.timeout(60)
def test_config_errors_exit_78_with_one_line(workers: Workers, tmp_path: Path) -> None:
    """C11 for the worker: a typo in the config or a world-readable key is a config
    error (exit 78, one line), never a restart loop."""
    proc = workers.start(slotz=2)
    assert proc.wait(20) == ExitCode.CONFIG
    out = (tmp_path / "worker-run1.log").read_text().strip().splitlines()
    assert len(out) == 1 and out[0].startswith("ccsq-workerd: config error:") and "slotz" in out[0]
    (tmp_path / "keys" / "worker-1.key").chmod(0o644)
    proc = workers.start()
    assert proc.wait(20) == ExitCode.CONFIG
    assert "chmod 600" in (tmp_path / "worker-run2.log").read_text()


@pytest.mark.timeout(60)
def test_second_worker_on_the_same_journal_exits_75(broker: WorkerBroker, workers: Workers) -> None:
    """One journal_dir per worker: a second process on it exits TEMPFAIL (transient, restartable)."""
    first = workers.start()
    broker.wait_for(protocol.Hello)
    second = workers.start()
    assert second.wait(20) == ExitCode.TEMPFAIL
    assert first.poll() is None


@pytest.mark.timeout(60)
def test_large_payload_and_result_travel_through_the_claim_store(broker: WorkerBroker, workers: Workers,
                                                                 tmp_path: Path) -> None:
    """A payload held by reference is fetched from the claim store; a result over
    16 KiB is stored there and reported by reference; one up to 16 KiB travels inline."""
    from ccsq.common.storage.claimstore import FileStore

    store = FileStore(tmp_path / "blobs")
    big, small = os.urandom(20_000), os.urandom(16_384)
    digest = store.put(big)
    workers.start()
    broker.wait_for(protocol.Hello)
    broker.dispatch(protocol.Task("big", 1, "echo", protocol.Blob(digest, len(big), None), {}, 1), task("small", "echo", small))
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) == 2, 10, "2 results")
    results = {r.item_id: r for s in broker.of(protocol.Complete) for r in s.msg.results}
    assert results["big"].result == protocol.Blob(digest, len(big), None) and store.get(digest) == big
    assert results["small"].result.inline == small
