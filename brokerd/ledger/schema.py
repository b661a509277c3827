"""What the ledger stores and how, in one place: sub-databases, every key prefix and key
builder, the item record (:class:`Item`) and the value packing (docs/ledger.md).

Nothing here touches LMDB; the other modules of the package build every key through
these functions, so the byte layout of a ledger file is read off this page. All values
are msgpack (``use_bin_type=True``); ``>Q`` is an 8-byte big-endian unsigned integer,
``>I`` 4 bytes, ``>q`` 8 bytes signed; keys sort bytewise. Changing anything here
changes the file format: existing ledger files must stay readable.
"""

from __future__ import annotations

import hashlib
import operator
import struct
import threading
from typing import Any, TypedDict

import lz4.block
import msgpack

from ccsq.common.wire import protocol

S = protocol.ItemState
STATES: tuple[str, ...] = tuple(s.value for s in S)

#: Flow counters (monotonic, in meta ``c:<name>``, changed in the same txn as the state).
COUNTERS: tuple[str, ...] = (
    "received",
    "routed",
    "completed",
    "acknowledged",
    "retried",
    "failed",
    "dead",
    "expired",
    "duplicate_submits",
    "fenced_completions",
    "fenced_failures",
    "redelivered",
    "released",
    "late_results_accepted",
    "purged",
    "replayed",
    "dead_purged",
    "quarantined",
)

DB_NAMES = (
    "items",  # item_id -> msgpack Item record
    "payloads",  # item_id -> msgpack Blob
    "results",  # item_id -> msgpack Blob
    "ready",  # kind \0 >I prio_key >Q not_before_ms >Q seq -> item_id
    "leased",  # item_id -> msgpack [token, worker]
    "completed",  # >Q completion_seq -> item_id
    "dead",  # item_id -> b""
    "acked",  # >Q acked_ms + item_id -> b""
    "deadline",  # >Q deadline_ms + item_id -> b""
    "keys",  # key_index(idempotency key) -> msgpack [item_id, created_ms] (older ledgers: the key's UTF-8 bytes)
    "keytime",  # >Q created_ms + the key's entry in keys -> b""
    "events",  # window \0 >Q n -> msgpack event
    "meta",  # counters, per-state counts, ids: the prefixes below
)

PRIO_MAX = protocol.PRIO_MAX
_Q = struct.Struct(">Q")
_q = struct.Struct(">q")
_I = struct.Struct(">I")
_READY = struct.Struct(">IQQ")

# --- meta keys: a two-byte prefix, then the name ---
#: ``m:<name>``: ledger-wide ids and sequences (``>q``, except ``m:ledger_id``: raw ASCII).
META = b"m:"
LEDGER_ID = META + b"ledger_id"  # 8 random hex chars made at creation; prefix of every item id
EPOCH = META + b"epoch"  # +1 at every broker start
NEXT_SEQ = META + b"next_seq"  # arrival sequence; item id = id prefix + %012x of it
ID_PREFIX = META + b"id_prefix"  # 8 hex chars that begin new item ids (absent: the ledger id); new after a restore
RESTORE_PENDING = META + b"restore_pending"  # set in a `ccsq backup` copy; the first writer gives it a new id prefix
NEXT_TOKEN = META + b"next_token"  # fencing tokens (only ever increase, ledger-wide)
NEXT_CSEQ = META + b"next_cseq"  # completion sequence (delivery order)
SAMPLE_N = META + b"sample_n"  # accounting samples written so far
COUNTER = b"c:"  # c:<counter> -> >q
STATE = b"s:"  # s:<state> -> >q items in that state
KIND_STATE = b"k:"  # k:<kind>\0<state> -> >q
GAP = b"g:"  # g:<window> -> >q events ever recorded
REJECT = b"r:"  # r:<reason> -> >q frames rejected
DRAIN = b"d:"  # d:<worker> -> b"" (drained by an operator)
SERVED = b"w:"  # w:<kind> -> >q ms of the last HELLO of a worker serving it
#: p:<peer id> -> msgpack [session, hello ts_ms, broker wall ms]: the newest HELLO that opened a
#: session of that peer (its replay identity: a restarted broker refuses it and older ones again)
LAST_HELLO = b"p:"
SAMPLE = b"t:"  # t: + >I slot -> msgpack accounting sample (a ring)
HISTORY = b"h:"  # h: + >Q txnid -> msgpack [ts_ms, last_pgno, live_pages]

