"""The wire protocol's message types: constants, roles, states, the records and messages
as frozen dataclasses, and which role may send which type. No I/O, no codec.

Every message is a frozen dataclass with a ``TYPE``. A message body is a msgpack map
whose keys are exactly the dataclass's field names; nested records (items, leases,
blobs) are maps too (the codec: :mod:`ccsq.common.wire.codec`; what a field may hold:
:mod:`ccsq.common.wire.limits`). A field added after version-1 peers shipped is an
:func:`extension`: encoded only when non-empty.
(Design after zguide's MDP constants module and nats.py's protocol package.)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, ClassVar, Union

from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.limits import blob_problem

PROTOCOL_VERSION = 1

# --- rejection reasons (counted per reason by the broker) -------------------
REJECT_OVERSIZE = "OVERSIZE"  # frame over max_frame_bytes (checked before anything else)
REJECT_FRAMING = "FRAMING"  # wrong number of frames / signature length
REJECT_MALFORMED = "MALFORMED"  # msgpack invalid, over a decode limit, or wrong shape/types
REJECT_VERSION = "VERSION"  # unknown protocol version
REJECT_UNKNOWN_TYPE = "UNKNOWN_TYPE"
REJECT_UNKNOWN_SENDER = "UNKNOWN_SENDER"
REJECT_BAD_SIGNATURE = "BAD_SIGNATURE"
REJECT_FORGED_ORIGIN = "FORGED_ORIGIN"  # sender id differs from the one bound to this connection
REJECT_ROLE = "ROLE"  # role may not send this type
REJECT_REPLAY = "REPLAY"  # (session, seq) already seen
REJECT_STALE = "STALE"  # timestamp outside max_clock_skew_s
REJECT_NO_SESSION = "NO_SESSION"  # first message of a session is not HELLO
#: Sent to a session that a newer HELLO with the same peer id replaced while it was
#: still connected: two live processes share one identity (a configuration error).
ERROR_REPLACED = "REPLACED"
#: A HELLO for a peer id whose session is live (heard within its liveness window) from
#: another process: refused, the live session keeps the id (a session refusal, not a
#: frame rejection, so not in ALL_REJECT_REASONS). ``Error.retry_in_s`` says when the
#: live session lapses unless heard again (sent only to HELLOs carrying INSTANCE_INFO).
REJECT_ID_IN_USE = "ID_IN_USE"
#: HELLO ``info`` key: this link's process instance, ``"<host>/<pid>/<random hex>"``, one
#: per BrokerLink. A HELLO with the live session's instance is the same process
#: reconnecting (it replaces its old session); another instance is refused with
#: REJECT_ID_IN_USE while that session is live. Older brokers ignore it.
INSTANCE_INFO = "instance"
#: A HELLO to a standby broker (docs/ha.md): refused, this broker does not serve peers.
#: ``Error.primary`` names the primary's peer endpoint as etcd has it ("" while no broker
#: holds the swarm's key, i.e. during an election): the peer goes there at once (its
#: ``broker_endpoint`` list, common/link/peer.py), or retries by backoff when "".
REJECT_NOT_PRIMARY = "NOT_PRIMARY"
#: Worker HELLO ``info`` key: the leases whose jobs were running when this worker's
#: previous process died (journaled ``started``), as ``"item_id:token item_id:token"``
#: ("" when none). Present (even empty): of the leases the broker holds for this
#: worker that the HELLO does not list, only these count an attempt (``worker_lost``);
#: the rest never ran here (a DISPATCH whose hold was not journaled) and are released
#: uncounted. Absent (an older worker): every unlisted lease counts an attempt.
LOST_INFO = "lost"


def lost_info(keys: list[tuple[str, int]]) -> str:
    """:data:`LOST_INFO`'s value for ``keys`` (item id, fencing token)."""
    return " ".join(f"{item_id}:{token}" for item_id, token in keys)


