"""The fault list of a seed and how each fault strikes.

:func:`generate` draws the list from the seed alone (so dropping faults while shrinking
leaves the others as they were): each fault fires when the swarm has landed a given
number of items (spread over the run), at a random moment shortly after. A fault is
``(at_items, kind, target, a, b)``; :data:`KINDS` are the kinds with their weights.
"""

from __future__ import annotations

import random

import msgpack

from ccsq.common.wire import protocol

CRASH_POINTS = ("broker.after_submit_commit", "broker.after_lease_commit", "broker.after_complete_commit",
                "broker.after_ack_commit")
#: kind -> relative weight
KINDS = {
    "broker_crash": 0.5,   # now, at the next commit (power loss before it is durable), at a crash point, mid-replies
    "worker_crash": 1.5,
    "completion_crash": 0.6,
    "producer_crash": 0.6,
    "partition": 1.5,      # a peer cut off both ways for a while, then healed
    "flap": 1.0,           # a flaky link: cut off past the lease TTL, up for 1-20 ms, cut off past the TTL again
    "flap_then_die": 1.0,  # a worker's host cut off past the lease TTL; as the link returns its process dies (WELCOME / DISPATCH)
    "drop": 6,             # a frame lost (the connection is dead from there: peers find out by silence)
    "dup": 6,              # a frame delivered twice (a replay: refused, the session ends)
    "reorder": 5,          # two frames swapped
    "delay": 8,            # a connection slowed down for a while
    "backpressure": 8,     # a peer's pipe full for a while (sends answer AGAIN)
    "junk": 20,            # a stranger's frame: garbage, unknown sender, bad signature, oversize, a replayed frame
    "skew": 4,             # a peer's clock off by up to 80 s for a while (past 60 s its frames are STALE)
    "clock_jump": 3,       # the broker's wall clock steps (NTP) and steps back later
    "stall": 1.5,          # the broker process does not run for a while (VM pause, SIGSTOP)
    "slow_fsync": 6,       # the next commits take up to 3 s each
    "disk_full": 1.5,      # free disk below min_free_disk_bytes for a while
    "map_full": 1.5,       # the ledger map cannot grow for a while
}
#: kind -> relative weight, added in a federated world (two swarms and a relay, tests/sim/relay.py); the
#: kinds above strike its brokers (chosen by target), its relay's two sessions (partitions on each link) too
RELAY_KINDS = {
    "relay_crash": 1.0,    # the relay process dies: now, or at one of relayd's crash points
    "forged_origin": 1.0,  # the relay's downstream session SUBMITs an item whose origin does not verify
}


def generate(seed: int, items: int, per_item: float, only: tuple[str, ...] = (), *, federated: bool = False) -> list[tuple]:
    """The fault list of ``seed``: ``round(items x per_item)`` faults, ordered by when they strike
    (``only``: of these kinds alone; ``federated``: :data:`RELAY_KINDS` too)."""
    rng = random.Random(seed * 31337 + 11)
    n = int(round(items * per_item))
    table = {**KINDS, **RELAY_KINDS} if federated else KINDS
    kinds = [k for k in table if not only or k in only]
    weights = [table[k] for k in kinds]
    out = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        out.append((rng.randrange(max(1, items)), kind, rng.randrange(1 << 16), rng.random(), rng.random()))
    out.sort(key=lambda f: f[0])
    return out


def describe(f: tuple) -> str:
    at, kind, target, a, b = f
    return f"after {at} items: {kind} (target {target}, {a:.3f}, {b:.3f})"


def arm(world) -> None:
    """Fire each fault of ``world.faults`` when its item count is reached (checked every 20 ms)."""
    world.fault_next = 0
    world.temporaries = 0

    def check() -> None:
        faults = world.faults
        while world.fault_next < len(faults) and faults[world.fault_next][0] <= world.ended_items():
            f = faults[world.fault_next]
            world.fault_next += 1
            world.after(world.rng.uniform(0, 0.02), lambda f=f: strike(world, f))
        if world.fault_next < len(faults):
            world.after(0.02, check)

    world.after(0.02, check)


def all_over(world) -> bool:
    return getattr(world, "fault_next", 0) >= len(world.faults) and world.temporaries == 0


def _peer(world, target: int, cls: str | None = None):
    peers = [x for x in world.peers if cls is None or type(x).__name__ == cls]
    return peers[target % len(peers)]


def _temporary(world, duration_s: float, end) -> None:
    world.temporaries += 1

    def over() -> None:
        world.temporaries -= 1
        end()

    world.after(duration_s, over)


