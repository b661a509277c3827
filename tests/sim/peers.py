"""Simulated peers that follow the protocol as the real ones do (docs/simulation.md says
where each rule comes from): a :class:`Producer` (``producer/``: SUBMIT re-sent on a timer
and on every new session, dedup by idempotency key, an outbox that outlives a crash), a
:class:`Worker` (``workerd/``: a journal of held leases and finished reports that outlives a
crash, HELLO listing them, credit granted back per report, reports re-sent until
confirmed, a job started before a crash never re-run), a :class:`Completion`
(``completiond/``: results landed idempotently by item id in a durable database, then ACK,
then credit). Every frame is built and read with the real envelope codec (signed HELLO
and WELCOME, session MACs after), so the broker's intake sees what it sees in production.

Common link rules (``common/link/peer.py`` ``BrokerLink``): HELLO on a new socket with a
new session; no WELCOME within ``HELLO_TIMEOUT_S`` -> reconnect; the broker silent for
heartbeat x liveness -> reconnect; an invalid envelope from the broker, or an ERROR
saying the session is gone -> reconnect (with the one backoff); idle peers heartbeat.
"""

from __future__ import annotations

import hashlib

from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.errors import DecodeError
from tests.sim.world import RESTART_DELAY_S

HELLO_TIMEOUT_S = 3.0
RECONNECT_S = (0.05, 0.5)
SESSION_GONE = {protocol.REJECT_NO_SESSION, protocol.ERROR_REPLACED, protocol.REJECT_REPLAY, protocol.REJECT_STALE,
                protocol.REJECT_BAD_SIGNATURE, protocol.REJECT_FORGED_ORIGIN}
KIND = "echo"
#: every URGENT_EVERY-th item is submitted with a higher priority (a mixed workload): an expired
#: urgent item goes back to the head of the ready queue, ahead of never-leased ones
URGENT_EVERY, URGENT_PRIORITY = 10, 5


def payload_of(n: int) -> bytes:
    return b"item-%d" % n


def result_of(payload: bytes) -> bytes:
    return b"done:" + payload


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


