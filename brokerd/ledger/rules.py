"""The state transitions of items: :class:`LedgerTxn`, the one write transaction of a
broker turn (docs/ledger.md, "Transitions and their rules").

Every state change runs inside a :class:`LedgerTxn`, which keeps the counters, the
per-state counts, the state indexes and the gap-register events in step with the
item records, so that the balance

    received == ready + leased + completed + acknowledged + dead + expired

holds at every commit. Times are wall-clock milliseconds (they must survive
restarts); the broker keeps its monotonic lease timers in memory. Which failure
retries, counts an attempt or dead-letters at once is the one failure policy
(:data:`ccsq.common.wire.policy.FAIL_POLICY`); retry delays are the one backoff
(:func:`ccsq.common.wire.backoff.backoff_delay_s`). Only the broker's actor opens one.
The background slices (deadline expiry, purges, samples) are in
:mod:`ccsq.brokerd.ledger.maintenance`.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from ccsq.brokerd import gaps
from ccsq.brokerd.ledger import schema
from ccsq.brokerd.ledger.schema import Item
from ccsq.brokerd.ledger.view import LedgerView
from ccsq.common.wire import protocol
from ccsq.common.wire.backoff import backoff_delay_s
from ccsq.common.wire.policy import FAIL_POLICY, fail_rule

if TYPE_CHECKING:
    from ccsq.brokerd.ledger.store import Ledger, Policy

S = protocol.ItemState
# the states as plain strings: an enum's ``.value`` is a property read, several per transition
_ACKNOWLEDGED = S.ACKNOWLEDGED.value
_COMPLETED = S.COMPLETED.value
_DEAD = S.DEAD.value
_EXPIRED = S.EXPIRED.value
_LEASED = S.LEASED.value
_READY = S.READY.value

#: The meta key of every flow counter, built once (a transition bumps one or two).
_COUNTER_KEYS: dict[str, bytes] = {name: schema.counter_key(name) for name in schema.COUNTERS}
_MOVED_PREFIXES = (schema.STATE, schema.KIND_STATE)  # meta keys a state move changes
_CACHED_STATES = frozenset({_READY, _LEASED, _COMPLETED})  # records kept between transactions (Ledger.cache_records)
_IN_FLIGHT_STATES = frozenset({_LEASED, _COMPLETED})  # ... those kept while the queue is deep (_keep_records)
_READY_KEY = schema.state_key(_READY)
_pack_item_state = schema.pack_item_state
#: A payload or result kept with its record in the ledger's record cache: a claim-check
#: reference, or inline bytes up to this size.
CACHED_BLOB_MAX_BYTES = 2048


#: Shortest wait before an item whose worker could not reach the claim store is ready again.
STORE_RETRY_MIN_MS = 1000
#: Commit history in meta (``h:`` + >Q txnid): at most one entry a second, kept an hour
#: (<= 3600 entries, ~100 KiB): how old a reader's snapshot is and what it pins.
HISTORY_INTERVAL_MS = 1000
HISTORY_KEEP_MS = 3600 * 1000

_REFUSE_MESSAGES = {
    "QUEUE_FULL": ("the broker's ledger is full (max_map_size_bytes, counting the room kept for the results of accepted items: "
                   "result_reserve_bytes): retry with backoff or spool"),
    "DISK_FULL": "the broker's disk is nearly full (min_free_disk_bytes): retry with backoff or spool",
}


def backoff_ms(attempt: int, policy: Policy, rng: random.Random) -> int:
    """Full-jitter exponential backoff for the retry after attempt ``attempt`` (1-based), in ms:
    :func:`ccsq.common.wire.backoff.backoff_delay_s` (the one backoff) with the ledger's seeded rng."""
    return int(backoff_delay_s(attempt - 1, policy.retry_backoff_base_s, policy.retry_backoff_max_s, rng) * 1000)


