"""A misbehaving peer for the HA peer tests: a standby broker's peer endpoint, scripted.

A real ZeroMQ ROUTER on a background thread with the real :class:`EnvelopeCodec`,
signing as the swarm's broker (the shared service identity of a pair, docs/ha.md: the
same ``keys/broker.key`` every broker of the pair holds). It answers every HELLO with
``Error(NOT_PRIMARY, primary=...)`` as a standby does, and nothing else. ``primaries``
scripts the ``primary`` field of successive answers: the last entry repeats
(``["", "", "tcp://..."]``: an election twice, then the primary's endpoint).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key


class StandbyStub:
    """Listens on ``endpoint`` between :meth:`start` and :meth:`close`; ``hellos`` records
    (monotonic time, peer id, primary answered) per HELLO, under ``lock``."""

    def __init__(self, root: Path, endpoint: str, primaries: list[str]) -> None:
        self.endpoint = endpoint
        self.primaries = list(primaries) or [""]
        self.codec = EnvelopeCodec("broker", load_private_key(root / "keys" / "broker.key"),
                                   AuthorizedKeys(root / "authorized_keys.toml"), require_hello=True)
        self.lock = threading.Lock()
        self.hellos: list[tuple[float, str, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()

    def start(self) -> StandbyStub:
        bound = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(bound,), name="standby-stub", daemon=True)
        self._thread.start()
        if not bound.wait(5):
            raise RuntimeError("standby stub did not bind")
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ctx.term()

    def __enter__(self) -> StandbyStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hello_count(self, peer_id: str | None = None) -> int:
        with self.lock:
            return sum(1 for _, pid, _ in self.hellos if peer_id is None or pid == peer_id)

    def _run(self, bound: threading.Event) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        bound.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(50)):
                    continue
                routing_id, *frames = sock.recv_multipart()
                try:
                    env = self.codec.decode(frames)
                except DecodeError as exc:
                    with self.lock:
                        self.errors.append(f"{exc.code}: {exc}")
                    continue
                if not isinstance(env.message, protocol.Hello):
                    continue  # a standby serves no session: anything else is dropped
                with self.lock:
                    primary = self.primaries[min(len(self.hellos), len(self.primaries) - 1)]
                    self.hellos.append((time.monotonic(), env.sender, primary))
                sentence = ("this broker is a standby; the primary is at " + primary) if primary else \
                    "this broker is a standby; no primary holds the swarm's key (an election is on)"
                sock.send_multipart([routing_id, *self.codec.encode(protocol.Error(protocol.REJECT_NOT_PRIMARY, sentence, env.seq,
                                                                               primary=primary))])
        finally:
            sock.close(linger=0)
