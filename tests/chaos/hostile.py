"""A hostile peer: forged, replayed, oversized, stale and random frames at the broker, all run long.

It connects straight to the broker's ROUTER (not through the proxy) on its own
DEALER sockets, so every frame it sends must be rejected (or, for the admin
HELLO it replays, accepted once) without disturbing the real peers. Each
frame kind is counted in :attr:`HostilePeer.sent`.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import msgpack
import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key

KINDS = ("random", "wrong_key", "unknown_sender", "oversized", "replay", "forged_origin", "stale", "hostile_msgpack",
         "bad_version", "garbage_signature")


class HostilePeer:
    """Sends one hostile frame every ``interval_s`` (jittered) from a daemon thread
    until :meth:`stop`. ``root`` is the swarm directory (keys, authorized_keys)."""

    def __init__(self, root: Path, endpoint: str, rng: random.Random, *, interval_s: float = 0.05,
                 max_frame_bytes: int = 1 << 20) -> None:
        self.endpoint = endpoint
        self.rng = rng
        self.interval_s = interval_s
        self.max_frame_bytes = max_frame_bytes
        self.authorized = AuthorizedKeys(root / "authorized_keys.toml")
        self.admin_key = load_private_key(root / "keys" / "admin.key")
        self.producer_key = load_private_key(root / "keys" / "producer-1.key")
        self.sent: dict[str, int] = {k: 0 for k in KINDS}
        self.errors_received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-hostile", daemon=True)
        self._ctx = zmq.Context.instance()
        self._socks: list[zmq.Socket] = []

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def start(self) -> "HostilePeer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self._socks:
            s.close(linger=0)
        self._socks.clear()

    # --- sockets ---
    def _socket(self) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100)
        s.setsockopt(zmq.SNDTIMEO, 0)
        s.connect(self.endpoint)
        self._socks.append(s)
        if len(self._socks) > 8:  # rotate: the broker sees new routing ids too
            self._socks.pop(0).close(linger=0)
        return s

    def _drain(self) -> None:
        for s in self._socks:
            while True:
                try:
                    s.recv_multipart(zmq.NOBLOCK)
                    self.errors_received += 1
                except zmq.Again:
                    break

    def _send(self, s: zmq.Socket, frames: list[bytes]) -> None:
        try:
            s.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass

    # --- frames ---
    def _codec(self, peer_id: str, key: Ed25519PrivateKey) -> EnvelopeCodec:
        return EnvelopeCodec(peer_id, key, self.authorized, max_frame_bytes=1 << 30, require_hello=False)

    def _raw_envelope(self, key: Ed25519PrivateKey, header: list) -> list[bytes]:
        payload = msgpack.packb(header, use_bin_type=True)
        return [payload, key.sign(payload)]

    def _one(self) -> None:
        kind = self.rng.choice(KINDS)
        if kind == "oversized" and self.rng.random() < 0.8:
            kind = "random"  # keep oversized frames (1 MiB each) rare
        s = self._socks[-1] if self._socks and self.rng.random() < 0.7 else self._socket()
        rng = self.rng
        if kind == "random":
            frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 4))]
        elif kind == "wrong_key":  # a real peer's id, signed with a key the broker never saw
            who = rng.choice(["worker-1", "worker-2", "producer-1", "completion-1", "admin"])
            frames = self._codec(who, Ed25519PrivateKey.generate()).encode(protocol.Hello(role="worker", credit=5))
        elif kind == "unknown_sender":
            frames = self._codec("mallory", Ed25519PrivateKey.generate()).encode(protocol.Heartbeat())
        elif kind == "oversized":
            frames = [b"\x00" * (self.max_frame_bytes + 1), b"\x00" * 64]
        elif kind == "replay":  # a valid admin HELLO, then the very same frames again on another socket
            frames = self._codec("admin", self.admin_key).encode(protocol.Hello(role="admin"))
            self._send(s, frames)
            s = self._socket()
        elif kind == "forged_origin":  # an admin session that sends a producer-signed SUBMIT
            admin = self._codec("admin", self.admin_key)
            self._send(s, admin.encode(protocol.Hello(role="admin")))
            item = protocol.SubmitItem(key=f"forged-{rng.getrandbits(64):x}", kind="echo", payload=protocol.Blob("0" * 64, 1, b"x"))
            frames = self._codec("producer-1", self.producer_key).encode(protocol.Submit(req=1, items=[item]))
        elif kind == "stale":  # valid signature, timestamp an hour old
            frames = self._raw_envelope(self.admin_key, [protocol.PROTOCOL_VERSION, int(protocol.MsgType.HELLO), "admin",
                                                         rng.getrandbits(62), 1, int(time.time() * 1000) - 3_600_000,
                                                         protocol.encode_body(protocol.Hello(role="admin"))])
        elif kind == "hostile_msgpack":  # claims a 4 GiB bin in a few bytes
            frames = [b"\x97\x01\x01\xa5admin\x01\x01\x01\xc6\xff\xff\xff\xff", b"\x00" * 64]
        elif kind == "bad_version":
            frames = self._raw_envelope(self.admin_key, [99, int(protocol.MsgType.HELLO), "admin", rng.getrandbits(62), 1,
                                                         int(time.time() * 1000), protocol.encode_body(protocol.Hello(role="admin"))])
        else:  # garbage_signature on a well-formed envelope
            frames = self._codec("admin", self.admin_key).encode(protocol.Heartbeat())
            frames[1] = rng.randbytes(64)
        self._send(s, frames)
        self.sent[kind] += 1

    def _run(self) -> None:
        self._socket()
        while not self._stop.wait(self.rng.uniform(0.2, 1.8) * self.interval_s):
            try:
                self._one()
                self._drain()
            except zmq.ZMQError:
                continue