#: Accounting samples kept in meta (``t:`` + >I slot), a ring: ``ccsq gap-report --html``
#: charts them. At the default 30 s interval this is 24 h (~1 MiB at most).
SAMPLES_KEPT = 2880


def counter_key(name: str) -> bytes:
    return COUNTER + name.encode()


_state_keys: dict[str, bytes] = {}
_kind_state_keys: dict[tuple[str, str], bytes] = {}
_KEYS_KEPT = 4096  # memo of the per-state count keys (four of them per transition); cleared when this big


def state_key(state: str) -> bytes:
    k = _state_keys.get(state)
    if k is None:
        if len(_state_keys) >= _KEYS_KEPT:
            _state_keys.clear()
        k = _state_keys[state] = STATE + state.encode()
    return k


def kind_state_key(kind: str, state: str) -> bytes:
    k = _kind_state_keys.get((kind, state))
    if k is None:
        if len(_kind_state_keys) >= _KEYS_KEPT:
            _kind_state_keys.clear()
        k = _kind_state_keys[(kind, state)] = KIND_STATE + kind.encode() + b"\0" + state.encode()
    return k


def parse_kind_state(key: bytes) -> tuple[str, str]:
    """``(kind, state)`` of a :func:`kind_state_key`."""
    kind, _, state = key[len(KIND_STATE):].decode().partition("\0")
    return kind, state


def gap_key(window: str) -> bytes:
    return GAP + window.encode()


def reject_key(code: str) -> bytes:
    return REJECT + code.encode()


def drain_key(worker: str) -> bytes:
    return DRAIN + worker.encode()


def served_key(kind: str) -> bytes:
    return SERVED + kind.encode()


def last_hello_key(peer_id: str) -> bytes:
    return LAST_HELLO + peer_id.encode()


def sample_key(n: int) -> bytes:
    """The ring slot of accounting sample ``n`` (1-based)."""
    return SAMPLE + _I.pack(n % SAMPLES_KEPT)


def history_key(txnid: int) -> bytes:
    return HISTORY + _Q.pack(txnid)


def history_txnid(key: bytes) -> int:
    return _Q.unpack(key[len(HISTORY):])[0]


def pack_num(n: int) -> bytes:
    """A meta integer (``>q``)."""
    return _q.pack(n)


def unpack_num(raw: bytes | None) -> int:
    """A meta integer; 0 when absent."""
    return _q.unpack(raw)[0] if raw else 0


# --- index keys ---
def ready_prefix(kind: str) -> bytes:
    return kind.encode() + b"\0"


def ready_key(kind: str, priority: int, not_before_ms: int, seq: int) -> bytes:
    """Index key ordering ready items by priority desc, then not-before, then arrival."""
    return ready_prefix(kind) + _READY.pack(PRIO_MAX - priority, not_before_ms, seq)


def parse_ready(rest: bytes) -> tuple[int, int, int]:
    """``(prio_key, not_before_ms, seq)`` of a ready key after its ``kind \\0`` prefix."""
    return _READY.unpack(rest)


def ready_bucket_after(prefix: bytes, prio_key: int) -> bytes:
    """The first ready key of the next priority bucket after ``prio_key`` under ``prefix``."""
    return prefix + _I.pack(prio_key + 1)


#: The last priority bucket (lowest priority): there is no bucket after it.
LAST_PRIO_KEY = 0xFFFFFFFF


def seq_key(n: int) -> bytes:
    """The ``completed`` index key (completion seq), and the ``>Q`` of an event number."""
    return _Q.pack(n)


