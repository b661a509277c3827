"""The ccsq wire protocol: constants, typed messages and their body codec. No I/O.

Every message is a frozen dataclass with a ``TYPE``. A message body is a
msgpack map whose keys are exactly the dataclass's field names; nested records
(items, leases, blobs) are maps too. :func:`decode_body` checks the key set and
every value's type strictly, so nothing malformed is half-applied: either the
whole message decodes or :class:`~ccsq.common.wire.errors.DecodeError` is raised
with one of the ``REJECT_*`` codes.

Framing and signatures live in :mod:`ccsq.common.wire.envelope`.
(Design after zguide's MDP constants module and nats.py's protocol package.)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Union

from ccsq.common.wire.errors import DecodeError

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

# --- default limits ---------------------------------------------------------
DEFAULT_MAX_FRAME_BYTES = 1 << 20  # 1 MiB
MAX_ARRAY_LEN = 65_536
MAX_MAP_LEN = 256
_OMIT_EMPTY = "ccsq_omit_empty"


def extension(default_factory: Callable[[], Any]) -> Any:
    """A field added after version-1 peers shipped: it is encoded only when non-empty,
    so a peer that does not know it (decoders reject unknown fields) keeps working
    as long as the feature is unused (docs/security.md, "compatibility")."""
    return dataclasses.field(default_factory=default_factory, metadata={_OMIT_EMPTY: True})

MAX_DEPTH = 8
SIGNATURE_BYTES = 64  # Ed25519
SHA256_HEX_LEN = 64


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
    Role.STANDBY: frozenset({MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.REPL_ACK}),
}
#: Roles whose sessions hold leases (fencing tokens, heartbeat extension, resume at HELLO).
LEASE_HOLDER_ROLES = frozenset({Role.WORKER, Role.RELAY})

_HEX_RE = re.compile(r"[0-9a-f]{64}")

# A scalar value allowed in free-form maps (params, info).
Scalar = Union[str, int, float, bool, bytes, None]
Params = dict[str, Scalar]


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
        if len(self.sha256) != SHA256_HEX_LEN or not _HEX_RE.fullmatch(self.sha256):
            raise DecodeError("blob sha256 must be 64 lowercase hex chars", code=REJECT_MALFORMED)
        if self.size < 0:
            raise DecodeError("blob size must be >= 0", code=REJECT_MALFORMED)
        if self.inline is not None and len(self.inline) != self.size:
            raise DecodeError("inline blob length differs from size", code=REJECT_MALFORMED)


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


PRIO_MAX = (1 << 31) - 1
PRIO_MIN = -(1 << 31)
MAX_KIND_LEN = 128
MAX_KEY_BYTES = 400


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _has_control(text: str) -> bool:
    return _CONTROL_RE.search(text) is not None


def submit_item_problem(item: SubmitItem) -> str:
    """Return "" when ``item`` is acceptable, else a human reason.

    One rule for the producer (raises InvalidRequest before sending) and the
    broker (answers MALFORMED for that item). Besides ranges it refuses what a
    results database can never store, so one bad item cannot wedge the
    completion service later: control characters (NUL...) in ``key``/``kind``,
    NUL in param keys or strings, and non-finite floats (NaN, +-Infinity are
    not JSON) in ``params``, ``deadline_ts`` or ``max_runtime_s``. The payload is
    not part of the rule (:func:`submit_fields_problem` is the same rule on the fields).
    """
    try:
        if _submit_item_plainly_fine(item):
            return ""
    except Exception:  # noqa: BLE001 - anything odd: the rule below decides (and raises as it always did)
        pass
    return submit_fields_problem(kind=item.kind, key=item.key, priority=item.priority, max_attempts=item.max_attempts,
                                 max_runtime_s=item.max_runtime_s, deadline_ts=item.deadline_ts, params=item.params)


_FLOAT_MAX = sys.float_info.max
_PARAM_PLAIN_TYPES = frozenset({int, bool, bytes, type(None)})


def _submit_item_plainly_fine(item: SubmitItem) -> bool:
    """True only when :func:`submit_fields_problem` would return "" for ``item`` (the broker
    runs this per submitted item): plain ASCII key and kind (for ASCII, ``isprintable`` is
    exactly "no control character", and the length is the UTF-8 length), exact int and
    float types, finite floats by comparison. False means "not sure": the full rule runs."""
    kind, key = item.kind, item.key
    if not (type(kind) is str and 0 < len(kind) <= MAX_KIND_LEN and kind.isascii() and kind.isprintable()):
        return False
    if not (type(key) is str and 0 < len(key) <= MAX_KEY_BYTES and key.isascii() and key.isprintable()):
        return False
    prio, attempts, runtime, deadline = item.priority, item.max_attempts, item.max_runtime_s, item.deadline_ts
    if not (type(prio) is int and PRIO_MIN <= prio <= PRIO_MAX and type(attempts) is int and 0 <= attempts <= 1000):
        return False
    if not (type(runtime) is float and 0.0 <= runtime <= _FLOAT_MAX):  # NaN fails every comparison
        return False
    if deadline is not None and not (type(deadline) is float and -_FLOAT_MAX <= deadline <= _FLOAT_MAX):
        return False
    params = item.params
    if type(params) is not dict:
        return False
    for k, v in params.items():
        if type(k) is not str or "\0" in k:
            return False
        t = type(v)
        if t is float:
            if not -_FLOAT_MAX <= v <= _FLOAT_MAX:
                return False
        elif t is str:
            if "\0" in v:
                return False
        elif t not in _PARAM_PLAIN_TYPES:
            return False
    return True


def submit_fields_problem(*, kind: str, key: str | None, priority: int, max_attempts: int, max_runtime_s: float,
                          deadline_ts: float | None, params: Params) -> str:
    """:func:`submit_item_problem` on the fields of a SubmitItem before it exists, so the
    producer checks an item once, before its payload is written to the claim store.
    ``key`` None: derived from the payload later (64 hex chars, always acceptable)."""
    if not kind or len(kind) > MAX_KIND_LEN or _has_control(kind):
        return f"kind must be 1..{MAX_KIND_LEN} chars without control characters"
    if key is not None and (not key or len(key.encode()) > MAX_KEY_BYTES or _has_control(key)):
        return f"key must be 1..{MAX_KEY_BYTES} bytes without control characters"
    if not PRIO_MIN <= priority <= PRIO_MAX:
        return "priority out of the 32-bit signed range"
    if not 0 <= max_attempts <= 1000:
        return "max_attempts must be 0..1000"
    if not (math.isfinite(max_runtime_s) and max_runtime_s >= 0):
        return "max_runtime_s must be a finite number >= 0"
    if deadline_ts is not None and not math.isfinite(deadline_ts):
        return "deadline_ts must be a finite UNIX time"
    for k, v in params.items():
        if "\0" in k:
            return f"params key {k!r} contains NUL"
        if isinstance(v, float) and not math.isfinite(v):
            return f"params[{k!r}] = {v!r} is not a finite number (NaN/Infinity are not JSON)"
        if isinstance(v, str) and "\0" in v:
            return f"params[{k!r}] contains NUL"
    return ""


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
    )
}


# --- body codec -----------------------------------------------------------------
# Converters are compiled once per dataclass (a closure per field) so the hot
# path does no typing introspection per value.

#: the types a params value may have (``Scalar``), for isinstance checks
SCALAR_TYPES = (str, int, float, bool, bytes, type(None))
_ENCODERS: dict[type, Any] = {}
_DECODERS: dict[type, Any] = {}


def _bad(path: str, why: str) -> DecodeError:
    return DecodeError(f"{path}: {why}", code=REJECT_MALFORMED)


def _compile_encoder(tp: Any):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            enc = _record_encoder(inner[0])
            return lambda v: None if v is None else enc(v)
        return None
    if origin is list:
        (elem,) = typing.get_args(tp)
        if dataclasses.is_dataclass(elem):
            enc = _record_encoder(elem)
            return lambda v: [enc(x) for x in v]
        return list
    if origin is dict:
        return dict
    if dataclasses.is_dataclass(tp):
        return _record_encoder(tp)
    return None  # scalar: as is


def _record_encoder(cls: type):
    enc = _ENCODERS.get(cls)
    if enc is not None:
        return enc
    hints = typing.get_type_hints(cls)
    plan: list = []

    def encode(obj: Any) -> dict:
        out = {}
        for name, conv, omit_empty in plan:
            v = getattr(obj, name)
            if omit_empty and not v:
                continue
            out[name] = v if conv is None else conv(v)
        return out

    _ENCODERS[cls] = encode
    plan.extend((f.name, _compile_encoder(hints[f.name]), bool(f.metadata.get(_OMIT_EMPTY)))
                for f in dataclasses.fields(cls))
    return encode


def _compile_decoder(tp: Any):
    """Return ``conv(value, path, depth)`` that validates and converts one value of type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        nullable = type(None) in args
        variants = [_compile_decoder(a) for a in args if a is not type(None)]

        def conv_union(v, path, depth):
            if v is None and nullable:
                return None
            errors = []
            for var in variants:
                try:
                    return var(v, path, depth)
                except DecodeError as exc:
                    errors.append(str(exc))
            raise _bad(path, f"no variant matched ({'; '.join(errors)})")

        return conv_union
    if origin is list:
        (elem,) = typing.get_args(tp)
        econv = _compile_decoder(elem)

        def conv_list(v, path, depth):
            if type(v) is not list:
                raise _bad(path, f"expected array, got {type(v).__name__}")
            if depth >= MAX_DEPTH:
                raise _bad(path, "nested too deeply")
            return [econv(x, path, depth + 1) for x in v]  # element errors name the list

        return conv_list
    if origin is dict:

        def conv_map(v, path, depth):
            if type(v) is not dict:
                raise _bad(path, f"expected map, got {type(v).__name__}")
            if len(v) > MAX_MAP_LEN:
                raise _bad(path, "map too long")
            for k, x in v.items():
                if type(k) is not str:
                    raise _bad(path, "map keys must be strings")
                if not isinstance(x, SCALAR_TYPES):
                    raise _bad(f"{path}.{k}", "map values must be scalars")
            return dict(v)

        return conv_map
    if dataclasses.is_dataclass(tp):
        rec = _record_decoder(tp)

        def conv_rec(v, path, depth):
            if depth >= MAX_DEPTH:
                raise _bad(path, "nested too deeply")
            return rec(v, path, depth + 1)

        return conv_rec
    if tp is float:

        def conv_float(v, path, depth):
            t = type(v)
            if t is float:
                return v
            if t is int:
                return float(v)
            raise _bad(path, f"expected number, got {t.__name__}")

        return conv_float
    if tp in (int, bool, str, bytes):
        name = "integer" if tp is int else tp.__name__

        def conv_exact(v, path, depth, tp=tp, name=name):
            if type(v) is not tp:
                raise _bad(path, f"expected {name}, got {type(v).__name__}")
            return v

        return conv_exact
    if tp is Any:
        return lambda v, path, depth: v
    raise TypeError(f"unsupported field type {tp!r}")  # programming error, at import time


