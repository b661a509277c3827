"""The simulated world: one seeded scheduler, the broker's real actor, simulated peers.

Nothing here runs on wall time: :class:`SimClock` is the only clock (the broker's
``Clock``, every codec's ``wall_ms``), and :class:`World.run` pops events from one
heap in (time, sequence) order, so a seed (and a fault list) is one history.

What is real: ``brokerd.actor.Broker`` and every module it drives (intake with the
real envelope codec and session MACs, sessions, dispatch, delivery, outbound, the
ledger rules on a real LMDB environment in a temporary directory). What is simulated:
the network (:class:`Conn`), the disk under LMDB at a crash (:meth:`World._power_loss`),
and the peers (``tests/sim/peers.py``), which follow the protocol as the real ones do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ccsq.brokerd import actor as actor_mod
from ccsq.brokerd import transport
from ccsq.brokerd.actor import Broker
from ccsq.brokerd.clock import Clock
from ccsq.brokerd.ledger import Ledger, LedgerTxn, Policy
from ccsq.brokerd.ledger import store as store_mod
from ccsq.brokerd import gaps
from ccsq.common.wire import envelope as envelope_mod
from ccsq.common.wire import protocol
from ccsq.common.wire.config import BrokerConfig
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.keys import AuthorizedKeys, public_key_b64, write_authorized_keys
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

BASE_WALL_MS = 1_800_000_000_000  # the simulated wall clock starts here (2027)
LATENCY_S = (0.0002, 0.002)  # one frame's network latency, uniform
TURN_COST_S = 0.003  # simulated time one broker turn takes (a commit's fsync), plus per frame and per record written
TURN_COST_PER_FRAME_S = 0.00005  # decoding a frame (MAC, msgpack)
TURN_COST_PER_RECORD_S = 0.000025  # an item operation (brokerd/actor.py: ~25 us each), so a loaded turn batches more
RESTART_DELAY_S = (0.2, 2.0)  # a crashed process comes back after this
STUCK_S = 90.0  # once the faults are over, an item must end at least this often (leases: 8 s, backoff <= 1 s)
S, L, C, A, D, E = (protocol.ItemState.READY.value, protocol.ItemState.LEASED.value, protocol.ItemState.COMPLETED.value,
                    protocol.ItemState.ACKNOWLEDGED.value, protocol.ItemState.DEAD.value, protocol.ItemState.EXPIRED.value)


class SimCrash(BaseException):
    """The broker process dies here (power loss): raised inside its turn, caught by the world."""


class Violation(Exception):
    """An invariant broke: ``kind`` names it, ``detail`` says how."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class SimClock(Clock):
    """The world's time: ``t`` (simulated seconds) drives the monotonic clock; the broker's
    wall clock is ``t`` from :data:`BASE_WALL_MS` plus ``jump_ms`` (an NTP step)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.jump_ms = 0

    def monotonic_s(self) -> float:
        return 1000.0 + self.t

    def wall_ms(self) -> int:
        return BASE_WALL_MS + int(self.t * 1000) + self.jump_ms

    def true_wall_ms(self) -> int:
        return BASE_WALL_MS + int(self.t * 1000)


class BrokerClock(Clock):
    """One broker process's view of the world's time: the world's monotonic clock, and a
    wall clock of its own (``jump_ms``: an NTP step of that host)."""

    def __init__(self, world_clock: SimClock) -> None:
        self.world_clock = world_clock
        self.jump_ms = 0

    def monotonic_s(self) -> float:
        return 1000.0 + self.world_clock.t

    def wall_ms(self) -> int:
        return BASE_WALL_MS + int(self.world_clock.t * 1000) + self.jump_ms


class _SeededSecrets:
    """Stands in for the ``secrets`` module in the ledger store (the ledger id) and the
    envelope codec (session ids) so that one seed gives the same ids, hence the same
    hash order of every set and dict of strings (with PYTHONHASHSEED fixed)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def token_hex(self, n: int = 16) -> str:
        return "".join(f"{self.rng.randrange(256):02x}" for _ in range(n))

    def randbits(self, k: int) -> int:
        return self.rng.getrandbits(k)


@dataclasses.dataclass
class Conn:
    """One ZeroMQ connection (a DEALER socket of a peer to the broker's ROUTER): its
    routing id, FIFO delivery both ways, and the faults on it."""

    rid: bytes
    peer: object  # the peer (tests/sim/peers.py) or None for a stranger
    bp: BrokerProcess  # the broker process whose ROUTER it reaches
    closed: bool = False
    broken: bool = False  # a frame was lost: everything after it is lost too (a dead TCP connection)
    up_at: float = 0.0  # FIFO: the last delivery time peer -> broker
    down_at: float = 0.0
    delay_until: float = 0.0
    delay_s: float = 0.0
    again_until: float = 0.0  # the peer's pipe is full: sends answer AGAIN
    pending_fault: str = ""  # "drop-up", "dup-down", ... applied to the next frame
    held: list | None = None  # a frame held back to be delivered after the next one (reorder)


