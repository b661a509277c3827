"""A simulated relay (``ccsq-relayd``, one link from swarm a to swarm b) that follows
``relayd/relay.py`` rule by rule (docs/simulation.md names each), with a journal that
outlives a crash (``relayd/relay_journal.py``: every write fsynced before the next
message goes out).

One process, two sessions (:class:`RelaySide`, role ``relay``): upstream on broker a
(``relay_side = upstream``: leased work like a worker, its leases listed in every
heartbeat, COMPLETE under the upstream token with the downstream's signed proof, credit
granted and withdrawn by what the downstream backs), downstream on broker b (SUBMIT with
the upstream's origin record and signature under the key ``origin:<swarm>:<item>``, the
RESULT routed back here, ACKed only once the upstream confirmed the COMPLETE). Claim-check
payloads (inline only here), the ``deadline`` policy and refused links are not simulated.

A crash keeps only the journal: :attr:`SimRelay.jrows` (rows) and :attr:`SimRelay.jcounters`
(the federation report's counters); a write that was not fsynced (:meth:`SimRelay._write`
deferred, a plant) is gone, and the world fails the run if a message of that step had
already gone out (``relay_sent_unjournaled``).
"""

from __future__ import annotations

import dataclasses
import random

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ccsq.brokerd import gaps
from ccsq.common.wire import federation as fed
from ccsq.common.wire import protocol
from ccsq.common.wire.policy import task_failure
from ccsq.relayd.relay import RETRY_LATER, status_failures, submit_item
from ccsq.relayd.relay_journal import FAILING, LEASED, RESULTED, RETURNED, SUBMITTED, Row
from tests.sim.peers import KIND, Peer, blob
from tests.sim.world import RESTART_DELAY_S

LINK = "ab"
UP_ID, DOWN_ID = f"r0-{LINK}-up", f"r0-{LINK}-down"  # relayd: <peer_id>-<link>-up / -down
TICK_S = 0.1  # relayd/relay.py TICK_S
RESEND_S = 2.0  # relayd/config.py resend_interval_s
STATUS_S = 5.0  # status_interval_s
HOLD_MAX_S = 2.0  # downstream_hold_max_s (default 30 s; 2 here: a partition fault (up to 12 s) the relay notices after 5 s passes it)
RESULT_CREDIT = 64  # result_credit
MAX_IN_FLIGHT = 256  # max_in_flight
BATCH = 64  # items per SUBMIT / COMPLETE / FAIL frame (relayd cuts by the frame budget; small inline items here)
CRASH_POINTS = ("relay.after_lease_journaled", "relay.after_submit_ack", "relay.after_result_journaled",
                "relay.after_complete_ack")


class _Died(Exception):
    """The relay process dies at a crash point (caught where the message was handled)."""


def _row(task: protocol.Task) -> Row:
    """The journal row relayd writes for an upstream lease (``relay_journal.Row``, state
    ``leased``; this world has one link, ``ab``)."""
    return Row("ab", task.item_id, task.token, task.kind, LEASED, task)


class RelaySide(Peer):
    """One of the relay's two broker sessions (``common/link/peer.py`` ``BrokerLink``, role relay)."""

    role = protocol.Role.RELAY

    def __init__(self, relay: SimRelay, peer_id: str, bp, upstream: bool) -> None:
        super().__init__(relay.w, peer_id, bp)
        self.relay, self.upstream = relay, upstream

    def push(self, msg: protocol.Message) -> bool:
        """BrokerLink.send: queued for the current session, False when not connected."""
        if not self.up or self.conn is None:
            return False
        if isinstance(msg, protocol.Ack):
            self.relay.check_ack(msg.item_ids)
        self.send(msg)
        return True

    def start(self) -> None:
        if not self.relay.dead:
            super().start()

    def hello(self) -> protocol.Hello:
        return self.relay.up_hello() if self.upstream else self.relay.down_hello()

    def heartbeat(self) -> protocol.Heartbeat:
        return self.relay.up_heartbeat() if self.upstream else self.relay.down_heartbeat_out()

    def on_welcome(self, msg: protocol.Welcome) -> None:
        self.relay.guard(lambda: self.relay.up_connect(msg) if self.upstream else self.relay.down_connect())

    def on_message(self, msg: protocol.Message) -> None:
        self.relay.guard(lambda: self.relay.up_message(msg) if self.upstream else self.relay.down_message(msg))

    def on_heartbeat(self, msg: protocol.Heartbeat) -> None:
        self.relay.guard(lambda: self.relay.up_heartbeat_in(msg) if self.upstream else self.relay.down_heartbeat(msg))

    def finished(self) -> bool:
        return self.relay.finished()

    def describe(self) -> str:
        return f"{super().describe()}{' ' + self.relay.describe() if self.upstream else ''}"