def parse_lost_info(value: object) -> set[tuple[str, int]] | None:
    """The (item id, token) pairs of a :data:`LOST_INFO` value; None when it is absent or
    not a string (the older rule: every unlisted lease counts). Malformed words are skipped."""
    if not isinstance(value, str):
        return None
    out: set[tuple[str, int]] = set()
    for word in value.split():
        item_id, _, token = word.rpartition(":")
        if item_id and token.isdigit():
            out.add((item_id, int(token)))
    return out


ALL_REJECT_REASONS = (
    REJECT_OVERSIZE,
    REJECT_FRAMING,
    REJECT_MALFORMED,
    REJECT_VERSION,
    REJECT_UNKNOWN_TYPE,
    REJECT_UNKNOWN_SENDER,
    REJECT_BAD_SIGNATURE,
    REJECT_FORGED_ORIGIN,
    REJECT_ROLE,
    REJECT_REPLAY,
    REJECT_STALE,
    REJECT_NO_SESSION,
)

_OMIT_EMPTY = "ccsq_omit_empty"


def extension(default_factory: Callable[[], Any]) -> Any:
    """A field added after version-1 peers shipped: it is encoded only when non-empty,
    so a peer that does not know it (decoders reject unknown fields) keeps working
    as long as the feature is unused (docs/security.md, "compatibility")."""
    return dataclasses.field(default_factory=default_factory, metadata={_OMIT_EMPTY: True})


class Role(str, enum.Enum):
    BROKER = "broker"
    WORKER = "worker"
    PRODUCER = "producer"
    COMPLETION = "completion"
    ADMIN = "admin"
    #: a federation relay (ccsq-relayd): toward an upstream swarm it holds leases like a
    #: worker; toward a downstream swarm it submits relayed items and takes their results
    RELAY = "relay"
    #: a standby broker (docs/ha.md): it receives the primary's committed turns
    #: (REPL_TURNS) and acknowledges what it applied (REPL_ACK)
    STANDBY = "standby"


class MsgType(enum.IntEnum):
    # session, all roles
    HELLO = 1
    WELCOME = 2
    HEARTBEAT = 3
    BYE = 4
    ERROR = 5
    # producer <-> broker
    SUBMIT = 10
    SUBMIT_ACK = 11
    STATUS = 12
    STATUS_REPLY = 13
    CANCEL = 14
    # worker <-> broker
    CREDIT = 20
    DISPATCH = 21
    COMPLETE = 22
    COMPLETE_ACK = 23
    FAIL = 24
    FAIL_ACK = 25
    # completion service <-> broker
    RESULT = 30
    ACK = 31
    ACK_OK = 32
    # admin <-> broker
    ADMIN = 40
    ADMIN_REPLY = 41
    # primary broker <-> standby broker (docs/ha.md; brokerd/replica.py)
    REPL_TURNS = 50
    REPL_ACK = 51
    REPL_COPY_CHUNK = 52
    REPL_COPY_ACK = 53


class ItemState(str, enum.Enum):
    READY = "ready"
    LEASED = "leased"
    COMPLETED = "completed"
    ACKNOWLEDGED = "acknowledged"
    DEAD = "dead"
    EXPIRED = "expired"


TERMINAL_STATES = frozenset({ItemState.ACKNOWLEDGED, ItemState.DEAD, ItemState.EXPIRED})


class Outcome(str, enum.Enum):
    """What the broker did with a COMPLETE, FAIL or ACK."""

    ACCEPTED = "accepted"  # first valid report with the current lease token
    FENCED = "fenced"  # stale lease token: confirmed but discarded (gap event)
    DUPLICATE = "duplicate"  # already recorded (a replay); idempotent no-op
    UNKNOWN = "unknown"  # the broker has no such item (purged or never existed)
    #: a relay's result whose downstream proof does not verify: discarded, lease untouched
    REJECTED = "rejected"