class SimTransport:
    """The broker's :class:`~ccsq.brokerd.transport.FrameTransport` in the world: frames out
    of :meth:`send` are encoded by the broker's real codec and travel on a :class:`Conn`."""

    def __init__(self, bp: BrokerProcess, codec: EnvelopeCodec) -> None:
        self.world = bp.w
        self.bp = bp
        self.codec = codec
        self.endpoint = f"sim://{bp.peer_id}"
        self.drained_all = True
        self.sent_again = 0
        self.sent_unroutable = 0

    async def wait_readable(self, timeout_s: float) -> bool:  # pragma: no cover - the world calls turn()
        raise RuntimeError("the simulation drives Broker.turn itself")

    def wake(self) -> None:
        pass

    def drain(self, max_messages: int, max_bytes: int = 1 << 62) -> list[list[bytes]]:
        return self.bp.take_inbox(max_messages, max_bytes)

    def send(self, routing_id: bytes, msg: protocol.Message) -> str:
        w, bp = self.world, self.bp
        frames = self.codec.encode(msg, channel=routing_id)  # (raises PAYLOAD_TOO_LARGE like the real one)
        conn = bp.conns.get(routing_id)
        if conn is None or conn.closed:
            self.sent_unroutable += 1
            return transport.UNROUTABLE
        if conn.again_until > w.clock.t:
            self.sent_again += 1
            return transport.AGAIN
        bp.crash_on_send()
        w.net_down(conn, frames)
        return transport.SENT