def parse_seq(key: bytes) -> int:
    return _Q.unpack(key)[0]


#: First byte of an idempotency key's digest entry in ``keys`` (0xFF never
#: begins UTF-8, so these entries cannot be taken for the raw keys older versions wrote).
KEY_DIGEST = b"\xff"


def key_index(key: str) -> bytes:
    """The ``keys`` (and ``keytime``) entry of idempotency key ``key``: 0xFF + the
    BLAKE2b-128 digest of its UTF-8 bytes, 17 bytes whatever the key's length (up to 400).
    The producer's derived keys are 64 hex characters in random order; every SUBMIT puts
    one into this B-tree, so its size decides the pages a commit dirties (the
    raw keys' branch pages held 56 entries, a commit of 100 submits into 100,000 keys
    rewrote ~160 pages; digests fit ~150 per branch page). A digest's hit is checked
    against the item's own ``key`` while its record exists (rules.py ``LedgerTxn.submit``)."""
    return KEY_DIGEST + hashlib.blake2b(key.encode(), digest_size=16).digest()


def timed_key(ms: int, rest: bytes) -> bytes:
    """``>Q ms`` + ``rest``: the ``acked``, ``deadline`` and ``keytime`` indexes."""
    return _Q.pack(ms) + rest


def parse_timed(key: bytes) -> tuple[int, bytes]:
    """``(ms, rest)`` of a :func:`timed_key`."""
    return _Q.unpack(key[:8])[0], key[8:]


def event_prefix(window: str) -> bytes:
    return window.encode() + b"\0"


def event_key(window: str, n: int) -> bytes:
    return event_prefix(window) + _Q.pack(n)


def parse_event_key(key: bytes) -> tuple[str, int]:
    """``(window, n)`` of an :func:`event_key`."""
    window, _, n = key.partition(b"\0")
    return window.decode(), _Q.unpack(n)[0]


# --- values ---
_packers = threading.local()


def _pack() -> Any:
    """This thread's ``msgpack.Packer(use_bin_type=True).pack``: the bytes of ``msgpack.packb(...,
    use_bin_type=True)`` without a Packer made per call (~1 us of the ~1.3-1.7 us of a small value;
    each job's path packs four: its payload, its result, its lease and its idempotency key)."""
    try:
        return _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True).pack
        return pack


def pack(obj: Any) -> bytes:
    return _pack()(obj)


def unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False)


def blob_to_wire(blob: protocol.Blob) -> dict:
    return {"sha256": blob.sha256, "size": blob.size, "inline": blob.inline}


def blob_from_wire(d: dict) -> protocol.Blob:
    return protocol.Blob(d["sha256"], d["size"], d.get("inline"))


# --- blobs (``payloads``, ``results``) ---
# Format 1 (older brokers): the map ``{sha256: hex str, size, inline}``.
# Format 2: the array ``[sha256 (32 raw bytes), size, inline]``, or, for an inline
# payload that LZ4 shrinks by at least an eighth, ``[sha256, size, lz4 block, 1]``
# (``lz4.block`` without the size header: ``size`` is the length). Both are read.
#: Inline payloads shorter than this are stored as they are (LZ4 could not win much).
COMPRESS_MIN_BYTES = 128
_LZ4 = 1


def pack_blob(blob: protocol.Blob, *, compress: bool = False) -> bytes:
    """The ``payloads``/``results`` value of ``blob`` (format 2). ``compress``: store
    an inline payload LZ4-compressed when that saves at least an eighth."""
    inline = blob.inline
    sha = bytes.fromhex(blob.sha256)
    if compress and inline is not None and len(inline) >= COMPRESS_MIN_BYTES:
        packed = lz4.block.compress(inline, mode="fast", acceleration=4, store_size=False)
        if len(packed) <= len(inline) - (len(inline) >> 3):
            return _pack()([sha, blob.size, packed, _LZ4])
    return _pack()([sha, blob.size, inline])