class Peer:
    role: protocol.Role

    def __init__(self, world, peer_id: str, bp=None) -> None:
        self.w = world
        self.bp = bp or world.brokers[0]  # the broker process (tests/sim/world.py BrokerProcess) this peer talks to
        self.id = peer_id
        self.gen = 0  # bumped at every crash and reconnect: callbacks of an older session do nothing
        self.life = 0  # bumped at every crash
        self.conn = None
        self.up = False
        self.down = False  # crashed, not yet restarted
        self.skew_ms = 0
        self.partitioned_until = 0.0
        self.crash_at_welcome = False  # fault flap_then_die: the process dies as its next WELCOME arrives
        self.last_recv = 0.0
        self.hb_s = world.cfg.heartbeat_interval_s
        self.liveness = world.cfg.liveness
        self.codec = world.codec_for(peer_id, self.wall_ms)

    def wall_ms(self) -> int:
        return self.w.clock.true_wall_ms() + self.skew_ms

    def later(self, dt: float, fn) -> None:
        """``fn`` after ``dt`` unless the session ended (a reconnect) or the process died first."""
        gen = self.gen
        self.w.after(dt, lambda: fn() if gen == self.gen else None)

    def in_process(self, dt: float, fn) -> None:
        """``fn`` after ``dt`` unless the process died first (work outlives a reconnect)."""
        life = self.life
        self.w.after(dt, lambda: fn() if life == self.life else None)

    # --- the link ---
    def start(self) -> None:
        self.down = False
        self.connect()

    def connect(self) -> None:
        if self.conn is not None:
            self.w.close_conn(self.conn)
        self.gen += 1
        self.up = False
        self.codec.new_session()
        self.conn = self.w.new_conn(self)
        self.send(self.hello())
        self.later(HELLO_TIMEOUT_S, self._hello_timeout)

    def _hello_timeout(self) -> None:
        if not self.up:
            self.reconnect("no WELCOME")

    def reconnect(self, why: str) -> None:
        self.w.note(self.id, "reconnect", why)
        if self.conn is not None:
            self.w.close_conn(self.conn)
            self.conn = None
        self.up = False
        self.gen += 1
        self.on_link_lost()
        self.later(self.w.rng.uniform(*RECONNECT_S), self.connect)

    def send(self, msg: protocol.Message) -> None:
        if self.conn is None:
            return
        self.w.net_up(self.conn, self.codec.encode(msg))

    def receive(self, conn, frames: list[bytes], gen: int) -> None:
        if gen != self.gen or conn is not self.conn or self.down:
            return
        try:
            env = self.codec.decode(frames, bound_sender=self.bp.peer_id)
        except DecodeError as exc:
            self.reconnect(f"invalid envelope from broker: {exc.code}")
            return
        self.last_recv = self.w.clock.t
        msg = env.message
        if isinstance(msg, protocol.Welcome):
            if self.up:
                return
            if self.crash_at_welcome:
                self.crash_at_welcome = False
                self.crash()
                return
            self.up = True
            self.hb_s, self.liveness = msg.heartbeat_interval_s, msg.liveness
            self.on_welcome(msg)
            self.later(self.hb_s, self._tick)
        elif isinstance(msg, protocol.Error):
            if msg.code in SESSION_GONE:
                self.reconnect(f"broker said {msg.code}")
        elif isinstance(msg, protocol.Bye):
            self.reconnect("bye")
        elif isinstance(msg, protocol.Heartbeat):
            if self.up:
                self.on_heartbeat(msg)
        elif self.up:
            self.on_message(msg)

    def _tick(self) -> None:
        if not self.up:
            return
        if self.w.clock.t - self.last_recv > self.hb_s * self.liveness:
            self.reconnect("broker silent")
            return
        self.send(self.heartbeat())
        self.on_tick()
        self.later(self.hb_s, self._tick)

    def crash(self) -> None:
        """The process dies: memory gone (subclasses keep only what is durable), socket closed."""
        self.w.note(self.id, "crash")
        self.w.stats["peer_crashes"] += 1
        if self.conn is not None:
            self.w.close_conn(self.conn)
            self.conn = None
        self.up = False
        self.down = True
        self.gen += 1
        self.life += 1
        self.on_crash()
        self.w.after(self.w.rng.uniform(*RESTART_DELAY_S), self.start)

    def describe(self) -> str:
        conn = self.conn
        return (f"{self.id}({'up' if self.up else 'down' if self.down else 'connecting'}, last heard {self.last_recv:.1f}, "
                f"conn {conn.rid[-4:].decode() if conn else '-'}{' broken' if conn is not None and conn.broken else ''}, "
                f"skew {self.skew_ms} ms)")

    # --- for subclasses ---
    def hello(self) -> protocol.Hello:
        raise NotImplementedError

    def heartbeat(self) -> protocol.Heartbeat:
        return protocol.Heartbeat()

    def on_welcome(self, msg: protocol.Welcome) -> None:
        pass

    def on_message(self, msg: protocol.Message) -> None:
        pass

    def on_tick(self) -> None:
        pass

    def on_heartbeat(self, msg: protocol.Heartbeat) -> None:
        pass

    def on_link_lost(self) -> None:
        pass

    def on_crash(self) -> None:
        pass

    def finished(self) -> bool:
        return True


