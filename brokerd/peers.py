"""The broker's typed peer table and in-memory lease timers (owned by the actor).

Only the broker actor mutates these. A *session* is one connected peer: it is
bound to a ZeroMQ routing id at HELLO and removed by the one disconnect rule
(silence, socket error, invalid envelope), by BYE, or when a new HELLO for the
same peer id replaces it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import time

from ccsq.common.wire import protocol


class PeerStatus(enum.Enum):
    CONNECTED = "connected"
    GONE = "gone"


@dataclasses.dataclass
class Session:
    """One connected peer."""

    # --- identity ---
    peer_id: str
    role: protocol.Role
    routing_id: bytes
    session: int  # the peer's envelope session id
    status: PeerStatus = PeerStatus.CONNECTED
    # --- liveness (monotonic seconds) ---
    connected_mono: float = dataclasses.field(default_factory=time.monotonic)
    last_recv_mono: float = dataclasses.field(default_factory=time.monotonic)
    #: last_recv_mono when a lease of this peer expired unextended (-1: never): until it sends
    #: again it is silent (frozen, cut off) and gets no DISPATCH (brokerd/dispatch.py takers)
    lease_lost_recv_mono: float = -1.0
    # --- flow control ---
    credit: int = 0  # deliveries (DISPATCH tasks / RESULT items) we may still send
    credit_msgs: int = 0  # CREDIT frames applied in this session (a relay's upstream side resyncs its credit by it)
    slots: int = 0
    kinds: tuple[str, ...] = ()  # empty: every kind
    healthy: bool = True
    busy: int = 0
    done: int = 0
    acked: int = 0  # a completion peer: items its ACKs acknowledged in this session (its "done"; heartbeats carry none)
    info: dict = dataclasses.field(default_factory=dict)  # HELLO info, updated by heartbeats
    info_hello: dict = dataclasses.field(default_factory=dict)  # HELLO info as sent
    # --- messages not yet sent while the peer's pipe is full (HWM); brokerd/outbound.py ---
    unsent: collections.deque = dataclasses.field(default_factory=collections.deque)


class PeerTable:
    """peer id -> Session, and routing id -> peer id; ``draining``: worker ids that get
    no new DISPATCH (``ccsq drain``; kept across their reconnects, and in the ledger across a
    broker restart: loaded by ``Broker._recover``)."""

    def __init__(self) -> None:
        self.by_id: dict[str, Session] = {}
        self.by_route: dict[bytes, str] = {}
        self.draining: set[str] = set()
        #: worker id -> FAILs with reason store_unavailable since the broker started (kept across
        #: the worker's reconnects); with the worker's heartbeat info store_ok/store_error, the
        #: per-worker claim-store health shown by `ccsq status` and the metrics
        self.store_failures: dict[str, int] = {}

    def note_store_failure(self, worker: str) -> None:
        """Count one store_unavailable FAIL from ``worker``."""
        self.store_failures[worker] = self.store_failures.get(worker, 0) + 1

    def store_health(self, s: Session) -> dict:
        """``store_ok`` (the worker's last heartbeat; True when it never said), the
        worker's ``store_error`` while unhealthy, and the broker's count ``store_failures``."""
        ok = s.info.get("store_ok", True) is not False
        doc: dict[str, object] = {"store_ok": ok, "store_failures": self.store_failures.get(s.peer_id, 0)}
        if not ok:
            doc["store_error"] = str(s.info.get("store_error", ""))
        return doc

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, peer_id: str) -> Session | None:
        return self.by_id.get(peer_id)

    def by_routing(self, routing_id: bytes) -> Session | None:
        pid = self.by_route.get(routing_id)
        return self.by_id.get(pid) if pid is not None else None

    def add(self, s: Session) -> Session | None:
        """Bind ``s``; returns the session it replaces (same peer id), already unbound."""
        old = self.remove(s.peer_id)
        self.by_id[s.peer_id] = s
        self.by_route[s.routing_id] = s.peer_id
        return old

    def remove(self, peer_id: str) -> Session | None:
        s = self.by_id.pop(peer_id, None)
        if s is not None:
            s.status = PeerStatus.GONE
            if self.by_route.get(s.routing_id) == peer_id:
                del self.by_route[s.routing_id]
        return s

    def sessions(self, role: protocol.Role | None = None) -> list[Session]:
        return [s for s in self.by_id.values() if role is None or s.role is role]


@dataclasses.dataclass(slots=True)
class Lease:
    item_id: str
    token: int
    worker: str
    expires_mono: float


#: Ended leases' heap entries tolerated beyond the live ones before a rebuild (LeaseTimers).
HEAP_COMPACT_MIN = 4096


class LeaseTimers:
    """item id -> Lease with expiry on the monotonic clock; a heap finds the due ones.

    Extending a lease only updates the dict; a popped heap entry whose lease was
    extended is pushed again, so each lease has one heap entry at a time. The entry of a
    lease that ended (completed, failed, released) stays until the heap holds more of them
    than live leases (and :data:`HEAP_COMPACT_MIN` at least): then the heap is rebuilt
    without them, O(1) per lease on average (otherwise each would sit there until its
    expiry and be popped then, one O(log n) pop per job in any run longer than
    ``lease_ttl_s``). Every lease
    deadline is computed here, from ``ttl_s`` (the config's ``lease_ttl_s``):
    :meth:`expiry` for the timers, :attr:`ttl_ms` for the ledger's record."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.leases: dict[str, Lease] = {}
        self.by_worker: dict[str, set[str]] = {}
        self._heap: list[tuple[float, str, int]] = []

    def _compact(self) -> None:
        """Rebuild the heap with the entries of live leases only (:meth:`discard`)."""
        leases = self.leases
        self._heap = [e for e in self._heap if (lease := leases.get(e[1])) is not None and lease.token == e[2]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self.leases)

    def expiry(self, now_mono: float) -> float:
        """The monotonic deadline of a lease granted, resumed or heartbeated at ``now_mono``."""
        return now_mono + self.ttl_s

    @property
    def ttl_ms(self) -> int:
        """The lease's time to live in ms, for the ledger's ``lease_expires_ms`` (wall clock)."""
        return int(self.ttl_s * 1000)

    def get(self, item_id: str) -> Lease | None:
        return self.leases.get(item_id)

    def add(self, item_id: str, token: int, worker: str, expires_mono: float) -> None:
        self.discard(item_id)
        self.leases[item_id] = Lease(item_id, token, worker, expires_mono)
        self.by_worker.setdefault(worker, set()).add(item_id)
        heapq.heappush(self._heap, (expires_mono, item_id, token))

    def add_many(self, tasks: list[protocol.Task], worker: str, expires_mono: float) -> None:
        """:meth:`add` for every task of one DISPATCH to ``worker`` (one expiry for them all)."""
        leases, heap, push = self.leases, self._heap, heapq.heappush
        held = self.by_worker.setdefault(worker, set())
        for t in tasks:
            item_id, token = t.item_id, t.token
            if item_id in leases:  # a lease of it still held (another token): it goes first, as in add
                self.discard(item_id)
                held = self.by_worker.setdefault(worker, set())
            leases[item_id] = Lease(item_id, token, worker, expires_mono)
            held.add(item_id)
            push(heap, (expires_mono, item_id, token))

    def discard_many(self, ended: list[tuple[str, int]]) -> None:
        """:meth:`discard` of each ``(item_id, token)`` of ``ended``; the heap is rebuilt at most once."""
        leases, by_worker = self.leases, self.by_worker
        for item_id, token in ended:
            lease = leases.get(item_id)
            if lease is None or lease.token != token:
                continue
            del leases[item_id]
            held = by_worker.get(lease.worker)
            if held is not None:
                held.discard(item_id)
                if not held:
                    del by_worker[lease.worker]
        if len(self._heap) > 2 * len(leases) + HEAP_COMPACT_MIN:
            self._compact()

    def extend(self, item_id: str, token: int, worker: str, expires_mono: float) -> bool:
        """Extend a lease held by ``worker`` with ``token``; False if it is not that lease."""
        lease = self.leases.get(item_id)
        if lease is None or lease.token != token or lease.worker != worker:
            return False
        lease.expires_mono = max(lease.expires_mono, expires_mono)
        return True

    def discard(self, item_id: str, token: int | None = None) -> None:
        lease = self.leases.get(item_id)
        if lease is None or (token is not None and lease.token != token):
            return
        del self.leases[item_id]
        held = self.by_worker.get(lease.worker)
        if held is not None:
            held.discard(item_id)
            if not held:
                del self.by_worker[lease.worker]
        if len(self._heap) > 2 * len(self.leases) + HEAP_COMPACT_MIN:
            self._compact()

    def held_by(self, worker: str) -> list[Lease]:
        return [self.leases[i] for i in self.by_worker.get(worker, ())]

    def next_due_mono(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_mono: float, limit: int) -> list[Lease]:
        """Up to ``limit`` leases whose expiry has passed (they stay in the table
        until :meth:`discard`; the caller expires them in the ledger)."""
        due: list[Lease] = []
        while self._heap and len(due) < limit and self._heap[0][0] <= now_mono:
            _, item_id, token = heapq.heappop(self._heap)
            lease = self.leases.get(item_id)
            if lease is None or lease.token != token:
                continue  # stale heap entry
            if lease.expires_mono > now_mono:
                heapq.heappush(self._heap, (lease.expires_mono, item_id, token))
                continue
            due.append(lease)
        return due

    def shift(self, delta_s: float) -> None:
        """Push every expiry ``delta_s`` later (the broker itself was stalled and could
        not hear the heartbeats that would have extended them)."""
        for lease in self.leases.values():
            lease.expires_mono += delta_s

    def requeue_check(self, lease: Lease) -> None:
        """Put a popped lease back on the heap (its ledger expiry was not applied)."""
        if self.leases.get(lease.item_id) is lease:
            heapq.heappush(self._heap, (lease.expires_mono, lease.item_id, lease.token))
