"""The limits and value rules of the wire protocol: what a field may hold, one function per
rule. No I/O, no message classes at run time (:mod:`ccsq.common.wire.messages` builds on it).

Each rule is a function that returns ``""`` when the value is acceptable, else a human
reason, so every caller words a refusal the same way: the records' own checks
(``Blob.__post_init__``), the producer before it sends (``InvalidRequest``), the broker per
submitted item (``MALFORMED``). A faster copy of a rule is kept only beside a test that it
agrees with the rule on generated inputs (tests/test_codec_equivalence.py).
"""

from __future__ import annotations

import math
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ccsq.common.wire.messages import Params, SubmitItem

# --- default limits ---------------------------------------------------------
DEFAULT_MAX_FRAME_BYTES = 1 << 20  # 1 MiB
MAX_ARRAY_LEN = 65_536
MAX_MAP_LEN = 256
MAX_DEPTH = 8
SIGNATURE_BYTES = 64  # Ed25519
SHA256_HEX_LEN = 64

_HEX_RE = re.compile(r"[0-9a-f]{64}")


def blob_problem(sha256: str, size: int, inline: bytes | None) -> str:
    """Return "" when ``(sha256, size, inline)`` make a valid :class:`~ccsq.common.wire.messages.Blob`,
    else the reason: ``sha256`` 64 lowercase hex chars, ``size`` >= 0 (bytes), ``inline``
    None or exactly ``size`` bytes. Values of another type raise as ``len`` / ``<`` do."""
    if len(sha256) != SHA256_HEX_LEN or not _HEX_RE.fullmatch(sha256):
        return "blob sha256 must be 64 lowercase hex chars"
    if size < 0:
        return "blob size must be >= 0"
    if inline is not None and len(inline) != size:
        return "inline blob length differs from size"
    return ""


# --- the rule for a submitted item ---------------------------------------------
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
    params: Any = item.params  # checked value by value here, whatever the annotation says
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
