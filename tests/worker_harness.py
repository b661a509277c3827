"""The scripted broker of the worker tests and the ``ccsq-workerd`` launcher (support code,
not a test file: the worker tests and ``bench/worker_cpu.py`` import it).

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

from ccsq.common.wire import protocol
from ccsq.common.storage.claimstore import sha256_hex
from ccsq.common.wire.envelope import Envelope, EnvelopeCodec
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair
from ccsq.workerd.worker_journal import Journal

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
        self._out: queue.Queue[protocol.Message] = queue.Queue()
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
    def send(self, msg: protocol.Message) -> None:
        """Send ``msg`` to the worker's current session."""
        self._out.put(msg)

    def dispatch(self, *tasks: protocol.Task) -> None:
        self.send(protocol.Dispatch(tasks=list(tasks)))

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
                    self._send(sock, protocol.Heartbeat())
        finally:
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket, msg: protocol.Message) -> None:
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
        if isinstance(msg, protocol.Hello):
            self.ident = ident
            self._send(sock, protocol.Welcome(
                heartbeat_interval_s=HB_S, liveness=LIVENESS, broker_epoch=1, mac_x25519=self.codec.open_session_mac(env, ident),
                resumed=[ref for ref in msg.leases if ref.item_id not in self.release_on_hello],
                released=[ref for ref in msg.leases if ref.item_id in self.release_on_hello]))
        elif isinstance(msg, (protocol.Complete, protocol.Fail)):
            if self.drop_confirmations > 0:
                self.drop_confirmations -= 1
                return
            reports = msg.results if isinstance(msg, protocol.Complete) else msg.failures
            outcomes = [protocol.ItemOutcome(r.item_id, r.token, protocol.Outcome.ACCEPTED.value) for r in reports]
            self._send(sock, protocol.CompleteAck(outcomes=outcomes) if isinstance(msg, protocol.Complete)
                       else protocol.FailAck(outcomes=outcomes))


def task(item_id: str, kind: str, payload: bytes = b"payload", token: int = 1, **kw: Any) -> protocol.Task:
    blob = protocol.Blob(sha256_hex(payload), len(payload), payload)
    return protocol.Task(item_id=item_id, token=token, kind=kind, payload=blob, params=kw.pop("params", {}), attempt=1, **kw)


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


def stop_with_empty_journal(proc, tmp_path: Path) -> None:
    """SIGTERM the worker, which exits 0; everything it held was confirmed and forgotten:
    its journal is empty."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    j = Journal.open(tmp_path / "journal")
    assert j.entries() == []
    j.close()
