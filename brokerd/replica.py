"""The replication link between a primary broker and its standbys (docs/ha.md).

Messages (signed envelopes like every ccsq message, common/wire/envelope.py; the standby
is a peer of role ``standby`` in the primary's authorized keys, the primary one of role
``broker`` in the standby's):

- the standby's HELLO (:func:`standby_hello`): role ``standby``, ``info`` =
  ``{repl_ledger_id, repl_epoch, repl_seq}``: the ledger it holds and its position;
- the primary's WELCOME: ``broker_epoch`` is the primary's election epoch;
- REPL_TURNS (:class:`~ccsq.common.wire.protocol.ReplTurns`): packed write sets in
  order (:class:`Shipper` makes them, a turn above the frame budget in pieces);
- REPL_ACK (:class:`~ccsq.common.wire.protocol.ReplAck`): the standby's position after
  it applied and fsynced a batch (:class:`Standby`);
- an ERROR with code :data:`NEED_COPY` when the primary cannot stream from the
  standby's position (its backlog lost those turns, or the standby holds a tail or
  another ledger): the standby seeds again from a consistent copy.

:class:`SyncTracker` is the primary's count of acknowledgements: the highest turn that
at least ``sync_standbys`` standbys hold (what a ``sync`` primary may confirm up to).

Built and tested here: these pieces over real sockets (tests/test_replica_link.py).
Not built yet: the broker running them (a standby mode of ``ccsq-brokerd``, the actor
holding confirms until :meth:`SyncTracker.durable_seq` covers their turn, promotion).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ccsq.brokerd.ledger import replication
from ccsq.common.wire import protocol

#: ERROR code: the standby must seed again from a consistent copy (docs/ha.md).
NEED_COPY = "NEED_COPY"
#: HELLO ``info`` keys of a standby.
INFO_LEDGER_ID, INFO_EPOCH, INFO_SEQ = "repl_ledger_id", "repl_epoch", "repl_seq"
#: Bytes of a REPL_TURNS frame kept for the envelope and msgpack framing.
_ENVELOPE_SLACK_BYTES = 1024


def standby_hello(replica: replication.ReplicaLedger) -> protocol.Hello:
    """The HELLO a standby opens its session with."""
    epoch, seq = replica.position
    return protocol.Hello(role=protocol.Role.STANDBY.value, info={INFO_LEDGER_ID: replica.ledger_id, INFO_EPOCH: epoch, INFO_SEQ: seq})


def standby_position(hello: protocol.Hello) -> tuple[str, tuple[int, int]]:
    """(ledger id, (epoch, seq)) from a standby's HELLO. Raises
    :class:`~ccsq.brokerd.ledger.replication.ReplicationError` when they are missing."""
    info = hello.info
    lid, epoch, seq = info.get(INFO_LEDGER_ID), info.get(INFO_EPOCH), info.get(INFO_SEQ)
    if not (isinstance(lid, str) and isinstance(epoch, int) and isinstance(seq, int)) or epoch < 0 or seq < 0:
        raise replication.ReplicationError(f"a standby's HELLO needs info {INFO_LEDGER_ID}, {INFO_EPOCH}, {INFO_SEQ}")
    return lid, (epoch, seq)


class Shipper:
    """The primary's side of one standby: what to send next. ``max_frame_bytes``: the
    link's frame limit (turns are packed into REPL_TURNS up to it, a bigger one in pieces)."""

    def __init__(self, log: replication.ReplicationLog, ledger_id: str, hello: protocol.Hello, *,
                 max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES) -> None:
        lid, pos = standby_position(hello)
        if lid != ledger_id:
            raise replication.Diverged(f"the standby holds ledger {lid!r}, this primary {ledger_id!r}")
        self.log, self.budget = log, max(max_frame_bytes - _ENVELOPE_SLACK_BYTES, 64)
        self.sent_seq = pos[1]
        self.backlog = log.since(pos)  # BacklogTruncated / Diverged: answer NEED_COPY

    def messages(self, turns: Iterable[replication.WriteSet] = ()) -> list[protocol.ReplTurns]:
        """REPL_TURNS for the catch-up backlog (first call) and then ``turns`` (newly
        committed ones), in order, each frame within the budget."""
        todo, self.backlog = list(self.backlog) + [ws for ws in turns if ws.seq > self.sent_seq], []
        out: list[protocol.ReplTurns] = []
        batch: list[bytes] = []
        size = 0
        epoch = todo[0].epoch if todo else self.log.epoch
        for ws in todo:
            raw = ws.pack()
            if batch and (size + len(raw) + 8 > self.budget or ws.epoch != epoch):
                out.append(protocol.ReplTurns(epoch, batch))
                batch, size = [], 0
            epoch = ws.epoch
            if len(raw) + 8 > self.budget:
                for i in range(0, len(raw), self.budget):
                    piece = raw[i:i + self.budget]
                    out.append(protocol.ReplTurns(epoch, [piece], partial=i + self.budget < len(raw)))
            else:
                batch.append(raw)
                size += len(raw) + 8
            self.sent_seq = ws.seq
        if batch:
            out.append(protocol.ReplTurns(epoch, batch))
        return out


