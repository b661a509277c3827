"""The one failure policy and the one backoff (common/wire/policy.py, common/wire/backoff.py):
the table covers every reason, the worker's wire flag and the ledger's decision both
follow it, and refusal codes map to typed errors. Real LMDB files, no processes."""

from __future__ import annotations

import random

import pytest

from ccsq.brokerd.ledger.rules import backoff_ms
from ccsq.brokerd.ledger.store import Policy
from ccsq.common.wire import errors
from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.policy import (FAIL_POLICY, PEER_REFUSED_CODES, fail_rule, refusal_error, refusal_final, refusal_retryable,
                                     task_failure)
from tests import test_ledger as ledger_tests  # its helpers (a module alias, so pytest does not collect its tests twice)


def test_every_reason_has_one_consistent_rule():
    assert set(FAIL_POLICY) == set(protocol.FailReason)
    for reason, rule in FAIL_POLICY.items():
        assert rule.retryable != rule.dead_letters_at_once, reason
        assert task_failure("i", 1, reason, "m").retryable is rule.retryable
    # a reason this version does not know follows the sender's flag
    assert fail_rule("from_the_future", True).retryable and fail_rule("", False).dead_letters_at_once


def test_backoff_is_full_jitter_capped_and_the_ledger_replays_it():
    rng = random.Random(1)
    delays = [backoff_delay_s(3, 0.1, 0.5, rng) for _ in range(500)]
    assert all(0.0 <= d <= 0.5 for d in delays) and max(delays) > 0.4 and min(delays) < 0.1
    assert all(0.0 <= backoff_delay_s(0, 0.1, 10.0) <= 0.1 for _ in range(100))
    pol = Policy(retry_backoff_base_s=0.5, retry_backoff_max_s=60.0)
    a, b = random.Random(9), random.Random(9)  # the ledger's ms = the one backoff for attempt-1, same rng draws
    assert [backoff_ms(n, pol, a) for n in range(1, 9)] == [int(backoff_delay_s(n - 1, 0.5, 60.0, b) * 1000)
                                                             for n in range(1, 9)]


@pytest.mark.parametrize("reason", list(protocol.FailReason))
def test_the_ledger_decides_from_the_table_not_the_wire_flag(tmp_path, reason):
    """A known reason is decided by FAIL_POLICY even if a sender's flag disagrees."""
    if reason is protocol.FailReason.WORKER_LOST:
        pytest.skip("the broker's own reason (lease expiry), never reported")
    led = ledger_tests.open_ledger(tmp_path / "l", retry_backoff_base_s=0.0, max_attempts=3)
    try:
        ledger_tests.submit(led, ledger_tests.item("a"))
        (t,) = ledger_tests.lease_all(led)
        rule = FAIL_POLICY[reason]
        txn = led.begin()
        assert txn.fail(protocol.TaskFailure(t.item_id, t.token, reason.value, not rule.retryable, "x"), 3_000) == "accepted"
        rec = txn.get(t.item_id)
        txn.commit()
        assert rec["state"] == ("dead" if rule.dead_letters_at_once else "ready"), reason
        assert rec["attempt"] == (1 if rule.counts_attempt else 0), reason
    finally:
        led.close()


def test_refusal_codes_map_to_error_types():
    assert isinstance(refusal_error("QUEUE_FULL", "m"), errors.QueueFull) and refusal_retryable("QUEUE_FULL")
    assert isinstance(refusal_error("DISK_FULL", "m"), errors.DiskFull) and refusal_retryable("DISK_FULL")
    for code in ("MALFORMED", "DEADLINE_EXCEEDED", "PAYLOAD_TOO_LARGE", "SOMETHING_NEW"):
        err = refusal_error(code, "m")
        assert isinstance(err, errors.PermanentError) and err.code == code and not refusal_retryable(code)
    for code in PEER_REFUSED_CODES:
        err = refusal_error(code, "m")
        assert isinstance(err, errors.Unauthorized) and err.code == code
        assert refusal_final(code) and not refusal_retryable(code)
    # the link and the producer stop for good on the type, not on a list of their own
    assert not any(refusal_final(c) for c in ("QUEUE_FULL", "DISK_FULL", "MALFORMED", protocol.REJECT_NO_SESSION, "NEW"))
