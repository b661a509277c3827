"""The relay: moves items from an upstream swarm to a downstream swarm's idle GPUs and
their results back, one :class:`LinkRunner` per ``[[links]]`` table (docs/federation.md).

Per link, two sessions (:class:`~ccsq.common.link.peer.BrokerLink`, role ``relay``):

* **upstream** (``relay_side = upstream``): the relay holds leases like a worker. Its
  credit there follows the downstream's free worker capacity for the link's kinds
  (``cap:<kind>`` in the downstream broker's heartbeats, less items submitted since,
  plus results since): more with CREDIT, less with a negative CREDIT, resynced by the
  upstream's heartbeats (``credit``, ``credit_msgs``). It lists its leases in every
  heartbeat (extension), and reports each result with COMPLETE under the lease's
  fencing token, carrying the downstream broker's signed proof.

A side refused for good by its broker stops only that link (:meth:`LinkRunner._side_refused`);
:class:`Relay` raises :class:`RelayRefused` (exit 77) when every link is refused. After
``downstream_hold_max_s`` of downstream partition, submitted leases go back upstream and
their copies are cancelled once the downstream is reachable.
* **downstream** (``relay_side = downstream``): the relay SUBMITs each leased item
  with the upstream broker's origin signature and the origin key
  (``origin:<swarm>:<item>``: a resubmission is a dedup hit); the downstream routes the
  item's RESULT back to this session; the relay ACKs it only after the upstream
  confirmed the COMPLETE (ack-mode on-confirm).

Every step is journaled (:mod:`ccsq.relayd.relay_journal`) before the next message goes out,
so a SIGKILL anywhere resumes every item after a restart. Crash points (tests):
``relay.after_lease_journaled``, ``relay.after_submit_ack``,
``relay.after_result_journaled``, ``relay.after_complete_ack``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable

import msgpack
import structlog

from ccsq.common.wire.federation import (BROKEN_FIX_INFO, BROKEN_INFO, BROKEN_SINCE_INFO, CAP_PREFIX, CREDIT_INFO,
                                    CREDIT_MSGS_INFO, DOWNSTREAM, LATE_PREFIX,
                                    ORIGIN_REJECTED, POLICY, RELAY_SIDE, UPSTREAM, WORKERS_PREFIX, origin_key)
from ccsq.common.wire import protocol
from ccsq.common.wire.frames import FrameBudget, encoded_size
from ccsq.common.storage.claimstore import ClaimStore, open_store, store_failure
from ccsq.common.wire.envelope import Envelope
from ccsq.common.wire.errors import ConfigError, PayloadMissing
from ccsq.common.runtime.faults import crash_point
from ccsq.common.link.peer import BrokerLink, LinkState, refusal_fix
from ccsq.common.wire.policy import task_failure
from ccsq.relayd.config import LinkConfig, RelayConfig
from ccsq.relayd.relay_journal import FAILING, LEASED, RESULTED, RETURNED, SUBMITTED, Key, RelayJournal, Row

log = structlog.get_logger("ccsq.relayd")

TICK_S = 0.1
#: SUBMIT errors after which the item is simply tried again later (nothing is wrong with it).
RETRY_LATER = frozenset({"QUEUE_FULL", "DISK_FULL"})


def _reason(error: str) -> protocol.FailReason:
    """The downstream's dead-letter reason as ours (a reason this version does not know:
    handler_error, whose rule is then the upstream's FAIL_POLICY)."""
    try:
        return protocol.FailReason(error)
    except ValueError:
        return protocol.FailReason.HANDLER_ERROR


def _origin_fields(task: protocol.Task) -> dict:
    return msgpack.unpackb(task.origin, raw=False) if task.origin else {}


def submit_item(task: protocol.Task) -> protocol.SubmitItem:
    """The downstream SUBMIT of an upstream task: every field as the origin signed it."""
    rec = _origin_fields(task)
    return protocol.SubmitItem(
        key=origin_key(rec.get("swarm", ""), task.item_id),
        kind=task.kind,
        payload=task.payload,
        params=task.params,
        priority=rec.get("priority", 0),
        deadline_ts=task.deadline_ts,
        max_attempts=rec.get("max_attempts", 0),
        max_runtime_s=task.max_runtime_s,
        origin=task.origin,
        origin_sig=task.origin_sig,
    )