class Producer(Peer):
    """Submits its items in frames of up to ``BATCH``, at most ``WINDOW`` frames unconfirmed,
    while the swarm holds fewer than ``world.max_open`` items not yet landed (an application
    pacing itself). Unconfirmed items are re-sent on a timer and on every new session (the
    broker's dedup by key makes that safe); a crash keeps the outbox (what is unconfirmed).
    Items refused with QUEUE_FULL / DISK_FULL are retried after the producer library's
    backoff (``producer/client.py``: full jitter from 0.2 s doubling per refusal, capped at
    ``reconnect_backoff_max_s``, 5 s), nothing sent meanwhile (the submit call waits)."""

    role = protocol.Role.PRODUCER
    BATCH = 64
    WINDOW = 4
    RESEND_S = 3.0
    REFUSED_BASE_S, REFUSED_CAP_S = 0.2, 5.0  # producer/client.py: _RETRY_BASE_S x 4, reconnect_backoff_max_s

    def __init__(self, world, peer_id: str, numbers: range) -> None:
        super().__init__(world, peer_id)
        self.todo = list(reversed(numbers))  # the outbox: items not yet sent (popped from the end)
        self.inflight: dict[int, tuple[float, list[int]]] = {}  # req -> (sent at, item numbers)
        self.retry: list[int] = []  # refused (QUEUE_FULL / DISK_FULL) or unconfirmed at a session end
        self.req = 0
        self.accepted = 0
        self.total = len(numbers)
        self.refusals = 0  # refusals in a row (the backoff's attempt)
        self.retry_at = 0.0  # refused items wait until then
        self.pump_due = False  # a pump is scheduled (paced by max_open or the refusal backoff)
        self._built: dict[int, protocol.SubmitItem] = {}  # items sent and not yet confirmed

    def hello(self) -> protocol.Hello:
        return protocol.Hello(role=self.role.value)

    def on_welcome(self, msg: protocol.Welcome) -> None:
        self.pump()

    def on_link_lost(self) -> None:
        for _, nums in self.inflight.values():
            self.retry.extend(nums)
        self.inflight.clear()
        self.pump_due = False  # (the scheduled pump belonged to the session)

    def on_crash(self) -> None:
        self.on_link_lost()

    def finished(self) -> bool:
        return self.accepted >= self.total

    def _pump_later(self, dt: float) -> None:
        if not self.pump_due:
            self.pump_due = True
            self.later(dt, self._pumped)

    def _pumped(self) -> None:
        self.pump_due = False
        self.pump()

    def pump(self) -> None:
        if not self.up:
            return
        w = self.w
        if self.retry and w.clock.t < self.retry_at:
            self._pump_later(self.retry_at - w.clock.t)
            return
        while len(self.inflight) < self.WINDOW and (self.retry or self.todo):
            if w.open_items() >= w.max_open and not self.retry:
                self._pump_later(0.05)
                return
            nums = []
            while len(nums) < self.BATCH and self.retry:
                nums.append(self.retry.pop())
            while len(nums) < self.BATCH and self.todo:
                nums.append(self.todo.pop())
            self._send(nums)

    def _item(self, n: int) -> protocol.SubmitItem:
        """Item ``n`` as the application built it once (its payload's digest computed once; the
        same object for every re-send until it is confirmed)."""
        item = self._built.get(n)
        if item is None:
            item = self._built[n] = protocol.SubmitItem(f"k{n}", KIND, blob(payload_of(n)),
                                                 priority=URGENT_PRIORITY if n % URGENT_EVERY == 0 else 0)
        return item

    def _send(self, nums: list[int]) -> None:
        self.req += 1
        items = [self._item(n) for n in nums]
        self.inflight[self.req] = (self.w.clock.t, nums)
        self.send(protocol.Submit(self.req, items))

    def on_tick(self) -> None:
        now = self.w.clock.t
        for req, (t, nums) in list(self.inflight.items()):
            if now - t > self.RESEND_S:
                del self.inflight[req]
                self._send(nums)
        self.pump()

    def on_message(self, msg: protocol.Message) -> None:
        if not isinstance(msg, protocol.SubmitAck):
            return
        sent = self.inflight.pop(msg.req, None)
        if sent is None:
            return
        w = self.w
        refused = False
        for n, r in zip(sent[1], msg.results):
            if r.item_id:
                known = self.bp.key_item.get(r.key)
                if known is None:
                    self.bp.key_item[r.key] = r.item_id
                    self.accepted += 1
                    self._built.pop(n, None)
                elif known != r.item_id:
                    w.fail("dedup", f"key {r.key} confirmed as {known} and then as {r.item_id}")
                self.bp.confirm(r.item_id, 1)
            elif r.error in ("QUEUE_FULL", "DISK_FULL"):
                self.retry.append(n)
                refused = True
            else:
                w.fail("submit_refused", f"{r.key}: {r.error} {r.message}")
        if refused:
            self.retry_at = w.clock.t + backoff_delay_s(self.refusals, self.REFUSED_BASE_S, self.REFUSED_CAP_S, w.rng)
            self.refusals += 1
        elif msg.results:
            self.refusals = 0
        self.pump()