#: ``Blob(sha256, size, inline)`` without its checks (for values checked when they came in)
_trusted_blob = protocol.trusted_constructor(protocol.Blob, ("sha256", "size", "inline"))
#: The records the broker makes per job from values it holds (every field given, in order), without
#: a frozen ``__init__`` (one ``object.__setattr__`` a field: a Task cost ~6 us, a Delivery ~6 us);
#: neither class has checks of its own (``__post_init__``), so the objects are the same.
trusted_task = protocol.trusted_constructor(protocol.Task, (
    "item_id", "token", "kind", "payload", "params", "attempt", "max_runtime_s", "deadline_ts", "origin", "origin_sig"))
trusted_delivery = protocol.trusted_constructor(protocol.Delivery, (
    "item_id", "key", "kind", "result", "params", "attempt", "handler", "handler_version", "completed_ts", "redelivery",
    "proof", "proof_sig"))
trusted_submit_result = protocol.trusted_constructor(protocol.SubmitResult, ("key", "item_id", "duplicate", "error", "message"))
trusted_outcome = protocol.trusted_constructor(protocol.ItemOutcome, ("item_id", "token", "outcome"))


def unpack_blob(raw: bytes) -> protocol.Blob:
    """A blob value of either format. A format-2 blob was checked when it came in (the
    sha256 is 32 bytes by construction): built without :class:`~ccsq.common.wire.protocol.Blob`'s
    checks again."""
    v = msgpack.unpackb(raw, raw=False)
    if isinstance(v, dict):  # format 1
        return blob_from_wire(v)
    inline = v[2]
    if len(v) > 3 and v[3] == _LZ4:
        inline = lz4.block.decompress(inline, uncompressed_size=v[1])
    if len(v[0]) != 32 or (inline is not None and len(inline) != v[1]):
        return protocol.Blob(v[0].hex(), v[1], inline)  # (cannot happen; the checks say what is wrong)
    return _trusted_blob(v[0].hex(), v[1], inline)


def blob_ref(raw: bytes) -> str | None:
    """The sha256 of a claim-store reference (hex), or None for an inline blob (either
    format; nothing decompressed)."""
    v = msgpack.unpackb(raw, raw=False)
    if isinstance(v, dict):
        return v["sha256"] if v.get("inline") is None else None
    return v[0].hex() if v[2] is None else None


class Item(TypedDict, total=False):
    """The item record (``items`` sub-database; in memory a plain map, on disk format 3
    (:func:`pack_item`), formats 1 and 2 read too); see docs/ledger.md.

    Fields written at SUBMIT (always present): ``id`` (ledger id + ``%012x`` seq),
    ``key`` (idempotency key), ``kind``, ``params`` (free-form scalars),
    ``priority`` (higher first), ``deadline_ms`` (None: none; past it the item
    expires instead of running), ``max_attempts`` (0: the broker's),
    ``max_runtime_s`` (0: none), ``state`` (an ``ItemState`` value), ``attempt``
    (leases so far; a released lease gives one back), ``token`` (fencing token of
    the latest lease, 0: never leased), ``worker`` (see below), ``nb_ms``
    (not-before: arrival or retry backoff, part of the ready key), ``seq``
    (arrival), ``created_ms``, ``error`` (last failure or dead/expired reason).

    ``worker``: the worker the latest ``token`` was leased to ("" before the first
    lease). It stays after the lease ends (requeue, release, expiry, dead letter,
    replay), so that a report under that token is honoured only from its holder;
    whether the lease is live is the ``state``. Records written before this rule
    cleared ``worker`` when the lease ended and kept the holder in ``token_worker``
    (and older ones had neither): read the holder with :func:`token_holder`; a new
    lease drops ``token_worker``.

    Later fields: ``lease_expires_ms`` (informational), ``fail_token`` (token of
    the last accepted FAIL: its replay is a duplicate), ``error_message``,
    ``ended_ms`` (dead/expired), ``cseq`` / ``completed_token`` / ``completed_ms``
    / ``completed_epoch`` / ``handler`` / ``handler_version`` / ``runtime_s`` /
    ``worker_done`` (on completion), ``acked_ms`` and ``quarantined`` (on ACK),
    ``origin`` / ``reply_to`` (a relayed item's verified origin and its relay).
    """

    id: str
    key: str
    kind: str
    params: dict[str, Any]
    priority: int
    deadline_ms: int | None
    max_attempts: int
    max_runtime_s: float
    state: str
    attempt: int
    token: int
    worker: str
    token_worker: str  # read only (records written before ``worker`` was kept): see above
    nb_ms: int
    seq: int
    created_ms: int
    error: str
    error_message: str
    lease_expires_ms: int
    fail_token: int
    ended_ms: int
    cseq: int
    completed_token: int
    completed_ms: int
    completed_epoch: int
    handler: str
    handler_version: str
    runtime_s: float
    worker_done: str
    acked_ms: int
    quarantined: str
    origin: dict[str, Any]
    reply_to: str