class Standby:
    """The standby's side: applies REPL_TURNS from the primary of ``epoch`` (its WELCOME's
    ``broker_epoch``) to ``replica`` and answers with REPL_ACK."""

    def __init__(self, replica: replication.ReplicaLedger, welcome: protocol.Welcome) -> None:
        self.replica, self.epoch = replica, welcome.broker_epoch
        self._pieces: list[bytes] = []

    def write_sets(self, msg: protocol.ReplTurns) -> list[replication.WriteSet]:
        """The whole turns ``msg`` completes (pieces of a bigger turn are kept until its
        last), checked to be of this session's epoch; for :meth:`ReplicaLedger.apply_many
        <ccsq.brokerd.ledger.replication.ReplicaLedger.apply_many>` over several messages."""
        if msg.epoch != self.epoch:
            raise replication.StaleEpoch(f"REPL_TURNS of epoch {msg.epoch} from the primary of epoch {self.epoch}")
        if msg.partial or self._pieces:
            if len(msg.turns) != 1:
                raise replication.ReplicationError("a piece of a turn comes alone in its REPL_TURNS")
            self._pieces.append(msg.turns[0])
            if msg.partial:
                return []
            raws, self._pieces = [b"".join(self._pieces)], []
        else:
            raws = msg.turns
        out = [replication.WriteSet.unpack(raw) for raw in raws]
        for ws in out:
            if ws.epoch != self.epoch:
                raise replication.StaleEpoch(f"turn ({ws.epoch}, {ws.seq}) inside REPL_TURNS of epoch {self.epoch}")
        return out

    def on_turns(self, msg: protocol.ReplTurns) -> protocol.ReplAck | None:
        """Apply the turns (each in its own fsynced transaction); the REPL_ACK to send, or
        None (a piece of a turn, or nothing new). Raises :class:`~ccsq.brokerd.ledger.replication.StaleEpoch`
        for turns of another epoch than this session's primary, and whatever
        :meth:`ReplicaLedger.apply` raises (the standby then drops the session; on
        :class:`Diverged` it seeds again)."""
        applied = False
        for ws in self.write_sets(msg):
            applied = self.replica.apply(ws) or applied
        if not applied:
            return None
        return protocol.ReplAck(*self.replica.position)


@dataclass
class SyncTracker:
    """The primary's acknowledgements: standby id -> the last seq it acknowledged in this
    epoch. :meth:`durable_seq` is the highest seq held by at least ``sync_standbys`` of
    them (0 while fewer are connected: a ``sync`` primary then confirms nothing)."""

    epoch: int
    sync_standbys: int = 1
    acked: dict[str, int] = field(default_factory=dict)

    def ack(self, standby: str, msg: protocol.ReplAck) -> None:
        """Record a REPL_ACK. Raises :class:`StaleEpoch` for one of another epoch (a
        standby still following an older primary's numbering)."""
        if msg.epoch != self.epoch:
            raise replication.StaleEpoch(f"REPL_ACK of epoch {msg.epoch} from {standby!r}; this primary is epoch {self.epoch}")
        self.acked[standby] = max(self.acked.get(standby, 0), msg.seq)

    def drop(self, standby: str) -> None:
        """The standby's session ended: its acknowledgements no longer count."""
        self.acked.pop(standby, None)

    def durable_seq(self) -> int:
        if self.sync_standbys <= 0:
            return 1 << 62
        seqs = sorted(self.acked.values(), reverse=True)
        return seqs[self.sync_standbys - 1] if len(seqs) >= self.sync_standbys else 0