class BrokerProcess:
    """One broker process of the world: its real ``Broker`` actor on its own LMDB environment,
    its ROUTER's inbox and routing table (``conns``), its crash / restart, its host's faults
    (wall-clock steps, stalls, slow fsync, disk and map full), and the ground truth the
    invariants check its ledger against (what it confirmed to peers, its committed leases,
    gap events and FAILs, what its completion services landed). ``swarm``: its swarm id;
    ``trusted``: {swarm id: public key} of the swarms it federates with ({}: federation off)."""

    def __init__(self, world: World, name: str, peer_id: str, swarm: str, cfg: BrokerConfig) -> None:
        self.w = world
        self.name, self.peer_id, self.swarm, self.cfg = name, peer_id, swarm, cfg
        self.clock = BrokerClock(world.clock)
        self.ledger_dir = world.tmp / ("ledger" if name == "a" else f"ledger-{name}")
        self.broker: Broker | None = None
        self.ledger: Ledger | None = None
        self.gen = 0
        self.next_turn_at = float("inf")
        self.inbox: list[list[bytes]] = []
        self.conns: dict[bytes, Conn] = {}
        self.disk_full_until = 0.0
        self.map_full_until = 0.0
        self.stall_until = 0.0
        self.slow_fsync: list[float] = []  # seconds the next commits take
        self.crash_at: str = ""  # "commit", "send:N" or a crash point name: the broker dies there
        self._sends_this_turn = 0
        self.turn_records = 0  # item records the turn's commit wrote (its simulated cost)
        self.durable_image: Path | None = None  # the LMDB file as last fsynced, when the env does not sync each commit
        # --- ground truth the invariants compare this ledger against ---
        self.key_item: dict[str, str] = {}  # producer key -> item id the broker confirmed
        self.confirmed: dict[str, int] = {}  # item id -> 1 submitted, 2 completed, 3 acknowledged (as confirmed to a peer)
        self.purged: set[str] = set()  # item ids a committed purge deleted
        self.leases: dict[str, list[int]] = {}  # item id -> tokens of committed leases, in order
        self.executed: dict[str, set[int]] = {}  # item id -> tokens a worker started running
        self.gap_events: dict[str, dict[str, int]] = {}  # G2 / G7 -> item id -> committed events
        self.gap_totals: dict[str, int] = {}  # window -> committed events
        self.fails_accepted: dict[str, int] = {}  # item id -> committed accepted FAILs
        self.landed: dict[str, int] = {}  # item id -> landings in the results database (idempotent: 1 row)
        self.first_delivered: set[str] = set()  # item ids delivered once with redelivery=false
        self.results_db: dict[str, bytes] = {}  # this swarm's completion services' database (durable)
        self.done_items = 0  # items landed (first landing)
        self.relayed: dict[str, str] = {}  # relayed item id (committed here by a relay's SUBMIT) -> its origin key
        self.relay_leases_expired = 0  # committed expiries of leases a relay held (each owes an F1 event)
        self.upstream: BrokerProcess | None = None  # the swarm whose items a relay brings here

    def _tag(self) -> tuple[str, ...]:
        """The trace's name of this broker ("" in a world of one: its traces read as before)."""
        return (self.name,) if len(self.w.brokers) > 1 else ()

    # --- the process ---
    def wake(self, t: float) -> None:
        if t < self.next_turn_at:
            self.next_turn_at = t
            gen = self.gen
            self.w.at(t, lambda: self._turn(gen, t))

    def take_inbox(self, max_messages: int, max_bytes: int) -> list[list[bytes]]:
        out, size, n = [], 0, 0
        inbox = self.inbox
        while n < len(inbox) and n < max_messages and size < max_bytes:
            size += sum(len(x) for x in inbox[n])
            n += 1
        out, self.inbox = inbox[:n], inbox[n:]
        return out

    def _turn(self, gen: int, t: float) -> None:
        w = self.w
        if gen != self.gen or self.broker is None or t != self.next_turn_at:
            return  # a stale wake-up
        self.next_turn_at = float("inf")
        if self.stall_until > w.clock.t:
            self.wake(self.stall_until)
            return
        b = self.broker
        frames = self.take_inbox(actor_mod.MAX_FRAMES_PER_TURN if b._carry_items < actor_mod.CARRY_MAX_ITEMS
                                 else actor_mod.TRICKLE_FRAMES,
                                 actor_mod.MAX_BYTES_PER_TURN if b._carry_items < actor_mod.CARRY_MAX_ITEMS
                                 else actor_mod.TRICKLE_BYTES)
        w.stats["turns"] += 1
        self._sends_this_turn = 0
        self.turn_records = 0
        b._committed_ops = 0
        w.current = self
        try:
            b.turn(frames)
        except SimCrash:
            self._died("crash inside the turn")
            return
        except Exception as exc:  # the broker's own error: the daemon would exit (systemd restarts it)
            import lmdb

            if isinstance(exc, lmdb.Error):
                self._died(f"ledger write failed: {type(exc).__name__}")
                return
            raise
        w.clock.t += TURN_COST_S + TURN_COST_PER_FRAME_S * len(frames) + TURN_COST_PER_RECORD_S * self.turn_records
        if b._committed_ops and not self.inbox and not b._carry:
            self.wake(w.clock.t + actor_mod.COMMIT_DELAY_S)  # as Broker.run: gather for the next commit
        elif self.inbox or b._carry:
            self.wake(w.clock.t)
        else:
            self.wake(w.clock.t + max(0.001, b._idle_timeout_s(self.clock.monotonic_s())))

    def crash_on_send(self) -> None:
        if self.crash_at.startswith("send:"):
            self._sends_this_turn += 1
            if self._sends_this_turn >= int(self.crash_at[5:]):
                self.crash_at = ""
                raise SimCrash()

    def crash(self, where: str) -> None:
        """Fault: the broker dies now ("now"), or at the next commit / crash point / n-th send of a turn."""
        if self.broker is None:
            return
        if where == "now":
            self._died("crash between turns")
        else:
            self.crash_at = where

    def _died(self, why: str) -> None:
        w = self.w
        w.note(*self._tag(), "broker_died", why)
        w.stats["broker_crashes"] += 1
        self.crash_at = ""
        self.broker = None
        self.gen += 1
        self.next_turn_at = float("inf")
        self.inbox = []
        for conn in list(self.conns.values()):
            conn.broken = True  # every connection to the dead process is gone; ZeroMQ reconnects the peers' sockets
        w._pending.clear()
        w._txn_leases.clear()
        self.ledger.close()
        self.ledger = None
        self._power_loss()
        w.after(w.rng.uniform(*RESTART_DELAY_S), self.start)

    def _power_loss(self) -> None:
        """What a power loss leaves of the ledger: LMDB with ``sync`` fsyncs every commit, so the
        file as it is; an environment that does not sync (a plant) keeps only the image of its last
        sync (taken when it was opened)."""
        if self.durable_image is not None:
            self.w.stats["power_losses"] += 1
            shutil.copyfile(self.durable_image, self.ledger_dir / "data.mdb")
            self.durable_image = None

    def start(self) -> None:
        w = self.w
        w.current = self
        self.ledger = Ledger(self.ledger_dir, map_size_bytes=self.cfg.map_size_bytes,
                             max_map_size_bytes=self.cfg.max_map_size_bytes, policy=Policy.from_config(self.cfg),
                             rng=random.Random(w.rng.getrandbits(32)), max_readers=self.cfg.max_readers)
        self.ledger.sim_bp = self  # the observers attribute each transaction to its ledger
        if not self.ledger.env.flags()["sync"]:
            self.durable_image = w.tmp / f"durable-{self.name}.mdb"
            self.ledger.env.sync(True)
            shutil.copyfile(self.ledger_dir / "data.mdb", self.durable_image)
        self._check_confirmed()
        if w.violation is not None:
            return
        codec = w.codec_for(self.peer_id, self.clock.wall_ms, broker=True)
        self.broker = Broker(self.cfg, self.ledger, SimTransport(self, codec), self.clock)
        self.gen += 1
        self.next_turn_at = float("inf")
        w.note(*self._tag(), "broker_started", self.broker.epoch)
        self.wake(w.clock.t)

    def arrive(self, conn: Conn, raw: list[bytes]) -> None:
        if self.broker is None or conn.closed or conn.broken:
            return  # the broker is down: ZeroMQ had no one to hand it to
        self.w.stats["frames_up"] += 1
        self.inbox.append(raw)
        self.wake(self.w.clock.t + 0.0002)

    def inject(self, raw: list[bytes]) -> None:
        """A stranger's frame reaches this broker's ROUTER."""
        if self.broker is not None:
            self.w.stats["junk"] += 1
            self.inbox.append(raw)
            self.wake(self.w.clock.t + 0.0002)

    # --- what peers were told (ground truth for "nothing confirmed is lost") ---
    def confirm(self, item_id: str, level: int) -> None:
        if self.confirmed.get(item_id, 0) < level:
            self.confirmed[item_id] = level

    def _check_confirmed(self) -> None:
        """At a (re)start, before the broker serves: every item confirmed to a peer is in the
        ledger at least in the state it was confirmed in; and the accounting equation holds."""
        purged = self.purged
        w = self.w
        with self.ledger.read() as view:
            if not view.balanced():
                w.fail("accounting", f"{self.name}: after restart: counters {view.counters()} states {view.states()}")
                return
            for item_id, level in self.confirmed.items():
                if item_id in purged:
                    continue
                rec = view.get(item_id)
                if rec is None:
                    w.fail("confirmed_lost", f"{''.join(t + ': ' for t in self._tag())}{item_id} was confirmed "
                                             f"({_LEVELS[level]}) and is gone after a crash")
                    return
                st = rec["state"]
                if level == 2 and st not in (C, A) or level == 3 and st != A:
                    w.fail("confirmed_lost", f"{''.join(t + ': ' for t in self._tag())}{item_id} was confirmed "
                                             f"{_LEVELS[level]} and is {st} after a crash")
                    return

    def quiet(self) -> bool:
        """The ledger holds nothing ready, leased or completed."""
        with self.ledger.read() as view:
            st = view.states()
        return st.get(S, 0) == 0 and st.get(L, 0) == 0 and st.get(C, 0) == 0

    def state_line(self) -> str:
        if self.ledger is None:
            return f"{self.name}: broker down"
        with self.ledger.read() as view:
            line = f"{self.name}: states={view.states()}"
        if self.broker is not None:
            line += "; sessions " + ", ".join(f"{s.peer_id}(credit {s.credit}, unsent {len(s.unsent)}, rid {s.routing_id[-4:].decode()})"
                                             for s in self.broker.peers.sessions())
        line += f"; wall clock {self.clock.jump_ms:+d} ms, stalled until {self.stall_until:.1f}, inbox {len(self.inbox)}, " \
                f"next turn {self.next_turn_at:.3f}"
        return line

    def ran(self, item_id: str, token: int) -> None:
        """A worker of this swarm started ``item_id`` under ``token``. A relayed item's run is also
        a run of its origin item upstream (token -1: "ran downstream"), so an item run both at
        home and downstream needs its explanation there too (:meth:`check_runs`)."""
        self.executed.setdefault(item_id, set()).add(token)
        key = self.relayed.get(item_id)
        if key is not None and self.upstream is not None:
            self.upstream.executed.setdefault(key.rsplit(":", 1)[-1], set()).add(-1)

    def dead_items(self) -> int:
        return len(self.gap_events.get(gaps.G7_DEAD_LETTERED, ())) if self.key_item else 0

    # --- the end ---
    def final_checks(self, produced: int) -> None:
        """``produced``: items this swarm's producers submitted (keys)."""
        w = self.w
        with self.ledger.read() as view:
            counters, states = view.counters(), view.states()
            if not view.balanced():
                w.fail("accounting", f"{self.name}: counters {counters} states {states}")
                return
            dead = set()
            for item_id in self.key_item.values():
                rec = view.get(item_id)
                st = rec["state"] if rec is not None else "purged" if item_id in self.purged else "missing"
                if st in (D, E):
                    dead.add(item_id)
                elif st not in (A, "purged"):
                    w.fail("not_ended", f"{item_id} is {st} at the end")
                    return
            for item_id, key in self.relayed.items():  # relayed here: acknowledged by the relay, or dead / expired here
                rec = view.get(item_id)
                st = rec["state"] if rec is not None else "purged" if item_id in self.purged else "missing"
                if st not in (A, D, E, "purged"):
                    w.fail("not_ended", f"{self.name}: relayed item {item_id} ({key}) is {st} at the end")
                    return
        if counters["received"] != produced + len(self.relayed):
            w.fail("accounting", f"{self.name}: {counters['received']} items received for {produced} keys "
                                 f"and {len(self.relayed)} relayed items (dedup?)")
            return
        if len(self.key_item) != produced:
            w.fail("not_ended", f"{produced - len(self.key_item)} items never confirmed to their producer")
            return
        for item_id in self.key_item.values():
            if item_id in dead:
                if item_id in self.results_db:
                    w.fail("ended_twice", f"{item_id} is dead and its result landed")
                    return
            elif item_id not in self.results_db:
                w.fail("not_ended", f"{item_id} acknowledged but its result never landed")
                return
        for item_id in list(self.executed):
            self.check_runs(item_id)
        self.dead = len(dead)

    def check_runs(self, item_id: str) -> None:
        """Every duplicate execution has its gap event: an item run under n tokens had n - 1
        lease expiries (G2) or accepted FAILs (a relay's FAIL ``released`` included: the lease it
        gives back after a downstream partition may have a copy running there, the F1 window of
        docs/federation.md; a worker's ``released`` never ran)."""
        toks = self.executed.get(item_id, ())
        extra = len(toks) - 1
        g2 = self.gap_events.get(gaps.G2_LEASE_EXPIRED, {}).get(item_id, 0)
        if extra > 0 and extra > g2 + self.fails_accepted.get(item_id, 0):
            self.w.fail("duplicate_without_gap", f"{item_id} ran under {len(toks)} tokens {sorted(toks)}; "
                                                 f"G2 events {g2}, FAILs accepted {self.fails_accepted.get(item_id, 0)}")

    def retire(self, item_id: str) -> None:
        """A committed purge deleted ``item_id`` (acknowledged, past retention): check what ends
        with it and forget it (keeps a long run's memory flat)."""
        self.check_runs(item_id)
        self.purged.add(item_id)
        for d in (self.executed, self.leases, self.fails_accepted, self.confirmed,
                  self.gap_events.get(gaps.G2_LEASE_EXPIRED, {})):
            d.pop(item_id, None)