# Item record formats. Format 1 (older brokers): the map of :class:`Item` with its
# long field names, ``id`` included. Format 2: the array of the fields every record has
# from SUBMIT on (:data:`ITEM_CORE`, in that order), then a map of the other fields
# present (long names); no ``id`` (it is the record's key). Format 3 (what this broker
# writes): the byte 0x03, the length of the *fixed* part (a msgpack
# unsigned integer), the fixed part, then the *state* part. The fixed part is what SUBMIT
# sets once and nothing changes (:data:`ITEM_FIXED`, then a map of ``origin`` /
# ``reply_to`` when the item was relayed), packed once and copied as bytes into every
# later rewrite; the state part is the array of :data:`ITEM_STATE`, then of
# :data:`ITEM_STATE_MORE` (nil: the field is absent; trailing nils left out), then, only
# when a record has other fields (or one of :data:`ITEM_STATE_MORE` holding None), a map of them.
# A map is format 1, an array format 2, a value
# that starts with 0x03 format 3 (msgpack would read it as the integer 3 followed by more
# data, so an older broker refuses it loudly instead of misreading it): :func:`unpack_item`
# reads all three.
ITEM_CORE: tuple[str, ...] = (
    "key", "kind", "params", "priority", "deadline_ms", "max_attempts", "max_runtime_s", "state",
    "attempt", "token", "worker", "nb_ms", "seq", "created_ms", "error",
)
_CORE_STATE_AT = ITEM_CORE.index("state")
#: What a format-1 record written before a core field existed reads as (old ones lack ``worker``).
_CORE_DEFAULTS: dict[str, Any] = {
    "params": {}, "priority": 0, "max_attempts": 0, "max_runtime_s": 0.0, "attempt": 0, "token": 0,
    "worker": "", "error": "",
}
#: Format 3: the fields SUBMIT writes once (the fixed part), in this order; a relayed
#: item's ``origin`` and ``reply_to`` follow in a map.
ITEM_FIXED: tuple[str, ...] = (
    "key", "kind", "params", "priority", "deadline_ms", "max_attempts", "max_runtime_s", "seq", "created_ms",
)
ITEM_FIXED_EXTRA: tuple[str, ...] = ("origin", "reply_to")
#: Format 3: the fields every record has that transitions change (the state part), in this order.
ITEM_STATE: tuple[str, ...] = ("state", "attempt", "token", "worker", "nb_ms", "error")
#: Format 3: the fields transitions add later, by position after :data:`ITEM_STATE` (nil: absent).
ITEM_STATE_MORE: tuple[str, ...] = (
    "lease_expires_ms", "cseq", "completed_token", "completed_ms", "completed_epoch", "handler", "handler_version",
    "runtime_s", "worker_done", "acked_ms", "fail_token", "ended_ms", "error_message", "quarantined", "token_worker",
)
_STATE_ALL = ITEM_STATE + ITEM_STATE_MORE
_fixed_of = operator.itemgetter(*ITEM_FIXED)
_NOT_STATE_EXTRA = frozenset(ITEM_FIXED) | frozenset(ITEM_FIXED_EXTRA) | frozenset(_STATE_ALL) | {"id"}
_STATE_MORE_SET = frozenset(ITEM_STATE_MORE)
_N_FIXED, _N_STATE, _N_STATE_ALL = len(ITEM_FIXED), len(ITEM_STATE), len(_STATE_ALL)
_N_USUAL = 1 + _N_FIXED + _N_STATE  # id, the fixed fields, ITEM_STATE
#: ``_state_prefix_of[k](rec)``: the values of ITEM_STATE and the first k of ITEM_STATE_MORE
_state_prefix_of = [operator.itemgetter(*_STATE_ALL[:_N_STATE + k]) for k in range(_N_STATE_ALL - _N_STATE + 1)]
FORMAT3 = 0x03
_packb = msgpack.Packer(use_bin_type=True).pack  # (a Packer is reusable: one per process, the actor's thread)
_unpackb = msgpack.unpackb