def _record_decoder(cls: type):
    dec = _DECODERS.get(cls)
    if dec is not None:
        return dec
    fields: list = []
    required: set[str] = set()
    known: set[str] = set()

    def decode(value: Any, path: str, depth: int) -> Any:
        if type(value) is not dict:
            raise _bad(path, f"expected map for {cls.__name__}, got {type(value).__name__}")
        if not known.issuperset(value.keys()):
            unknown = sorted(str(k) for k in value if k not in known)
            raise _bad(path, f"unknown field(s) {unknown} for {cls.__name__}")
        if not required.issubset(value.keys()):
            missing = sorted(required - set(value))
            raise _bad(path, f"missing field {missing[0]!r} for {cls.__name__}")
        kwargs = {}
        for name, conv in fields:
            if name in value:
                try:
                    kwargs[name] = conv(value[name], name, depth)
                except DecodeError as exc:
                    # paths are built only on the error path (hot path stays cheap)
                    raise DecodeError(f"{path}.{exc}", code=exc.code) from None
        try:
            return cls(**kwargs)
        except DecodeError:
            raise
        except (TypeError, ValueError) as exc:
            raise _bad(path, str(exc)) from None

    _DECODERS[cls] = decode
    hints = {k: v for k, v in typing.get_type_hints(cls).items() if k != "TYPE"}
    for f in dataclasses.fields(cls):
        fields.append((f.name, _compile_decoder(hints[f.name])))
        known.add(f.name)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.add(f.name)
    return decode