class FailReason(str, enum.Enum):
    HANDLER_ERROR = "handler_error"
    TIMEOUT = "timeout"  # max_runtime_s exceeded
    PAYLOAD_MISSING = "payload_missing"
    RELEASED = "released"  # the worker gives the lease back without running it
    WORKER_LOST = "worker_lost"  # lease expired (set by the broker, never sent)
    FATAL = "fatal"  # permanent handler error: dead-letter at once
    CANCELLED = "cancelled"
    #: the claim store could not be read or written (an outage, not a missing blob):
    #: requeued after a backoff without counting the attempt, so an outage never
    #: dead-letters items (an older broker counts it as a retryable handler_error)
    STORE_UNAVAILABLE = "store_unavailable"


#: Which message types each role may send; anything else is REJECT_ROLE.
ROLE_MAY_SEND: dict[Role, frozenset[MsgType]] = {
    Role.BROKER: frozenset(
        {
            MsgType.WELCOME,
            MsgType.HEARTBEAT,
            MsgType.BYE,
            MsgType.ERROR,
            MsgType.SUBMIT_ACK,
            MsgType.STATUS_REPLY,
            MsgType.DISPATCH,
            MsgType.COMPLETE_ACK,
            MsgType.FAIL_ACK,
            MsgType.RESULT,
            MsgType.ACK_OK,
            MsgType.ADMIN_REPLY,
            MsgType.REPL_TURNS,
            MsgType.REPL_COPY_CHUNK,
        }
    ),
    Role.PRODUCER: frozenset(
        {MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.SUBMIT, MsgType.STATUS, MsgType.CANCEL}
    ),
    Role.WORKER: frozenset(
        {MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.CREDIT, MsgType.COMPLETE, MsgType.FAIL}
    ),
    Role.COMPLETION: frozenset(
        {MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.CREDIT, MsgType.ACK, MsgType.STATUS}
    ),
    Role.ADMIN: frozenset({MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.ADMIN, MsgType.STATUS, MsgType.CANCEL}),
    Role.RELAY: frozenset(
        {MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.CREDIT, MsgType.COMPLETE, MsgType.FAIL,
         MsgType.SUBMIT, MsgType.STATUS, MsgType.ACK, MsgType.CANCEL}
    ),
    Role.STANDBY: frozenset({MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.REPL_ACK, MsgType.REPL_COPY_ACK}),
}
#: Roles whose sessions hold leases (fencing tokens, heartbeat extension, resume at HELLO).
LEASE_HOLDER_ROLES = frozenset({Role.WORKER, Role.RELAY})

# A scalar value allowed in free-form maps (params, info).
Scalar = Union[str, int, float, bool, bytes, None]
Params = dict[str, Scalar]
#: the types a params value may have (``Scalar``), for isinstance checks
SCALAR_TYPES = (str, int, float, bool, bytes, type(None))


# --- nested records -----------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Blob:
    """A payload or result: inline bytes, or a claim-check reference into the claim store.

    ``sha256`` is the lowercase hex SHA-256 of the content (64 chars) and ``size``
    its length in bytes, in both forms; ``inline`` holds the bytes when small
    (below the producer's ``inline_max_bytes``), else ``None`` and the content is
    in the claim store under ``sha256``.
    """

    sha256: str
    size: int
    inline: bytes | None = None

    def __post_init__(self) -> None:
        problem = blob_problem(self.sha256, self.size, self.inline)  # the one rule (the codec inlines it)
        if problem:
            raise DecodeError(problem, code=REJECT_MALFORMED)


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseRef:
    """A lease a worker holds: item id and its fencing token."""

    item_id: str
    token: int


