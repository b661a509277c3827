"""The real ``ccsq-workerd`` process against a scripted broker.

The scripted broker is a raw ZeroMQ ROUTER with the real EnvelopeCodec on a
background thread: it answers HELLO with WELCOME, heartbeats the worker,
records every message with its arrival time, sends the DISPATCHes a test asks
for, and confirms COMPLETE / FAIL (unless told to drop confirmations). It is
not the broker: no ledger, no leases, nothing but what each test scripts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import tomli_w
import zmq

from ccsq.common.wire import protocol as p
from ccsq.common.storage.claimstore import sha256_hex
from ccsq.common.wire.envelope import Envelope, EnvelopeCodec
from ccsq.common.wire.errors import DecodeError, ExitCode
from ccsq.common.runtime.faults import env_for
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair
from ccsq.workerd.journal import Journal

T = TypeVar("T")
HB_S = 0.2  # heartbeat interval the scripted broker hands out
LIVENESS = 3
WORKER_BIN = Path(sys.executable).parent / "ccsq-workerd"


def wait_until(pred: Callable[[], T], timeout_s: float, what: str) -> T:
    """Poll ``pred`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


@dataclasses.dataclass(frozen=True)
class Seen:
    mono: float  # arrival, time.monotonic()
    ident: bytes
    env: Envelope

    @property
    def msg(self) -> Any:
        return self.env.message


class WorkerBroker:
    """A scripted broker for one worker (``worker-1``); see the module doc."""

    def __init__(self, root: Path, *, session_macs: bool = False) -> None:
        self.root = root
        entries = {}
        for peer_id, role in (("broker", "broker"), ("worker-1", "worker")):
            priv, _ = write_keypair(root / "keys", peer_id)
            entries[peer_id] = (role, public_key_b64(load_private_key(priv)))
        write_authorized_keys(root / "authorized_keys.toml", entries)
        self.codec = EnvelopeCodec("broker", load_private_key(root / "keys" / "broker.key"),
                                   AuthorizedKeys(root / "authorized_keys.toml"), require_hello=True,
                                   session_macs=session_macs)  # answer the worker's MAC offer (bench.worker_cpu)
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.rejected: list[str] = []
        self.silent = False  # read nothing, send nothing (a frozen broker, case C02)
        self.drop_confirmations = 0  # leave the next N COMPLETE/FAIL frames unanswered
        self.release_on_hello: set[str] = set()  # item ids to list as released in WELCOME
        self.ident: bytes | None = None  # the worker's current session
        self.endpoint = ""
        self._out: queue.Queue[p.Message] = queue.Queue()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        bound = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(bound,), daemon=True, name="worker-broker")
        self._thread.start()
        assert bound.wait(5), "scripted broker did not bind"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()

    # --- script ---
    def send(self, msg: p.Message) -> None:
        """Send ``msg`` to the worker's current session."""
        self._out.put(msg)

    def dispatch(self, *tasks: p.Task) -> None:
        self.send(p.Dispatch(tasks=list(tasks)))

    # --- observations ---
    def of(self, cls: type[T]) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if isinstance(s.msg, cls)]

    def wait_for(self, cls: type, pred: Callable[[Any], bool] = lambda m: True, timeout_s: float = 20.0,
                 n: int = 1) -> list[Seen]:
        """Wait until ``n`` messages of ``cls`` satisfy ``pred``; return them."""
        return wait_until(lambda: (hits if len(hits := [s for s in self.of(cls) if pred(s.msg)]) >= n else None),
                          timeout_s, f"{n} x {cls.__name__}")

    # --- the loop (the socket lives on this thread only) ---
    def _run(self, bound: threading.Event) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind("tcp://127.0.0.1:*")
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        bound.set()
        next_hb = time.monotonic()
        try:
            while not self._stop.is_set():
                if self.silent:
                    time.sleep(0.005)
                    continue
                if sock.poll(5):
                    self._handle(sock, sock.recv_multipart())
                while not self._out.empty():
                    self._send(sock, self._out.get())
                if time.monotonic() >= next_hb:
                    next_hb = time.monotonic() + HB_S
                    self._send(sock, p.Heartbeat())
        finally:
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket, msg: p.Message) -> None:
        if self.ident is None:
            return
        try:
            sock.send_multipart([self.ident, *self.codec.encode(msg, channel=self.ident)])
        except zmq.ZMQError as exc:
            self.rejected.append(f"send: {exc}")

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        ident, rest = frames[0], frames[1:]
        try:
            env = self.codec.decode(rest, bound_sender="worker-1")
        except DecodeError as exc:  # e.g. a retired session's late heartbeat
            self.rejected.append(f"{exc.code}: {exc}")
            return
        with self.lock:
            self.seen.append(Seen(time.monotonic(), ident, env))
        msg = env.message
        if isinstance(msg, p.Hello):
            self.ident = ident
            self._send(sock, p.Welcome(
                heartbeat_interval_s=HB_S, liveness=LIVENESS, broker_epoch=1, mac_x25519=self.codec.open_session_mac(env, ident),
                resumed=[ref for ref in msg.leases if ref.item_id not in self.release_on_hello],
                released=[ref for ref in msg.leases if ref.item_id in self.release_on_hello]))
        elif isinstance(msg, (p.Complete, p.Fail)):
            if self.drop_confirmations > 0:
                self.drop_confirmations -= 1
                return
            reports = msg.results if isinstance(msg, p.Complete) else msg.failures
            outcomes = [p.ItemOutcome(r.item_id, r.token, p.Outcome.ACCEPTED.value) for r in reports]
            self._send(sock, p.CompleteAck(outcomes=outcomes) if isinstance(msg, p.Complete)
                       else p.FailAck(outcomes=outcomes))


def task(item_id: str, kind: str, payload: bytes = b"payload", token: int = 1, **kw: Any) -> p.Task:
    blob = p.Blob(sha256_hex(payload), len(payload), payload)
    return p.Task(item_id=item_id, token=token, kind=kind, payload=blob, params=kw.pop("params", {}), attempt=1, **kw)


class Workers:
    """Starts ``ccsq-workerd`` processes on configs written next to the broker's keys."""

    def __init__(self, root: Path, broker: WorkerBroker) -> None:
        self.root = root
        self.broker = broker
        self.procs: list[subprocess.Popen] = []
        self.starts = 0

    def config(self, **over: Any) -> Path:
        cfg = {
            "peer_id": "worker-1",
            "private_key": "keys/worker-1.key",
            "authorized_keys": "authorized_keys.toml",
            "broker_endpoint": self.broker.endpoint,
            "broker_id": "broker",
            "handler": "echo",
            "slots": 1,
            "prefetch": 1,
            "claim_store": "file://blobs",
            "journal_dir": "journal",
            "log_format": "json",
            "reconnect_backoff_max_s": 0.2,
            "hello_timeout_s": 2.0,
            "drain_timeout_s": 5.0,
        }
        cfg.update(over)
        if cfg["claim_store"] == "file://blobs":
            (self.root / "blobs").mkdir(exist_ok=True)
        path = self.root / "workerd-1.toml"
        path.write_text(tomli_w.dumps(cfg))
        return path

    def start(self, env: dict[str, str] | None = None, **over: Any) -> subprocess.Popen:
        self.starts += 1
        log = open(self.root / f"worker-run{self.starts}.log", "wb")
        proc = subprocess.Popen([str(WORKER_BIN), "--config", str(self.config(**over))], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        log.close()
        self.procs.append(proc)
        return proc

    def log_events(self, run: int) -> list[dict]:
        out = []
        for line in (self.root / f"worker-run{run}.log").read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[WorkerBroker]:
    b = WorkerBroker(tmp_path)
    yield b
    b.close()


@pytest.fixture
def workers(tmp_path: Path, broker: WorkerBroker) -> Iterator[Workers]:
    w = Workers(tmp_path, broker)
    yield w
    w.kill_all()


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


# --- tests -------------------------------------------------------------------------------------

def stop_with_empty_journal(proc, tmp_path: Path) -> None:
    """SIGTERM the worker, which exits 0; everything it held was confirmed and forgotten:
    its journal is empty."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    j = Journal.open(tmp_path / "journal")
    assert j.entries() == []
    j.close()

@pytest.mark.timeout(60)
def test_c06_heartbeats_flow_while_a_cpu_bound_handler_runs(broker: WorkerBroker, workers: Workers) -> None:
    """C06: a handler burns pure-Python CPU for 3 x (heartbeat_interval x liveness);
    the broker sees no heartbeat gap over 1.5 x interval, every heartbeat lists the
    lease, the loop-lag probe stays small, and the item completes once; credit
    starts at slots + prefetch and one credit comes back after the COMPLETE."""
    burn_s = 3 * HB_S * LIVENESS
    workers.start(handler="sleep")
    (hello,) = broker.wait_for(p.Hello)
    assert hello.msg.credit == 2 and hello.msg.slots == 1 and hello.msg.kinds == ["sleep"]
    broker.dispatch(task("c06", "sleep", params={"seconds": burn_s, "burn": True}))
    (done,) = broker.wait_for(p.Complete, timeout_s=30)
    assert json.loads(done.msg.results[0].result.inline)["burn"] is True
    assert done.msg.results[0].runtime_s >= burn_s
    beats = [s for s in broker.of(p.Heartbeat) if s.mono > hello.mono]
    during = [s for s in beats if s.mono <= done.mono]
    assert len(during) >= burn_s / HB_S - 1
    assert max(_gaps([hello.mono] + [s.mono for s in during] + [done.mono])) <= 1.5 * HB_S
    running = [s for s in during if s.msg.busy == 1]
    assert len(running) >= (burn_s / HB_S) - 2
    assert all(s.msg.leases == [p.LeaseRef("c06", 1)] for s in running)
    assert max(s.msg.info["loop_lag_max_ms"] for s in beats) < 150.0  # on the loop it would be ~1800
    credit = broker.wait_for(p.Credit)
    assert credit[0].msg.credit == 1 and credit[0].mono >= done.mono
    assert len(broker.of(p.Complete)) == 1


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
    (hello,) = broker.wait_for(p.Hello)
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
    broker.wait_for(p.Hello)
    broker.dispatch(task("j1", "echo", payload=b"journal me", token=7))
    assert proc.wait(20) == -signal.SIGKILL
    assert not broker.of(p.Complete)
    proc = workers.start()
    (hello,) = broker.wait_for(p.Hello, n=2)[1:]
    assert hello.msg.leases == [p.LeaseRef("j1", 7)]
    assert hello.msg.credit == 2  # a finished result holds no slot
    (done,) = broker.wait_for(p.Complete)
    (res,) = done.msg.results
    assert (res.item_id, res.token, res.result.inline) == ("j1", 7, b"journal me")
    assert [e["event"] for e in workers.log_events(1)].count("job_started") == 1
    events = [e["event"] for e in workers.log_events(2)]
    assert "job_started" not in events and "journal_recovered" in events
    # confirmed -> forgotten: after a clean stop the journal is empty
    wait_until(lambda: not any(s.msg.leases for s in broker.of(p.Heartbeat) if s.mono > done.mono),
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
    broker.wait_for(p.Hello)
    broker.dispatch(task("poison", "fail", params={"kill_worker": True}, token=3), task("next", "fail", token=4))
    assert proc.wait(20) == -signal.SIGKILL
    proc = workers.start(handler="fail")
    (hello,) = broker.wait_for(p.Hello, n=2)[1:]
    assert hello.msg.leases == [p.LeaseRef("next", 4)] and hello.msg.credit == 2
    (fail,) = broker.wait_for(p.Fail)
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
    broker.wait_for(p.Hello)
    broker.dispatch(task("c02", "sleep", params={"seconds": 2.5}, token=5))
    broker.wait_for(p.Heartbeat, lambda m: m.busy == 1)
    frozen_at = time.time()
    broker.silent = True
    time.sleep(1.5)  # the scripted fault itself: a frozen broker, not a wait for a condition
    broker.silent = False
    (first, second) = broker.wait_for(p.Hello, n=2)
    assert second.ident != first.ident  # a rebuilt DEALER socket
    assert second.msg.leases == [p.LeaseRef("c02", 5)]
    noticed_s = second.env.ts_ms / 1000 - frozen_at
    assert 0.3 <= noticed_s <= HB_S * LIVENESS + 0.4, noticed_s
    assert second.msg.credit == 1  # one slot + prefetch, one held
    (done,) = broker.wait_for(p.Complete, timeout_s=20)
    assert done.ident == second.ident and done.msg.results[0].token == 5
    # three heartbeats later, still no second COMPLETE (the confirmed one is forgotten)
    wait_until(lambda: len([s for s in broker.of(p.Heartbeat) if s.mono > done.mono]) >= 3, 10, "3 heartbeats")
    assert len(broker.of(p.Complete)) == 1


@pytest.mark.timeout(60)
def test_failures_are_typed_and_resent_until_confirmed(broker: WorkerBroker, workers: Workers, tmp_path: Path) -> None:
    """Handler error -> retryable handler_error; PermanentHandlerError -> fatal; a payload
    the claim store does not hold -> store_unavailable; an unconfirmed FAIL is resent."""
    workers.start(handler="fail", slots=2, prefetch=2)
    broker.wait_for(p.Hello)
    broker.drop_confirmations = 1
    missing = p.Blob(sha256_hex(b"never stored"), 12, None)
    broker.dispatch(
        task("soft", "fail"),
        task("hard", "fail", params={"permanent": True}),
        p.Task("gone", 1, "fail", missing, {}, 1),
    )
    by_id: dict[str, list[p.TaskFailure]] = {}
    wait_until(lambda: len({f.item_id for s in broker.of(p.Fail) for f in s.msg.failures}) == 3, 10, "3 failures")
    for s in broker.of(p.Fail):
        for f in s.msg.failures:
            by_id.setdefault(f.item_id, []).append(f)
    assert (by_id["soft"][0].reason, by_id["soft"][0].retryable) == ("handler_error", True)
    assert "HandlerError" in by_id["soft"][0].message
    assert (by_id["hard"][0].reason, by_id["hard"][0].retryable) == ("fatal", False)
    # a blob missing in this worker's store: requeued uncounted (only reconcile dead-letters it, G7)
    assert (by_id["gone"][0].reason, by_id["gone"][0].retryable) == ("store_unavailable", True)
    # the first FAIL frame went unconfirmed: it is sent again on the timer
    wait_until(lambda: sum(len(s.msg.failures) for s in broker.of(p.Fail)) >= 4, 10, "a resent FAIL")
    total_credit = lambda: sum(s.msg.credit for s in broker.of(p.Credit))  # noqa: E731
    wait_until(lambda: total_credit() == 3, 10, "3 credits back")


@pytest.mark.timeout(60)
def test_max_runtime_exceeded_fails_at_once_and_holds_the_slot(broker: WorkerBroker, workers: Workers) -> None:
    """C05 (second half): a job over its max_runtime_s is reported failed(timeout,
    retryable) at once; its slot stays lost (no credit back) until the thread returns."""
    workers.start(handler="sleep")
    broker.wait_for(p.Hello)
    sent = time.monotonic()
    broker.dispatch(task("slow", "sleep", params={"seconds": 1.5}, max_runtime_s=0.3))
    (fail,) = broker.wait_for(p.Fail)
    (f,) = fail.msg.failures
    assert (f.reason, f.retryable) == ("timeout", True)
    assert fail.mono - sent < 1.2
    # a heartbeat sent between the overrun and FAIL_ACK still lists the lease (held, then
    # unconfirmed): wait for one without it while the slot is still lost
    broker.wait_for(p.Heartbeat, lambda m: m.info["lost_slots"] == 1 and not m.healthy and m.leases == [])
    (credit,) = broker.wait_for(p.Credit)
    assert credit.mono - sent >= 1.4 and credit.msg.credit == 1
    assert not broker.of(p.Complete)


@pytest.mark.timeout(60)
def test_sigterm_finishes_running_gives_back_queued_says_bye(broker: WorkerBroker, workers: Workers) -> None:
    """SIGTERM: no new credit, the running item finishes (COMPLETE), the prefetched one
    is given back at once (FAIL released, retryable), BYE, exit 0."""
    proc = workers.start(handler="sleep")
    broker.wait_for(p.Hello)
    broker.dispatch(task("run", "sleep", params={"seconds": 1.0}), task("queued", "sleep", params={"seconds": 1.0}))
    broker.wait_for(p.Heartbeat, lambda m: m.busy == 1 and len(m.leases) == 2)
    proc.send_signal(signal.SIGTERM)
    (fail,) = broker.wait_for(p.Fail)
    assert [(f.item_id, f.reason, f.retryable) for f in fail.msg.failures] == [("queued", "released", True)]
    (done,) = broker.wait_for(p.Complete)
    assert done.msg.results[0].item_id == "run"
    broker.wait_for(p.Bye)
    assert proc.wait(20) == 0
    assert not broker.of(p.Credit)


@pytest.mark.timeout(60)
def test_leases_released_in_welcome_are_dropped_and_never_reported(broker: WorkerBroker, workers: Workers) -> None:
    """After a reconnect the broker's WELCOME releases both held leases: the queued
    one is dropped at once, the running one finishes quietly; neither is reported,
    neither is listed again, and the credit comes back to slots + prefetch."""
    workers.start(handler="sleep")
    broker.wait_for(p.Hello)
    # "a" runs long enough to still be running at the new WELCOME, even on a loaded machine
    broker.dispatch(task("a", "sleep", params={"seconds": 3.0}), task("b", "sleep", params={"seconds": 1.0}))
    broker.wait_for(p.Heartbeat, lambda m: m.busy == 1 and len(m.leases) == 2)
    broker.release_on_hello = {"a", "b"}
    broker.silent = True
    time.sleep(HB_S * LIVENESS + 0.2)  # the scripted fault: long enough for the worker to give up the session
    broker.silent = False
    (_, second) = broker.wait_for(p.Hello, n=2)
    assert {r.item_id for r in second.msg.leases} == {"a", "b"} and second.msg.credit == 0
    wait_until(lambda: sum(s.msg.credit for s in broker.of(p.Credit) if s.mono > second.mono) == 2, 10,
               "credit back to slots + prefetch")
    later = broker.wait_for(p.Heartbeat, lambda m: m.busy == 0 and m.done == 0, timeout_s=10)
    assert all(s.msg.leases == [] for s in broker.of(p.Heartbeat) if s.mono > second.mono + 0.05)
    assert later and not broker.of(p.Complete) and not broker.of(p.Fail)


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
    broker.wait_for(p.Hello)
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
    broker.wait_for(p.Hello)
    broker.dispatch(p.Task("big", 1, "echo", p.Blob(digest, len(big), None), {}, 1), task("small", "echo", small))
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(p.Complete)) == 2, 10, "2 results")
    results = {r.item_id: r for s in broker.of(p.Complete) for r in s.msg.results}
    assert results["big"].result == p.Blob(digest, len(big), None) and store.get(digest) == big
    assert results["small"].result.inline == small
