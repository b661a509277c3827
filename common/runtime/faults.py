"""Named crash points for fault-injection tests (never active by accident).

A process kills itself with SIGKILL right after a named durable step when BOTH
environment variables are set::

    CCSQ_FAULT_INJECTION=kill-me-at-crash-points
    CCSQ_CRASH_AT=<point>[,<point>...]        e.g. broker.after_submit_commit

The first variable must hold that exact phrase, so a stray ``CCSQ_CRASH_AT``
in a production environment does nothing. Optionally ``CCSQ_CRASH_AFTER_N=K``
crashes at the K-th time a point is reached (default 1).

Known points (see docs/gap-register.md for what each one exercises):
broker.after_submit_commit, broker.after_lease_commit, broker.after_complete_commit,
broker.after_ack_commit, worker.dispatch_before_hold (a DISPATCH arrived, its hold not
journaled), worker.after_infer, worker.after_result_stored,
completion.after_db_commit, producer.after_blob_put; the federation relay's
relay.after_lease_journaled, relay.after_submit_ack, relay.after_result_journaled,
relay.after_complete_ack (docs/federation.md).
"""

from __future__ import annotations

import os
import signal

_PHRASE = "kill-me-at-crash-points"
_counts: dict[str, int] = {}


_armed_cache: tuple[str | None, str | None, frozenset[str]] | None = None  # (phrase, points, armed)


def _armed() -> frozenset[str]:
    """The armed points. Cached against the two variables' values (a crash point sits on
    every job's path: parsing the environment each time cost ~4 us a call)."""
    global _armed_cache
    env = os.environ._data  # type: ignore[attr-defined]  # raw bytes map: no per-call decode
    phrase, points = env.get(b"CCSQ_FAULT_INJECTION"), env.get(b"CCSQ_CRASH_AT")
    c = _armed_cache
    if c is not None and c[0] is phrase and c[1] is points:
        return c[2]
    armed: frozenset[str] = frozenset()
    if os.environ.get("CCSQ_FAULT_INJECTION") == _PHRASE:
        armed = frozenset(p.strip() for p in os.environ.get("CCSQ_CRASH_AT", "").split(",") if p.strip())
    _armed_cache = (phrase, points, armed)
    return armed


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``name`` is armed (see module doc); otherwise a no-op."""
    if name not in _armed():
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] >= int(os.environ.get("CCSQ_CRASH_AFTER_N", "1")):
        os.kill(os.getpid(), signal.SIGKILL)


def crash_point_armed(name: str) -> bool:
    """Is ``name`` armed? A caller with many items checks once, then calls
    :func:`crash_point` per item only when it is (``CCSQ_CRASH_AFTER_N`` counts items)."""
    return name in _armed()


def env_for(point: str, after_n: int = 1) -> dict[str, str]:
    """Environment that arms ``point`` in a child process (for tests)."""
    return {"CCSQ_FAULT_INJECTION": _PHRASE, "CCSQ_CRASH_AT": point, "CCSQ_CRASH_AFTER_N": str(after_n)}
