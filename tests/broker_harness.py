"""Test support: a real ``ccsq-brokerd`` subprocess and scripted peers (raw DEALER + codec).

No mocks: :class:`BrokerProcess` runs the daemon on an ephemeral port and waits
for its ``broker_started`` log line; :class:`ScriptedPeer` speaks the protocol
with a plain zmq DEALER so a test can misbehave on purpose (stop reading, send
garbage, replay a COMPLETE...).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w
import zmq

from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import Envelope, EnvelopeCodec
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, write_authorized_keys, write_keypair


def make_swarm(root: Path, peers: dict[str, str], **broker_overrides: Any) -> Path:
    """Create keys for ``broker`` + ``peers`` ({peer_id: role}), authorized_keys.toml
    and brokerd.toml (ephemeral port; a 5 s silence window because scripted peers
    only heartbeat when told to); returns the config path."""
    keys = root / "keys"
    entries = {}
    for pid, role in {"broker": "broker", **peers}.items():
        _priv, pub = write_keypair(keys, pid)
        entries[pid] = (role, pub.read_text().strip())
    write_authorized_keys(root / "authorized_keys.toml", entries)
    cfg = {
        "peer_id": "broker",
        "private_key": "keys/broker.key",
        "authorized_keys": "authorized_keys.toml",
        "endpoint": "tcp://127.0.0.1:0",
        "data_dir": "broker-data",
        "heartbeat_interval_s": 0.25,
        "liveness": 20,
        "lease_ttl_s": 5.0,
        "retry_backoff_base_s": 0.0,
        "min_free_disk_bytes": 0,
        "log_format": "json",
        **broker_overrides,
    }
    path = root / "brokerd.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


def wait_for(cond: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns a truthy value (returned) or raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class BrokerProcess:
    """``ccsq-brokerd --config PATH`` as a subprocess; stderr JSON lines are collected."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.endpoint = ""
        self._reader: threading.Thread | None = None

    def start(self, wait: bool = True, timeout_s: float = 20.0) -> BrokerProcess:
        self.lines = []
        self.endpoint = ""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ccsq.brokerd.main", "--config", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        if wait:
            wait_for(lambda: self.endpoint or self.proc.poll() is not None, timeout_s, what="broker_started")
            if not self.endpoint:
                raise RuntimeError(f"broker exited {self.proc.returncode}: {''.join(self.lines)[-2000:]}")
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append(line)
            if '"broker_started"' in line:
                try:
                    self.endpoint = json.loads(line)["endpoint"]
                except (ValueError, KeyError):
                    pass

    def events(self, name: str) -> list[dict]:
        out = []
        for line in list(self.lines):
            if f'"{name}"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def wait(self, timeout_s: float = 10.0) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout=timeout_s)
        if self._reader is not None:
            self._reader.join(timeout=2)
        return rc

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.signal(signal.SIGTERM)
        try:
            return self.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
            raise


class ScriptedPeer:
    """A peer driven step by step by a test: a plain DEALER and an EnvelopeCodec
    (signing every frame, like an older peer; ``session_macs=True``: offers session MACs
    in its HELLO and tags its frames once the WELCOME agrees, like BrokerLink)."""

    def __init__(self, root: Path, peer_id: str, endpoint: str, *, rcvhwm: int = 1000, rcvbuf: int = -1,
                 session_macs: bool = False) -> None:
        self.peer_id = peer_id
        self.codec = EnvelopeCodec(
            peer_id,
            load_private_key(root / "keys" / f"{peer_id}.key"),
            AuthorizedKeys(root / "authorized_keys.toml"),
            require_hello=False,
            session_macs=session_macs,
        )
        self.ctx = zmq.Context.instance()
        self.endpoint = endpoint
        self.sock: zmq.Socket | None = None
        self.connect(rcvhwm=rcvhwm, rcvbuf=rcvbuf)
        self.req = 0

    def connect(self, *, rcvhwm: int = 1000, rcvbuf: int = -1) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf > 0:
            self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sock.connect(self.endpoint)
        self.codec.new_session()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def send(self, msg: protocol.Message) -> None:
        assert self.sock is not None
        self.sock.send_multipart(self.codec.encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        assert self.sock is not None
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 5.0) -> Envelope | None:
        assert self.sock is not None
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.codec.decode(self.sock.recv_multipart(), bound_sender="broker")

    def recv_type(self, cls: type, timeout_s: float = 5.0, *, skip: tuple[type, ...] = (protocol.Heartbeat,)) -> Any:
        """Next message of type ``cls`` (skipping heartbeats and other types); TimeoutError if none."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.peer_id}: no {cls.__name__} within {timeout_s}s")
            env = self.recv(left)
            if env is None:
                continue
            if isinstance(env.message, cls):
                return env.message
            if isinstance(env.message, skip):
                continue

    def hello(self, role: str, **kw: Any) -> protocol.Welcome:
        # one peer object is one process: its reconnects replace its own live session
        # (a HELLO of another instance would be refused ID_IN_USE while that one is live)
        kw["info"] = {protocol.INSTANCE_INFO: f"harness/{self.peer_id}/{id(self):x}", **kw.get("info", {})}
        self.send(protocol.Hello(role=role, **kw))
        return self.recv_type(protocol.Welcome)

    def heartbeat(self, leases: list[protocol.LeaseRef] | None = None, **kw: Any) -> None:
        self.send(protocol.Heartbeat(leases=leases or [], **kw))

    def submit(self, items: list[protocol.SubmitItem], timeout_s: float = 5.0) -> list[protocol.SubmitResult]:
        req = self.next_req()
        self.send(protocol.Submit(req, items))
        while True:
            ack = self.recv_type(protocol.SubmitAck, timeout_s)
            if ack.req == req:
                return ack.results

    def status(self, item_ids: list[str], timeout_s: float = 5.0) -> list[protocol.ItemStatus]:
        req = self.next_req()
        self.send(protocol.Status(req, item_ids))
        while True:
            reply = self.recv_type(protocol.StatusReply, timeout_s)
            if reply.req == req:
                return reply.items

    def next_req(self) -> int:
        self.req += 1
        return self.req

    def admin_status(self, timeout_s: float = 20.0) -> dict:
        import msgpack

        req = self.next_req()
        self.send(protocol.Admin(req, "status"))
        reply = self.recv_type(protocol.AdminReply, timeout_s)
        return msgpack.unpackb(reply.body, raw=False)