def strike(world, f: tuple) -> None:
    at, kind, target, a, b = f
    if world.violation is not None:
        return
    world.faults_fired += 1
    world.fault_kinds[kind] = world.fault_kinds.get(kind, 0) + 1
    world.note("fault", kind, target, f"{a:.3f}", f"{b:.3f}")
    t = world.clock.t
    if kind in RELAY_KINDS:
        world.relay.strike(kind, target, a)
    elif kind == "broker_crash":
        modes = ["now", "commit", "send:1", "send:3", *CRASH_POINTS]
        world.broker_of(target >> 12).crash(modes[target % len(modes)])
    elif kind.endswith("_crash"):
        peer = _peer(world, target, kind.split("_")[0].capitalize())
        if not peer.down:
            peer.crash()
    elif kind in ("drop", "dup", "reorder"):
        peer = _peer(world, target)
        if peer.conn is not None:
            peer.conn.pending_fault = f"{kind}-{'up' if a < 0.5 else 'down'}"
    elif kind == "partition":
        peer = _peer(world, target)
        d = 0.5 + 11.5 * a ** 3
        peer.partitioned_until = max(peer.partitioned_until, t + d)
        _temporary(world, d, lambda: None)
    elif kind == "flap":
        peer = _peer(world, target)
        ttl = world.cfg.lease_ttl_s
        d1, gap, d2 = ttl + 0.5 + 7.5 * a, 0.001 + 0.019 * b, ttl + 0.5 + 7.5 * ((target >> 8) / 256)
        peer.partitioned_until = max(peer.partitioned_until, t + d1)

        def again() -> None:
            peer.partitioned_until = max(peer.partitioned_until, world.clock.t + d2)

        world.after(d1 + gap, again)
        _temporary(world, d1 + gap + d2, lambda: None)
    elif kind == "flap_then_die":
        # A worker's host cut off past the lease TTL (its reports unsent, its leases expire) whose
        # process dies as the link returns: at its first WELCOME, before it re-sends its reports
        # (b < 0.5), or once it started the jobs of its first DISPATCH after the heal (b >= 0.5:
        # a poison job, an OOM kill). The second is the chain of a late COMPLETE with an older
        # token (plant late_old_token): the HELLO at the heal lists the unconfirmed reports (token
        # t1, expired), the broker leases those items to it again (t2) on the credit it grants,
        # the process dies running them; restarted, its HELLO names the t2 jobs lost (they expire:
        # ready after a backoff) and it re-sends the t1 reports while those items are ready again.
        peer = _peer(world, target, "Worker")
        d1 = world.cfg.lease_ttl_s + world.cfg.heartbeat_interval_s + world.cfg.retry_backoff_max_s + 0.5 + 6.0 * a
        peer.partitioned_until = max(peer.partitioned_until, t + d1)
        flag = "crash_at_welcome" if b < 0.5 else "crash_at_dispatch"

        def healed() -> None:
            setattr(peer, flag, True)

        world.after(d1, healed)
        _temporary(world, d1 + 4.0, lambda: setattr(peer, flag, False))
    elif kind == "delay":
        peer = _peer(world, target)
        if peer.conn is not None:
            conn = peer.conn
            conn.delay_s, conn.delay_until = 0.01 + 1.99 * a ** 3, t + 0.2 + 4.8 * b
    elif kind == "backpressure":
        peer = _peer(world, target)
        if peer.conn is not None:
            peer.conn.again_until = t + 0.01 + a
    elif kind == "junk":
        _junk(world, target, a)
    elif kind == "skew":
        peer = _peer(world, target)
        sign = 1 if b < 0.5 else -1
        peer.skew_ms = sign * int(1000 + 79_000 * a * a)
        _temporary(world, 1 + 14 * b * b, lambda: setattr(peer, "skew_ms", 0))
    elif kind == "clock_jump":
        delta = int((1 if b < 0.5 else -1) * (500 + 39_500 * a))
        clock = world.broker_of(target).clock
        clock.jump_ms += delta

        def back() -> None:
            clock.jump_ms -= delta

        _temporary(world, 1 + 19 * b * b, back)
    elif kind == "stall":
        bp = world.broker_of(target)
        bp.stall_until = max(bp.stall_until, t + 0.2 + 14.8 * a ** 4)
    elif kind == "slow_fsync":
        world.broker_of(target >> 2).slow_fsync.extend(0.01 + 2.99 * a ** 4 for _ in range(1 + target % 3))
    elif kind == "disk_full":
        bp = world.broker_of(target)
        bp.disk_full_until = max(bp.disk_full_until, t + 0.5 + 9.5 * a ** 3)
        _temporary(world, 0.5 + 9.5 * a ** 3, lambda: None)
    elif kind == "map_full":
        bp = world.broker_of(target)
        if bp.ledger is not None:
            led = bp.ledger
            led.max_map_size_bytes = led.map_size_bytes()

            def back() -> None:
                if bp.ledger is led:
                    led.max_map_size_bytes = world.cfg.max_map_size_bytes

            _temporary(world, 0.5 + 9.5 * a ** 3, back)
    else:  # pragma: no cover
        raise ValueError(kind)


def _junk(world, target: int, a: float) -> None:
    """A stranger's frame on a connection of its own (the broker's answers reach nobody)."""
    conn = world.new_conn(None, world.broker_of(target >> 3))
    rng = world.rng
    kind = target % 5
    if kind == 0:  # garbage
        raw = [conn.rid, rng.randbytes(1 + int(a * 300)), rng.randbytes(64)]
    elif kind == 1:  # a well-formed HELLO from a sender nobody authorized
        payload = msgpack.packb([protocol.PROTOCOL_VERSION, int(protocol.MsgType.HELLO), "mallory", 1, 1, world.clock.true_wall_ms(),
                                 protocol.encode_body(protocol.Hello(role="worker"))], use_bin_type=True)
        raw = [conn.rid, payload, rng.randbytes(64)]
    elif kind == 2:  # a known peer's id with a forged signature
        payload = msgpack.packb([protocol.PROTOCOL_VERSION, int(protocol.MsgType.HELLO), "w0", 1, 1, world.clock.true_wall_ms(),
                                 protocol.encode_body(protocol.Hello(role="worker", credit=1000))], use_bin_type=True)
        raw = [conn.rid, payload, rng.randbytes(64)]
    elif kind == 3:  # over max_frame_bytes
        raw = [conn.rid, b"\x00" * (world.cfg.max_frame_bytes + 1), rng.randbytes(64)]
    else:  # a real peer's frame replayed from elsewhere
        if not world.captured:
            return
        raw = [conn.rid, *world.captured[int(a * len(world.captured)) % len(world.captured)]]
    conn.bp.inject(raw)
    world.close_conn(conn)
