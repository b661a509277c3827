"""The ccsq wire protocol, one import for all of it: the names of three modules. No I/O.

- :mod:`ccsq.common.wire.messages`: the message types. Constants (``PROTOCOL_VERSION``,
  the ``REJECT_*`` codes, HELLO ``info`` keys), roles, states and outcomes,
  ``ROLE_MAY_SEND``, the nested records (``Blob``, ``SubmitItem``, ``Task``...) and the
  messages, frozen dataclasses with a ``TYPE``, in ``MESSAGE_CLASSES``.
- :mod:`ccsq.common.wire.limits`: the rules. Decode limits, ranges, and one function per
  rule on a value (``blob_problem``, ``submit_fields_problem``, ``submit_item_problem``),
  each returning "" or the reason.
- :mod:`ccsq.common.wire.codec`: the body codec. ``encode_body`` / ``decode_body``, strict
  (either the whole message decodes or :class:`~ccsq.common.wire.errors.DecodeError` with a
  ``REJECT_*`` code), generated per message type at import over the per-field reference
  that words every refusal; ``trusted_constructor``.

Callers import this module (``from ccsq.common.wire import protocol``), never the
three directly, so the split stays an implementation detail. Framing and signatures
live in :mod:`ccsq.common.wire.envelope`.
"""

from __future__ import annotations

from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.messages import (
    Ack, AckOk, Admin, AdminReply, ALL_REJECT_REASONS, Blob, Bye, Cancel, Complete, CompleteAck, Credit, Delivery,
    Dispatch, Error, ERROR_REPLACED, extension, Fail, FailAck, FailReason, Heartbeat, Hello, INSTANCE_INFO,
    ItemOutcome, ItemState, ItemStatus, LEASE_HOLDER_ROLES, LeaseRef, LOST_INFO, lost_info, Message, MESSAGE_CLASSES,
    MsgType, _OMIT_EMPTY, Outcome, Params, parse_lost_info, PROTOCOL_VERSION, Quarantined, REJECT_BAD_SIGNATURE,
    REJECT_FORGED_ORIGIN, REJECT_FRAMING, REJECT_ID_IN_USE, REJECT_MALFORMED, REJECT_NOT_PRIMARY, REJECT_NO_SESSION,
    REJECT_OVERSIZE, REJECT_REPLAY, REJECT_ROLE, REJECT_STALE, REJECT_UNKNOWN_SENDER, REJECT_UNKNOWN_TYPE, REJECT_VERSION, ReplAck,
    ReplCopyAck, ReplCopyChunk, ReplTurns, Result, Role, ROLE_MAY_SEND, Scalar, SCALAR_TYPES, Status, StatusReply, Submit, SubmitAck,
    SubmitItem,
    SubmitResult, Task, TaskFailure, TaskResult, TERMINAL_STATES, Welcome,
)
from ccsq.common.wire.limits import (
    blob_problem, _CONTROL_RE, DEFAULT_MAX_FRAME_BYTES, _FLOAT_MAX, _has_control, _HEX_RE, MAX_ARRAY_LEN, MAX_DEPTH,
    MAX_KEY_BYTES, MAX_KIND_LEN, MAX_MAP_LEN, _PARAM_PLAIN_TYPES, PRIO_MAX, PRIO_MIN, SHA256_HEX_LEN, SIGNATURE_BYTES,
    submit_fields_problem, _submit_item_plainly_fine, submit_item_problem,
)
from ccsq.common.wire.codec import (
    _bad, _Bail, _compile_decoder, _compile_encoder, decode_body, _DECODERS, encode_body, _ENCODERS, _EXACT_NAMES,
    _FAST_DECODERS, _FAST_ENCODERS, _Gen, _gen_dec_record, _gen_dec_value, _gen_decoder, _gen_enc_record,
    _gen_enc_value, _gen_encoder, _INLINE_CHECKS, _make_twin, _MISS, _plain_fields, _record_decoder, _record_encoder,
    _SCALAR_SET, _slow_decode_body, trusted_constructor, _twin, _TWINS,
)

#: every name protocol.py had before the split, the private ones the tests read included (the
#: reference codec, the fast decoders) and ``DecodeError``, which its records raise
__all__ = [
    "DecodeError",
    "PROTOCOL_VERSION", "REJECT_OVERSIZE", "REJECT_FRAMING", "REJECT_MALFORMED", "REJECT_VERSION",
    "REJECT_UNKNOWN_TYPE", "REJECT_UNKNOWN_SENDER", "REJECT_BAD_SIGNATURE", "REJECT_FORGED_ORIGIN", "REJECT_ROLE",
    "REJECT_REPLAY", "REJECT_STALE", "REJECT_NO_SESSION", "ERROR_REPLACED", "REJECT_ID_IN_USE", "REJECT_NOT_PRIMARY", "INSTANCE_INFO",
    "LOST_INFO", "lost_info", "parse_lost_info", "ALL_REJECT_REASONS", "_OMIT_EMPTY", "extension", "Role", "MsgType",
    "ItemState", "TERMINAL_STATES", "Outcome", "FailReason", "ROLE_MAY_SEND", "LEASE_HOLDER_ROLES", "Scalar",
    "Params", "Blob", "LeaseRef", "SubmitItem", "SubmitResult", "Task", "TaskResult", "TaskFailure", "ItemOutcome",
    "Quarantined", "Delivery", "ItemStatus", "Message", "Hello", "Welcome", "Heartbeat", "Bye", "Error", "Submit",
    "SubmitAck", "Status", "Cancel", "StatusReply", "Credit", "Dispatch", "Complete", "CompleteAck", "Fail",
    "FailAck", "Result", "Ack", "AckOk", "Admin", "AdminReply", "ReplTurns", "ReplAck", "ReplCopyChunk", "ReplCopyAck",
    "MESSAGE_CLASSES",
    "SCALAR_TYPES", "DEFAULT_MAX_FRAME_BYTES", "MAX_ARRAY_LEN", "MAX_MAP_LEN", "MAX_DEPTH", "SIGNATURE_BYTES",
    "SHA256_HEX_LEN", "_HEX_RE", "PRIO_MAX", "PRIO_MIN", "MAX_KIND_LEN", "MAX_KEY_BYTES", "_CONTROL_RE",
    "_has_control", "submit_item_problem", "_FLOAT_MAX", "_PARAM_PLAIN_TYPES", "_submit_item_plainly_fine",
    "submit_fields_problem", "blob_problem", "_ENCODERS", "_DECODERS", "_bad", "_compile_encoder", "_record_encoder",
    "_compile_decoder", "_record_decoder", "_slow_decode_body", "_Bail", "_MISS", "_SCALAR_SET", "_EXACT_NAMES",
    "_Gen", "_plain_fields", "_gen_dec_value", "_gen_dec_record", "_INLINE_CHECKS", "_TWINS", "_twin", "_make_twin",
    "trusted_constructor", "_gen_decoder", "_gen_enc_value", "_gen_enc_record", "_gen_encoder", "_FAST_ENCODERS",
    "_FAST_DECODERS", "encode_body", "decode_body",
]