def pack_item_fixed(rec: Item) -> bytes:
    """The fixed part of ``rec`` (format 3): :data:`ITEM_FIXED`, then ``origin`` /
    ``reply_to`` when present. Written once per record and reused as bytes."""
    try:
        fixed = list(_fixed_of(rec))
    except KeyError:  # a format-1 record from before one of the fields
        fixed = [rec.get(f, _CORE_DEFAULTS.get(f)) for f in ITEM_FIXED]
    if "origin" in rec or "reply_to" in rec:
        fixed.append({k: rec[k] for k in ITEM_FIXED_EXTRA if k in rec})  # type: ignore[literal-required]
    return _packb(fixed)


def pack_item_state(rec: Item) -> bytes:
    """The state part of ``rec`` (format 3): :data:`ITEM_STATE` and :data:`ITEM_STATE_MORE`
    by position (nil: absent, trailing nils left out), then a map of any other field that
    is neither fixed nor ``id`` (and of a field of :data:`ITEM_STATE_MORE` holding None)."""
    # The usual record: id, the fixed fields (and origin/reply_to) and the first k fields of
    # ITEM_STATE_MORE, none None (transitions add them in that order up to acked_ms).
    k = len(rec) - _N_USUAL - ("origin" in rec) - ("reply_to" in rec)
    if 0 <= k <= _N_STATE_ALL - _N_STATE and "id" in rec:
        try:
            vals = _state_prefix_of[k](rec)
        except KeyError:
            pass
        else:
            if None not in vals:
                return _packb(vals)
    get = rec.get
    vals = [get(f) for f in _STATE_ALL]
    # every key accounted for: id, the fixed fields, and one per non-nil value
    if len(rec) == 1 + _N_FIXED + _N_STATE_ALL - vals.count(None) + ("origin" in rec) + ("reply_to" in rec) \
            and "id" in rec and None not in vals[:_N_STATE]:
        while vals[-1] is None:  # (never past ITEM_STATE: its fields are not None here)
            vals.pop()
        return _packb(vals)
    for i, f in enumerate(ITEM_STATE):  # a format-1 record from before one of these fields
        if vals[i] is None and f not in rec:
            vals[i] = _CORE_DEFAULTS.get(f)
    extra = {k: v for k, v in rec.items() if k not in _NOT_STATE_EXTRA or (v is None and k in _STATE_MORE_SET)}
    if not extra:
        while vals[-1] is None and len(vals) > _N_STATE:
            vals.pop()
        return _packb(vals)
    vals.append(extra)
    return _packb(vals)


def pack_item_head(rec: Item) -> bytes:
    """What every format-3 ``items`` value of ``rec`` starts with: 0x03, the length of the
    fixed part, the fixed part (:func:`pack_item_fixed`). The value is this + the state part."""
    fixed = pack_item_fixed(rec)
    n = len(fixed)
    if n < 0x80:
        return bytes((FORMAT3, n)) + fixed
    if n < 0x10000:
        return bytes((FORMAT3, 0xCD)) + n.to_bytes(2, "big") + fixed
    return bytes((FORMAT3, 0xCE)) + n.to_bytes(4, "big") + fixed