def status_failures(rows: Iterable[Row], items: Iterable[protocol.ItemStatus]) -> list[protocol.TaskFailure]:
    """What the upstream is told for the downstream copies a STATUS poll found ended there
    without a result: ``rows`` the link's journal rows (only ``submitted`` ones count),
    ``items`` the downstream's STATUS answer. A copy dead there fails its upstream lease
    with the downstream's reason, an expired one as a handler error, one the downstream no
    longer knows is given back (``released``: no attempt counted). One FAIL per row."""
    rows = list(rows)
    failures: list[protocol.TaskFailure] = []
    for st in items:
        mine = [r for r in rows if r.down_item == st.item_id and r.state == SUBMITTED]
        if st.state == protocol.ItemState.DEAD.value:
            failures += [task_failure(r.up_item, r.token, _reason(st.error),
                                       f"dead in the downstream swarm ({st.error})") for r in mine]
        elif st.state == protocol.ItemState.EXPIRED.value:
            failures += [task_failure(r.up_item, r.token, protocol.FailReason.HANDLER_ERROR,
                                       "deadline expired in the downstream swarm") for r in mine]
        elif st.state == "unknown":
            failures += [task_failure(r.up_item, r.token, protocol.FailReason.RELEASED,
                                       "the downstream swarm no longer knows the item") for r in mine]
    return failures