def _slow_decode_body(msg_type: int, body: Any) -> Message:
    """The reference decoder: the compiled closures above, one call per value."""
    try:
        cls = MESSAGE_CLASSES[MsgType(msg_type)]
    except ValueError:
        raise DecodeError(f"unknown message type {msg_type!r}", code=REJECT_UNKNOWN_TYPE) from None
    return _record_decoder(cls)(body, cls.__name__, 0)


# --- generated fast codec ----------------------------------------------------------
# The closures above are the reference: clear, one call per value, and the only place
# that words a refusal. On the hot path every process runs instead one function per
# message type, generated here once at import as Python source: type checks inlined
# per field (exact ``type(v) is T``), nested records and lists of records inlined into
# loops, each record's slots filled directly
# (``__post_init__`` still runs, or its rule is inlined: ``_INLINE_CHECKS``).
# A generated decoder only ever accepts a subset of what the reference accepts (it
# bails out on anything unusual: a missing or unknown field, a subclass, a wrong type,
# a refusal from ``__post_init__``); when it bails out, the reference decoder runs on
# the same body and either refuses with its exact message or returns its result. So
# what is accepted and refused, and every error message, is the reference's.


class _Bail(Exception):
    """The generated fast path gives up; the reference decoder decides."""


_MISS = object()
_SCALAR_SET = frozenset(SCALAR_TYPES)
_EXACT_NAMES = {str: "str", int: "int", bool: "bool", bytes: "bytes"}


