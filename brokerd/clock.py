"""The broker's one source of time: every decision the actor and its modules make
(liveness, lease expiry, backoff, dispatch slices, timestamps in the ledger) reads
the clock it was built with, never ``time.time()`` / ``time.monotonic()`` itself.

The daemon runs on :data:`SYSTEM_CLOCK`; the deterministic simulation
(``tests/sim``, docs/simulation.md) passes its own clock, moved by its scheduler,
so one seed replays one history. Measurements that decide nothing (turn and
commit durations for the metrics) may still read ``time.perf_counter()``.
"""

from __future__ import annotations

import time


class Clock:
    """``monotonic_s()``: seconds on a clock that never goes back (timers, liveness);
    ``wall_ms()``: wall-clock milliseconds since the epoch (ledger timestamps, retry
    times, deadlines, envelope timestamps). Subclass to drive time from outside."""

    def monotonic_s(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return int(time.time() * 1000)


#: The real clock (the daemon's).
SYSTEM_CLOCK = Clock()