class LinkRunner:
    """One link: its two broker sessions, its rows of the journal, its credit."""

    def __init__(self, rcfg: RelayConfig, cfg: LinkConfig, journal: RelayJournal) -> None:
        self.rcfg = rcfg
        self.cfg = cfg
        self.name = cfg.name
        self.journal = journal
        self.budget = FrameBudget(rcfg.max_frame_bytes)  # of every frame this link sends, both sides
        self.log = log.bind(link=cfg.name)
        self.rows: dict[Key, Row] = {r.key: r for r in journal.rows(cfg.name)}
        self.up = BrokerLink(rcfg.side(cfg, True), hello=self._up_hello, heartbeat=self._up_heartbeat,
                             on_message=self._up_message, on_connect=self._up_connect, on_heartbeat=self._up_heartbeat_in)
        self.down = BrokerLink(rcfg.side(cfg, False), hello=self._down_hello, heartbeat=self._down_heartbeat_out,
                               on_message=self._down_message, on_connect=self._down_connect,
                               on_heartbeat=self._down_heartbeat)
        same = cfg.upstream_claim_store == cfg.downstream_claim_store
        base = rcfg.config_path.rsplit("/", 1)[0] if rcfg.config_path else None
        self.up_store: ClaimStore | None = None
        self.down_store: ClaimStore | None = None
        if not same and cfg.upstream_claim_store and cfg.downstream_claim_store:
            self.up_store = open_store(cfg.upstream_claim_store, base)
            self.down_store = open_store(cfg.downstream_claim_store, base)
        self.capacity = 0  # free downstream worker slots: last heartbeat's, less our new items since, plus results since
        self.workers = 0  # downstream workers that take our kinds
        self.late = False  # policy deadline: the upstream forecasts a missed deadline
        self.granted = 0  # credit granted (less withdrawn) in this upstream session
        self.received = 0  # tasks received in this upstream session
        self._credit_unseen: list[int] = []  # CREDIT deltas sent that the upstream's heartbeats do not yet count
        self._credit_seen = 0  # CREDIT frames the upstream counted (its heartbeat's credit_msgs)
        self.can_withdraw = False  # the upstream reports our credit (a broker that applies a negative CREDIT)
        self.broken = ""  # set when a swarm refuses the link (its origins, proofs or the relay itself): stop pulling
        self.broken_since = 0.0  # unix seconds
        self.broken_fix = ""
        self.refused: dict[str, str] = {}  # side -> why, for each side whose broker refused the relay for good
        self.on_refused: Callable[[], None] | None = None  # the relay's: a side of this link was refused
        self._journal_broken: str | None = (journal.broken(cfg.name) or {}).get("cause")  # cause kept in the journal
        self._req = 0
        self._sent: dict[Key, float] = {}  # when each row's pending message last went out
        self._copying: set[Key] = set()  # claim-check copies under way
        self._last_status = time.monotonic()
        self._down_lost_mono: float | None = time.monotonic()
        self._cancel_down: set[str] = set()  # downstream items to cancel once reachable (given back after a partition)
        self._cancel_reqs: set[int] = set()

    # --- helpers ---
    def _next_req(self) -> int:
        self._req += 1
        return self._req

    def _held(self) -> list[protocol.LeaseRef]:
        return [protocol.LeaseRef(r.up_item, r.token) for r in self.rows.values() if not r.lost]

    def _rows_of(self, up_item: str) -> list[Row]:
        return [r for r in self.rows.values() if r.up_item == up_item]

    def _ready(self, link: BrokerLink) -> bool:
        return link.state is LinkState.READY

    # --- upstream session ---
    def _fixed(self, cause: str) -> None:
        """What broke the link (in an earlier run) is seen working now: the report stops saying so."""
        if self._journal_broken == cause and not self.broken:
            self.journal.clear_broken(self.name, (cause,))
            self._journal_broken = None
            self.log.info("link_repaired", cause=cause)

    def _up_hello(self) -> protocol.Hello:
        return protocol.Hello(role=protocol.Role.RELAY.value, credit=0, kinds=list(self.cfg.kinds), leases=self._held(),
                       info={RELAY_SIDE: UPSTREAM, "link": self.name, POLICY: self.cfg.policy})

    def _broken_info(self) -> dict:
        """Heartbeat.info while the link is broken (each broker's ``ccsq status`` shows it)."""
        if not self.broken:
            return {}
        return {BROKEN_INFO: self.broken[:300], BROKEN_SINCE_INFO: int(self.broken_since), BROKEN_FIX_INFO: self.broken_fix[:300]}

    def _up_heartbeat(self) -> protocol.Heartbeat:
        # a broken link says so and is unhealthy: the upstream dispatches nothing to it
        return protocol.Heartbeat(leases=self._held(), busy=len(self.rows), healthy=not self.broken, info=self._broken_info())

    def _down_heartbeat_out(self) -> protocol.Heartbeat:
        return protocol.Heartbeat(healthy=not self.broken, info=self._broken_info())

    def _break(self, cause: str, reason: str, fix: str) -> None:
        """The link stops pulling (``cause``: upstream_refused, downstream_refused,
        origin_rejected, proof_rejected): logged once as an error, kept in the journal
        (the federation report and the metric show it, since when, why and the fix)."""
        if not self.broken:
            self.broken_since = time.time()
            self.log.error("link_broken", cause=cause, reason=reason[:300], fix=fix[:500])
        self.broken, self.broken_fix = reason, fix
        self.broken_since = self.journal.set_broken(self.name, cause, reason, fix, self.broken_since)
        self._journal_broken = cause
        self._grant()  # withdraw the credit still unused upstream

    def _up_connect(self, welcome: protocol.Welcome) -> None:
        self.granted = self.received = self._credit_seen = 0
        self._credit_unseen = []
        self.can_withdraw = False
        released = {(r.item_id, r.token) for r in welcome.released}
        drop = [k for k in released if k in self.rows and self.rows[k].state == LEASED]
        if drop:
            self.journal.end(self.name, drop, "ended_released", "released")
            for k in drop:
                self.rows.pop(k, None)
        lost = [k for k in released if k in self.rows]
        if lost:
            self.journal.mark_lost(self.name, lost)
            for k in lost:
                self.rows[k].lost = True
        self.log.info("upstream_connected", resumed=len(welcome.resumed), released=len(drop), lost=len(lost))
        self._fixed("upstream_refused")
        self._resend(force=True)

    def _up_message(self, env: Envelope) -> Awaitable[None] | None:
        msg = env.message
        if isinstance(msg, protocol.Dispatch):
            return self._on_dispatch(msg.tasks)
        if isinstance(msg, protocol.CompleteAck):
            self._on_complete_ack(msg.outcomes)
        elif isinstance(msg, protocol.FailAck):
            keys = [(o.item_id, o.token) for o in msg.outcomes
                    if (o.item_id, o.token) in self.rows and self.rows[(o.item_id, o.token)].state == FAILING]
            self.journal.end(self.name, keys, "ended_failed")
            for k in keys:
                self.rows.pop(k, None)
                self._sent.pop(k, None)
        elif isinstance(msg, protocol.Error):
            self.log.warning("upstream_error", code=msg.code, message=msg.message)
        return None

    async def _on_dispatch(self, tasks: list[protocol.Task]) -> None:
        self.received += len(tasks)
        unsigned = [t for t in tasks if not t.origin or not t.origin_sig]
        if unsigned:  # an upstream broker without federation support: give them back
            self.log.error("upstream_dispatch_unsigned", items=len(unsigned))
        new = self.journal.insert_leased(self.name, tasks)
        for t in new:
            self.rows[(t.item_id, t.token)] = Row(self.name, t.item_id, t.token, t.kind, LEASED, t)
        crash_point("relay.after_lease_journaled")
        if self.broken:
            # credit granted before the link broke is still being spent upstream: give each
            # such lease straight back (released, uncounted) instead of running it downstream
            # again, where its result would be refused once more and bounce (a loop for as
            # long as the upstream does not trust the downstream's proofs)
            self._fail([task_failure(t.item_id, t.token, protocol.FailReason.RELEASED, self.broken)
                        for t in new], "released")
            return
        if unsigned:
            self._fail([task_failure(t.item_id, t.token, protocol.FailReason.RELEASED, "upstream did not sign")
                        for t in unsigned if (t.item_id, t.token) in self.rows], "refused")
        if self.down_store is not None:
            await self._copy_payloads([t for t in new if t.payload.inline is None])
        self._submit([self.rows[(t.item_id, t.token)] for t in new if (t.item_id, t.token) in self.rows
                      and self.rows[(t.item_id, t.token)].state == LEASED])

    async def _copy_payloads(self, tasks: list[protocol.Task]) -> None:
        """Claim-check payloads into the downstream store (digest-checked on read); a task
        whose copy is already under way (DISPATCH vs the tick) is skipped."""
        tasks = [t for t in tasks if (t.item_id, t.token) not in self._copying]
        self._copying.update((t.item_id, t.token) for t in tasks)
        try:
            await self._copy_each(tasks)
        finally:
            self._copying.difference_update((t.item_id, t.token) for t in tasks)

    async def _copy_each(self, tasks: list[protocol.Task]) -> None:
        failures = []
        for t in tasks:
            try:
                assert self.up_store is not None and self.down_store is not None  # set together (__init__)
                data = await self.up_store.aget_blob(t.payload)
                await asyncio.to_thread(self.down_store.put, data)
            except Exception as exc:  # any store error; a stored blob missing in our view is the store's problem (G7)
                failures.append(task_failure(t.item_id, t.token, store_failure(exc, t.payload), str(exc)[:300]))
                continue
            self.journal.set_copied(self.name, [(t.item_id, t.token)], t.payload.sha256)
            if (t.item_id, t.token) in self.rows:
                self.rows[(t.item_id, t.token)].copied = t.payload.sha256
            self.journal.count(self.name, "blobs_copied")
        if failures:
            self._fail(failures, "refused")

    def _on_complete_ack(self, outcomes: list[protocol.ItemOutcome]) -> None:
        mine = [o for o in outcomes if (o.item_id, o.token) in self.rows and self.rows[(o.item_id, o.token)].state == RESULTED]
        self.journal.mark_returned(self.name, mine)
        for o in mine:
            row = self.rows[(o.item_id, o.token)]
            row.state, row.outcome = RETURNED, o.outcome
            if o.outcome != protocol.Outcome.ACCEPTED.value:
                self.log.info("result_not_accepted_upstream", item=o.item_id, token=o.token, outcome=o.outcome)
        if any(o.outcome == protocol.Outcome.ACCEPTED.value for o in mine):
            self._fixed("proof_rejected")
        rejected = [o for o in mine if o.outcome == protocol.Outcome.REJECTED.value]
        if rejected:
            # the upstream cannot check the downstream's proofs (trust files): a misconfiguration.
            # Stop pulling and give these leases back uncounted, so the work runs at home
            # instead of expiring into dead letters (best effort: if lost, the lease expires)
            self.log.error("link_refused_by_upstream", items=len(rejected))
            self._break("proof_rejected", "upstream rejected the downstream's result proofs",
                        "the upstream broker's trusted_swarms must hold the downstream swarm's broker public key "
                        "(and the downstream's the upstream's); fix the files, restart both brokers, then the relay")
            self._send_up([task_failure(o.item_id, o.token, protocol.FailReason.RELEASED, self.broken)
                           for o in rejected], protocol.Fail)
        crash_point("relay.after_complete_ack")
        self._ack({self.rows[(o.item_id, o.token)].down_item for o in mine})

    def _fail(self, failures: list[protocol.TaskFailure], counter: str) -> None:
        self.journal.mark_failing(self.name, failures, counter)
        for f in failures:
            row = self.rows.get((f.item_id, f.token))
            if row is not None:
                row.state, row.report = FAILING, f
        self._send_up(failures, protocol.Fail)

    def _send_up(self, reports: list, cls: type) -> None:
        if not reports or not self._ready(self.up):
            return
        now = time.monotonic()
        for chunk in self.budget.split(reports):
            self.up.send(cls(chunk))
            for r in chunk:
                self._sent[(r.item_id, r.token)] = now

    # --- downstream session ---
    def _down_hello(self) -> protocol.Hello:
        return protocol.Hello(role=protocol.Role.RELAY.value, credit=self.rcfg.result_credit, kinds=list(self.cfg.kinds),
                       info={RELAY_SIDE: DOWNSTREAM, "link": self.name})

    def _down_connect(self, welcome: protocol.Welcome) -> None:
        self._down_lost_mono = None
        self.log.info("downstream_connected", in_flight=len(self.rows))
        if self._cancel_down:  # copies of leases given back during the partition: only those not started yet
            for chunk in self.budget.split(sorted(self._cancel_down)):
                req = self._next_req()
                self._cancel_reqs.add(req)
                self.down.send(protocol.Cancel(req, chunk))
        self._fixed("downstream_refused")
        self._resend(force=True)

    def _down_heartbeat(self, hb: protocol.Heartbeat) -> None:
        if self._down_lost_mono is not None:
            return
        # the broker counted every SUBMIT it acknowledged before this heartbeat (one socket,
        # in order): from here on, our new items lower it and results raise it until the next
        self.capacity = sum(v for k, v in hb.info.items() if k.startswith(CAP_PREFIX) and isinstance(v, int)
                            and k[len(CAP_PREFIX):] in self.cfg.kinds)
        self.workers = sum(v for k, v in hb.info.items() if k.startswith(WORKERS_PREFIX) and isinstance(v, int)
                           and k[len(WORKERS_PREFIX):] in self.cfg.kinds)
        self._grant()

    def _up_heartbeat_in(self, hb: protocol.Heartbeat) -> None:
        late = any(hb.info.get(LATE_PREFIX + k) == 1 for k in self.cfg.kinds)
        if late != self.late:
            self.log.info("upstream_deadline_pressure", late=late)
        self.late = late
        credit, seen = hb.info.get(CREDIT_INFO), hb.info.get(CREDIT_MSGS_INFO)
        if isinstance(credit, int) and isinstance(seen, int) and 0 <= seen - self._credit_seen <= len(self._credit_unseen):
            # resync: the upstream's credit for us as of the CREDIT frames it had applied, plus
            # those still on their way (every DISPATCH sent before this heartbeat is received)
            del self._credit_unseen[:seen - self._credit_seen]
            self._credit_seen = seen
            self.granted = self.received + max(0, credit + sum(self._credit_unseen))
            self.can_withdraw = True
            self._grant()

    def _grant(self) -> None:
        """Set the credit the upstream may still dispatch on to what the downstream backs:
        its free capacity less our items not yet confirmed there (policy ``capacity``), or
        the room up to ``max_in_flight`` while the upstream forecasts a missed deadline
        (policy ``deadline``); none while the link is broken or the downstream is gone.
        More is granted with CREDIT; less is withdrawn with a negative CREDIT (an upstream
        that reports our credit in its heartbeats)."""
        if not self._ready(self.up):
            return
        outstanding = max(0, self.granted - self.received)
        held = sum(1 for r in self.rows.values() if not r.lost)
        room = max(0, self.cfg.max_in_flight - held)
        if self.broken or not self._ready(self.down):
            want = 0
        elif self.cfg.policy == "deadline" and self.late and self.workers > 0:
            want = room  # spill: the upstream will miss a deadline; the downstream can run the kind
        else:
            waiting = sum(1 for r in self.rows.values() if r.state == LEASED)
            want = max(0, min(self.capacity - waiting, room))
        delta = want - outstanding
        if delta == 0 or (delta < 0 and not self.can_withdraw):
            return
        if self.up.send(protocol.Credit(delta)):
            self.granted += delta
            self._credit_unseen.append(delta)
            if len(self._credit_unseen) > 100_000:  # an upstream that never reports (cannot happen with can_withdraw)
                del self._credit_unseen[:50_000]
            self.log.debug("credit_granted" if delta > 0 else "credit_withdrawn", credit=delta, capacity=self.capacity,
                           outstanding=outstanding, want=want)

    def _down_message(self, env: Envelope) -> Awaitable[None] | None:
        msg = env.message
        if isinstance(msg, protocol.SubmitAck):
            self._on_submit_ack(msg.results)
        elif isinstance(msg, protocol.Result):
            return self._on_result(msg.deliveries)
        elif isinstance(msg, protocol.AckOk):
            self._on_ack_ok(set(msg.item_ids) | set(msg.unknown))
        elif isinstance(msg, protocol.StatusReply) and msg.req in self._cancel_reqs:
            self._cancel_reqs.discard(msg.req)
            self._on_cancelled(msg.items)
        elif isinstance(msg, protocol.StatusReply):
            self._on_status(msg.items)
        elif isinstance(msg, protocol.Error):
            self.log.warning("downstream_error", code=msg.code, message=msg.message)
        return None

    def _needs_copy(self, row: Row) -> bool:
        return self.down_store is not None and row.task.payload.inline is None and not row.copied

    def _submit(self, rows: list[Row]) -> None:
        rows = [r for r in rows if not self._needs_copy(r)]  # a claim check is copied first (tick)
        if not rows or not self._ready(self.down):
            return
        now = time.monotonic()
        sized = [(r, item, encoded_size(item)) for r in rows for item in (submit_item(r.task),)]
        lone = [r for r, _, n in sized if not self.budget.fits(n)]
        if lone:  # only with a smaller max_frame_bytes here than upstream: it runs at home instead
            why = f"item too large for one SUBMIT frame of this relay (max_frame_bytes={self.budget.max_frame_bytes})"
            self.log.error("submit_too_large", items=len(lone), reason=why, fix="raise max_frame_bytes in relayd.toml")
            self._fail([task_failure(r.up_item, r.token, protocol.FailReason.RELEASED, why) for r in lone], "released")
        for chunk in self.budget.split([s for s in sized if self.budget.fits(s[2])], size_of=lambda s: s[2]):
            # one SubmitItem per upstream item (two leases of one item are one downstream item)
            items = {r.up_item: item for r, item, _ in chunk}
            self.down.send(protocol.Submit(self._next_req(), list(items.values())))
            for r, _, _ in chunk:
                self._sent[r.key] = now

    def _on_submit_ack(self, results: list[protocol.SubmitResult]) -> None:
        refused: list[protocol.TaskFailure] = []
        for res in results:
            up_item = res.key.rsplit(":", 1)[-1]
            rows = [r for r in self._rows_of(up_item) if r.state == LEASED]
            if not rows:
                continue
            if res.error:
                if res.error in RETRY_LATER:
                    continue  # resent after resend_interval_s
                if res.error == ORIGIN_REJECTED:
                    self.log.error("link_refused_by_downstream", item=up_item, reason=res.message[:300])
                    self._break("origin_rejected", f"downstream refused our origin: {res.message}"[:300],
                                "the downstream broker's trusted_swarms must pin the upstream swarm's broker public key "
                                "(its keys/broker.pub) under the upstream's swarm_id; fix it, restart the downstream "
                                "broker, then the relay")
                    reason = protocol.FailReason.RELEASED
                else:
                    self.log.warning("downstream_refused_item", item=up_item, error=res.error, message=res.message[:300])
                    reason = protocol.FailReason.HANDLER_ERROR
                refused += [task_failure(r.up_item, r.token, reason, f"downstream {res.error}: {res.message}"[:500])
                            for r in rows]
                continue
            self.journal.mark_submitted(self.name, up_item, res.item_id, res.duplicate)
            self._fixed("origin_rejected")
            if not res.duplicate:
                self.capacity -= 1  # one more item waits for a downstream worker (until the next heartbeat says)
            for r in rows:
                r.state, r.down_item = SUBMITTED, res.item_id
            if res.duplicate:
                self._reuse_result(up_item, res.item_id, rows)
        if refused:
            self._fail(refused, "forged_rejected" if self.broken else "refused")
        crash_point("relay.after_submit_ack")

    def _reuse_result(self, up_item: str, down_item: str, rows: list[Row]) -> None:
        """The upstream leased an item again while an earlier lease of it already holds the
        downstream's result (the downstream delivered it once, to that row; it will not
        deliver it again before our ACK): report that result under the new tokens too,
        instead of waiting for a delivery that never comes while extending the lease."""
        done = next((r.report for r in self._rows_of(up_item)
                     if r.state in (RESULTED, RETURNED) and isinstance(r.report, protocol.TaskResult)), None)
        if done is None:
            return
        reports = [(dataclasses.replace(done, token=r.token), down_item) for r in rows]
        self.journal.store_results(self.name, reports)
        for (rep, _), r in zip(reports, rows):
            r.state, r.report = RESULTED, rep
        self._send_up([rep for rep, _ in reports], protocol.Complete)

    async def _on_result(self, deliveries: list[protocol.Delivery]) -> None:
        reports: list[tuple[protocol.TaskResult, str]] = []
        orphans: list[str] = []
        for d in deliveries:
            rows = [r for r in self._rows_of(d.key.rsplit(":", 1)[-1]) if r.state in (LEASED, SUBMITTED)]
            if not rows:
                # a row already past this step resends its COMPLETE or ACK itself; any other
                # result (a dropped or failing lease) is acknowledged and discarded
                if not any(r.down_item == d.item_id and r.state in (RESULTED, RETURNED) for r in self.rows.values()):
                    orphans.append(d.item_id)
                continue
            result = d.result
            if self.up_store is not None and result.inline is None:
                assert self.down_store is not None  # set together with up_store (__init__)
                try:
                    data = await self.down_store.aget_blob(result)
                    await asyncio.to_thread(self.up_store.put, data)
                except (PayloadMissing, OSError) as exc:
                    self.log.warning("result_copy_failed", item=d.item_id, error=str(exc)[:300])
                    continue  # not acknowledged: the downstream redelivers it
            for r in rows:
                reports.append((protocol.TaskResult(r.up_item, r.token, result, d.handler, d.handler_version, 0.0,
                                             d.proof, d.proof_sig), d.item_id))
        if reports:
            # each finished item frees a downstream worker slot: refill now instead of at the
            # next capacity heartbeat (the next one corrects any overshoot)
            self.capacity += len({d for _, d in reports})
            self.journal.store_results(self.name, reports)
            for rep, down_item in reports:
                row = self.rows[(rep.item_id, rep.token)]
                row.state, row.report, row.down_item = RESULTED, rep, down_item
            crash_point("relay.after_result_journaled")
            self._send_up([rep for rep, _ in reports], protocol.Complete)
            self._grant()
        if orphans:
            self.journal.count(self.name, "orphan_results", len(orphans))
            self.log.warning("orphan_results", items=orphans[:20])
            self.down.send(protocol.Ack(orphans))
        self.down.send(protocol.Credit(len(deliveries)))

    def _ack(self, down_items: set[str]) -> None:
        """ACK downstream the items whose every row the upstream has confirmed."""
        done = [d for d in down_items if d and all(r.state == RETURNED for r in self.rows.values() if r.down_item == d)]
        if not done or not self._ready(self.down):
            return
        now = time.monotonic()
        self.down.send(protocol.Ack(done))
        for r in self.rows.values():
            if r.down_item in done:
                self._sent[r.key] = now

    def _on_ack_ok(self, down_items: set[str]) -> None:
        rows = [r for r in self.rows.values() if r.state == RETURNED and r.down_item in down_items]
        if not rows:
            return
        self.journal.end(self.name, [r.key for r in rows], "ended_acked")
        for r in rows:
            self.rows.pop(r.key, None)
            self._sent.pop(r.key, None)
        if self.down_store is not None:
            still = {r.copied for r in self.rows.values()}
            for sha in {r.copied for r in rows if r.copied} - still:
                try:
                    self.down_store.delete(sha)  # our copy: the result is home
                except OSError as exc:
                    self.log.warning("blob_delete_failed", sha256=sha, error=str(exc)[:200])

    def _on_cancelled(self, items: list[protocol.ItemStatus]) -> None:
        """The downstream's answer to our CANCEL of copies given back after a partition: dead
        (cancelled) = never ran there; any other state = it ran or runs (its result, if any,
        comes back with no row: an orphan, acknowledged and discarded)."""
        cancelled = [st.item_id for st in items
                     if st.state == protocol.ItemState.DEAD.value and st.error == protocol.FailReason.CANCELLED.value]
        self._cancel_down.difference_update(st.item_id for st in items)
        if cancelled:
            self.journal.count(self.name, "cancelled_down", len(cancelled))
        self.log.info("downstream_copies_cancelled", cancelled=len(cancelled), ran=len(items) - len(cancelled))

    def _on_status(self, items: list[protocol.ItemStatus]) -> None:
        failures = status_failures(self.rows.values(), items)
        if failures:
            self._fail(failures, "failed_down")

    # --- periodic: resends, status polls, downstream outage ---
    def _resend(self, *, force: bool = False) -> None:
        now = time.monotonic()
        due = [r for r in self.rows.values() if force or now - self._sent.get(r.key, 0.0) >= self.rcfg.resend_interval_s]
        self._submit([r for r in due if r.state == LEASED])
        self._send_up([r.report for r in due if r.state == RESULTED and r.report is not None], protocol.Complete)
        self._send_up([r.report for r in due if r.state == FAILING and r.report is not None], protocol.Fail)
        self._ack({r.down_item for r in due if r.state == RETURNED})

    def _poll_status(self) -> None:
        now = time.monotonic()
        if now - self._last_status < self.rcfg.status_interval_s or not self._ready(self.down):
            return
        self._last_status = now
        ids = sorted({r.down_item for r in self.rows.values() if r.state == SUBMITTED and r.down_item})
        for chunk in self.budget.split(ids):
            self.down.send(protocol.Status(self._next_req(), chunk))

    def _downstream_outage(self) -> None:
        """The downstream is unreachable: give the leases we have not submitted back to
        the upstream (released: no attempt counted) so its own workers can run them."""
        if self._ready(self.down):
            self._down_lost_mono = None
            return
        now = time.monotonic()
        if self._down_lost_mono is None:
            self._down_lost_mono = now
            self.capacity = 0
        if now - self._down_lost_mono < self.rcfg.resend_interval_s * 2:
            return
        give_back = [r for r in self.rows.values() if r.state == LEASED and not r.lost]
        if give_back and self._ready(self.up):
            self.log.warning("downstream_unreachable_release", items=len(give_back))
            self._fail([task_failure(r.up_item, r.token, protocol.FailReason.RELEASED, "downstream unreachable")
                        for r in give_back], "released")
        hold_s = self.rcfg.downstream_hold_max_s
        pinned = [r for r in self.rows.values() if r.state == SUBMITTED and not r.lost]
        if hold_s > 0 and pinned and now - self._down_lost_mono >= hold_s and self._ready(self.up):
            # a partition must not pin work downstream while the upstream may have idle
            # workers: give the leases back (released, no attempt counted); each copy is
            # cancelled once the downstream is reachable, unless it has started there
            self.log.warning("downstream_partition_release", items=len(pinned), unreachable_s=round(now - self._down_lost_mono, 1))
            self._cancel_down.update(r.down_item for r in pinned if r.down_item)
            self._fail([task_failure(r.up_item, r.token, protocol.FailReason.RELEASED,
                                     f"downstream unreachable for {hold_s:g} s (downstream_hold_max_s)") for r in pinned],
                       "partition_released")

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            uncopied = [r.task for r in self.rows.values() if r.state == LEASED and self._needs_copy(r)]
            if uncopied:  # e.g. journaled, then SIGKILLed before the copy: copy now, submit next tick
                await self._copy_payloads(uncopied)
            self._downstream_outage()
            self._grant()  # e.g. withdraw what a lost downstream or a broken link no longer backs
            self._resend()
            self._poll_status()

    def _side_refused(self, side: str, link: BrokerLink) -> None:
        """A broker refused this side of the link for good (unknown key, CURVE allow-list,
        wrong role, a broker key we do not pin): this link stops pulling; the other side
        stays connected to give back what the link holds and to show the break in that
        broker's ``ccsq status``. Other links are not affected."""
        refused = link.refused
        assert refused is not None  # run() calls this only for a side whose link was refused
        why = f"{side} broker refused the relay ({refused.code}: {refused.message})"
        self.refused[side] = why
        self.log.error("link_refused", side=side, code=refused.code, endpoint=link.endpoint)
        self._break(f"{side}_refused", why[:300], refusal_fix(link.settings, protocol.Role.RELAY.value, refused))
        if side == "downstream":
            # nothing held here can run downstream any more: give every lease not yet back
            # to the upstream (released: no attempt counted) so its own workers run them; a
            # copy already running downstream comes back, when it does, as an orphan result
            back = [r for r in self.rows.values() if r.state in (LEASED, SUBMITTED) and not r.lost]
            if back and self._ready(self.up):
                self._fail([task_failure(r.up_item, r.token, protocol.FailReason.RELEASED, why[:300]) for r in back], "released")
        if self.on_refused is not None:
            self.on_refused()

    async def run(self) -> None:
        """Both sessions and the tick until the relay stops; a side refused for good ends
        only that side (:meth:`_side_refused`); returns when both sides have ended."""
        sides = {asyncio.create_task(self.up.run(), name=f"{self.name}-up"): ("upstream", self.up),
                 asyncio.create_task(self.down.run(), name=f"{self.name}-down"): ("downstream", self.down)}
        tick = asyncio.create_task(self.tick(), name=f"{self.name}-tick")
        pending = {*sides, tick}
        try:
            while pending - {tick}:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # raises what ended it
                if self.up.replaced or self.down.replaced:
                    # another live process uses this link's peer id: exit (systemd shows it) rather
                    # than run a link that will never reconnect
                    from ccsq.common.link.peer import id_in_use_message

                    twin = self.up if self.up.replaced else self.down
                    raise ConfigError(f"link {self.name}: {id_in_use_message(twin.settings, twin)}")
                refused = [sides[t] for t in done if t in sides and sides[t][1].refused is not None]
                for side, link in refused:
                    self._side_refused(side, link)
                if len(refused) < len([t for t in done if t in sides]):
                    return  # a side stopped without a refusal: the relay is stopping
        finally:
            for t in (*sides, tick):
                t.cancel()
            await asyncio.gather(*sides, tick, return_exceptions=True)

    async def stop(self) -> None:
        await asyncio.gather(self.up.stop("relay stopping"), self.down.stop("relay stopping"))