class Worker(Peer):
    """A GPU worker with ``slots`` and a credit ``window``. The journal (durable, like
    workerd's fsynced SQLite) holds (item id, token) -> [state, task, report]; state is
    ``held`` (not started), ``started``, or ``done`` (report journaled, not confirmed).
    A job of an item the broker leased again (a new token) keeps running: its report
    goes out with its own token and the broker fences it (workerd keys jobs by lease)."""

    role = protocol.Role.WORKER
    RUN_S = (0.005, 0.05)
    GROUP_COMMIT_S = 0.004  # reports journaled in one commit go out together (workerd's GroupCommit)
    FAIL_RATE = 0.05
    FATAL_RATE = 0.002

    def __init__(self, world, peer_id: str, *, slots: int, window: int, bp=None) -> None:
        super().__init__(world, peer_id, bp)
        self.slots, self.window = slots, window
        self.journal: dict[tuple[str, int], list] = {}
        self.queue: list[tuple[str, int]] = []
        self.running = 0
        self.unsent: list[tuple[str, int]] = []  # reports journaled, not yet sent in this session
        self.granted = 0  # credit the broker holds for this session (HELLO's, less tasks dispatched, plus CREDITs)
        self.flush_due = False
        self.held = 0  # journal rows not yet reported (held or started): workerd's jobs, what its credit counts
        self.lost: list[tuple[str, int]] = []  # jobs that were running when the process died: HELLO info "lost"
        self.crash_at_dispatch = False  # fault flap_then_die: the process dies once it started its next DISPATCH's jobs

    def _listed(self) -> list[protocol.LeaseRef]:
        return [protocol.LeaseRef(i, tok) for i, tok in self.journal]

    def describe(self) -> str:
        return (f"{super().describe()} journal {len(self.journal)} running {self.running} queued {len(self.queue)} "
                f"granted {self.granted}")

    def hello(self) -> protocol.Hello:
        # workerd: credit = capacity - jobs held (a finished report waiting for its confirmation holds
        # no credit); the leases listed are the jobs and the unconfirmed reports; the jobs that died
        # running are named in info "lost" (the broker expires those, counting the attempt, and
        # releases the other unlisted leases uncounted: they never ran here)
        self.granted = max(0, self.window - self.held)
        return protocol.Hello(role=self.role.value, slots=self.slots, credit=self.granted, kinds=[KIND], leases=self._listed(),
                       info={protocol.LOST_INFO: protocol.lost_info(self.lost)})

    def heartbeat(self) -> protocol.Heartbeat:
        return protocol.Heartbeat(leases=self._listed(), busy=self.running)

    def on_crash(self) -> None:
        # memory is gone; the journal stays (workerd/worker.py, "Restart"). A job that had started
        # is not re-run: its row is dropped, the job named lost in the next HELLO. A job held and
        # never started is given back: a FAIL released (re-leased at once, no attempt counted),
        # journaled as its report, listed and sent like any other report.
        for key, e in list(self.journal.items()):
            if e[0] == "started":
                del self.journal[key]
                self.lost.append(key)  # named in the next HELLO, forgotten once WELCOMEd
            elif e[0] == "held":
                e[0], e[2] = "done", protocol.TaskFailure(key[0], key[1], protocol.FailReason.RELEASED.value, True, "given back at restart")
        self.held = 0
        self.queue = []
        self.running = 0
        self.unsent = []
        self.flush_due = False

    def on_link_lost(self) -> None:
        self.unsent = []

    def on_welcome(self, msg: protocol.Welcome) -> None:
        self.lost = []
        for ref in msg.released:  # the broker does not know the lease: a job not reported yet is dropped
            key = (ref.item_id, ref.token)
            e = self.journal.get(key)
            if e is not None and e[0] != "done":
                del self.journal[key]
                self.held -= 1
        self.queue = [k for k in self.queue if k in self.journal]
        queued = set(self.queue)
        for key, e in self.journal.items():
            if e[0] == "held" and key not in queued:
                self.queue.append(key)
        self.unsent = [k for k, e in self.journal.items() if e[0] == "done"]  # re-sent on every new session
        self._flush()
        self._start_jobs()

    def on_message(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Dispatch):
            for t in msg.tasks:
                key = (t.item_id, t.token)
                if key in self.journal:
                    continue
                self.journal[key] = ["held", t, None]  # journaled (fsync) before anything else
                self.held += 1
                self.queue.append(key)
            self.granted -= len(msg.tasks)
            self._start_jobs()
            if self.crash_at_dispatch and self.running:
                self.crash_at_dispatch = False
                self.crash()  # its jobs were running: HELLO names them lost
        elif isinstance(msg, (protocol.CompleteAck, protocol.FailAck)):
            completed = isinstance(msg, protocol.CompleteAck)
            for o in msg.outcomes:
                key = (o.item_id, o.token)
                e = self.journal.get(key)
                if e is not None and e[0] == "done":
                    del self.journal[key]  # confirmed (whatever the outcome): forgotten
                    self._flush_soon()
                if completed and o.outcome in (protocol.Outcome.ACCEPTED.value, protocol.Outcome.DUPLICATE.value):
                    self.bp.confirm(o.item_id, 2)

    def _start_jobs(self) -> None:
        w = self.w
        while self.running < self.slots and self.queue:
            key = self.queue.pop(0)
            e = self.journal.get(key)
            if e is None or e[0] != "held":
                continue
            e[0] = "started"
            self.running += 1
            self.bp.ran(key[0], key[1])
            self.in_process(w.rng.uniform(*self.RUN_S), lambda k=key: self._finish(k))

    def _finish(self, key: tuple[str, int]) -> None:
        self.running -= 1
        e = self.journal.get(key)
        if e is not None and e[0] == "started":
            item_id, token = key
            t: protocol.Task = e[1]
            r = self.w.rng.random()
            if r < self.FATAL_RATE:
                e[2] = protocol.TaskFailure(item_id, token, protocol.FailReason.FATAL.value, False, "planted fatal")
            elif r < self.FAIL_RATE:
                e[2] = protocol.TaskFailure(item_id, token, protocol.FailReason.HANDLER_ERROR.value, True, "flaky")
            else:
                e[2] = protocol.TaskResult(item_id, token, blob(result_of(t.payload.inline)), "echo", "1", 0.01)
            e[0] = "done"  # the report is journaled (fsync) before it is sent
            self.held -= 1
            self.unsent.append(key)
        self._flush_soon()
        self._start_jobs()

    def _flush_soon(self) -> None:
        if not self.flush_due:
            self.flush_due = True
            self.in_process(self.GROUP_COMMIT_S, self._flush)

    def _flush(self) -> None:
        """One COMPLETE and one FAIL for what finished since the last flush, then one CREDIT."""
        self.flush_due = False
        if not self.up:
            return
        results, failures = [], []
        for key in self.unsent:
            e = self.journal.get(key)
            if e is None or e[0] != "done":
                continue
            (results if isinstance(e[2], protocol.TaskResult) else failures).append(e[2])
        self.unsent = []
        for i in range(0, len(results), 64):
            self.send(protocol.Complete(results[i:i + 64]))
        for i in range(0, len(failures), 64):
            self.send(protocol.Fail(failures[i:i + 64]))
        missing = self.window - self.held - self.granted  # (workerd's Credit rule: grant back what is missing)
        if missing > 0:
            self.send(protocol.Credit(missing))
            self.granted += missing

    def on_tick(self) -> None:
        # reports not yet confirmed are re-sent every 2 heartbeats (the broker is idempotent)
        self.ticks = getattr(self, "ticks", 0) + 1
        if self.ticks % 2 == 0:
            self.unsent = [k for k, e in self.journal.items() if e[0] == "done"]
            if self.unsent:
                self._flush()


