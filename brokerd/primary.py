"""The broker as the primary of a replicated pair (docs/ha.md): when its confirms may leave.

:class:`ConfirmGate` is driven by the actor (``brokerd/actor.py``) only. Every confirm
a committed turn produces (SUBMIT_ACK, COMPLETE_ACK, FAIL_ACK, ACK_OK, DISPATCH,
a CANCEL's STATUS_REPLY, the reply of an admin command that changes state) is
*held* with the replication seq of the ledger at that turn (``ReplicationLog.position``
after it: a duplicate SUBMIT answered without a write still waits for the turn that
wrote its item). Held replies are released in commit order once both hold:

- the turn is durable where the mode says: ``sync``: every member of
  ``/ccsq/<swarm>/sync`` as written to etcd acknowledged it, with at least
  ``ha_sync_standbys`` members in sync (a standby counts only once the set naming it is
  written; a laggard is written out before a confirm goes without it:
  :meth:`ConfirmGate.on_members`); ``async``, or ``sync`` degraded: committed here;
- ``Election.may_confirm(now)``: the etcd lease cannot have expired yet (the margin).

Reads (STATUS, admin status / items_show / dlq_list), heartbeats, WELCOMEs and
refusals are never held; RESULT leaves at the commit while the lease allows confirming
(held, like a confirm, while it does not). While the gate cannot confirm at all (the lease is in doubt,
a sync primary without enough standbys, a planned failover) the actor leases and
delivers nothing new (a DISPATCH that cannot leave would only run its lease down).

``ha_on_standby_loss = degrade``: a sync primary short of standbys for
``ha_degrade_after_s`` first writes the sync set without them (``on_members`` path,
in a thread, the etcd write must succeed), and only then confirms alone (logged,
counted, ``mode: "degraded"`` in status). A standby that is in sync again is written
back into the set and counted again (back to ``sync``).

Errors: none raised to the actor; a failed etcd write is logged and retried at the
next check (nothing is confirmed alone until it succeeds).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from ccsq.common.wire import protocol

log = structlog.get_logger("ccsq.brokerd")

#: Admin commands that only read: their replies are not held.
READ_COMMANDS = frozenset({"status", "items_show", "dlq_list"})
#: How often a sync primary short of standbys re-reads the server's status (seconds).
CHECK_INTERVAL_S = 0.1


class ReplServer(Protocol):
    """What the gate reads of ``brokerd/replserver.py`` ``ReplicationServer`` (HA-CONTRACT.md)."""

    def durable_seq(self) -> int: ...

    def status(self) -> dict[str, Any]: ...


class Lease(Protocol):
    """What the gate reads of :class:`~ccsq.brokerd.election.Election`."""

    def may_confirm(self, now_mono: float) -> bool: ...

    def write_sync(self, members: list[str], *, handover: bool = False) -> bool: ...


def is_confirm(msg: protocol.Message) -> bool:
    """A reply that tells a peer something is durable (held by a primary until its turn is).
    RESULT is not one: it hands the completion service a result and confirms nothing to the
    worker or the producer, so it leaves at this primary's commit while the lease allows
    confirming (:meth:`ConfirmGate.hold`; docs/ha.md, "What a confirm waits for": if this
    primary dies before a standby has the COMPLETE, the worker still holds its unconfirmed
    report and resends it, and the new primary's delivery counts as a redelivery, G3, and
    lands once by item id)."""
    return isinstance(msg, (protocol.SubmitAck, protocol.CompleteAck, protocol.FailAck, protocol.AckOk, protocol.Dispatch,
                            protocol.StatusReply, protocol.AdminReply))


def alone_at_promotion(previous: Any, node: str, *, mode: str, on_standby_loss: str) -> str:
    """Whether a broker just promoted may degrade at once instead of after
    ``ha_degrade_after_s`` (docs/ha.md, "A pair of two"): "" = no, else why. Yes when
    ``ha_mode = sync``, ``ha_on_standby_loss = degrade``, and the sync set the last primary
    wrote (``previous``: an ``election.SyncSet`` or None) names no standby besides ``node``
    and was not written by a planned failover (whose old primary rejoins at once, alive, with
    every turn). Then no broker can be in sync within the wait: the only other broker that
    held the confirmed turns is the deposed primary, just lost, which comes back (if at all)
    through a restart, a fresh session and, with an unreplicated tail, a copy: seconds at
    best. Waiting would only hold every confirm and DISPATCH for ``ha_degrade_after_s``."""
    if mode != "sync" or on_standby_loss != "degrade" or previous is None:
        return ""
    if getattr(previous, "handover", False):
        return ""
    others = [m for m in getattr(previous, "members", ()) if m != node]
    if others:
        return ""
    return (f"the last sync set {list(getattr(previous, 'members', ()))} (epoch {getattr(previous, 'epoch', 0)}) names no "
            f"standby besides {node}: the deposed primary {getattr(previous, 'primary', '') or '?'} was the only other copy")


class ConfirmGate:
    """Holds a primary's confirms until they may leave (module docstring).

    ``mode``: "sync" or "async"; ``sync_standbys``: acks needed; ``on_standby_loss``:
    "wait" or "degrade"; ``last_seq()``: the replication log's position (seq) now;
    ``wake()``: make the actor run a turn (thread-safe: ``transport.wake``);
    ``monotonic_s``: the actor's clock."""

    def __init__(self, *, mode: str, sync_standbys: int, on_standby_loss: str, degrade_after_s: float,
                 election: Lease, server: ReplServer, last_seq: Callable[[], int], wake: Callable[[], None],
                 monotonic_s: Callable[[], float] = time.monotonic, epoch: int = 0, node: str = "") -> None:
        self.mode, self.sync_standbys, self.on_loss = mode, sync_standbys, on_standby_loss
        self.degrade_after_s = degrade_after_s
        self.election, self.server, self.last_seq, self.wake = election, server, last_seq, wake
        self.monotonic_s = monotonic_s
        self.epoch, self.node = epoch, node
        self.held: collections.deque[tuple[int, float, bytes, protocol.Message]] = collections.deque()
        self.released = 0  # replies released since start (metrics)
        self.degraded = False  # sync primary confirming alone (ha_on_standby_loss = degrade)
        self.degrade_count = 0
        self.short_since: float | None = None  # monotonic time since when too few standbys are in sync
        self.members: tuple[str, ...] = ()  # the sync set as last written to etcd
        self._want: tuple[str, ...] | None = None  # a set for the writer thread to write
        self._lock = threading.Lock()
        self._etcd_lock = threading.Lock()  # one sync-set write at a time (the writer thread, on_members)
        self._degrade_wanted = False
        self._writer: threading.Thread | None = None
        self.lost = ""  # why this broker may never confirm again (the lease is gone): "" while primary
        self.paused = ""  # a planned failover in progress: why (confirms held)
        self.pinned: tuple[str, ...] | None = None  # a planned failover's sync set: only this node may take the key
        self.confirming = False  # the last check's answer (status, metrics)
        #: called with each released confirm's hold in seconds (its turn's commit -> sent; the metric)
        self.observe_held: Callable[[float], None] | None = None
        self._next_check = 0.0

    # --- the actor's side ---
    def hold(self, seq: int, replies: list[tuple[bytes, protocol.Message]], reads: set[int],
             send: Callable[[bytes, protocol.Message], None]) -> None:
        """After a commit: queue the turn's confirms with ``seq``; reads (ids in ``reads``)
        and non-confirms go now. Then release what may leave."""
        now = self.monotonic_s()
        lease_ok: bool | None = None
        for rid, msg in replies:
            if isinstance(msg, protocol.Result):  # at commit, but never from a primary whose lease is in doubt
                if lease_ok is None:
                    lease_ok = not self.lost and not self.paused and self.election.may_confirm(now)
                if lease_ok:
                    send(rid, msg)
                else:
                    self.held.append((seq, now, rid, msg))
            elif id(msg) in reads or not is_confirm(msg):
                send(rid, msg)
            else:
                self.held.append((seq, now, rid, msg))
        self.release(send)

    def release(self, send: Callable[[bytes, protocol.Message], None]) -> int:
        """Send the held replies whose turn is durable, oldest first, while confirming is
        allowed. Returns how many went."""
        now = self.monotonic_s()
        if now < self._next_check and (not self.held or (
                self.mode == "sync" and not self.degraded and self.server.durable_seq() < self.held[0][0])):
            # nothing to send, or nothing the server counts as durable yet (the gate's own count is
            # never above the server's): look at the standbys and the lease every CHECK_INTERVAL_S
            return 0
        self._next_check = now + CHECK_INTERVAL_S
        durable = self.durable_seq(now)
        ok = not self.lost and not self.paused and self.election.may_confirm(now)
        self.confirming = ok and durable is not None
        if not ok or durable is None:
            return 0
        n = 0
        held, observe = self.held, self.observe_held
        while held and held[0][0] <= durable:
            _seq, t, rid, msg = held.popleft()
            send(rid, msg)
            if observe is not None:
                observe(now - t)
            n += 1
        self.released += n
        return n

    def recheck(self) -> None:
        """The next :meth:`release` looks again at once (a state it reads changed)."""
        self._next_check = 0.0

    def may_plan(self) -> bool:
        """Whether new leases and deliveries are worth planning (their DISPATCH / RESULT could leave)."""
        return self.confirming and not self.lost and not self.paused

    def durable_seq(self, now: float) -> int | None:
        """The highest seq whose confirms may leave as far as replication goes (None: none
        yet). Sync: the lowest seq acknowledged by *every* member of the sync set as written
        to etcd (so each standby that may take over holds every confirmed turn), once at
        least ``sync_standbys`` members are in sync; a member not connected counts 0."""
        if self.mode == "async":
            return self.last_seq()
        st = self.server.status()
        standbys = st.get("standbys", [])
        seqs = {str(sb.get("node")): int(sb.get("seq", 0)) for sb in standbys}
        in_sync = {str(sb.get("node")) for sb in standbys if sb.get("in_sync")}
        members = self.members
        if len(members) >= self.sync_standbys and sum(m in in_sync for m in members) >= self.sync_standbys:
            self.short_since = None
            if self.degraded:
                self.degraded = False
                log.warning("ha_sync_restored", members=list(members), note="confirms wait for the standbys again")
            return min(self.server.durable_seq(), min(seqs.get(m, 0) for m in members))
        if self.short_since is None:
            self.short_since = now
            log.warning("ha_standbys_short", members=list(members), in_sync=sorted(in_sync), needed=self.sync_standbys,
                        on_loss=self.on_loss, degraded=self.degraded)
        if self.degraded:
            return self.last_seq()
        if self.on_loss == "degrade" and now - self.short_since >= self.degrade_after_s:
            self._degrade(sorted(m for m in members if m in in_sync))
        return None

    def _degrade(self, keep: list[str]) -> None:
        """Write the sync set without the missing standbys (in a thread); confirm alone once written."""
        with self._lock:
            if self._writer is not None and self._writer.is_alive():
                return
        self.set_members(keep, degrade=True)

    # --- the replication server's side (on_members) and etcd ---
    def on_members(self, members: list[str]) -> None:
        """``ReplicationServer``'s ``on_members``: the standbys in sync now. Called in a
        worker thread; blocks until etcd holds the new sync set; raises (EtcdUnavailable,
        RuntimeError when this broker's key is gone) so the server retries. The set written:
        ``members`` when they are at least ``ha_sync_standbys`` (a laggard is removed
        *before* any confirm goes without it: the gate counts only the set as written);
        fewer: ``members`` plus the set as it is (nobody removed: confirms wait, and every
        listed standby holds every confirmed turn so far and may take over); ``async``: the
        set stays empty (any standby may take over)."""
        if self.mode == "async":
            return
        if self.pinned is not None:
            raise RuntimeError(f"a planned failover pinned the sync set to {list(self.pinned)}: not rewritten")
        new = set(members)
        want = tuple(sorted(new if len(new) >= self.sync_standbys else new | set(self.members)))
        if want == self.members:
            return
        if not self._write(want, degrade=False):
            raise RuntimeError(f"the sync set {list(want)} was not written: this broker's primary key is gone")

    def set_members(self, members: list[str], *, degrade: bool = False, initial: bool = False) -> None:
        """Write exactly ``members`` as the sync set in a thread (retried until written or
        the lease is lost): ``initial``: this epoch's first (empty) set; ``degrade``: the
        smaller set a degrading primary writes before it confirms alone."""
        want = tuple(sorted(members))
        with self._lock:
            self._want = want
            self._degrade_wanted = degrade
            if self._writer is not None and self._writer.is_alive():
                return
            self._writer = threading.Thread(target=self._write_loop, name="ccsq-ha-sync-set", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while not self.lost:
            with self._lock:
                want, degrade = self._want, self._degrade_wanted
                self._want = None
                if want is None:
                    return
            if self._write(want, degrade=degrade):
                continue
            time.sleep(0.2)
            with self._lock:
                if self._want is None:
                    self._want, self._degrade_wanted = want, degrade

    def _write(self, want: tuple[str, ...], *, degrade: bool) -> bool:
        """Write ``want`` to ``/sync`` and count it from then on; False when not written (or
        a planned failover pinned the set: :meth:`pin`)."""
        with self._etcd_lock:
            if self.pinned is not None and want != self.pinned:
                return False
            try:
                written = self.election.write_sync(list(want))
            except Exception as exc:  # noqa: BLE001 - EtcdUnavailable, or anything else
                log.error("ha_sync_set_write_failed", members=list(want), error=str(exc)[:300])
                if not degrade:
                    raise
                return False
            if not written:
                return False
            self.members = want
            if degrade and not self.degraded and len(want) < self.sync_standbys:
                self.degraded = True
                self.degrade_count += 1
                log.warning("ha_degraded", members=list(want), needed=self.sync_standbys,
                            note="confirming without enough standbys (ha_on_standby_loss = degrade): a failover now "
                                 "may lose turns confirmed since; the sync set in etcd was shrunk first, so no "
                                 "standby missing them can take over")
            else:
                log.info("ha_sync_set", members=list(want))
        self.wake()
        return True

    def pin(self, node: str) -> str:
        """A planned failover to ``node`` (a standby that acknowledged the last turn while
        confirms are paused): write ``/sync`` = ``[node]`` so that only ``node`` may take the
        key once this broker resigns (every other standby, in sync or not, and this broker,
        rejoining as a standby, are outside the set), and write nothing else from now on.
        Safe for RPO 0: shrinking the set only removes candidates, and ``node`` holds every
        turn this primary confirmed. Blocks on etcd (call it in a thread). Returns "" when
        written, else why not (the pin is undone: :meth:`unpin`)."""
        with self._etcd_lock:
            self.pinned = (node,)
            try:
                written = self.election.write_sync([node], handover=True)
            except Exception as exc:  # noqa: BLE001 - EtcdUnavailable, or anything else
                written, why = False, f"etcd: {str(exc)[:300]}"
            else:
                why = "" if written else "this broker's primary key is gone"
            if written:
                self.members = (node,)
                log.warning("ha_sync_set_pinned", members=[node], note="a planned failover: only this standby may take the key")
                return ""
            self.pinned = None
            return f"the sync set could not be pinned to {node!r} ({why})"

    def unpin(self) -> None:
        """A refused planned failover: the sync set follows the standbys again."""
        self.pinned = None

    def wait_written(self, timeout_s: float) -> bool:
        """Block until the sync-set writer has nothing left to write (tests, shutdown); True if so."""
        with self._lock:
            writer = self._writer
        if writer is not None:
            writer.join(timeout_s)
            return not writer.is_alive()
        return True

    def lose(self, why: str) -> None:
        """The lease is gone (or in doubt past the margin): never confirm again (any thread)."""
        if not self.lost:
            self.lost = why or "lease lost"
            self.confirming = False

    # --- reading ---
    def oldest_held_age_s(self) -> float:
        return round(self.monotonic_s() - self.held[0][1], 3) if self.held else 0.0

    def status(self) -> dict[str, Any]:
        """The status document's ``ha`` fields the gate knows."""
        mode = "degraded" if self.degraded else self.mode
        waiting = ""
        if self.lost:
            waiting = f"lease lost: {self.lost}"
        elif self.paused:
            waiting = self.paused
        elif not self.election.may_confirm(self.monotonic_s()):
            waiting = "etcd lease not renewed within the margin"
        elif self.mode == "sync" and not self.degraded and self.short_since is not None:
            waiting = (f"waiting for {self.sync_standbys} standby(s) in sync (members {list(self.members)}); "
                       f"ha_on_standby_loss = {self.on_loss}")
        return {"mode": mode, "confirming": self.confirming and not waiting, "waiting": waiting,
                "held_replies": len(self.held), "oldest_held_s": self.oldest_held_age_s(),
                "sync_members": list(self.members), "degraded_count": self.degrade_count}


class HaPrimary:
    """What the actor holds of its primary role: the election ``epoch``, the :class:`ConfirmGate`,
    the replication ``server`` (``status()`` for the status document), the advertised
    ``repl_endpoint``, and ``step_down(why)``: leave the primary role (the role loop in
    ``brokerd/role.py`` stops the actor, resigns and runs as standby)."""

    def __init__(self, epoch: int, gate: ConfirmGate, server: Any, repl_endpoint: str,
                 step_down: Callable[[str], None]) -> None:
        self.epoch, self.gate, self.server, self.repl_endpoint, self.step_down = epoch, gate, server, repl_endpoint, step_down
