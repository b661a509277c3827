"""The one backoff of ccsq (wire layer: imports nothing of ccsq).

Every retry delay in the project comes from :func:`backoff_delay_s`: the peer link's
reconnect, the producer's resubmit, the ledger's retry schedule (through
``ledger.backoff_ms`` with its seeded rng, so ledger tests replay), and the completion
service's database retries and parked deliveries.
"""

from __future__ import annotations

import random


def backoff_delay_s(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Capped exponential backoff with full jitter (AWS architecture blog, 2015), in seconds:
    ``uniform(0, min(cap_s, base_s * 2**attempt))``. ``attempt`` counts from 0 (exponent
    clamped at 30); ``rng`` defaults to the module-level ``random`` (pass a seeded
    ``random.Random`` for replayable schedules). Never negative, never above ``cap_s``."""
    return (rng or random).uniform(0.0, min(cap_s, base_s * (2 ** min(max(attempt, 0), 30))))
