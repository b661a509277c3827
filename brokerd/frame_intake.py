"""Frame intake of the broker actor: every frame read from the ROUTER is verified here
before the actor looks at its message (signature checked before the body is parsed;
``common/wire/envelope.py``), and every refused frame is counted, logged within limits
and, where allowed, answered (docs/security.md).

- An authenticated sender (a session, or a code raised after the signature verified)
  gets an ERROR; a session that sent an invalid envelope ends (the one disconnect rule).
- An unauthenticated sender gets at most a fixed sentence naming the id it claimed,
  rate-limited per claimed id and for all strangers together, so a flood costs the
  broker no more than its frames.
- Counts: :attr:`FrameIntake.rejects` (since start; metric ``ccsq_frames_rejected``) and
  :attr:`FrameIntake.unsaved` (not yet added to the ledger's counters; the actor's next
  transaction writes and clears it). Reconnect noise (:data:`RECONNECT_NOISE`: a known
  peer's frame of a session this broker no longer has, e.g. after a broker restart or a
  session it ended) is not a refusal: it counts apart, in :attr:`FrameIntake.noise` (metric
  ``ccsq_reconnect_noise_frames``; in the ledger under ``noise:<code>``, the gap report's
  ``reconnect_noise``), and logs at info level, rate-limited like refusals.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from ccsq.brokerd.clock import SYSTEM_CLOCK, Clock
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import DecodeError

if TYPE_CHECKING:  # pragma: no cover
    from ccsq.brokerd.outbound import Outbound
    from ccsq.brokerd.peers import PeerTable, Session
    from ccsq.common.wire.envelope import Envelope, EnvelopeCodec

log = structlog.get_logger("ccsq.brokerd")

REJECT_LOG_INTERVAL_S = 10.0
REJECT_LOG_LINES_PER_INTERVAL = 100  # frame_rejected lines per interval, all peers together
#: Codes raised after the signature was verified: the sender is authenticated, so it gets an ERROR
#: (a NO_SESSION raised before, for a MAC-tagged frame with no MAC session, names a claimed
#: ``sender`` and is answered like a stranger: rate-limited, STRANGER_ANSWERS).
POST_VERIFY_CODES = frozenset(
    {protocol.REJECT_UNKNOWN_TYPE, protocol.REJECT_ROLE, protocol.REJECT_STALE, protocol.REJECT_REPLAY, protocol.REJECT_NO_SESSION}
)
#: Refusals an unauthenticated sender may get (rate-limited; nothing but the id it claimed).
STRANGER_ANSWERS = {
    protocol.REJECT_UNKNOWN_SENDER: "peer id {peer!r} is not in the broker's authorized_keys",
    protocol.REJECT_BAD_SIGNATURE: "the signature of {peer!r} does not verify with the public key the broker holds for it",
    # a session-MAC-tagged frame with no MAC session (e.g. the broker restarted): reconnect
    protocol.REJECT_NO_SESSION: "no session: {peer!r} must reconnect and send HELLO",
}
#: Codes that mean "this peer's session is gone here, it must say HELLO again" (every
#: reconnect after a broker restart or a session the broker ended): counted apart.
RECONNECT_NOISE = frozenset({protocol.REJECT_NO_SESSION})
#: Ledger reject-counter prefix of reconnect noise (``brokerd/gap_report.py`` splits it off).
NOISE_PREFIX = "noise:"
STRANGER_ANSWER_INTERVAL_S = 2.0  # per claimed peer id
STRANGER_ANSWERS_PER_S = 20.0  # all strangers together


class FrameIntake:
    """Verifies frames with ``codec``; ``end_session(sess, reason)`` is the one disconnect rule."""

    def __init__(self, codec: EnvelopeCodec, peers: PeerTable, outbound: Outbound,
                 end_session: Callable[[Session, str], None], *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.codec = codec
        self.peers = peers
        self.outbound = outbound
        self._end_session = end_session
        self.rejects: collections.Counter = collections.Counter()  # code -> refused frames since start
        self.unsaved: collections.Counter = collections.Counter()  # code -> refused frames not yet in the ledger
        self.noise: collections.Counter = collections.Counter()  # code -> reconnect-noise frames since start
        self._reject_logged: dict[tuple[bytes | str, str], float] = {}
        self._reject_window_mono, self._reject_window_lines, self._reject_lines_dropped = -1e9, 0, 0
        self._stranger_answered: dict[str, float] = {}  # claimed peer id -> when last answered
        self._stranger_tokens, self._stranger_tokens_mono = STRANGER_ANSWERS_PER_S, clock.monotonic_s()

    def decode(self, raw: list[bytes], now: float) -> tuple[bytes, Envelope] | None:
        """``(routing id, verified envelope)``, or None for a refused frame (counted,
        answered where allowed, its session ended)."""
        rid = raw[0]
        sess = self.peers.by_routing(rid)
        try:
            return rid, self.codec.decode(raw[1:], bound_sender=sess.peer_id if sess else None)
        except DecodeError as exc:
            self.count_reject(exc.code, str(exc)[:300], sess.peer_id if sess else exc.sender, rid, now)
            if sess is not None or (exc.code in POST_VERIFY_CODES and exc.sender is None):
                self.outbound.send_raw(rid, protocol.Error(exc.code, str(exc)[:300]))
            elif exc.code in STRANGER_ANSWERS and exc.answerable and exc.sender and self._may_answer_stranger(exc.sender, now):
                # unauthenticated: a fixed sentence naming only the id it claimed (docs/security.md)
                self.outbound.send_raw(rid, protocol.Error(exc.code, STRANGER_ANSWERS[exc.code].format(peer=exc.sender)))
            if sess is not None:
                self._end_session(sess, f"invalid envelope: {exc.code}")
            return None

    def count_reject(self, code: str, reason: str, peer: str | None, rid: bytes, now: float) -> None:
        """Count a refused frame (metric ccsq_frames_rejected, persisted) and log it at most
        once per REJECT_LOG_INTERVAL_S per claimed peer id (per connection when none).
        Reconnect noise (:data:`RECONNECT_NOISE`) counts apart and logs at info."""
        noise = code in RECONNECT_NOISE
        if noise:
            self.noise[code] += 1
            self.unsaved[NOISE_PREFIX + code] += 1
        else:
            self.rejects[code] += 1
            self.unsaved[code] += 1
        key = (peer or rid, code)
        if now - self._reject_logged.get(key, -1e9) >= REJECT_LOG_INTERVAL_S:
            if now - self._reject_window_mono >= REJECT_LOG_INTERVAL_S:  # a new window for all peers together
                if self._reject_lines_dropped:
                    log.warning("frame_rejected_suppressed", lines=self._reject_lines_dropped,
                                interval_s=REJECT_LOG_INTERVAL_S, limit=REJECT_LOG_LINES_PER_INTERVAL)
                self._reject_window_mono, self._reject_window_lines, self._reject_lines_dropped = now, 0, 0
            if self._reject_window_lines >= REJECT_LOG_LINES_PER_INTERVAL:  # many ids: a flood, not a peer
                self._reject_lines_dropped += 1
                return
            self._reject_window_lines += 1
            if len(self._reject_logged) > 10_000:
                self._reject_logged.clear()
            self._reject_logged[key] = now
            if noise:
                log.info("stale_session_frame", code=code, reason=reason, peer=peer,
                         hint="the peer reconnects (HELLO) by itself; counted as reconnect noise, not a refusal")
            else:
                log.warning("frame_rejected", code=code, reason=reason, peer=peer)

    def _may_answer_stranger(self, sender: str, now: float) -> bool:
        """Whether an unauthenticated sender may get its refusal now: at most once per
        STRANGER_ANSWER_INTERVAL_S per claimed id, and STRANGER_ANSWERS_PER_S for all
        strangers together (token bucket), so a flood costs the broker no more than its frames."""
        last = self._stranger_answered.get(sender)
        if last is not None and now - last < STRANGER_ANSWER_INTERVAL_S:
            return False
        elapsed = now - self._stranger_tokens_mono
        self._stranger_tokens = min(STRANGER_ANSWERS_PER_S, self._stranger_tokens + elapsed * STRANGER_ANSWERS_PER_S)
        self._stranger_tokens_mono = now
        if self._stranger_tokens < 1.0:
            return False
        self._stranger_tokens -= 1.0
        if len(self._stranger_answered) > 10_000:
            self._stranger_answered.clear()
        self._stranger_answered[sender] = now
        return True
