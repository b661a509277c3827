"""The one failure policy of ccsq (wire layer: imports only ``protocol`` and ``errors``).

One table says, for each :class:`~ccsq.common.wire.protocol.FailReason`, whether the item may
run again, whether the failed attempt counts toward ``max_attempts``, and whether it is
dead-lettered at once. The worker fills ``TaskFailure.retryable`` from it (kept on the
wire: older brokers read it), the ledger decides from it (``LedgerTxn.fail``,
``_store_unavailable``, ``expire_lease``), and nobody else picks a ``retryable`` flag.

A second table maps a broker refusal code (a ``SubmitResult.error``, or the ERROR
that refuses a HELLO) to the typed exception of :mod:`ccsq.common.wire.errors`, whose type
(:class:`RetryableError` / :class:`PermanentError`) says whether to retry.
"""

from __future__ import annotations

import dataclasses

from ccsq.common.wire import protocol
from ccsq.common.wire.errors import ERRORS_BY_CODE, CcsqError, PermanentError, RetryableError, Unauthorized


@dataclasses.dataclass(frozen=True, slots=True)
class FailRule:
    """What the broker does with one failure report of a reason."""

    #: the item may run again (sent as ``TaskFailure.retryable``)
    retryable: bool
    #: the failed attempt counts toward ``max_attempts`` (False: handed back, an outage)
    counts_attempt: bool
    #: dead-lettered on this failure whatever attempts are left
    dead_letters_at_once: bool


_RETRY = FailRule(retryable=True, counts_attempt=True, dead_letters_at_once=False)
_FREE_RETRY = FailRule(retryable=True, counts_attempt=False, dead_letters_at_once=False)
_DEAD = FailRule(retryable=False, counts_attempt=True, dead_letters_at_once=True)

#: The failure policy: reason -> rule. Every FailReason has a row (tests/test_ledger.py checks).
FAIL_POLICY: dict[protocol.FailReason, FailRule] = {
    protocol.FailReason.HANDLER_ERROR: _RETRY,  # retried with backoff until max_attempts
    protocol.FailReason.TIMEOUT: _RETRY,  # over max_runtime_s: like a handler error
    protocol.FailReason.WORKER_LOST: _RETRY,  # lease expired (the broker's own reason)
    protocol.FailReason.PAYLOAD_MISSING: _DEAD,  # the blob is gone or corrupt: no retry can help
    protocol.FailReason.FATAL: _DEAD,  # PermanentHandlerError
    protocol.FailReason.CANCELLED: _DEAD,  # an operator cancelled it
    protocol.FailReason.RELEASED: _FREE_RETRY,  # given back unstarted: ready again at once
    protocol.FailReason.STORE_UNAVAILABLE: _FREE_RETRY,  # claim-store outage: ready again after a backoff
}


def fail_rule(reason: str, wire_retryable: bool = True) -> FailRule:
    """The rule for a reported ``reason`` (a :class:`FailReason` value). A reason this
    version does not know (a newer or foreign worker, or empty) falls back to the
    sender's ``retryable`` flag: retried (counting the attempt) or dead at once."""
    try:
        return FAIL_POLICY[protocol.FailReason(reason)]
    except ValueError:
        return _RETRY if wire_retryable else _DEAD


def task_failure(item_id: str, token: int, reason: protocol.FailReason, message: str = "") -> protocol.TaskFailure:
    """A FAIL entry for ``reason`` with ``retryable`` taken from :data:`FAIL_POLICY`."""
    return protocol.TaskFailure(item_id, token, reason.value, FAIL_POLICY[reason].retryable, message)


#: The ERROR codes with which a broker refuses a HELLO for good: reconnecting cannot
#: help until an operator changes authorized_keys (and restarts the peer).
CURVE_REFUSED = "CURVE_REFUSED"  # not a wire code: the ZAP handshake failed with status 400
#: not a wire code either: the broker's answer to our HELLO is not signed by the key (or the
#: broker id) this peer pins in its authorized_keys: a wrong file, or a broker key rotated
#: without this host; reconnecting cannot help, and a session would only lose leases
BROKER_KEY_MISMATCH = "BROKER_KEY_MISMATCH"
PEER_REFUSED_CODES = frozenset({"UNAUTHORIZED", protocol.REJECT_UNKNOWN_SENDER, protocol.REJECT_BAD_SIGNATURE, protocol.REJECT_ROLE,
                                protocol.REJECT_FORGED_ORIGIN, CURVE_REFUSED, BROKER_KEY_MISMATCH})


def refusal_error(code: str, message: str) -> CcsqError:
    """The typed exception for a broker refusal ``code``: a HELLO refusal gives
    :class:`Unauthorized`; a known wire code its own type (QUEUE_FULL, DISK_FULL are
    :class:`RetryableError`); anything else a :class:`PermanentError` carrying the code."""
    if code in PEER_REFUSED_CODES:
        return Unauthorized(message, code=code)
    cls = ERRORS_BY_CODE.get(code)
    return cls(message, code=code) if cls is not None else PermanentError(f"{code}: {message}", code=code)


def refusal_retryable(code: str) -> bool:
    """True when a broker refusal ``code`` is worth retrying later (its type is a
    :class:`RetryableError`: QUEUE_FULL, DISK_FULL)."""
    return isinstance(refusal_error(code, ""), RetryableError)


def refusal_final(code: str) -> bool:
    """True when a broker refusal ``code`` refuses this peer for good (its type is
    :class:`Unauthorized`): reconnecting cannot help until an operator changes
    authorized_keys, so the link stops and waiting requests fail at once."""
    return isinstance(refusal_error(code, ""), Unauthorized)
