"""A small scripted broker for producer / completion-service tests.

A real ZeroMQ ROUTER and the real :class:`EnvelopeCodec` (signed frames), run
on a background thread, answering HELLO, SUBMIT, STATUS, CREDIT and ACK (and ADMIN, when
its ``admin`` answer function is set) by the
protocol's semantics, with knobs to misbehave (drop or delay SUBMITs, refuse
with QUEUE_FULL, go silent). It is not the broker: no ledger, state in memory.
With ``auto_complete`` every submitted item immediately becomes a completed
(echo) result that is delivered to the completion peer, credit permitting,
and redelivered (``redelivery=True``) when that peer opens a new session
before acknowledging it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import zmq

from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair


def make_pki(root: Path, peers: dict[str, str]) -> Path:
    """Key pairs for ``{"broker": "broker", peer_id: role, ...}`` under ``root/keys``;
    returns the authorized-keys path."""
    entries = {}
    for peer_id, role in peers.items():
        priv, _ = write_keypair(root / "keys", peer_id)
        entries[peer_id] = (role, public_key_b64(load_private_key(priv)))
    ak = root / "authorized_keys.toml"
    write_authorized_keys(ak, entries)
    return ak


@dataclasses.dataclass
class _Peer:
    peer_id: str
    role: protocol.Role
    session: int
    credit: int = 0
    in_flight: dict[str, protocol.Delivery] = dataclasses.field(default_factory=dict)


class ScriptedBroker:
    """Listens on ``endpoint`` once :meth:`start` is called. All recorded state is
    guarded by ``lock``; read it through the helper methods."""

    def __init__(self, root: Path, endpoint: str, *, heartbeat_interval_s: float = 0.2, liveness: int = 5,
                 auto_complete: bool = False) -> None:
        self.endpoint = endpoint
        self.codec = EnvelopeCodec("broker", load_private_key(root / "keys" / "broker.key"),
                                   AuthorizedKeys(root / "authorized_keys.toml"), require_hello=True)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.liveness = liveness
        self.auto_complete = auto_complete
        self.lock = threading.Lock()
        # --- knobs (set before or while running) ---
        self.drop_submit_frames = 0  # ignore the next N SUBMIT frames
        self.submit_delay_s = 0.0  # answer SUBMITs this late
        self.ack_ok_delay_s = 0.0  # answer ACKs this late (a broker slow to commit them)
        self.queue_full_frames = 0  # answer the next N SUBMIT frames with QUEUE_FULL for every item
        self.silent = False  # read nothing, send nothing (a frozen broker); set with set_silent()
        #: admin commands: ``admin(command, args) -> (ok, body dict or error text)``; None: ADMIN is not answered
        self.admin = None
        self.admin_calls: list[tuple[str, dict]] = []
        self._silent_seen = threading.Event()
        # --- recorded state ---
        self.item_by_key: dict[str, str] = {}
        self.items: dict[str, protocol.SubmitItem] = {}  # item_id -> item
        self.state: dict[str, str] = {}  # item_id -> ItemState value
        self.submit_frames = 0
        self.submitted_keys: list[str] = []  # every key received, duplicates included
        self.duplicate_submits = 0
        self.hellos: list[tuple[str, str]] = []  # (peer_id, role)
        self.acks: list[tuple[float, list[str]]] = []  # (monotonic time, item ids) per ACK frame
        self.ack_count: dict[str, int] = {}
        self.quarantined: dict[str, str] = {}  # item id -> error, from ACK.quarantined
        self.deliveries: list[protocol.Delivery] = []  # every delivery sent (redeliveries included)
        self.max_in_flight = 0  # most unacknowledged deliveries a completion peer held at once
        self.errors: list[str] = []
        self.byes: list[str] = []  # peer ids that said BYE
        # --- internals ---
        self._ready: list[protocol.Delivery] = []
        self._peers: dict[bytes, _Peer] = {}
        self._delayed: list[tuple[float, bytes, protocol.Message]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()

    # --- lifecycle ---
    def start(self) -> ScriptedBroker:
        bound = threading.Event()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(bound,), name="scripted-broker", daemon=True)
        self._thread.start()
        if not bound.wait(5):
            raise RuntimeError("scripted broker did not bind")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._peers.clear()

    def close(self) -> None:
        self.stop()
        self._ctx.term()

    def __enter__(self) -> ScriptedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_silent(self, silent: bool) -> None:
        """Freeze (or thaw) the broker; returns once the loop has stopped handling frames."""
        self._silent_seen.clear()
        self.silent = silent
        if silent and self._thread is not None and not self._silent_seen.wait(5):
            raise RuntimeError("scripted broker loop did not go silent")

    # --- observations ---
    def acked_ids(self) -> set[str]:
        with self.lock:
            return set(self.ack_count)

    def ack_frames(self) -> int:
        with self.lock:
            return len(self.acks)

    def add_completed(self, delivery: protocol.Delivery) -> None:
        """Queue a completed result for the completion peer."""
        with self.lock:
            self.state[delivery.item_id] = protocol.ItemState.COMPLETED.value
            self._ready.append(delivery)

    # --- the loop ---
    def _run(self, bound: threading.Event) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind(self.endpoint)
        bound.set()
        next_hb = time.monotonic()
        try:
            while not self._stop.is_set():
                if self.silent:
                    self._silent_seen.set()
                    time.sleep(0.01)
                    continue
                if sock.poll(10):
                    frames = sock.recv_multipart()
                    self._handle(sock, frames)
                now = time.monotonic()
                with self.lock:
                    due = [d for d in self._delayed if d[0] <= now]
                    self._delayed = [d for d in self._delayed if d[0] > now]
                for _, ident, msg in due:
                    self._send(sock, ident, msg)
                self._deliver(sock)
                if now >= next_hb:
                    next_hb = now + self.heartbeat_interval_s
                    for ident in list(self._peers):
                        self._send(sock, ident, protocol.Heartbeat())
        finally:
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket, ident: bytes, msg: protocol.Message) -> None:
        try:
            sock.send_multipart([ident, *self.codec.encode(msg)])
        except zmq.ZMQError as exc:  # unroutable: the peer is gone, its results go back to ready
            gone = self._peers.pop(ident, None)
            if gone is not None:
                self._requeue(gone)
            self.errors.append(f"send to {ident!r}: {exc}")

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        ident, rest = frames[0], frames[1:]
        peer = self._peers.get(ident)
        try:
            env = self.codec.decode(rest, bound_sender=peer.peer_id if peer else None)
        except DecodeError as exc:
            self.errors.append(f"{exc.code}: {exc}")
            return
        msg = env.message
        if isinstance(msg, protocol.Hello):
            self._on_hello(sock, ident, env.sender, env.role, env.session, msg)
        elif peer is None or peer.session != env.session:
            return
        elif isinstance(msg, protocol.Submit):
            self._on_submit(sock, ident, msg)
        elif isinstance(msg, protocol.Status):
            with self.lock:
                items = [protocol.ItemStatus(item_id=i, state=self.state.get(i, "unknown")) for i in msg.item_ids]
            self._send(sock, ident, protocol.StatusReply(req=msg.req, items=items))
        elif isinstance(msg, protocol.Admin) and self.admin is not None:
            import msgpack

            with self.lock:
                self.admin_calls.append((msg.command, dict(msg.args)))
            ok, out = self.admin(msg.command, dict(msg.args))
            self._send(sock, ident, protocol.AdminReply(msg.req, True, body=msgpack.packb(out, use_bin_type=True)) if ok
                       else protocol.AdminReply(msg.req, False, error=str(out)))
        elif isinstance(msg, protocol.Credit):
            peer.credit += msg.credit
        elif isinstance(msg, protocol.Ack):
            self._on_ack(sock, ident, peer, msg)
        elif isinstance(msg, protocol.Bye):
            with self.lock:
                self.byes.append(peer.peer_id)
            self._requeue(peer)
            self._peers.pop(ident, None)

    def _on_hello(self, sock, ident, sender, role, session, msg: protocol.Hello) -> None:
        for other_ident, other in list(self._peers.items()):
            if other.peer_id == sender:
                self._requeue(other)
                del self._peers[other_ident]
        self._peers[ident] = _Peer(sender, role, session, credit=msg.credit)
        with self.lock:
            self.hellos.append((sender, role.value))
        self._send(sock, ident, protocol.Welcome(heartbeat_interval_s=self.heartbeat_interval_s, liveness=self.liveness,
                                          broker_epoch=1))

    def _requeue(self, peer: _Peer) -> None:
        with self.lock:
            for d in peer.in_flight.values():
                if self.state.get(d.item_id) == protocol.ItemState.COMPLETED.value:
                    self._ready.append(dataclasses.replace(d, redelivery=True))
            peer.in_flight.clear()

    def _on_submit(self, sock, ident, msg: protocol.Submit) -> None:
        with self.lock:
            self.submit_frames += 1
            if self.drop_submit_frames > 0:
                self.drop_submit_frames -= 1
                return
            if self.queue_full_frames > 0:
                self.queue_full_frames -= 1
                results = [protocol.SubmitResult(key=it.key, item_id="", error="QUEUE_FULL", message="scripted: full")
                           for it in msg.items]
                reply = protocol.SubmitAck(req=msg.req, results=results)
            else:
                results = []
                for it in msg.items:
                    self.submitted_keys.append(it.key)
                    dup = it.key in self.item_by_key
                    if dup:
                        self.duplicate_submits += 1
                    else:
                        item_id = f"i{len(self.items) + 1:06d}"
                        self.item_by_key[it.key] = item_id
                        self.items[item_id] = it
                        self.state[item_id] = protocol.ItemState.READY.value
                        if self.auto_complete:
                            self.state[item_id] = protocol.ItemState.COMPLETED.value
                            self._ready.append(protocol.Delivery(
                                item_id=item_id, key=it.key, kind=it.kind, result=it.payload, params=it.params,
                                attempt=1, handler="echo", handler_version="test", completed_ts=time.time()))
                    results.append(protocol.SubmitResult(key=it.key, item_id=self.item_by_key[it.key], duplicate=dup))
                reply = protocol.SubmitAck(req=msg.req, results=results)
            if self.submit_delay_s:
                self._delayed.append((time.monotonic() + self.submit_delay_s, ident, reply))
                return
        self._send(sock, ident, reply)

    def _on_ack(self, sock, ident, peer: _Peer, msg: protocol.Ack) -> None:
        known, unknown = [], []
        with self.lock:
            self.acks.append((time.monotonic(), list(msg.item_ids)))
            self.quarantined.update({q.item_id: q.error for q in msg.quarantined})
            for i in msg.item_ids:
                self.ack_count[i] = self.ack_count.get(i, 0) + 1
                if self.state.get(i) == protocol.ItemState.COMPLETED.value:
                    self.state[i] = protocol.ItemState.ACKNOWLEDGED.value
                    known.append(i)
                else:
                    unknown.append(i)
                peer.in_flight.pop(i, None)
        reply = protocol.AckOk(item_ids=known, unknown=unknown)
        if self.ack_ok_delay_s:
            self._delayed.append((time.monotonic() + self.ack_ok_delay_s, ident, reply))
            return
        self._send(sock, ident, reply)

    def _deliver(self, sock) -> None:
        for ident, peer in list(self._peers.items()):
            if peer.role is not protocol.Role.COMPLETION or peer.credit <= 0:
                continue
            with self.lock:
                batch = []
                while self._ready and len(batch) < min(peer.credit, 256):
                    d = self._ready.pop(0)
                    if self.state.get(d.item_id) != protocol.ItemState.COMPLETED.value:
                        continue  # acknowledged meanwhile
                    batch.append(d)
                for d in batch:
                    peer.in_flight[d.item_id] = d
                self.deliveries.extend(batch)
                self.max_in_flight = max(self.max_in_flight, len(peer.in_flight))
            if batch:
                peer.credit -= len(batch)
                self._send(sock, ident, protocol.Result(deliveries=batch))


def write_config(root: Path, name: str, peer_id: str, endpoint: str, **extra: object) -> Path:
    """Write ``root/<name>.toml`` for ``peer_id`` (fast test timings); returns its path."""
    import tomli_w

    doc = {"peer_id": peer_id, "private_key": f"keys/{peer_id}.key", "authorized_keys": "authorized_keys.toml",
           "broker_endpoint": endpoint, "broker_id": "broker", "reconnect_backoff_max_s": 0.2,
           "hello_timeout_s": 1.0, "log_format": "json", **extra}
    path = root / f"{name}.toml"
    path.write_text(tomli_w.dumps(doc))
    store = str(doc.get("claim_store", "file://blobs"))
    if store.startswith("file://") and name != "admin":  # daemons refuse a store root that does not exist
        (root / store[len("file://"):]).mkdir(parents=True, exist_ok=True)
    return path