@dataclasses.dataclass(frozen=True, slots=True)
class SubmitItem:
    """One item in a SUBMIT. ``key`` is the idempotency key; ``deadline_ts`` is
    wall-clock UNIX seconds (None: no deadline); ``max_attempts`` 0 means the
    broker default; ``max_runtime_s`` 0 means no per-attempt limit."""

    key: str
    kind: str
    payload: Blob
    params: Params = dataclasses.field(default_factory=dict)
    priority: int = 0
    deadline_ts: float | None = None
    max_attempts: int = 0
    max_runtime_s: float = 0.0
    #: federation (relay submissions only): the origin broker's signed canonical record
    #: of the item (msgpack, docs/federation.md) and its Ed25519 signature
    origin: bytes = extension(bytes)
    origin_sig: bytes = extension(bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class SubmitResult:
    """Per-item answer in SUBMIT_ACK: ``error`` is "" on success or an error code
    (``QUEUE_FULL``, ``DISK_FULL``, ``PAYLOAD_TOO_LARGE``...)."""

    key: str
    item_id: str
    duplicate: bool = False
    error: str = ""
    message: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One leased item in a DISPATCH; ``token`` is the fencing token to quote back."""

    item_id: str
    token: int
    kind: str
    payload: Blob
    params: Params
    attempt: int
    max_runtime_s: float = 0.0
    deadline_ts: float | None = None
    #: federation (DISPATCH to a relay only): this broker's signed canonical record of the
    #: item and its signature; the downstream broker checks both (docs/federation.md)
    origin: bytes = extension(bytes)
    origin_sig: bytes = extension(bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class TaskResult:
    """One finished item in a COMPLETE. ``runtime_s`` is handler wall time in seconds."""

    item_id: str
    token: int
    result: Blob
    handler: str
    handler_version: str
    runtime_s: float = 0.0
    #: federation (COMPLETE from a relay only): the downstream broker's signed proof of
    #: the result (origin item id, result digest) and its signature
    proof: bytes = extension(bytes)
    proof_sig: bytes = extension(bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class TaskFailure:
    """One failed item in a FAIL. ``reason`` is a :class:`FailReason` value."""

    item_id: str
    token: int
    reason: str
    retryable: bool
    message: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ItemOutcome:
    """The broker's answer for one item in COMPLETE_ACK / FAIL_ACK (an :class:`Outcome` value)."""

    item_id: str
    token: int
    outcome: str


@dataclasses.dataclass(frozen=True, slots=True)
class Quarantined:
    """One acknowledged result the completion service could not store in its results
    table for a data reason (the database refused that row, not an outage): it is
    stored in the quarantine table instead, with ``error`` (gap G12)."""

    item_id: str
    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """One completed result in a RESULT to the completion service.
    ``redelivery`` is true when this result was sent before without an ACK (gap G3)."""

    item_id: str
    key: str
    kind: str
    result: Blob
    params: Params
    attempt: int
    handler: str
    handler_version: str
    completed_ts: float
    redelivery: bool = False
    #: federation (RESULT to a relay only): this broker's signed proof of the result
    proof: bytes = extension(bytes)
    proof_sig: bytes = extension(bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class ItemStatus:
    """An item's state as STATUS_REPLY reports it (``state`` is an :class:`ItemState`
    value, or "unknown"); ``error`` is the dead-letter reason; ``result`` is the
    handler's output as a :class:`Blob` (inline bytes, or a claim-check reference:
    resolve with ``ClaimStore.get_blob``) while the item is completed or acknowledged
    (until acknowledged items are purged after ``retention_s``), else None."""

    item_id: str
    state: str
    attempt: int = 0
    kind: str = ""
    error: str = ""
    result: Blob | None = None


# --- messages ---------------------------------------------------------------------
class Message:
    """Base of all messages; subclasses are frozen dataclasses with a ``TYPE``."""

    TYPE: ClassVar[MsgType]
    __slots__ = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Hello(Message):
    """First message of a session. ``credit`` is the initial credit (workers,
    completion service); ``leases`` the leases the peer still holds (resume);
    ``info`` free-form facts (execution provider, cpu_fallback, handler version)."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    role: str
    slots: int = 0
    credit: int = 0
    kinds: list[str] = dataclasses.field(default_factory=list)
    leases: list[LeaseRef] = dataclasses.field(default_factory=list)
    info: Params = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Welcome(Message):
    """Broker's answer to HELLO. Peers use these liveness settings.
    ``resumed`` leases are still theirs; ``released`` ones are not (drop them)."""

    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    heartbeat_interval_s: float
    liveness: int
    broker_epoch: int
    resumed: list[LeaseRef] = dataclasses.field(default_factory=list)
    released: list[LeaseRef] = dataclasses.field(default_factory=list)
    #: the broker's ephemeral X25519 public key (32 bytes): session MACs agreed; sent only
    #: when the HELLO offered them (info ``mac_x25519``; common/wire/envelope.py)
    mac_x25519: bytes = extension(bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Liveness ping, either direction. From a worker it lists the leases it
    holds (which extends them), ``busy`` slots, ``done`` items so far and
    ``healthy``; ``info`` may carry e.g. ``gpu_mem_free_bytes``."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    leases: list[LeaseRef] = dataclasses.field(default_factory=list)
    busy: int = 0
    done: int = 0
    healthy: bool = True
    info: Params = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Bye(Message):
    TYPE: ClassVar[MsgType] = MsgType.BYE
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Error(Message):
    """A typed refusal. ``ref_seq`` is the sequence number of the offending message (0 if none)."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: str
    message: str
    ref_seq: int = 0
    #: REJECT_ID_IN_USE only: seconds until the live session lapses unless heard again
    #: (the refused peer retries until then, then gives up); sent to peers whose HELLO
    #: carried INSTANCE_INFO
    retry_in_s: float = extension(float)
    #: REJECT_NOT_PRIMARY only: the primary's peer endpoint ("" during an election)
    primary: str = extension(str)


@dataclasses.dataclass(frozen=True, slots=True)
class Submit(Message):
    """Submit items; ``req`` is a producer-chosen request id echoed in SUBMIT_ACK."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    req: int
    items: list[SubmitItem]


@dataclasses.dataclass(frozen=True, slots=True)
class SubmitAck(Message):
    """Sent only after the ledger commit (fsync) that made the items durable."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT_ACK
    req: int
    results: list[SubmitResult]
    #: kinds of these items that no worker seen since the broker started serves; sent only
    #: to producers whose HELLO info has ``features = "unserved_kinds"``
    unserved: list[str] = extension(list)
    #: with ``unserved``, the kinds workers seen recently do serve (up to 100, sorted), for a
    #: producer whose HELLO ``features`` list ``kinds_served`` (a typo'd kind is then plain)
    served: list[str] = extension(list)


@dataclasses.dataclass(frozen=True, slots=True)
class Status(Message):
    TYPE: ClassVar[MsgType] = MsgType.STATUS
    req: int
    item_ids: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Cancel items that have not started: a READY item becomes DEAD with reason
    ``cancelled`` (gap event G7); a leased, completed or terminal item is left as
    it is. The broker answers with a STATUS_REPLY (same ``req``) giving each
    item's state after the cancel, so the caller sees what happened."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    req: int
    item_ids: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class StatusReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.STATUS_REPLY
    req: int
    items: list[ItemStatus]


@dataclasses.dataclass(frozen=True, slots=True)
class Credit(Message):
    """Grant ``credit`` more deliveries (incremental; HELLO sets the initial amount)."""

    TYPE: ClassVar[MsgType] = MsgType.CREDIT
    credit: int


@dataclasses.dataclass(frozen=True, slots=True)
class Dispatch(Message):
    """Leased items for a worker; each lease was committed before this was sent."""

    TYPE: ClassVar[MsgType] = MsgType.DISPATCH
    tasks: list[Task]


@dataclasses.dataclass(frozen=True, slots=True)
class Complete(Message):
    TYPE: ClassVar[MsgType] = MsgType.COMPLETE
    results: list[TaskResult]


@dataclasses.dataclass(frozen=True, slots=True)
class CompleteAck(Message):
    """Sent after the commit; only then may the worker forget the result."""

    TYPE: ClassVar[MsgType] = MsgType.COMPLETE_ACK
    outcomes: list[ItemOutcome]


@dataclasses.dataclass(frozen=True, slots=True)
class Fail(Message):
    TYPE: ClassVar[MsgType] = MsgType.FAIL
    failures: list[TaskFailure]


@dataclasses.dataclass(frozen=True, slots=True)
class FailAck(Message):
    TYPE: ClassVar[MsgType] = MsgType.FAIL_ACK
    outcomes: list[ItemOutcome]


@dataclasses.dataclass(frozen=True, slots=True)
class Result(Message):
    """Completed results for the completion service (at most its credit)."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    deliveries: list[Delivery]


@dataclasses.dataclass(frozen=True, slots=True)
class Ack(Message):
    """The completion service committed these results to its database.
    ``quarantined`` names those of ``item_ids`` that went to its quarantine table."""

    TYPE: ClassVar[MsgType] = MsgType.ACK
    item_ids: list[str]
    quarantined: list[Quarantined] = extension(list)


@dataclasses.dataclass(frozen=True, slots=True)
class AckOk(Message):
    """Sent after the broker committed the acknowledgements. ``unknown`` lists
    ids the broker does not hold in state completed (already acknowledged or purged)."""

    TYPE: ClassVar[MsgType] = MsgType.ACK_OK
    item_ids: list[str]
    unknown: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class Admin(Message):
    """An admin command (``status``, ``items_show``, ``dlq_list``, ``dlq_replay``,
    ``dlq_purge``, ``drain``) with string arguments."""

    TYPE: ClassVar[MsgType] = MsgType.ADMIN
    req: int
    command: str
    args: Params = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class AdminReply(Message):
    """``body`` is a msgpack-encoded JSON-like document (decoded by the admin CLI)."""

    TYPE: ClassVar[MsgType] = MsgType.ADMIN_REPLY
    req: int
    ok: bool
    body: bytes = b""
    error: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplTurns(Message):
    """Primary -> standby: committed turns of ``epoch`` in order, each a packed write set
    (:meth:`ccsq.brokerd.ledger.replication.WriteSet.pack`). ``partial``: ``turns`` holds one
    piece of a turn too big for one frame; the pieces go in order, the last with
    ``partial`` false (brokerd/replica.py)."""

    TYPE: ClassVar[MsgType] = MsgType.REPL_TURNS
    epoch: int
    turns: list[bytes]
    partial: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ReplAck(Message):
    """Standby -> primary: every turn up to ``(epoch, seq)`` is applied and fsynced here."""

    TYPE: ClassVar[MsgType] = MsgType.REPL_ACK
    epoch: int
    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReplCopyChunk(Message):
    """Primary -> standby, after an ERROR ``NEED_COPY``: bytes ``offset .. offset +
    len(data)`` of a consistent copy of the primary's ``data.mdb`` (``total`` bytes) that
    holds every turn up to ``(epoch, seq)`` (brokerd/replserver.py). The primary keeps at
    most a window of chunks unacknowledged (:class:`ReplCopyAck`)."""

    TYPE: ClassVar[MsgType] = MsgType.REPL_COPY_CHUNK
    epoch: int
    seq: int
    offset: int
    total: int
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ReplCopyAck(Message):
    """Standby -> primary: the copy's bytes before ``offset`` are written here (the
    primary's send window moves; ``offset == total``: the copy is installed and fsynced)."""

    TYPE: ClassVar[MsgType] = MsgType.REPL_COPY_ACK
    offset: int


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        Heartbeat,
        Bye,
        Error,
        Submit,
        SubmitAck,
        Status,
        StatusReply,
        Cancel,
        Credit,
        Dispatch,
        Complete,
        CompleteAck,
        Fail,
        FailAck,
        Result,
        Ack,
        AckOk,
        Admin,
        AdminReply,
        ReplTurns,
        ReplAck,
        ReplCopyChunk,
        ReplCopyAck,
    )
}