class _Gen:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ns: dict[str, Any] = {"_Bail": _Bail, "_MISS": _MISS, "_SCALARS": _SCALAR_SET, "_new": object.__new__,
                                   "_hexfull": _HEX_RE.fullmatch}
        self._n = 0

    def var(self, base: str) -> str:
        self._n += 1
        return f"{base}{self._n}"

    def const(self, obj: Any, base: str) -> str:
        name = self.var(f"_k_{base}_")
        self.ns[name] = obj
        return name

    def emit(self, ind: int, line: str) -> None:
        self.lines.append("    " * ind + line)

    def build(self, name: str) -> Callable:
        exec(compile("\n".join(self.lines) + "\n", f"<ccsq codec {name}>", "exec"), self.ns)  # noqa: S102
        return self.ns[name]


def _plain_fields(cls: type) -> tuple:
    fields = dataclasses.fields(cls)
    if any(not f.init for f in fields):  # the reference refuses such a field when sent: leave it to it
        raise TypeError(f"{cls.__name__}: no generated decoder for a field outside __init__")
    return fields


def _gen_dec_value(g: _Gen, tp: Any, x: str, depth: int, ind: int) -> None:
    """Emit statements that check local ``x`` like ``_compile_decoder(tp)(x, _, depth)``
    and leave the converted value in ``x`` (or raise _Bail)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        if type(None) not in args or len(inner) != 1:
            g.emit(ind, "raise _Bail")  # not in the schema today: the reference decides
            return
        g.emit(ind, f"if {x} is not None:")
        _gen_dec_value(g, inner[0], x, depth, ind + 1)
        return
    if origin is list:
        (elem,) = typing.get_args(tp)
        g.emit(ind, f"if type({x}) is not list: raise _Bail")
        if depth >= MAX_DEPTH:
            g.emit(ind, "raise _Bail")
            return
        e = g.var("e")
        if elem in _EXACT_NAMES:
            g.emit(ind, f"for {e} in {x}:")
            g.emit(ind + 1, f"if type({e}) is not {_EXACT_NAMES[elem]}: raise _Bail")
            g.emit(ind, f"{x} = list({x})")
            return
        lst = g.var("l")
        g.emit(ind, f"{lst} = []")
        g.emit(ind, f"for {e} in {x}:")
        _gen_dec_value(g, elem, e, depth + 1, ind + 1)
        g.emit(ind + 1, f"{lst}.append({e})")
        g.emit(ind, f"{x} = {lst}")
        return
    if origin is dict:
        k, e = g.var("k"), g.var("e")
        g.emit(ind, f"if type({x}) is not dict or len({x}) > {MAX_MAP_LEN}: raise _Bail")
        g.emit(ind, f"for {k}, {e} in {x}.items():")
        g.emit(ind + 1, f"if type({k}) is not str or type({e}) not in _SCALARS: raise _Bail")
        g.emit(ind, f"{x} = dict({x})")
        return
    if dataclasses.is_dataclass(tp):
        if depth >= MAX_DEPTH:
            g.emit(ind, "raise _Bail")
            return
        _gen_dec_record(g, tp, x, depth + 1, ind)
        return
    if tp is float:
        g.emit(ind, f"if type({x}) is not float:")
        g.emit(ind + 1, f"if type({x}) is not int: raise _Bail")
        g.emit(ind + 1, f"{x} = float({x})")
        return
    if tp in _EXACT_NAMES:
        g.emit(ind, f"if type({x}) is not {_EXACT_NAMES[tp]}: raise _Bail")
        return
    if tp is Any:
        return
    raise TypeError(f"unsupported field type {tp!r}")


def _gen_dec_record(g: _Gen, cls: type, m: str, depth: int, ind: int) -> None:
    """Emit statements that decode the map in local ``m`` as ``_record_decoder(cls)(m, _, depth)``
    would and leave the instance in ``m``."""
    hints = typing.get_type_hints(cls)
    fields = _plain_fields(cls)
    n_req = sum(1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    g.emit(ind, f"if type({m}) is not dict: raise _Bail")
    cnt = None
    if n_req == len(fields):
        g.emit(ind, f"if len({m}) != {n_req}: raise _Bail")
    else:
        cnt = g.var("n")
        g.emit(ind, f"{cnt} = {n_req}")
    args = []
    for f in fields:
        v = g.var("v")
        args.append(v)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            g.emit(ind, f"{v} = {m}[{f.name!r}]")  # KeyError: the reference names the missing field
            _gen_dec_value(g, hints[f.name], v, depth, ind)
            continue
        if f.default is not dataclasses.MISSING:
            default = g.const(f.default, f.name)
        else:
            default = g.const(f.default_factory, f.name) + "()"
        g.emit(ind, f"{v} = {m}.get({f.name!r}, _MISS)")
        g.emit(ind, f"if {v} is _MISS:")
        g.emit(ind + 1, f"{v} = {default}")
        g.emit(ind, "else:")
        g.emit(ind + 1, f"{cnt} += 1")
        _gen_dec_value(g, hints[f.name], v, depth, ind + 1)
    if cnt is not None:
        g.emit(ind, f"if len({m}) != {cnt}: raise _Bail")  # every key was a known field
    post = getattr(cls, "__post_init__", None)
    check = _INLINE_CHECKS.get(cls)
    if check is not None:  # __post_init__'s rule as one expression over the (exactly typed) values
        g.emit(ind, f"if not ({check.format(**dict(zip((f.name for f in fields), args)))}): raise _Bail")
        post = None
    twin = _twin(cls)
    if twin is None:  # not a plain slots class: its constructor
        g.emit(ind, f"{m} = {g.const(cls, cls.__name__)}({', '.join(args)})")
        return
    # A frozen dataclass's __init__ stores each field through object.__setattr__ (a
    # call per field): instead fill the slots of an unfrozen twin with plain stores, make
    # it the real class (same slot layout), and run __post_init__ as __init__ would.
    g.emit(ind, f"{m} = _new({g.const(twin, 'twin_' + cls.__name__)})")
    for f, v in zip(fields, args):
        g.emit(ind, f"{m}.{f.name} = {v}")
    g.emit(ind, f"{m}.__class__ = {g.const(cls, cls.__name__)}")
    if post is not None:
        g.emit(ind, f"{g.const(post, 'post')}({m})")


#: ``__post_init__`` rules the generated decoders inline, as one expression over the field
#: values (there already of the exact field types: str, int, bytes | None). Keep each in
#: step with its ``__post_init__`` (tests/test_codec_equivalence.py compares the two).
_INLINE_CHECKS: dict[type, str] = {
    Blob: "len({sha256}) == 64 and _hexfull({sha256}) is not None and {size} >= 0"
          " and ({inline} is None or len({inline}) == {size})",
}


_TWINS: dict[type, type | None] = {}


def _twin(cls: type) -> type | None:
    """An unfrozen class with ``cls``'s exact slots whose instances may become ``cls``
    instances by ``__class__`` assignment; None when ``cls`` is not such a slots class."""
    if cls not in _TWINS:
        _TWINS[cls] = _make_twin(cls)
    return _TWINS[cls]


def _make_twin(cls: type) -> type | None:
    names = tuple(f.name for f in dataclasses.fields(cls))
    if getattr(cls, "__slots__", None) != names or any("__slots__" not in vars(b) for b in cls.__mro__[:-1]):
        return None
    if any(vars(b)["__slots__"] for b in cls.__mro__[1:-1]):
        return None
    twin = type(f"_{cls.__name__}Slots", cls.__bases__, {"__slots__": names})
    try:  # prove it once: the same object the constructor would build
        probe = object.__new__(twin)
        for n in names:
            setattr(probe, n, None)
        probe.__class__ = cls
        if any(getattr(probe, n) is not None for n in names):
            return None
    except Exception:  # noqa: BLE001 - a layout CPython will not swap: use the constructor
        return None
    return twin


def trusted_constructor(cls: type, names: tuple[str, ...]) -> Any:
    """A positional constructor of the frozen, slotted dataclass ``cls`` whose fields are
    ``names`` (all of them, in order) that fills the slots of its unfrozen twin and makes the
    object a ``cls`` (as the generated decoders do): no ``__init__`` (one
    ``object.__setattr__`` call per field in a frozen class) and no ``__post_init__`` check.
    Only for values that pass ``cls``'s checks by construction (a digest from
    ``hexdigest()``, a size from ``len``...); the object is the one ``cls(...)`` makes
    (equal, hashed, encoded the same, still frozen). When ``cls`` is not such a dataclass or
    its fields are not exactly ``names`` (a changed record): ``cls`` itself, checks and all."""
    try:
        fields = tuple(f.name for f in dataclasses.fields(cls))
    except TypeError:  # not a dataclass
        return cls
    twin = _twin(cls) if fields == names else None
    if twin is None:
        return cls
    g = _Gen()
    fn = f"_make_{cls.__name__}"
    args = [f"_a{i}" for i in range(len(names))]  # never a field's own name
    g.emit(0, f"def {fn}({', '.join(args)}):")
    g.emit(1, f"_o = _new({g.const(twin, 'twin')})")
    for n, a in zip(names, args):
        g.emit(1, f"_o.{n} = {a}")
    g.emit(1, f"_o.__class__ = {g.const(cls, 'cls')}")
    g.emit(1, "return _o")
    return g.build(fn)


def _gen_decoder(cls: type) -> Callable[[Any], Any]:
    g = _Gen()
    name = f"_decode_{cls.__name__}"
    g.emit(0, f"def {name}(m):")
    _gen_dec_record(g, cls, "m", 0, 1)
    g.emit(1, "return m")
    return g.build(name)


def _gen_enc_value(g: _Gen, tp: Any, src: str, ind: int) -> str:
    """Emit what is needed before, and return the expression ``_compile_encoder(tp)`` gives for ``src``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            t, r = g.var("t"), g.var("r")
            g.emit(ind, f"{t} = {src}")
            g.emit(ind, f"if {t} is None:")
            g.emit(ind + 1, f"{r} = None")
            g.emit(ind, "else:")
            g.emit(ind + 1, f"{r} = {_gen_enc_record(g, inner[0], t, ind + 1)}")
            return r
        return src
    if origin is list:
        (elem,) = typing.get_args(tp)
        if not dataclasses.is_dataclass(elem):
            return f"list({src})"
        lst, e = g.var("l"), g.var("e")
        g.emit(ind, f"{lst} = []")
        g.emit(ind, f"for {e} in {src}:")
        g.emit(ind + 1, f"{lst}.append({_gen_enc_record(g, elem, e, ind + 1)})")
        return lst
    if origin is dict:
        return f"dict({src})"
    if dataclasses.is_dataclass(tp):
        t = g.var("t")
        g.emit(ind, f"{t} = {src}")
        return _gen_enc_record(g, tp, t, ind)
    return src