class Completion(Peer):
    """Lands results in the results database (idempotent by item id: a redelivery is a no-op
    upsert), then ACKs them, then grants the credit back."""

    role = protocol.Role.COMPLETION
    LAND_S = 0.003  # deliveries that arrive within this long land in one database transaction

    def __init__(self, world, peer_id: str, *, credit: int, bp=None) -> None:
        super().__init__(world, peer_id, bp)
        self.credit = credit
        self.batch: list[str] = []

    def on_link_lost(self) -> None:
        self.batch = []

    def on_crash(self) -> None:
        self.batch = []

    def hello(self) -> protocol.Hello:
        return protocol.Hello(role=self.role.value, credit=self.credit)

    def on_message(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Result):
            if not self.batch:
                self.later(self.LAND_S, self._land)
            self.batch.extend(msg.deliveries)
        elif isinstance(msg, protocol.AckOk):
            for item_id in msg.item_ids:
                self.bp.confirm(item_id, 3)

    def _land(self) -> None:
        """One database transaction for the batch (results upserted by item id), then ACK, then credit."""
        w, bp = self.w, self.bp
        batch, self.batch = self.batch, []
        if batch:
            ids = []
            for d in batch:
                if not d.key.startswith("k"):  # a relayed item's result goes to its relay, never here (docs/federation.md)
                    w.fail("relayed_result_landed", f"{bp.name}: {d.item_id} ({d.key}) delivered to completion {self.id}")
                    return
                n = int(d.key[1:])
                known = bp.key_item.get(d.key)
                if known is not None and known != d.item_id:
                    w.fail("dedup", f"a result for {d.item_id} of key {d.key}, which was confirmed as {known}")
                if not d.redelivery:  # only the first delivery the broker sends may be unmarked (G3)
                    if d.item_id in bp.first_delivered:
                        w.fail("redelivery_unmarked", f"{d.item_id} delivered twice without redelivery=true (G3)")
                    bp.first_delivered.add(d.item_id)
                if d.result.inline != result_of(payload_of(n)):
                    w.fail("wrong_result", f"{d.item_id}: {d.result.inline[:40]!r}")
                if d.item_id not in bp.results_db:
                    bp.results_db[d.item_id] = d.result.inline
                    bp.done_items += 1
                bp.landed[d.item_id] = bp.landed.get(d.item_id, 0) + 1
                ids.append(d.item_id)
            self.send(protocol.Ack(ids))
            self.send(protocol.Credit(len(ids)))