def pack_item(rec: Item) -> bytes:
    """The ``items`` value of ``rec`` (format 3; ``rec["id"]`` is the key, not stored)."""
    return pack_item_head(rec) + pack_item_state(rec)


def _fixed_span(raw: bytes) -> tuple[int, int]:
    """``(start, end)`` of the fixed part in a format-3 value."""
    b = raw[1]
    if b < 0x80:
        return 2, 2 + b
    if b == 0xCD:
        return 4, 4 + int.from_bytes(raw[2:4], "big")
    if b == 0xCE:
        return 6, 6 + int.from_bytes(raw[2:6], "big")
    raise ValueError(f"not a format-3 item record (length byte {b:#x})")


def unpack_item_parts(raw: bytes, item_id: str) -> tuple[Item, bytes | None]:
    """An item record of any format, and its head (:func:`pack_item_head`) when it is format
    3 (None otherwise: a rewrite packs it). ``item_id`` (its key in ``items``) fills ``id``
    of a format-2 or format-3 record."""
    if raw[0] == FORMAT3:
        start, end = _fixed_span(raw)
        f = _unpackb(raw[start:end], raw=False)
        st = _unpackb(raw[end:], raw=False)
        rec: dict[str, Any] = dict(zip(ITEM_FIXED, f))
        rec["id"] = item_id
        if len(f) > _N_FIXED:
            rec.update(f[_N_FIXED])
        rec.update(zip(ITEM_STATE, st))
        if len(st) > _N_STATE:
            for k, v in zip(ITEM_STATE_MORE, st[_N_STATE:_N_STATE_ALL]):
                if v is not None:
                    rec[k] = v
            if len(st) > _N_STATE_ALL:
                rec.update(st[_N_STATE_ALL])
        return rec, raw[:end]  # type: ignore[return-value]
    v = _unpackb(raw, raw=False)
    if type(v) is dict:  # format 1
        return v, None  # type: ignore[return-value]
    rec = {"id": item_id}
    rec.update(zip(ITEM_CORE, v))
    rec.update(v[len(ITEM_CORE)])
    return rec, None  # type: ignore[return-value]


def unpack_item(raw: bytes, item_id: str) -> Item:
    """An item record of any format (:func:`unpack_item_parts`)."""
    return unpack_item_parts(raw, item_id)[0]


def item_state(raw: bytes) -> str:
    """The ``state`` of a packed item record of any format (format 3: the fixed part is not read)."""
    if raw[0] == FORMAT3:
        return _unpackb(raw[_fixed_span(raw)[1]:], raw=False)[0]
    v = _unpackb(raw, raw=False)
    return v["state"] if type(v) is dict else v[_CORE_STATE_AT]


#: Bits of a replicated primary's fencing token below its epoch (docs/ha.md).
TOKEN_COUNTER_BITS = 32


def fencing_token(epoch: int, counter: int) -> int:
    """The fencing token a replicated primary of ``epoch`` grants: ``epoch << 32 |
    (counter mod 2**32)``; ``counter`` is ``m:next_token``, which continues across epochs.
    A token granted in an epoch is never granted in another (the high bits differ), and
    within one epoch only after 2**32 more leases. Still one int (< 2**64 for epochs
    below 2**32) on the wire."""
    return (epoch << TOKEN_COUNTER_BITS) | (counter & ((1 << TOKEN_COUNTER_BITS) - 1))


def token_epoch(token: int) -> int:
    """The epoch of a replicated primary's token (0: a single broker's bare counter)."""
    return token >> TOKEN_COUNTER_BITS


def token_holder(rec: Item) -> str:
    """The worker the item's latest token was leased to ("" if never leased)."""
    return rec.get("token_worker") or rec.get("worker") or ""