class SimRelay:
    """The relay process of link ``ab`` (upstream ``up_bp``, downstream ``down_bp``)."""

    def __init__(self, world, up_bp, down_bp) -> None:
        self.w = world
        self.up_bp, self.down_bp = up_bp, down_bp
        self.up = RelaySide(self, UP_ID, up_bp, True)
        self.down = RelaySide(self, DOWN_ID, down_bp, False)
        self.sides = [self.up, self.down]
        # --- the journal (durable) ---
        self.jrows: dict[tuple[str, int], Row] = {}
        self.jcounters: dict[str, int] = {}
        self.unsynced: list[tuple[list, object]] = []  # writes not yet fsynced (only a plant leaves any)
        self._out_unsynced: set = set()  # rows whose message went out while their write was unsynced
        self.dead = False
        self.life = 0
        self.crash_at = ""
        self.forged: dict[str, int] = {}  # forged items' keys -> variant (fault forged_origin)
        self.seen = {"fenced": 0, "resubmits": 0}  # relayed results fenced upstream, dedup hits downstream (as confirmed)
        self._boot()

    def _boot(self) -> None:
        """The process starts: memory from the journal only (``LinkRunner.__init__``)."""
        self.rows: dict[tuple[str, int], Row] = {k: dataclasses.replace(r) for k, r in self.jrows.items()}
        self.capacity = 0
        self.workers = 0
        self.granted = 0
        self.received = 0
        self._credit_unseen: list[int] = []
        self._credit_seen = 0
        self.can_withdraw = False
        self.broken = ""
        self._req = 0
        self._sent: dict[tuple[str, int], float] = {}
        self._last_status = self.w.clock.t
        self._down_lost: float | None = self.w.clock.t
        self._cancel_down: set[str] = set()
        self._cancel_reqs: set[int] = set()

    def arm(self) -> None:
        life = self.life
        self.w.after(TICK_S, lambda: self._tick() if life == self.life else None)

    def describe(self) -> str:
        states: dict[str, int] = {}
        for r in self.rows.values():
            states[r.state] = states.get(r.state, 0) + 1
        return (f"relay(rows {states}, capacity {self.capacity}, granted {self.granted}, received {self.received}, "
                f"down lost since {self._down_lost}, broken {self.broken!r})")

    def finished(self) -> bool:
        return not self.dead and not self.jrows

    # --- the process: crash and restart ---
    def guard(self, fn) -> None:
        try:
            fn()
        except _Died:
            self.crash()

    def _point(self, name: str) -> None:
        if self.crash_at == name:
            self.crash_at = ""
            raise _Died()

    def crash(self) -> None:
        """The relay process dies (power loss): both sessions gone, memory gone, the journal as
        last fsynced (an unsynced write whose message already went out breaks the rule)."""
        if self.dead:
            return
        w = self.w
        w.note("relay", "crash")
        w.stats["relay_crashes"] += 1
        lost = {k for keys, _ in self.unsynced for k in keys} & self._out_unsynced
        if lost:
            w.fail("relay_sent_unjournaled", f"a relay crash lost the journal writes of {sorted(lost)[:3]} "
                                             f"({len(lost)} rows) whose messages had gone out")
        self.unsynced, self._out_unsynced = [], set()
        self.dead = True
        self.crash_at = ""
        self.life += 1
        for side in self.sides:
            if side.conn is not None:
                w.close_conn(side.conn)
                side.conn = None
            side.up = False
            side.down = True
            side.gen += 1
            side.life += 1
        w.after(w.rng.uniform(*RESTART_DELAY_S), self._restart)

    def _restart(self) -> None:
        self.dead = False
        self._boot()
        for side in self.sides:
            side.start()
        self.arm()

    # --- the journal (relayd/relay_journal.py: one fsynced transaction per write) ---
    def _write(self, keys: list, fn) -> None:
        """One journal transaction, durable before the caller sends the next message."""
        fn()

    def _sync(self) -> None:
        for _, fn in self.unsynced:
            fn()
        self.unsynced, self._out_unsynced = [], set()

    def _sent_now(self, keys) -> None:
        """Messages of these rows went out now (resend timers; the journal-before-send check)."""
        now = self.w.clock.t
        for k in keys:
            self._sent[k] = now
        if self.unsynced:
            self._out_unsynced.update(keys)

    def _bump(self, name: str, n: int = 1) -> None:
        if n:
            self.jcounters[name] = self.jcounters.get(name, 0) + n

    def _j_insert(self, tasks: list[protocol.Task]) -> None:
        rows = [_row(t) for t in tasks]

        def fn() -> None:
            for r in rows:
                self.jrows[r.key] = r
            self._bump("leased", len(rows))

        self._write([r.key for r in rows], fn)

    def _j_update(self, keys: list, counter: str = "", extra: str = "", **fields) -> None:
        """Rows' fields changed (``fields`` per key: a dict of field -> value, or one for all)."""
        def fn() -> None:
            n = 0
            for k in keys:
                r = self.jrows.get(k)
                if r is not None:
                    for f, v in (fields.get("per", {}).get(k) or fields.get("all", {})).items():
                        setattr(r, f, v)
                    n += 1
            self._bump(counter, n if counter else 0)
            if extra:
                self._bump(extra, n)

        self._write(list(keys), fn)

    def _j_end(self, keys: list, counter: str, extra: str = "") -> None:
        def fn() -> None:
            n = sum(1 for k in keys if self.jrows.pop(k, None) is not None)
            self._bump(counter, n)
            if extra:
                self._bump(extra, n)

        self._write(list(keys), fn)

    # --- helpers ---
    def _next_req(self) -> int:
        self._req += 1
        return self._req

    def _held(self) -> list[protocol.LeaseRef]:
        return [protocol.LeaseRef(r.up_item, r.token) for r in self.rows.values() if not r.lost]

    def _rows_of(self, up_item: str) -> list[Row]:
        return [r for r in self.rows.values() if r.up_item == up_item]

    # --- upstream session ---
    def up_hello(self) -> protocol.Hello:
        return protocol.Hello(role=protocol.Role.RELAY.value, credit=0, kinds=[KIND], leases=self._held(),
                              info={fed.RELAY_SIDE: fed.UPSTREAM, "link": LINK, fed.POLICY: "capacity"})

    def up_heartbeat(self) -> protocol.Heartbeat:
        return protocol.Heartbeat(leases=self._held(), busy=len(self.rows), healthy=not self.broken)

    def down_heartbeat_out(self) -> protocol.Heartbeat:
        return protocol.Heartbeat(healthy=not self.broken)

    def up_connect(self, welcome: protocol.Welcome) -> None:
        self.granted = self.received = self._credit_seen = 0
        self._credit_unseen = []
        self.can_withdraw = False
        released = {(r.item_id, r.token) for r in welcome.released}
        drop = [k for k in released if k in self.rows and self.rows[k].state == LEASED]
        if drop:
            self._j_end(drop, "ended_released", "released")
            for k in drop:
                self.rows.pop(k, None)
        lost = [k for k in released if k in self.rows]
        if lost:
            self._j_update(lost, "lost_leases", all={"lost": True})
            for k in lost:
                self.rows[k].lost = True
        self._resend(force=True)

    def up_message(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Dispatch):
            self._on_dispatch(msg.tasks)
        elif isinstance(msg, protocol.CompleteAck):
            for o in msg.outcomes:  # ground truth: the upstream confirmed this COMPLETE (any outcome)
                self.w.relay_confirmed.add((o.item_id, o.token))
                if o.outcome == protocol.Outcome.FENCED.value:
                    self.seen["fenced"] += 1
                if o.outcome in (protocol.Outcome.ACCEPTED.value, protocol.Outcome.DUPLICATE.value):
                    self.up_bp.confirm(o.item_id, 2)
            self._on_complete_ack(msg.outcomes)
        elif isinstance(msg, protocol.FailAck):
            keys = [(o.item_id, o.token) for o in msg.outcomes
                    if (o.item_id, o.token) in self.rows and self.rows[(o.item_id, o.token)].state == FAILING]
            self._j_end(keys, "ended_failed")
            for k in keys:
                self.rows.pop(k, None)
                self._sent.pop(k, None)

    def _on_dispatch(self, tasks: list[protocol.Task]) -> None:
        self.received += len(tasks)
        unsigned = [t for t in tasks if not t.origin or not t.origin_sig]
        if unsigned:
            self.w.fail("unsigned_dispatch", f"{self.up_bp.name} dispatched {unsigned[0].item_id} to the relay unsigned")
        new = [t for t in tasks if (t.item_id, t.token) not in self.rows]
        self._j_insert(new)
        for t in new:
            self.rows[(t.item_id, t.token)] = _row(t)
        self._point("relay.after_lease_journaled")
        if self.broken:
            self._fail([task_failure(t.item_id, t.token, protocol.FailReason.RELEASED, self.broken) for t in new], "released")
            return
        self._submit([self.rows[(t.item_id, t.token)] for t in new if self.rows[(t.item_id, t.token)].state == LEASED])

    def _on_complete_ack(self, outcomes: list[protocol.ItemOutcome]) -> None:
        mine = [o for o in outcomes if (o.item_id, o.token) in self.rows and self.rows[(o.item_id, o.token)].state == RESULTED]
        counter = {protocol.Outcome.ACCEPTED.value: "returned", protocol.Outcome.FENCED.value: "fenced",
                   protocol.Outcome.REJECTED.value: "proof_rejected"}
        for o in mine:
            self._j_update([(o.item_id, o.token)], counter.get(o.outcome, "duplicate"),
                           all={"state": RETURNED, "outcome": o.outcome})
            row = self.rows[(o.item_id, o.token)]
            row.state, row.outcome = RETURNED, o.outcome
        rejected = [o for o in mine if o.outcome == protocol.Outcome.REJECTED.value]
        if rejected:
            self.w.fail("proof_rejected", f"{self.up_bp.name} rejected the downstream's proof for {rejected[0].item_id}")
            return
        self._point("relay.after_complete_ack")
        self._ack({self.rows[(o.item_id, o.token)].down_item for o in mine})

    def _fail(self, failures: list[protocol.TaskFailure], counter: str) -> None:
        per = {(f.item_id, f.token): {"state": FAILING, "report": f} for f in failures
               if (f.item_id, f.token) in self.rows and self.rows[(f.item_id, f.token)].state in (LEASED, SUBMITTED)}
        self._j_update(list(per), counter, per=per)
        for f in failures:
            row = self.rows.get((f.item_id, f.token))
            if row is not None:
                row.state, row.report = FAILING, f
        self._send_up(failures, protocol.Fail)

    def _send_up(self, reports: list, cls: type) -> None:
        if not reports or not self.up.up:
            return
        for i in range(0, len(reports), BATCH):
            chunk = reports[i:i + BATCH]
            self.up.push(cls(chunk))
            self._sent_now([(r.item_id, r.token) for r in chunk])

    # --- downstream session ---
    def down_hello(self) -> protocol.Hello:
        return protocol.Hello(role=protocol.Role.RELAY.value, credit=RESULT_CREDIT, kinds=[KIND],
                              info={fed.RELAY_SIDE: fed.DOWNSTREAM, "link": LINK})

    def down_connect(self) -> None:
        self._down_lost = None
        if self._cancel_down:
            for i in range(0, len(self._cancel_down), BATCH):
                req = self._next_req()
                self._cancel_reqs.add(req)
                self.down.push(protocol.Cancel(req, sorted(self._cancel_down)[i:i + BATCH]))
        self._resend(force=True)

    def down_heartbeat(self, hb: protocol.Heartbeat) -> None:
        if self._down_lost is not None:
            return
        self.capacity = sum(v for k, v in hb.info.items() if k.startswith(fed.CAP_PREFIX) and isinstance(v, int)
                            and k[len(fed.CAP_PREFIX):] == KIND)
        self.workers = sum(v for k, v in hb.info.items() if k.startswith(fed.WORKERS_PREFIX) and isinstance(v, int)
                           and k[len(fed.WORKERS_PREFIX):] == KIND)
        self._grant()

    def up_heartbeat_in(self, hb: protocol.Heartbeat) -> None:
        credit, seen = hb.info.get(fed.CREDIT_INFO), hb.info.get(fed.CREDIT_MSGS_INFO)
        if isinstance(credit, int) and isinstance(seen, int) and 0 <= seen - self._credit_seen <= len(self._credit_unseen):
            del self._credit_unseen[:seen - self._credit_seen]
            self._credit_seen = seen
            self.granted = self.received + max(0, credit + sum(self._credit_unseen))
            self.can_withdraw = True
            self._grant()

    def _grant(self) -> None:
        """relay.py ``_grant`` (policy capacity): the credit the upstream may still dispatch on
        follows the downstream's free capacity less our items waiting; negative CREDIT withdraws."""
        if not self.up.up:
            return
        outstanding = max(0, self.granted - self.received)
        held = sum(1 for r in self.rows.values() if not r.lost)
        room = max(0, MAX_IN_FLIGHT - held)
        if self.broken or not self.down.up:
            want = 0
        else:
            waiting = sum(1 for r in self.rows.values() if r.state == LEASED)
            want = max(0, min(self.capacity - waiting, room))
        delta = want - outstanding
        if delta == 0 or (delta < 0 and not self.can_withdraw):
            return
        if self.up.push(protocol.Credit(delta)):
            self.granted += delta
            self._credit_unseen.append(delta)

    def down_message(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.SubmitAck):
            for r in msg.results:  # ground truth: what the downstream confirmed to the relay
                if r.key in self.forged:
                    if r.item_id:
                        self.w.fail("forged_origin_accepted", f"{self.down_bp.name} accepted {r.key} "
                                                              f"(forged origin, variant {self.forged[r.key]}) as {r.item_id}")
                        return
                    if r.error != fed.ORIGIN_REJECTED:
                        self.w.fail("forged_origin_accepted", f"{r.key} refused with {r.error}, not {fed.ORIGIN_REJECTED}")
                        return
                    self.w.stats["forged_refused"] += 1
                elif r.item_id:
                    self.down_bp.confirm(r.item_id, 1)
                    self.seen["resubmits"] += 1 if r.duplicate else 0
            self._on_submit_ack(msg.results)
        elif isinstance(msg, protocol.Result):
            self._on_result(msg.deliveries)
        elif isinstance(msg, protocol.AckOk):
            for item_id in msg.item_ids:
                self.down_bp.confirm(item_id, 3)
            self._on_ack_ok(set(msg.item_ids) | set(msg.unknown))
        elif isinstance(msg, protocol.StatusReply) and msg.req in self._cancel_reqs:
            self._cancel_reqs.discard(msg.req)
            self._on_cancelled(msg.items)
        elif isinstance(msg, protocol.StatusReply):
            self._on_status(msg.items)

    def _submit(self, rows: list[Row]) -> None:
        if not rows or not self.down.up:
            return
        for i in range(0, len(rows), BATCH):
            chunk = rows[i:i + BATCH]
            items = {r.up_item: submit_item(r.task) for r in chunk}  # one SubmitItem per upstream item
            self.down.push(protocol.Submit(self._next_req(), list(items.values())))
            self._sent_now([r.key for r in chunk])

    def _on_submit_ack(self, results: list[protocol.SubmitResult]) -> None:
        refused: list[protocol.TaskFailure] = []
        for res in results:
            up_item = res.key.rsplit(":", 1)[-1]
            rows = [r for r in self._rows_of(up_item) if r.state == LEASED]
            if not rows:
                continue
            if res.error:
                if res.error in RETRY_LATER:
                    continue
                if res.error == fed.ORIGIN_REJECTED:
                    self.w.fail("origin_refused", f"{self.down_bp.name} refused the genuine origin of {up_item}: {res.message}")
                    return
                # a genuine item is refused only for a defect here (every item fits, none has a deadline)
                self.w.fail("relayed_item_refused", f"{self.down_bp.name} refused {res.key}: {res.error} {res.message}")
                refused += [task_failure(r.up_item, r.token, protocol.FailReason.HANDLER_ERROR,
                                         f"downstream {res.error}: {res.message}"[:500]) for r in rows]
                continue
            keys = [r.key for r in rows]
            self._j_update(keys, "submitted", "dedup_hits" if res.duplicate else "", all={"state": SUBMITTED, "down_item": res.item_id})
            if not res.duplicate:
                self.capacity -= 1
            for r in rows:
                r.state, r.down_item = SUBMITTED, res.item_id
            if res.duplicate:
                self._reuse_result(up_item, res.item_id, rows)
        if refused:
            self._fail(refused, "refused")
        self._point("relay.after_submit_ack")

    def _reuse_result(self, up_item: str, down_item: str, rows: list[Row]) -> None:
        done = next((r.report for r in self._rows_of(up_item)
                     if r.state in (RESULTED, RETURNED) and isinstance(r.report, protocol.TaskResult)), None)
        if done is None:
            return
        reports = [(dataclasses.replace(done, token=r.token), down_item) for r in rows]
        per = {(rep.item_id, rep.token): {"state": RESULTED, "report": rep, "down_item": d} for rep, d in reports}
        self._j_update(list(per), "completed", per=per)
        for (rep, _), r in zip(reports, rows):
            r.state, r.report = RESULTED, rep
        self._send_up([rep for rep, _ in reports], protocol.Complete)

    def _on_result(self, deliveries: list[protocol.Delivery]) -> None:
        reports: list[tuple[protocol.TaskResult, str]] = []
        orphans: list[str] = []
        for d in deliveries:
            rows = [r for r in self._rows_of(d.key.rsplit(":", 1)[-1]) if r.state in (LEASED, SUBMITTED)]
            if not rows:
                if not any(r.down_item == d.item_id and r.state in (RESULTED, RETURNED) for r in self.rows.values()):
                    orphans.append(d.item_id)
                continue
            for r in rows:
                reports.append((protocol.TaskResult(r.up_item, r.token, d.result, d.handler, d.handler_version, 0.0,
                                                    d.proof, d.proof_sig), d.item_id))
        if reports:
            self.capacity += len({d for _, d in reports})
            per = {(rep.item_id, rep.token): {"state": RESULTED, "report": rep, "down_item": d} for rep, d in reports}
            self._j_update(list(per), "completed", per=per)
            for rep, down_item in reports:
                row = self.rows[(rep.item_id, rep.token)]
                row.state, row.report, row.down_item = RESULTED, rep, down_item
            self._point("relay.after_result_journaled")
            self._send_up([rep for rep, _ in reports], protocol.Complete)
            self._ack({d for _, d in reports})  # (nothing yet: ACK waits for the upstream's COMPLETE_ACK)
            self._grant()
        if orphans:
            self._bump("orphan_results", len(orphans))
            self.down.push(protocol.Ack(orphans))
        self.down.push(protocol.Credit(len(deliveries)))

    def _ack(self, down_items: set[str]) -> None:
        """ACK downstream the items whose every row the upstream has confirmed."""
        done = [d for d in down_items if d and all(r.state == RETURNED for r in self.rows.values() if r.down_item == d)]
        if not done or not self.down.up:
            return
        self.down.push(protocol.Ack(done))
        self._sent_now([r.key for r in self.rows.values() if r.down_item in done])

    def check_ack(self, down_items: list[str]) -> None:
        """ack-mode on-confirm: a downstream item is ACKed only once the upstream confirmed the
        COMPLETE of every row that carries its result (an orphan has none)."""
        ids = set(down_items)
        early = [r for r in self.rows.values() if r.down_item in ids and r.state == RESULTED
                 and r.key not in self.w.relay_confirmed]
        if early:
            self.w.fail("relay_acked_before_confirm", f"ACK of {early[0].down_item} downstream before the upstream "
                                                      f"confirmed the COMPLETE of {early[0].key}")

    def _on_ack_ok(self, down_items: set[str]) -> None:
        rows = [r for r in self.rows.values() if r.state == RETURNED and r.down_item in down_items]
        if not rows:
            return
        self._j_end([r.key for r in rows], "ended_acked")
        for r in rows:
            self.rows.pop(r.key, None)
            self._sent.pop(r.key, None)

    def _on_cancelled(self, items: list[protocol.ItemStatus]) -> None:
        cancelled = [st.item_id for st in items
                     if st.state == protocol.ItemState.DEAD.value and st.error == protocol.FailReason.CANCELLED.value]
        self._cancel_down.difference_update(st.item_id for st in items)
        self._bump("cancelled_down", len(cancelled))

    def _on_status(self, items: list[protocol.ItemStatus]) -> None:
        failures = status_failures(self.rows.values(), items)
        if failures:
            self._fail(failures, "failed_down")

    # --- periodic: resends, status polls, downstream outage ---
    def _resend(self, *, force: bool = False) -> None:
        now = self.w.clock.t
        due = [r for r in self.rows.values() if force or now - self._sent.get(r.key, -1e9) >= RESEND_S]
        self._submit([r for r in due if r.state == LEASED])
        self._send_up([r.report for r in due if r.state == RESULTED and r.report is not None], protocol.Complete)
        self._send_up([r.report for r in due if r.state == FAILING and r.report is not None], protocol.Fail)
        self._ack({r.down_item for r in due if r.state == RETURNED})

    def _poll_status(self) -> None:
        now = self.w.clock.t
        if now - self._last_status < STATUS_S or not self.down.up:
            return
        self._last_status = now
        ids = sorted({r.down_item for r in self.rows.values() if r.state == SUBMITTED and r.down_item})
        for i in range(0, len(ids), 512):
            self.down.push(protocol.Status(self._next_req(), ids[i:i + 512]))

    def _downstream_outage(self) -> None:
        if self.down.up:
            self._down_lost = None
            return
        now = self.w.clock.t
        if self._down_lost is None:
            self._down_lost = now
            self.capacity = 0
        if now - self._down_lost < RESEND_S * 2:
            return
        give_back = [r for r in self.rows.values() if r.state == LEASED and not r.lost]
        if give_back and self.up.up:
            self._fail([task_failure(r.up_item, r.token, protocol.FailReason.RELEASED, "downstream unreachable")
                        for r in give_back], "released")
        pinned = [r for r in self.rows.values() if r.state == SUBMITTED and not r.lost]
        if HOLD_MAX_S > 0 and pinned and now - self._down_lost >= HOLD_MAX_S and self.up.up:
            self._cancel_down.update(r.down_item for r in pinned if r.down_item)
            self._fail([task_failure(r.up_item, r.token, protocol.FailReason.RELEASED,
                                     f"downstream unreachable for {HOLD_MAX_S:g} s (downstream_hold_max_s)") for r in pinned],
                       "partition_released")

    def _tick(self) -> None:
        self._sync()  # (a no-op: every write is fsynced when made, unless a plant defers it to here)
        self.guard(self._tick_body)
        if not self.dead:
            self.arm()

    def _tick_body(self) -> None:
        self._downstream_outage()
        self._grant()
        self._resend()
        self._poll_status()

    # --- faults ---
    def strike(self, kind: str, target: int, a: float) -> None:
        """Fault ``relay_crash`` (now, or at one of relayd's crash points) or ``forged_origin``
        (the downstream side SUBMITs an item whose origin does not verify: a record signed by a
        rogue key, or a genuine record and signature with a field of the item changed)."""
        if self.dead:
            return
        if kind == "relay_crash":
            modes = ["now", *CRASH_POINTS]
            mode = modes[target % len(modes)]
            if mode == "now":
                self.crash()
            else:
                self.crash_at = mode
            return
        if not self.down.up:
            return
        n = len(self.forged)
        item_id = f"forged{n}"
        variant = target % 2
        genuine = next((r.task for r in self.rows.values() if r.task.origin), None)
        if variant == 1 and genuine is not None:
            real = submit_item(genuine)
            item = dataclasses.replace(real, key=fed.origin_key(self.up_bp.swarm, item_id), priority=real.priority + 1)
        else:
            variant = 0
            payload = blob(b"forged-%d" % n)
            rec = {"id": item_id, "kind": KIND, "params": {}, "deadline_ms": None, "priority": 0, "max_runtime_s": 0.0}
            record = fed.origin_record(self.up_bp.swarm, rec, payload, 8)
            rogue = Ed25519PrivateKey.from_private_bytes(random.Random(target).randbytes(32))
            item = protocol.SubmitItem(fed.origin_key(self.up_bp.swarm, item_id), KIND, payload, max_attempts=8,
                                       origin=record, origin_sig=rogue.sign(record))
        self.forged[item.key] = variant
        self.w.note("relay", "forged_origin", item.key, variant)
        self.down.push(protocol.Submit(self._next_req(), [item]))

    # --- the end ---
    def final_checks(self) -> None:
        """Every row ended (the journal is empty) and the link's books balance
        (``federation_report``: leased == in flight + ended_acked + ended_failed + ended_released)."""
        w = self.w
        up, down = self.up_bp.gap_totals, self.down_bp.gap_totals
        for window, where, need, what in ((gaps.F1_RELAY_LEASE_LOST, up, self.up_bp.relay_leases_expired, "relay leases expired"),
                                          (gaps.F2_RELAYED_RESULT_LATE, up, self.seen["fenced"], "relayed results fenced"),
                                          (gaps.F3_RELAYED_RESUBMIT, down, self.seen["resubmits"], "relayed resubmissions"),
                                          (gaps.F4_RELAYED_ITEM_REFUSED, down, w.stats["forged_refused"], "forged origins refused")):
            if where.get(window, 0) < need:
                w.fail("federation_gap_missing", f"{need} {what} confirmed to the relay, {where.get(window, 0)} {window} events")
                return
        c = self.jcounters
        ended = sum(c.get(k, 0) for k in ("ended_acked", "ended_failed", "ended_released"))
        if c.get("leased", 0) != len(self.jrows) + ended:
            self.w.fail("relay_books", f"leased {c.get('leased', 0)} != in flight {len(self.jrows)} + ended {ended}: {c}")
        elif self.jrows:
            self.w.fail("not_ended", f"relay rows left at the end: {list(self.jrows.values())[:2]}")