class LedgerTxn(LedgerView):
    """One write transaction. Every mutation of item state goes through here.

    Use :meth:`commit` or :meth:`abort` exactly once. Methods take ``now_ms``
    (wall clock, milliseconds) so tests can drive time.
    """

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger, write=True)
        # Meta integers: values read from LMDB, and this transaction's changes to them,
        # written once at commit (a key whose change nets 0 is not rewritten).
        self._nums: dict[bytes, int] = {}
        self._delta: dict[bytes, int] = {}
        # Per-state counts moved by transitions: (kind, old state, new state) -> items,
        # folded into ``_delta`` (four meta keys each) when read or at commit.
        self._moves: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        # Flow counters bumped here: name -> change, folded into ``_delta`` (``c:<name>``)
        # when one is read or at commit (a bump is one dict increment, not a key lookup).
        self._counts: defaultdict[str, int] = defaultdict(int)
        self.changed = False
        self.records = 0  # item records written (group-commit size, exported as a metric)
        # Records and payloads this transaction wrote, by item id: a lease right after its
        # SUBMIT, a delivery right after its COMPLETE (same turn) reads them from here,
        # not from LMDB. Gone with the transaction; purges evict (:meth:`forget`).
        self._recs: dict[str, Item] = {}
        self._payloads: dict[str, protocol.Blob] = {}
        self._results: dict[str, protocol.Blob] = {}
        # The head (record format 3: marker, length, packed fixed part) of records read or
        # written here: a rewrite packs only the state part.
        self._heads: dict[str, bytes] = {}
        self._forgotten: set[str] = set()  # ids purged here (they leave the ledger's record cache)
        self._ready_after = 0  # items ready once this transaction commits (read at commit, for the record cache)
        if ledger.replication is not None:  # a primary: record this turn's writes (replication.py)
            from ccsq.brokerd.ledger.replication import RecordingTxn

            self.txn = RecordingTxn(self.txn, ledger.db_names)  # type: ignore[assignment]  # LMDB's, recording
        db = self.db
        self._items_db, self._ready_db, self._leased_db = db["items"], db["ready"], db["leased"]
        self._completed_db, self._dead_db, self._acked_db = db["completed"], db["dead"], db["acked"]
        self._payloads_db, self._results_db, self._keys_db = db["payloads"], db["results"], db["keys"]
        self._keytime_db, self._deadline_db, self._events_db = db["keytime"], db["deadline"], db["events"]

    def __exit__(self, *exc: object) -> None:
        if self.txn is not None:
            self.abort()

    def commit(self) -> None:
        """Write the counters and commit (fsync). Raises MapFullError (txn aborted) on a full map.
        With replication on, a transaction that wrote anything is a turn: its position is
        its last write, and its write set goes to the ledger's replication log after the commit."""
        meta = self.db["meta"]
        ws = None
        rep = self.ledger.replication
        try:
            self._fold_moves()
            self._fold_counts()
            if self.ledger.record_cache_max:
                self._ready_after = self.num(_READY_KEY)
            put, nums = self.txn.put, self._nums
            for key, d in self._delta.items():
                if d:
                    put(key, schema.pack_num((nums[key] if key in nums else self._base(key)) + d), db=meta)
            if rep is not None and getattr(self.txn, "ops", None):
                ws = self._write_set(rep)
            self.txn.commit()
        except BaseException:
            self.txn.abort()
            self.txn = None  # type: ignore[assignment]  # ended: the object is not used again
            raise
        self.txn = None  # type: ignore[assignment]
        if ws is not None and rep is not None:
            rep.committed(ws)
        if self.ledger.record_cache_max:
            self._keep_records()

    def _write_set(self, rep: Any) -> Any:
        """Write this turn's replication position (its last write) and return its write set."""
        from ccsq.brokerd.ledger.replication import REPL_POS, WriteSet, pack_pos

        seq = rep.next_seq()
        self.txn.put(REPL_POS, pack_pos(rep.epoch, seq), db=self.db["meta"])
        return WriteSet(self.ledger.ledger_id, rep.epoch, seq, tuple(getattr(self.txn, "ops")))

    def _keep_records(self) -> None:
        """After commit: the records this transaction wrote go to the ledger's record cache
        while their item is not done (ready, leased, completed), and leave it otherwise."""
        cache, heads, payloads, results = self.ledger.record_cache, self._heads, self._payloads, self._results
        for item_id in self._forgotten:
            cache.pop(item_id, None)
        # A ready record is kept only while the queue is shallow (at most half the cache
        # ready): in a deeper queue it would be evicted before its lease comes (the leases
        # take the oldest), and on its way out it would push out the leased and completed
        # records that their COMPLETE, delivery and ACK read a few turns later (with
        # 100,000 queued most of those would miss the cache and be unpacked from LMDB).
        states = _CACHED_STATES if self._ready_after <= self.ledger.record_cache_ready_max else _IN_FLIGHT_STATES
        pop, get_payload, get_result, get_head = cache.pop, payloads.get, results.get, heads.get
        for item_id, rec in self._recs.items():
            was = pop(item_id, None)  # (mostly taken already by the transition: _rec)
            if rec["state"] in states:
                # payload and result never change once written: kept when small, from this
                # transaction or the entry before; re-inserted last (the oldest entries go first)
                payload = get_payload(item_id)
                if payload is None and was is not None:
                    payload = was[2]
                if payload is not None and payload.inline is not None and len(payload.inline) > CACHED_BLOB_MAX_BYTES:
                    payload = None
                result = get_result(item_id)
                if result is None and was is not None:
                    result = was[3]
                if result is not None and result.inline is not None and len(result.inline) > CACHED_BLOB_MAX_BYTES:
                    result = None
                cache[item_id] = (rec, get_head(item_id), payload, result)
        for _ in range(len(cache) - self.ledger.record_cache_max):
            cache.popitem(last=False)

    def abort(self) -> None:
        if self.txn is not None:
            self.txn.abort()
            self.txn = None  # type: ignore[assignment]

    # --- numbers ---
    def _base(self, key: bytes) -> int:
        """The meta integer ``key`` as this transaction found it (read once)."""
        v = self._nums.get(key)
        if v is None:
            v = self._nums[key] = super().num(key)
        return v

    def num(self, key: bytes) -> int:
        if self._moves and key[:2] in _MOVED_PREFIXES:
            self._fold_moves()
        if self._counts and key[:2] == schema.COUNTER:
            self._fold_counts()
        return self._base(key) + self._delta.get(key, 0)

    def _add(self, key: bytes, delta: int) -> None:
        d = self._delta
        d[key] = d.get(key, 0) + delta
        self.changed = True

    def bump(self, name: str, delta: int = 1) -> None:
        """Add ``delta`` to flow counter ``name`` (meta ``c:<name>``, written at commit)."""
        self._counts[name] += delta
        self.changed = True

    def _fold_counts(self) -> None:
        """Fold the counters bumped so far into ``_delta`` (their meta keys)."""
        d = self._delta
        for name, n in self._counts.items():
            key = _COUNTER_KEYS.get(name) or schema.counter_key(name)
            d[key] = d.get(key, 0) + n
        self._counts.clear()

    def _move(self, kind: str, old: str, new: str) -> None:
        """One item of ``kind`` went from state ``old`` ("" for a new item) to ``new``."""
        self._moves[(kind, old, new)] += 1
        self.changed = True

    def _fold_moves(self) -> None:
        """Fold the state moves into the per-state and per-kind-and-state counts."""
        d = self._delta
        for (kind, old, new), n in self._moves.items():
            for key, dn in ((schema.state_key(new), n), (schema.kind_state_key(kind, new), n)) + (
                    ((schema.state_key(old), -n), (schema.kind_state_key(kind, old), -n)) if old else ()):
                d[key] = d.get(key, 0) + dn
        self._moves.clear()

    def kind_states(self) -> dict[str, dict[str, int]]:
        """As :meth:`LedgerView.kind_states`, including this transaction's changes."""
        out = super().kind_states()
        self._fold_moves()
        for key in self._delta:
            if key.startswith(schema.KIND_STATE):
                kind, state = schema.parse_kind_state(key)
                per = out.setdefault(kind, {})
                n = self.num(key)
                if n:
                    per[state] = n
                else:
                    per.pop(state, None)
                if not per:
                    del out[kind]
        return out

    def next_num(self, key: bytes) -> int:
        """Increment the meta sequence ``key`` (``schema.NEXT_SEQ``..., or a gap window's count;
        not a counter or a per-state count) and return its new value."""
        v = self._nums.get(key)
        if v is None:
            v = self._base(key)
        d = self._delta
        n = d[key] = d.get(key, 0) + 1
        self.changed = True
        return v + n

    # --- bookkeeping beside the items: drains, kinds served, rejects, gap events, history ---
    def set_draining(self, worker: str, on: bool) -> None:
        """Record (``on``) or clear a drain of ``worker`` (see :meth:`LedgerView.draining`)."""
        key = schema.drain_key(worker)
        if on:
            self.txn.put(key, b"", db=self.db["meta"])
        else:
            self.txn.delete(key, db=self.db["meta"])
        self.changed = True

    def note_kinds_served(self, kinds: set[str], now_ms: int) -> None:
        """Record that a worker serving ``kinds`` said HELLO now (see :meth:`LedgerView.kinds_served`)."""
        for kind in kinds:
            self.txn.put(schema.served_key(kind), schema.pack_num(now_ms), db=self.db["meta"])
        self.changed = self.changed or bool(kinds)

    def note_hellos(self, hellos: dict[str, tuple[int, int]], now_ms: int) -> None:
        """Record the replay identity of the newest HELLO that opened a session of each peer:
        ``{peer id: (session, hello ts_ms)}`` (meta ``p:<peer id>``, overwritten; see
        :meth:`LedgerView.last_hellos`). Written in the turn that opened those sessions,
        before any lease side effect of theirs commits."""
        meta = self.db["meta"]
        for peer_id, (session, ts_ms) in hellos.items():
            self.txn.put(schema.last_hello_key(peer_id), schema.pack([session, ts_ms, now_ms]), db=meta)
        self.changed = self.changed or bool(hellos)

    def count_reject(self, code: str, n: int = 1) -> None:
        self._add(schema.reject_key(code), n)

    def event(self, window: str, item_id: str, now_ms: int, detail: str) -> None:
        """Append a gap-register event and bump the window's count."""
        n = self.next_num(schema.gap_key(window))
        ev = {"window": window, "item_id": item_id, "ts": now_ms / 1000.0, "detail": detail}
        self.txn.put(schema.event_key(window, n), schema.pack(ev), db=self._events_db)

    def restored_from_backup(self, now_ms: int) -> int:
        """The first write to a restored ``ccsq backup`` copy: every item not done in the
        copy (ready, leased, completed and not acknowledged) may have run, completed and
        been delivered after the copy was taken, so it may run (or be delivered) again:
        one G13 event each (the newest ``EVENTS_KEPT_PER_WINDOW`` written, the rest only
        counted). Returns how many items."""
        window = gaps.G13_RESTORED_FROM_BACKUP
        items = list(self.open_items())
        shown = items[-gaps.EVENTS_KEPT_PER_WINDOW:]
        self._add(schema.gap_key(window), len(items) - len(shown))
        for item_id, state in shown:
            self.event(window, item_id, now_ms, f"restored from a backup: {state} in the copy, so it may run or be "
                                                f"delivered again (the source broker may have finished it after the copy)")
        return len(items)

    def note_history(self, now_ms: int, live_pages: int) -> bool:
        """Record this commit in the commit history (``h:`` + >Q txnid -> [ts_ms,
        last_pgno, live_pages]) when the newest entry is :data:`HISTORY_INTERVAL_MS`
        old; entries older than :data:`HISTORY_KEEP_MS` go. A reader's snapshot age
        and the pages it pins are estimated from it
        (:func:`~ccsq.brokerd.ledger.maintenance.reader_report`). Entries above this
        transaction's id (a restored, compacted copy restarts the ids) are dropped
        first. True if written; call only in a transaction that commits."""
        meta = self.db["meta"]
        txnid = self.txn.id()
        cur = self.txn.cursor(db=meta)
        stale = []
        if cur.set_range(schema.history_key(txnid)):
            for k in cur.iternext(keys=True, values=False):
                if not k.startswith(schema.HISTORY):
                    break
                stale.append(k)
        for k in stale:
            self.txn.delete(k, db=meta)
        last = self.history_at_or_before(txnid)
        if last is not None and now_ms - last[1][0] < HISTORY_INTERVAL_MS:
            return False
        old: list[bytes] = []
        if cur.set_range(schema.HISTORY):
            for k, v in cur:
                if not k.startswith(schema.HISTORY) or len(old) >= 16 or schema.unpack(v)[0] >= now_ms - HISTORY_KEEP_MS:
                    break
                old.append(k)
        for k in old:
            self.txn.delete(k, db=meta)
        info = self.ledger.env.info()
        self.txn.put(schema.history_key(txnid), schema.pack([now_ms, info["last_pgno"], live_pages]), db=meta)
        self.changed = True
        return True

    # --- records and indexes ---
    def get(self, item_id: str) -> Item | None:
        """As :meth:`LedgerView.get`; a record this transaction wrote comes from memory (a
        copy: callers change the record they get, then write it)."""
        rec = self._recs.get(item_id)
        if rec is not None:
            return dict(rec)  # type: ignore[return-value]
        return self._load(item_id)

    def _load(self, item_id: str) -> Item | None:
        """The record of ``item_id`` from the ledger's record cache (a copy) or LMDB (its
        head kept for a rewrite)."""
        hit = self.ledger.record_cache.get(item_id)
        if hit is not None:
            if hit[1] is not None:
                self._heads[item_id] = hit[1]
            return dict(hit[0])  # type: ignore[return-value]
        return self._unpack(item_id)

    def _unpack(self, item_id: str) -> Item | None:
        """The record of ``item_id`` from LMDB (its head kept for a rewrite)."""
        raw = self.txn.get(item_id.encode(), db=self._items_db)
        if raw is None:
            return None
        rec, head = schema.unpack_item_parts(raw, item_id)
        if head is not None:
            self._heads[item_id] = head
        return rec

    def _rec(self, item_id: str) -> Item | None:
        """The record of ``item_id`` for a transition that writes it back (:meth:`_transition`):
        the one this transaction holds, not a copy; one in the ledger's record cache is
        taken out of it (this transaction owns it now: it goes back at commit, and an
        aborted transaction leaves it out, to be read from LMDB again)."""
        rec = self._recs.get(item_id)
        if rec is not None:
            return rec
        hit = self.ledger.record_cache.pop(item_id, None)
        if hit is None:
            return self._unpack(item_id)
        rec, head, payload, result = hit
        if head is not None:
            self._heads[item_id] = head
        if payload is not None:
            self._payloads[item_id] = payload
        if result is not None:
            self._results[item_id] = result
        return rec

    def record(self, item_id: str) -> Item | None:
        """The record of ``item_id`` to read only (not a copy when this transaction or the
        ledger's record cache holds it: do not change it)."""
        rec = self._recs.get(item_id)
        if rec is not None:
            return rec
        hit = self.ledger.record_cache.get(item_id)
        return hit[0] if hit is not None else self._unpack(item_id)

    def payload(self, item_id: str) -> protocol.Blob:
        blob = self._payloads.get(item_id)
        if blob is None:
            hit = self.ledger.record_cache.get(item_id)
            blob = hit[2] if hit is not None else None
        return blob if blob is not None else super().payload(item_id)

    def result(self, item_id: str) -> protocol.Blob | None:
        blob = self._results.get(item_id)
        if blob is None:
            hit = self.ledger.record_cache.get(item_id)
            blob = hit[3] if hit is not None else None
        return blob if blob is not None else super().result(item_id)

    def forget(self, item_id: str) -> None:
        """The item's record, payload and result were deleted in this transaction (purges)."""
        self._recs.pop(item_id, None)
        self._payloads.pop(item_id, None)
        self._results.pop(item_id, None)
        self._heads.pop(item_id, None)
        self._forgotten.add(item_id)

    def _put(self, rec: Item, iid: bytes, *, append: bool = False) -> None:
        """Write ``rec`` (format 3: its head packed once, the state part now). ``append``: a
        new record whose id is above every other (full pages, not half-split ones); out of
        order it falls back to a plain put."""
        item_id = rec["id"]
        head = self._heads.get(item_id)
        if head is None:  # a record of format 1 or 2 (or a new one): rewritten in format 3
            head = self._heads[item_id] = schema.pack_item_head(rec)
        packed = head + _pack_item_state(rec)
        put = self.txn.put
        if not (append and put(iid, packed, db=self._items_db, append=True)):
            put(iid, packed, db=self._items_db)
        self._recs[item_id] = rec
        self.changed = True
        self.records += 1

    def _index_remove(self, rec: Item, iid: bytes) -> None:
        st = rec["state"]
        if st == _READY:
            self.txn.delete(schema.ready_key(rec["kind"], rec["priority"], rec["nb_ms"], rec["seq"]), db=self._ready_db)
        elif st == _LEASED:
            self.txn.delete(iid, db=self._leased_db)
        elif st == _COMPLETED:
            self.txn.delete(schema.seq_key(rec["cseq"]), db=self._completed_db)
        elif st == _DEAD:
            self.txn.delete(iid, db=self._dead_db)
        elif st == _ACKNOWLEDGED:
            self.txn.delete(schema.timed_key(rec["acked_ms"], iid), db=self._acked_db)

    def _index_add(self, rec: Item, iid: bytes) -> None:
        st = rec["state"]
        if st == _READY:
            self.txn.put(schema.ready_key(rec["kind"], rec["priority"], rec["nb_ms"], rec["seq"]), iid, db=self._ready_db)
        elif st == _LEASED:
            self.txn.put(iid, schema.pack([rec["token"], rec["worker"]]), db=self._leased_db)
        elif st == _COMPLETED:
            self.txn.put(schema.seq_key(rec["cseq"]), iid, db=self._completed_db)
        elif st == _DEAD:
            self.txn.put(iid, b"", db=self._dead_db)
        elif st == _ACKNOWLEDGED:
            self.txn.put(schema.timed_key(rec["acked_ms"], iid), b"", db=self._acked_db)

    def _transition(self, rec: Item, new_state: str, **updates: Any) -> None:
        """Move ``rec`` to ``new_state`` applying ``updates``; keeps indexes and counts in step."""
        old = rec["state"]
        iid = rec["id"].encode()
        self._index_remove(rec, iid)
        rec.update(updates)  # type: ignore[typeddict-item]  # updates: Item keys, by the callers' keywords
        rec["state"] = new_state
        self._index_add(rec, iid)
        if old != new_state:
            self._move(rec["kind"], old, new_state)
        self._put(rec, iid)

    def _max_attempts(self, rec: Item) -> int:
        return rec["max_attempts"] or self.ledger.policy.max_attempts

    def _deadline_passed(self, rec: Item, now_ms: int) -> bool:
        deadline_ms = rec.get("deadline_ms")
        return deadline_ms is not None and deadline_ms <= now_ms

    def expire(self, rec: Item, now_ms: int, why: str) -> None:
        """Move ``rec`` (ready or leased) to ``expired``: its deadline passed (G6)."""
        self._transition(rec, _EXPIRED, error="deadline", ended_ms=now_ms)
        self.bump("expired")
        self.event(gaps.G6_DEADLINE_EXPIRED, rec["id"], now_ms, why)

    def _dead(self, rec: Item, now_ms: int, reason: str, message: str) -> None:
        self._transition(rec, _DEAD, error=reason, error_message=message[:500], ended_ms=now_ms)
        self.bump("dead")
        self.event(gaps.G7_DEAD_LETTERED, rec["id"], now_ms, f"{reason} after attempt {rec['attempt']}: {message[:200]}")

    def _requeue(self, rec: Item, now_ms: int, *, min_delay_ms: int = 0, backoff_attempt: int | None = None) -> None:
        """Ready again after the backoff of ``backoff_attempt`` (default: the item's
        attempt), at least ``min_delay_ms`` from now."""
        attempt = rec["attempt"] if backoff_attempt is None else backoff_attempt
        nb = now_ms + max(min_delay_ms, backoff_ms(attempt, self.ledger.policy, self.ledger.rng))
        self._transition(rec, _READY, nb_ms=nb, lease_expires_ms=0)

    # --- SUBMIT ---
    def submit(self, item: protocol.SubmitItem, now_ms: int, *, refuse: str = "", origin: dict | None = None,
               reply_to: str = "") -> protocol.SubmitResult:
        """Create one item (or answer a duplicate). ``refuse`` is an error code
        (QUEUE_FULL/DISK_FULL) to answer for new items without writing them.
        ``origin``/``reply_to``: a relayed item's verified origin ({swarm, item_id, hops})
        and the relay its result goes back to (common/wire/federation.py). A relayed item
        whose key names an item already purged here (acknowledged, past ``retention_s``) is
        created anew: its upstream leased it again (the first result was fenced there) and
        no result is left here to hand back (G5)."""
        policy = self.ledger.policy
        why = protocol.submit_item_problem(item)
        if why:
            return protocol.SubmitResult(item.key, "", error="MALFORMED", message=why)
        kb = schema.key_index(item.key)
        found = self.key_entry(item.key, kb)
        window_ms = int(policy.dedup_window_s * 1000)
        stale_key = None
        if found is not None and self._key_of(found[0]) not in (None, item.key):
            found = None  # (a digest collision: another key's item; 2^-128 per pair of keys)
        if found is not None:
            item_id, created_ms, _entry = found
            purged = origin is not None and self.record(item_id) is None
            if now_ms - created_ms <= window_ms and not purged:
                self.bump("duplicate_submits")
                self.event(gaps.G9_SUBMIT_RETRIED, item_id, now_ms, f"key {item.key[:80]!r}")
                return schema.trusted_submit_result(item.key, item_id, True, "", "")
            stale_key = (item_id, "purged" if purged else "window passed")
        if refuse:
            return protocol.SubmitResult(item.key, "", error=refuse, message=_REFUSE_MESSAGES.get(refuse, refuse))
        if policy.max_ready_items and self.state_count(_READY) >= policy.max_ready_items:
            return protocol.SubmitResult(
                item.key, "", error="QUEUE_FULL", message=f"{policy.max_ready_items} items ready (max_ready_items)"
            )
        if item.deadline_ts is not None and item.deadline_ts * 1000 <= now_ms:
            return protocol.SubmitResult(item.key, "", error="DEADLINE_EXCEEDED", message="deadline_ts is already past")
        seq = self.next_num(schema.NEXT_SEQ)
        item_id = f"{self.ledger.id_prefix}{seq:012x}"
        deadline_ms = int(item.deadline_ts * 1000) if item.deadline_ts is not None else None
        rec: Item = {
            "id": item_id,
            "key": item.key,
            "kind": item.kind,
            "params": item.params,
            "priority": item.priority,
            "deadline_ms": deadline_ms,
            "max_attempts": item.max_attempts,
            "max_runtime_s": item.max_runtime_s,
            "state": _READY,
            "attempt": 0,
            "token": 0,
            "worker": "",
            "nb_ms": now_ms,
            "seq": seq,
            "created_ms": now_ms,
            "error": "",
        }
        if origin:
            rec["origin"], rec["reply_to"] = origin, reply_to
        iid = item_id.encode()
        txn = self.txn
        put = txn.put
        payloads = self._payloads_db
        blob = schema.pack_blob(item.payload, compress=True)
        # ids only grow: append (full pages, not half-split ones); out of order it falls back
        put(iid, blob, db=payloads, append=True) or put(iid, blob, db=payloads)
        self._put(rec, iid, append=True)
        self._payloads[item_id] = item.payload
        put(schema.ready_key(item.kind, item.priority, now_ms, seq), iid, db=self._ready_db)  # (_index_add)
        self._moves[(item.kind, "", _READY)] += 1
        self._counts["received"] += 1
        put(kb, schema.pack([item_id, now_ms]), db=self._keys_db)
        put(schema.timed_key(now_ms, kb), b"", db=self._keytime_db)
        if deadline_ms is not None:
            put(schema.timed_key(deadline_ms, iid), b"", db=self._deadline_db)
        if stale_key is not None:
            self.event(
                gaps.G5_DEDUP_WINDOW_PASSED, item_id, now_ms, f"key {item.key[:80]!r} was item {stale_key[0]} ({stale_key[1]})"
            )
        return schema.trusted_submit_result(item.key, item_id, False, "", "")

    # --- LEASE ---
    def lease(self, item_id: str, worker: str, now_ms: int, lease_ttl_ms: int) -> protocol.Task | None:
        """Lease a ready item to ``worker`` with a fresh fencing token; None if it is
        not ready (or its deadline passed: then it is expired here)."""
        rec = self._rec(item_id)
        if rec is None or rec["state"] != _READY:
            return None
        if self._deadline_passed(rec, now_ms):
            self.expire(rec, now_ms, "deadline passed while ready")
            return None
        token = self.next_num(schema.NEXT_TOKEN)
        fence = self.ledger.fencing_epoch
        more: dict[str, Any] = {}
        if fence:  # a replicated primary: the election epoch in the high bits (docs/ha.md, fencing tokens)
            token = schema.fencing_token(fence, token)
            before = schema.token_epoch(rec["token"])
            if 0 < before < fence and before < rec.get("completed_epoch", fence):
                # leased by an earlier primary, whose RESULT of it may have left before a standby had the
                # COMPLETE: this item's next delivery counts as a redelivery (G3, docs/ha.md)
                more["completed_epoch"] = before
        rec.pop("token_worker", None)  # an older record's holder of the previous token: ``worker`` says it now
        # ready -> leased, as _transition does it (the same writes, in the same order), unrolled: the hot path
        iid = item_id.encode()
        txn = self.txn
        txn.delete(schema.ready_key(rec["kind"], rec["priority"], rec["nb_ms"], rec["seq"]), db=self._ready_db)
        rec["attempt"] += 1
        rec["token"], rec["worker"], rec["lease_expires_ms"] = token, worker, now_ms + lease_ttl_ms
        if more:
            rec.update(more)  # type: ignore[typeddict-item]  # completed_epoch
        rec["state"] = _LEASED
        txn.put(iid, schema.pack([token, worker]), db=self._leased_db)
        self._moves[(rec["kind"], _READY, _LEASED)] += 1
        self._put(rec, iid)
        self._counts["routed"] += 1
        deadline_ms = rec["deadline_ms"]
        return schema.trusted_task(item_id, token, rec["kind"], self.payload(item_id), rec["params"], rec["attempt"],
                                   rec["max_runtime_s"], deadline_ms / 1000.0 if deadline_ms is not None else None, b"", b"")

    def release(self, item_id: str, token: int, now_ms: int) -> bool:
        """Give a lease back without counting the attempt (never sent, or the worker
        released it). True if it was leased with ``token``."""
        rec = self._rec(item_id)
        if rec is None or rec["state"] != _LEASED or rec["token"] != token:
            return False
        self._transition(rec, _READY, attempt=max(rec["attempt"] - 1, 0), nb_ms=now_ms, lease_expires_ms=0)
        self.bump("released")
        return True

    def expire_lease(self, item_id: str, token: int, now_ms: int, why: str = "lease expired") -> str:
        """A lease ran out: requeue with backoff, or dead-letter (worker_lost) after
        max attempts, or expire past the deadline. Returns the new state, or "" if
        the lease was not current (nothing done)."""
        rec = self._rec(item_id)
        if rec is None or rec["state"] != _LEASED or rec["token"] != token:
            return ""
        worker = rec["worker"]
        if FAIL_POLICY[protocol.FailReason.WORKER_LOST].dead_letters_at_once or rec["attempt"] >= self._max_attempts(rec):
            self._dead(rec, now_ms, protocol.FailReason.WORKER_LOST.value, f"{why} on {worker}")
            return _DEAD
        if self._deadline_passed(rec, now_ms):
            self.expire(rec, now_ms, f"{why} on {worker} after the deadline")
            return _EXPIRED
        self._requeue(rec, now_ms)
        self.bump("retried")
        self.event(gaps.G2_LEASE_EXPIRED, item_id, now_ms, f"{why}: token {token} on {worker}, attempt {rec['attempt']}")
        return _READY

    # --- COMPLETE / FAIL ---
    def complete(self, res: protocol.TaskResult, now_ms: int, sender: str = "") -> str:
        """Record a result. Returns an :class:`Outcome` value.

        Rule for late results: accepted if the item is leased with this token,
        or if its lease with this token expired and nobody leased it since
        (state ready, same token: the same work, G8 event). A replay of an
        accepted result is ``duplicate``; any other token is ``fenced`` (G4).
        ``sender``: the reporting peer; a token is honoured only from the worker
        it was leased to (another peer quoting it is ``fenced``, G4)."""
        rec = self._rec(res.item_id)
        if rec is None:
            return protocol.Outcome.UNKNOWN.value
        st = rec["state"]
        if st in (_COMPLETED, _ACKNOWLEDGED) and rec.get("completed_token") == res.token:
            return protocol.Outcome.DUPLICATE.value
        late = st == _READY and rec["token"] == res.token and res.token != 0
        if ((st == _LEASED and rec["token"] == res.token) or late) and not self._not_holder(rec, sender):
            iid = res.item_id.encode()
            txn = self.txn
            txn.put(iid, schema.pack_blob(res.result), db=self._results_db)
            self._results[res.item_id] = res.result
            cseq = self.next_num(schema.NEXT_CSEQ)
            epoch = self.epoch()
            # leased (or ready, late) -> completed, as _transition does it (the same writes, in the same order)
            if st == _LEASED:
                txn.delete(iid, db=self._leased_db)
            else:
                txn.delete(schema.ready_key(rec["kind"], rec["priority"], rec["nb_ms"], rec["seq"]), db=self._ready_db)
            rec["cseq"] = cseq
            rec["completed_token"] = res.token
            rec["completed_ms"] = now_ms
            # the oldest primary that may have delivered this result (a replicated pair: a lease an
            # earlier primary granted, which released RESULT at its commit; docs/ha.md): older than
            # the current epoch -> the next delivery is a redelivery (G3, brokerd/delivery.py)
            rec["completed_epoch"] = min(epoch, schema.token_epoch(res.token) or epoch, rec.get("completed_epoch") or epoch)
            rec["handler"] = res.handler
            rec["handler_version"] = res.handler_version
            rec["runtime_s"] = res.runtime_s
            rec["worker_done"] = schema.token_holder(rec) or sender
            rec["lease_expires_ms"] = 0
            rec["state"] = _COMPLETED
            txn.put(schema.seq_key(cseq), iid, db=self._completed_db)
            self._moves[(rec["kind"], st, _COMPLETED)] += 1
            self._put(rec, iid)
            self._counts["completed"] += 1
            if late:
                self.bump("late_results_accepted")
                self.event(gaps.G8_LATE_RESULT_ACCEPTED, res.item_id, now_ms, f"token {res.token} after its lease expired")
            return protocol.Outcome.ACCEPTED.value
        self.bump("fenced_completions")
        self.event(
            gaps.G4_FENCED_COMPLETION,
            res.item_id,
            now_ms,
            f"token {res.token} was leased to {schema.token_holder(rec)}, reported by {sender}; result discarded"
            if rec["token"] == res.token else f"token {res.token} is stale (item {st}, token {rec['token']}); result discarded",
        )
        return protocol.Outcome.FENCED.value

    def _key_of(self, item_id: str) -> str | None:
        """The idempotency key of ``item_id``'s record, or None when it was purged."""
        rec = self.record(item_id)
        return None if rec is None else rec["key"]

    @staticmethod
    def _not_holder(rec: Item, sender: str) -> bool:
        """True when ``sender`` is known and is not the worker the item's current token was leased to."""
        holder = schema.token_holder(rec)
        return bool(sender and holder and sender != holder)

    def fail(self, f: protocol.TaskFailure, now_ms: int, sender: str = "") -> str:
        """Record a failure report. Returns an :class:`Outcome` value.

        The reason's rule comes from the one failure policy (:data:`ccsq.common.wire.policy.FAIL_POLICY`;
        the wire's ``retryable`` only for a reason this version does not know).
        ``released``: back to ready now, attempt not counted. ``store_unavailable``:
        ready after a backoff, attempt not counted. Retryable: ready after backoff
        unless attempts are exhausted (dead) or the deadline passed (expired).
        Dead-lettered at once (fatal, payload_missing): dead with ``reason``."""
        rec = self._rec(f.item_id)
        if rec is None:
            return protocol.Outcome.UNKNOWN.value
        if rec["state"] != _LEASED or rec["token"] != f.token or self._not_holder(rec, sender):
            if rec.get("fail_token") == f.token and not self._not_holder(rec, sender):
                return protocol.Outcome.DUPLICATE.value
            self.bump("fenced_failures")
            return protocol.Outcome.FENCED.value
        rec["fail_token"] = f.token
        rule = fail_rule(f.reason, f.retryable)
        if f.reason == protocol.FailReason.RELEASED.value:
            attempt = rec["attempt"] if rule.counts_attempt else max(rec["attempt"] - 1, 0)
            self._transition(
                rec, _READY, attempt=attempt, nb_ms=now_ms, lease_expires_ms=0
            )
            self.bump("released")
            return protocol.Outcome.ACCEPTED.value
        if f.reason == protocol.FailReason.STORE_UNAVAILABLE.value:
            return self._store_unavailable(rec, now_ms, f.message)
        self.bump("failed")
        reason = f.reason or protocol.FailReason.HANDLER_ERROR.value
        if rule.dead_letters_at_once:
            self._dead(rec, now_ms, reason, f.message)
        elif rec["attempt"] >= self._max_attempts(rec):
            self._dead(rec, now_ms, reason, f.message)
        elif self._deadline_passed(rec, now_ms):
            self.expire(rec, now_ms, f"failed ({reason}) after the deadline")
        else:
            rec["error"] = reason
            self._requeue(rec, now_ms)
            self.bump("retried")
        return protocol.Outcome.ACCEPTED.value

    def _store_unavailable(self, rec: Item, now_ms: int, message: str) -> str:
        """The worker could not reach the claim store: not the item's fault, so the
        attempt is not counted (no dead letter however long the outage lasts); the
        item is ready again after a backoff of at least :data:`STORE_RETRY_MIN_MS`, or
        expires if its deadline passed."""
        self.bump("failed")
        if not FAIL_POLICY[protocol.FailReason.STORE_UNAVAILABLE].counts_attempt:
            rec["attempt"] = max(rec["attempt"] - 1, 0)
        if self._deadline_passed(rec, now_ms):
            self.expire(rec, now_ms, f"claim store unavailable after the deadline: {message[:200]}")
            return protocol.Outcome.ACCEPTED.value
        rec["error"] = protocol.FailReason.STORE_UNAVAILABLE.value
        self._requeue(rec, now_ms, min_delay_ms=STORE_RETRY_MIN_MS, backoff_attempt=rec["attempt"] + 1)
        self.bump("retried")
        return protocol.Outcome.ACCEPTED.value

    # --- ACK ---
    def ack(self, item_id: str, now_ms: int, quarantine_error: str = "") -> bool | None:
        """Mark a completed item acknowledged. True: done now; False: it was already
        acknowledged (idempotent); None: unknown / not completed.

        ``quarantine_error``: the completion service stored the result in its
        quarantine table, not its results table (counter ``quarantined``, gap G12)."""
        rec = self._rec(item_id)
        if rec is None:
            return None
        if rec["state"] == _ACKNOWLEDGED:
            return False
        if rec["state"] != _COMPLETED:
            return None
        if quarantine_error:
            self._transition(rec, _ACKNOWLEDGED, acked_ms=now_ms, quarantined=quarantine_error[:500])
            self.bump("quarantined")
            self.event(gaps.G12_RESULT_QUARANTINED, item_id, now_ms, quarantine_error[:200])
        else:  # completed -> acknowledged, as _transition does it (the same writes, in the same order)
            iid = item_id.encode()
            txn = self.txn
            txn.delete(schema.seq_key(rec["cseq"]), db=self._completed_db)
            rec["acked_ms"] = now_ms
            rec["state"] = _ACKNOWLEDGED
            txn.put(schema.timed_key(now_ms, iid), b"", db=self._acked_db)
            self._moves[(rec["kind"], _COMPLETED, _ACKNOWLEDGED)] += 1
            self._put(rec, iid)
        self._counts["acknowledged"] += 1
        self.changed = True
        return True

    def note_redelivery(self, item_id: str, now_ms: int, why: str) -> None:
        self.bump("redelivered")
        self.event(gaps.G3_RESULT_REDELIVERED, item_id, now_ms, why)

    # --- dead letters ---
    def dead_letter(self, item_id: str, token: int, reason: str, message: str, now_ms: int) -> bool:
        """Dead-letter a leased item (e.g. it can never be dispatched). False if not leased with ``token``."""
        rec = self._rec(item_id)
        if rec is None or rec["state"] != _LEASED or rec["token"] != token:
            return False
        self._dead(rec, now_ms, reason, message)
        return True

    def replay_dead(self, item_id: str, now_ms: int, who: str = "operator") -> bool:
        """Make a dead item ready again with its attempt count reset (a fresh attempt
        budget) and a G10 event. False if not dead."""
        rec = self._rec(item_id)
        if rec is None or rec["state"] != _DEAD:
            return False
        was = f"{rec.get('error', '')} after attempt {rec['attempt']}"
        self._transition(rec, _READY, attempt=0, nb_ms=now_ms, error="")
        self.bump("replayed")
        self.event(gaps.G10_DEAD_LETTER_REPLAYED, item_id, now_ms, f"replayed by {who} (was dead: {was})")
        return True

    def dead_letter_ready(self, item_id: str, reason: str, message: str, now_ms: int) -> bool:
        """Dead-letter a *ready* item (operator or reconcile: e.g. ``payload_missing``).
        False if it is not ready (a leased item's worker reports the failure itself)."""
        rec = self._rec(item_id)
        if rec is None or rec["state"] != _READY:
            return False
        self._dead(rec, now_ms, reason, message)
        return True

    def purge_dead(self, item_id: str, now_ms: int, who: str = "operator") -> bool:
        """Delete a dead item's record, payload and idempotency key (a resubmit then
        makes a new item) with a G11 event. Like purged acknowledged items, it stays
        counted in state ``dead`` so the balance holds. False if not dead."""
        rec = self._rec(item_id)
        if rec is None or rec["state"] != _DEAD:
            return False
        iid = item_id.encode()
        self.txn.delete(iid, db=self.db["dead"])
        for name in ("items", "payloads", "results"):
            self.txn.delete(iid, db=self.db[name])
        self.forget(item_id)
        found = self.key_entry(rec["key"])
        if found is not None and found[0] == item_id:
            self.txn.delete(found[2], db=self.db["keys"])
        self.bump("dead_purged")
        self.event(gaps.G11_DEAD_LETTER_PURGED, item_id, now_ms, f"purged by {who} (dead: {rec.get('error', '')})")
        return True

    # --- accounting samples (a bounded ring in meta) ---