class RelayRefused(Exception):
    """Every link of the relay was refused by one of its brokers (exit 77: the keys, not
    a restart, fix it); ``args[0]``: one line per link, why and the fix."""


#: How long a relay whose every link was refused waits for the upstream to confirm the
#: leases it gave back before it exits.
REFUSED_DRAIN_S = 3.0


class Relay:
    """Every link of one ``relayd.toml``; :meth:`run` until :meth:`request_stop`, or until
    every link was refused (:class:`RelayRefused`)."""

    def __init__(self, cfg: RelayConfig, journal: RelayJournal) -> None:
        self.cfg = cfg
        self.journal = journal
        self.links = [LinkRunner(cfg, link, journal) for link in cfg.links]
        self._stop = asyncio.Event()
        self._refusal = asyncio.Event()
        for link in self.links:
            link.on_refused = self._refusal.set

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, on_ready: Callable[[], object] | None = None) -> None:
        tasks = [asyncio.create_task(link.run(), name=f"link-{link.name}") for link in self.links]
        log.info("relay_started", links=[link.name for link in self.links],
                 in_flight={link.name: len(link.rows) for link in self.links})
        if on_ready:
            on_ready()
        stop = asyncio.create_task(self._stop.wait())
        all_refused = False
        running = list(tasks)
        while running and not stop.done():
            refusal = asyncio.create_task(self._refusal.wait())
            done, _ = await asyncio.wait([stop, refusal, *running], return_when=asyncio.FIRST_COMPLETED)
            refusal.cancel()
            self._refusal.clear()
            for t in done:
                if t in tasks and (exc := t.exception()) is not None:
                    raise exc
            running = [t for t in running if not t.done()]
            if all(link.refused for link in self.links):
                all_refused = True
                break
        if all_refused:
            # give the upstreams a moment to confirm the leases given back (best effort:
            # an unconfirmed one expires there by the normal rules)
            deadline = time.monotonic() + REFUSED_DRAIN_S
            while time.monotonic() < deadline and any(
                    link._ready(link.up) and any(r.state == FAILING for r in link.rows.values()) for link in self.links):
                await asyncio.sleep(0.05)
        await asyncio.gather(*(link.stop() for link in self.links), return_exceptions=True)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.cancel()
        if all_refused:
            why = "; ".join(f"link {link.name}: {link.broken} (fix: {link.broken_fix})" for link in self.links)
            log.error("relay_stopped", reason="every link was refused", links={link.name: link.broken for link in self.links})
            raise RelayRefused(why)
        log.info("relay_stopped")