class World:
    """One simulated world: one swarm (``swarms=1``), or two federated by a relay
    (``swarms=2``: swarm a upstream with the producers, completion services and
    ``up_workers`` workers; swarm b downstream with ``workers`` workers and a completion
    service; ``tests/sim/relay.py``). ``faults``: the fault list (``tests/sim/faults.py``);
    ``plant``: the planted defect's name or "" (``tests/sim/plants.py``)."""

    def __init__(self, seed: int, items: int, faults: list, *, workers: int = 4, producers: int = 2,
                 completions: int = 2, plant: str = "", max_open: int = 4000, verbose: bool = False,
                 swarms: int = 1, up_workers: int = 0) -> None:
        from tests.sim import peers as peers_mod

        self.seed, self.items, self.faults, self.plant, self.verbose = seed, items, faults, plant, verbose
        self.swarms, self.up_workers = swarms, up_workers if swarms > 1 else workers
        self.rng = random.Random(seed * 7919 + 1)  # scheduling choices (latency, run times)
        self.ids_rng = random.Random(seed * 104729 + 3)
        self.clock = SimClock()
        self._heap: list = []
        self._seq = 0
        self.digest = hashlib.blake2b(digest_size=8)
        self.captured: list[list[bytes]] = []  # real peers' frames a stranger may replay (junk faults)
        self._up_count = 0
        self._rid_n = 0
        self.max_open = max_open
        self.n_workers = workers
        self.violation: Violation | None = None
        self.faults_fired = 0
        self.fault_kinds: dict[str, int] = {}
        self.stats = {"turns": 0, "broker_crashes": 0, "peer_crashes": 0, "frames_up": 0, "frames_down": 0,
                      "junk": 0, "power_losses": 0, "relay_crashes": 0, "forged_refused": 0}
        self._pending: dict[int, list] = {}  # id(txn) -> what it did, counted when it commits
        self._txn_leases: dict[int, dict[str, list[int]]] = {}  # id(txn) -> item id -> tokens it leased (not committed)
        self.tmp = Path(tempfile.mkdtemp(prefix="ccsq-sim-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self.cfg = BrokerConfig(
            peer_id="broker", heartbeat_interval_s=1.0, liveness=5, lease_ttl_s=8.0, max_attempts=8,
            retry_backoff_base_s=0.05, retry_backoff_max_s=1.0, retention_s=30.0, map_size_bytes=8 << 20,
            max_map_size_bytes=1 << 33, min_free_disk_bytes=1 << 20, max_batch_items=64,
            accounting_sample_interval_s=30.0, max_clock_skew_s=60.0, result_reserve_bytes=2048, sndhwm=1000)
        self.brokers = [BrokerProcess(self, "a", "broker", "sim-a", self.cfg)]
        if swarms > 1:
            self.brokers.append(BrokerProcess(self, "b", "broker-b", "sim-b", dataclasses.replace(self.cfg, peer_id="broker-b")))
        self.current: BrokerProcess = self.brokers[0]  # the broker process whose code runs now
        self._keys(peers_mod, workers, producers, completions)
        self.relay = None
        self.relay_confirmed: set[tuple[str, int]] = set()  # (item, token) whose COMPLETE_ACK reached the relay
        self.peers = self._make_peers(peers_mod, workers, producers, completions)

    # --- set-up ---
    def _keys(self, peers_mod, workers: int, producers: int, completions: int) -> None:
        rng = random.Random(self.seed)
        self.keys: dict[str, Ed25519PrivateKey] = {}
        entries = {}
        ids = ([("broker", "broker")] + [(f"w{i}", "worker") for i in range(self.up_workers)]
               + [(f"p{i}", "producer") for i in range(producers)] + [(f"c{i}", "completion") for i in range(completions)])
        if self.swarms > 1:
            from tests.sim import relay as relay_mod

            ids += ([("broker-b", "broker")] + [(f"bw{i}", "worker") for i in range(workers)] + [("bc0", "completion")]
                    + [(relay_mod.UP_ID, "relay"), (relay_mod.DOWN_ID, "relay")])
        for pid, role in ids:
            key = Ed25519PrivateKey.from_private_bytes(bytes(rng.randrange(256) for _ in range(32)))
            self.keys[pid] = key
            entries[pid] = (role, public_key_b64(key))
        self.ak_path = self.tmp / "authorized_keys.toml"
        write_authorized_keys(self.ak_path, entries)
        self.authorized = AuthorizedKeys(self.ak_path)
        if self.swarms > 1:
            self._federate()

    def _federate(self) -> None:
        """Each broker's signing key file and a trust file pinning the other swarm's broker key
        (``swarm_id``, ``private_key``, ``trusted_swarms``: what ``ccsq init-relay`` writes)."""
        import base64
        import os

        from cryptography.hazmat.primitives import serialization

        for bp in self.brokers:
            key = self.keys[bp.peer_id]
            path = self.tmp / f"{bp.peer_id}.key"
            raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(base64.b64encode(raw).decode() + "\n")
            others = [o for o in self.brokers if o is not bp]
            trust = self.tmp / f"trusted_swarms-{bp.name}.toml"
            trust.write_text("".join(f'[swarms.{o.swarm}]\npublic_key = "{public_key_b64(self.keys[o.peer_id])}"\n'
                                     for o in others))
            bp.cfg = dataclasses.replace(bp.cfg, swarm_id=bp.swarm, private_key=str(path), trusted_swarms=str(trust))

    def _make_peers(self, peers_mod, workers: int, producers: int, completions: int) -> list:
        out = []
        per = -(-self.items // producers)
        for i in range(producers):
            out.append(peers_mod.Producer(self, f"p{i}", range(i * per, min(self.items, (i + 1) * per))))
        for i in range(self.up_workers):
            # credit windows (workerd: slots x max_batch + prefetch): w0 256 (batches of 32), the others 64
            out.append(peers_mod.Worker(self, f"w{i}", slots=8, window=256 if i == 0 else 64))
        for i in range(completions):
            out.append(peers_mod.Completion(self, f"c{i}", credit=256))
        if self.swarms > 1:
            from tests.sim import relay as relay_mod

            down = self.brokers[1]
            for i in range(workers):
                out.append(peers_mod.Worker(self, f"bw{i}", slots=8, window=64, bp=down))
            out.append(peers_mod.Completion(self, "bc0", credit=256, bp=down))
            self.relay = relay_mod.SimRelay(self, self.brokers[0], down)
            down.upstream = self.brokers[0]
            out += self.relay.sides
        return out

    def codec_for(self, peer_id: str, wall_ms: Callable[[], int], *, broker: bool = False) -> EnvelopeCodec:
        return EnvelopeCodec(peer_id, self.keys[peer_id], self.authorized, max_frame_bytes=self.cfg.max_frame_bytes,
                             max_clock_skew_s=self.cfg.max_clock_skew_s, require_hello=broker, session_macs=True,
                             wall_ms=wall_ms)

    # --- the scheduler ---
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.clock.t + dt, fn)

    def note(self, *parts: object) -> None:
        """Feed the trace digest (replays compare it) and, verbose, print."""
        line = " ".join(str(x) for x in parts)
        self.digest.update(line.encode())
        if self.verbose:
            print(f"{self.clock.t:10.4f} {line}")

    def fail(self, kind: str, detail: str) -> None:
        if self.violation is None:
            self.violation = Violation(kind, detail)
            self.note("VIOLATION", kind, detail)

    def run(self, max_sim_s: float) -> None:
        """Run until every item has ended and the world is quiet, a violation, or ``max_sim_s``."""
        from tests.sim import faults as faults_mod

        self._install()
        try:
            for bp in self.brokers:
                bp.start()
            for peer in self.peers:
                self.after(self.rng.uniform(0, 0.05), peer.start)
            if self.relay is not None:
                self.relay.arm()
            faults_mod.arm(self)
            self.after(2.0, self._quiet_check)
            heap = self._heap
            clock = self.clock
            while heap and self.violation is None:
                t, _, fn = heapq.heappop(heap)
                if t > max_sim_s:
                    self.fail("no_progress", f"simulated {max_sim_s:.0f}s: {self.done_items}/{self.items} items landed; "
                                             f"{self._state_line()}")
                    break
                if t > clock.t:
                    clock.t = t
                fn()
                if self.finished:
                    break
            if self.violation is None:
                self._final_checks()
        finally:
            self._uninstall()

    finished = False

    def _quiet_check(self) -> None:
        """Every 2 simulated s once all items were submitted and the faults are over: the
        world is done when no ledger holds anything ready, leased or completed."""
        from tests.sim import faults as faults_mod

        self.after(2.0, self._quiet_check)
        ended = self.ended_items()
        if ended != getattr(self, "_last_ended", -1):
            self._last_ended, self._last_progress_t = ended, self.clock.t
        if self.temporaries == 0 and self.clock.t - self._last_progress_t > STUCK_S and self.ended_items() < self.items:
            self.fail("not_ended", f"no item ended for {STUCK_S:.0f} simulated s with no fault in force: "
                                   f"{self.ended_items()}/{self.items} ended; {self._state_line()}")
            return
        if any(bp.broker is None for bp in self.brokers) or not faults_mod.all_over(self):
            return
        if not all(peer.finished() for peer in self.peers):
            return
        if all(bp.quiet() for bp in self.brokers):
            self.finished = True

    def _state_line(self) -> str:
        line = "; ".join(bp.state_line() for bp in self.brokers)
        line += "; peers " + ", ".join(peer.describe() for peer in self.peers)
        return line + f"; temporaries {getattr(self, 'temporaries', 0)}"

    @property
    def done_items(self) -> int:
        """Items landed in their swarm's results database."""
        return sum(bp.done_items for bp in self.brokers)

    @property
    def gap_totals(self) -> dict[str, int]:
        """The first broker's gap events by window (``gaps_b`` in the summary: the second's)."""
        return self.brokers[0].gap_totals

    def ended_items(self) -> int:
        """Items landed or dead-lettered (the progress faults are spread over)."""
        return self.done_items + sum(bp.dead_items() for bp in self.brokers)

    def open_items(self) -> int:
        """Items confirmed to producers that have not ended yet (landed, dead-lettered)."""
        return sum(len(bp.key_item) for bp in self.brokers) - self.ended_items()

    def broker_of(self, target: int) -> BrokerProcess:
        return self.brokers[target % len(self.brokers)]

    # --- the network ---
    def new_conn(self, peer, bp: BrokerProcess | None = None) -> Conn:
        self._rid_n += 1
        rid = b"\x00sim%08d" % self._rid_n
        bp = bp or (peer.bp if peer is not None else self.brokers[0])
        conn = Conn(rid, peer, bp)
        bp.conns[rid] = conn
        return conn

    def close_conn(self, conn: Conn) -> None:
        conn.closed = True
        conn.bp.conns.pop(conn.rid, None)

    def _latency(self, conn: Conn) -> float:
        """A frame's time on the wire. A partition holds frames (TCP retransmits) until it heals:
        they arrive then, in order, unless a side gave up on the connection first."""
        now = self.clock.t
        d = self.rng.uniform(*LATENCY_S)
        if conn.delay_until > now:
            d += conn.delay_s
        cut = getattr(conn.peer, "partitioned_until", 0.0)
        if cut > now:
            d += cut - now
        return d

    def net_up(self, conn: Conn, frames: list[bytes]) -> None:
        """A peer sends ``frames`` to its broker on ``conn``."""
        if conn.closed or conn.broken:
            return
        fault, conn.pending_fault = (conn.pending_fault, "") if conn.pending_fault.endswith("-up") else ("", conn.pending_fault)
        raw = [conn.rid, *frames]
        self._up_count += 1
        if self._up_count % 97 == 0:
            if len(self.captured) < 64:
                self.captured.append(frames)
            else:
                self.captured[self._up_count % 64] = frames
        if fault == "drop-up":
            conn.broken = True  # a lost frame: the connection is dead from here on (peers find out by silence)
            return
        if fault == "reorder-up":
            conn.held = raw
            return
        t = max(conn.up_at, self.clock.t + self._latency(conn))
        conn.up_at = t
        bp = conn.bp
        self.at(t, lambda: bp.arrive(conn, raw))
        if fault == "dup-up":
            self.at(t + 0.0001, lambda: bp.arrive(conn, raw))
        if conn.held is not None:
            held, conn.held = conn.held, None
            self.at(t + 0.0001, lambda: bp.arrive(conn, held))

    def net_down(self, conn: Conn, frames: list[bytes]) -> None:
        """The broker sends ``frames`` to the peer on ``conn``."""
        peer = conn.peer
        if conn.broken or peer is None:
            return
        fault, conn.pending_fault = (conn.pending_fault, "") if conn.pending_fault.endswith("-down") else ("", conn.pending_fault)
        if fault == "drop-down":
            conn.broken = True
            return
        self.stats["frames_down"] += 1
        t = max(conn.down_at, self.clock.t + self._latency(conn))
        conn.down_at = t
        gen = peer.gen
        self.at(t, lambda: peer.receive(conn, frames, gen))
        if fault in ("dup-down", "reorder-down"):  # a replayed / out-of-order frame: the peer's codec refuses it
            self.at(t + 0.0001, lambda: peer.receive(conn, frames, gen))

    # --- observing the ledgers (what committed, attributed to each ledger) ---
    def _install(self) -> None:
        """Observe the real ledger rules (wrappers that call them unchanged) and the crash points."""
        world = self
        self._saved = {name: getattr(LedgerTxn, name)
                       for name in ("lease", "complete", "fail", "event", "commit", "abort", "forget", "submit", "expire_lease")}
        orig = self._saved
        pending = self._pending

        txn_leases = self._txn_leases  # id(txn) -> item id -> tokens this transaction leased it with (incremental)
        relays = {self.relay.up.id} if self.relay is not None else set()  # the relay's upstream peer id

        def rec(txn) -> list:
            r = pending.get(id(txn))
            if r is None:
                r = pending[id(txn)] = []
            return r

        def lease(txn, item_id, worker, now_ms, ttl_ms):
            task = orig["lease"](txn, item_id, worker, now_ms, ttl_ms)
            if task is not None:
                rec(txn).append(("lease", item_id, task.token))
                mine = txn_leases.setdefault(id(txn), {}).setdefault(item_id, [])
                mine.append(task.token)
                earlier = len(txn.ledger.sim_bp.leases.get(item_id, ())) + len(mine)
                if task.attempt > earlier:
                    world.fail("attempt_overcounted", f"{item_id} leased with attempt {task.attempt} on its lease #{earlier}")
            return task

        def newest_token(txn, item_id) -> int:
            toks = txn_leases.get(id(txn), {}).get(item_id)
            if toks:
                return toks[-1]
            committed = txn.ledger.sim_bp.leases.get(item_id)
            return committed[-1] if committed else 0

        def complete(txn, res, now_ms, sender=""):
            outcome = orig["complete"](txn, res, now_ms, sender)
            if outcome == protocol.Outcome.ACCEPTED.value and res.token != newest_token(txn, res.item_id):
                world.fail("fenced_result_accepted", f"COMPLETE of {res.item_id} with token {res.token} accepted; "
                                                     f"its newest lease has token {newest_token(txn, res.item_id)}")
            return outcome

        def fail(txn, f, now_ms, sender=""):
            outcome = orig["fail"](txn, f, now_ms, sender)
            if outcome == protocol.Outcome.ACCEPTED.value:
                if f.token != newest_token(txn, f.item_id):
                    world.fail("fenced_result_accepted", f"FAIL of {f.item_id} with token {f.token} accepted; "
                                                         f"its newest lease has token {newest_token(txn, f.item_id)}")
                if f.reason != protocol.FailReason.RELEASED.value or sender in relays:
                    # a worker's lease given back unrun explains no second run; a relay's may be running downstream
                    rec(txn).append(("fail", f.item_id, f.token))
            return outcome

        def submit(txn, item, now_ms, **kw):
            res = orig["submit"](txn, item, now_ms, **kw)
            if kw.get("origin") is not None and res.item_id and not res.duplicate:
                rec(txn).append(("relayed", res.item_id, item.key))
            return res

        def expire_lease(txn, item_id, token, now_ms, why="lease expired"):
            holder = (txn.get(item_id) or {}).get("worker", "") if relays else ""
            new = orig["expire_lease"](txn, item_id, token, now_ms, why)
            if new and holder in relays:
                rec(txn).append(("relay_expired", item_id, 0))
            return new

        def event(txn, window, item_id, now_ms, detail):
            orig["event"](txn, window, item_id, now_ms, detail)
            rec(txn).append(("event", item_id, window))

        def forget(txn, item_id):
            orig["forget"](txn, item_id)
            rec(txn).append(("purged", item_id, 0))

        def commit(txn):
            bp = txn.ledger.sim_bp
            if bp.crash_at == "commit":
                bp.crash_at = ""
                raise SimCrash()  # power lost before the commit was durable (the caller aborts the txn)
            if bp.slow_fsync:
                world.clock.t += bp.slow_fsync.pop(0)  # the fsync took this long: the turn's clock reads see it
            bp.turn_records += txn.records
            orig["commit"](txn)
            txn_leases.pop(id(txn), None)
            done = pending.pop(id(txn), ())
            for what, item_id, x in done:
                if what == "lease":
                    bp.leases.setdefault(item_id, []).append(x)
                elif what == "purged":
                    bp.retire(item_id)
                elif what == "fail":
                    bp.fails_accepted[item_id] = bp.fails_accepted.get(item_id, 0) + 1
                elif what == "relayed":
                    bp.relayed[item_id] = x
                elif what == "relay_expired":
                    bp.relay_leases_expired += 1
                    if ("event", item_id, gaps.F1_RELAY_LEASE_LOST) not in done:
                        world.fail("federation_gap_missing", f"{bp.name}: the relay's lease of {item_id} expired "
                                                             f"without its F1 event")
                else:
                    bp.gap_totals[x] = bp.gap_totals.get(x, 0) + 1
                    if x in _PER_ITEM_GAPS:
                        ev = bp.gap_events.setdefault(x, {})
                        ev[item_id] = ev.get(item_id, 0) + 1

        def abort(txn):
            pending.pop(id(txn), None)
            txn_leases.pop(id(txn), None)
            orig["abort"](txn)

        for name, fn in (("lease", lease), ("complete", complete), ("fail", fail), ("event", event),
                         ("commit", commit), ("abort", abort), ("forget", forget), ("submit", submit),
                         ("expire_lease", expire_lease)):
            setattr(LedgerTxn, name, fn)
        self._saved_crash_point = actor_mod.crash_point
        actor_mod.crash_point = self._crash_point
        self._saved_disk_free = actor_mod.disk_free_bytes
        actor_mod.disk_free_bytes = lambda path: 0 if self.current.disk_full_until > self.clock.t else 1 << 40
        self._saved_secrets = (store_mod.secrets, envelope_mod.secrets)
        store_mod.secrets = envelope_mod.secrets = _SeededSecrets(self.ids_rng)

    def _crash_point(self, name: str) -> None:
        bp = self.current
        if bp.crash_at == name:
            bp.crash_at = ""
            raise SimCrash()

    def _uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(LedgerTxn, name, fn)
        actor_mod.crash_point = self._saved_crash_point
        actor_mod.disk_free_bytes = self._saved_disk_free
        store_mod.secrets, envelope_mod.secrets = self._saved_secrets
        for bp in self.brokers:
            if bp.ledger is not None:
                bp.ledger.close()
                bp.ledger = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- the end ---
    def _final_checks(self) -> None:
        for i, bp in enumerate(self.brokers):
            bp.final_checks(self.items if i == 0 else 0)
            if self.violation is not None:
                return
        if self.relay is not None:
            self.relay.final_checks()
        self.dead = sum(getattr(bp, "dead", 0) for bp in self.brokers)


_LEVELS = {1: "submitted", 2: "completed", 3: "acknowledged"}
_PER_ITEM_GAPS = (gaps.G2_LEASE_EXPIRED, gaps.G7_DEAD_LETTERED)