def _gen_enc_record(g: _Gen, cls: type, o: str, ind: int) -> str:
    """Emit statements that build ``_record_encoder(cls)(o)`` (same keys, same order); return its variable."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    d = g.var("d")
    head = []
    i = 0
    while i < len(fields) and not fields[i].metadata.get(_OMIT_EMPTY):
        head.append(f"{fields[i].name!r}: {_gen_enc_value(g, hints[fields[i].name], f'{o}.{fields[i].name}', ind)}")
        i += 1
    g.emit(ind, f"{d} = {{{', '.join(head)}}}")
    for f in fields[i:]:
        if f.metadata.get(_OMIT_EMPTY):
            t = g.var("t")
            g.emit(ind, f"{t} = {o}.{f.name}")
            g.emit(ind, f"if {t}:")
            g.emit(ind + 1, f"{d}[{f.name!r}] = {_gen_enc_value(g, hints[f.name], t, ind + 1)}")
        else:
            g.emit(ind, f"{d}[{f.name!r}] = {_gen_enc_value(g, hints[f.name], f'{o}.{f.name}', ind)}")
    return d


def _gen_encoder(cls: type) -> Callable[[Any], dict]:
    g = _Gen()
    name = f"_encode_{cls.__name__}"
    g.emit(0, f"def {name}(o):")
    g.emit(1, f"return {_gen_enc_record(g, cls, 'o', 1)}")
    return g.build(name)


_FAST_ENCODERS: dict[type, Callable[[Any], dict]] = {}
_FAST_DECODERS: dict[int, Callable[[Any], Message]] = {}


def encode_body(obj: Any) -> Any:
    """Turn a message or record into plain msgpack-able data (maps of field name -> value).

    Same maps as the reference ``_record_encoder``: keys in field order, empty
    ``extension`` fields left out, nested records as maps, lists and maps copied."""
    enc = _FAST_ENCODERS.get(type(obj))
    if enc is None:
        return _record_encoder(type(obj))(obj)
    return enc(obj)


def decode_body(msg_type: int, body: Any) -> Message:
    """Build the typed message for ``msg_type`` from decoded msgpack ``body``.

    Raises :class:`DecodeError` (``UNKNOWN_TYPE`` or ``MALFORMED``) on any
    unknown type, unknown or missing field, or wrong value type.
    """
    try:
        fast = _FAST_DECODERS[msg_type]
    except Exception:  # not a plain message type number (or unhashable): the reference words it
        return _slow_decode_body(msg_type, body)
    try:
        return fast(body)
    except Exception:  # noqa: BLE001 - _Bail, KeyError, a refusal: the reference decides and words it
        return _slow_decode_body(msg_type, body)


for _cls in MESSAGE_CLASSES.values():  # compile eagerly: errors show at import, not on the wire
    _record_encoder(_cls)
    _record_decoder(_cls)
for _cls in list(_ENCODERS):  # every record reachable from a message
    _FAST_ENCODERS[_cls] = _gen_encoder(_cls)
for _type, _cls in MESSAGE_CLASSES.items():
    try:
        _FAST_DECODERS[int(_type)] = _gen_decoder(_cls)
    except TypeError:  # a shape the generator does not know: the reference decodes it (slowly)
        pass
