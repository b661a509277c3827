"""Read queries on one ledger snapshot: :class:`LedgerView` (docs/ledger.md).

A view is one LMDB read transaction (use it as a context manager and keep it short:
an old snapshot pins pages, see docs/ledger.md, "Readers and disk use"). It is also
the base of the write transaction :class:`~ccsq.brokerd.ledger.rules.LedgerTxn`,
whose reads see its own changes. Keys and values come from
:mod:`ccsq.brokerd.ledger.schema`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ccsq.brokerd import gaps
from ccsq.brokerd.ledger import schema
from ccsq.brokerd.ledger.schema import Item
from ccsq.brokerd.ledger.store import LedgerError
from ccsq.common.wire import protocol

if TYPE_CHECKING:
    from ccsq.brokerd.ledger.store import Ledger

S = protocol.ItemState


class LedgerView:
    """Read-only queries on a snapshot; also the base of :class:`LedgerTxn`."""

    def __init__(self, ledger: Ledger, *, write: bool = False) -> None:
        self.ledger = ledger
        self.db = ledger.db
        self.txn = ledger._begin(write)  # noqa: SLF001 - the ledger's own transaction factory

    def __enter__(self) -> LedgerView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.txn.abort()

    # --- numbers in meta ---
    def num(self, key: bytes) -> int:
        """A meta integer (:func:`~ccsq.brokerd.ledger.schema.pack_num`); 0 when absent."""
        return schema.unpack_num(self.txn.get(key, db=self.db["meta"]))

    def _meta_scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """``(name after prefix, value)`` of every meta key under ``prefix``, in key order."""
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(prefix):
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                yield k[len(prefix):], v

    def counter(self, name: str) -> int:
        return self.num(schema.counter_key(name))

    def draining(self) -> list[str]:
        """Worker ids an operator drained (``ccsq drain``; meta ``d:<worker>``), sorted.
        Kept in the ledger so a drain survives a broker restart."""
        return [name.decode() for name, _ in self._meta_scan(schema.DRAIN)]

    def kinds_served(self, since_ms: int) -> set[str]:
        """Kinds a worker served (HELLO) at or after ``since_ms`` (meta ``w:<kind>`` ->
        ``>q`` ms of its last HELLO; ``""`` = a worker that takes every kind). Read at
        broker start, so the unserved-kind hint needs no grace period after a restart."""
        return {kind.decode() for kind, v in self._meta_scan(schema.SERVED) if schema.unpack_num(v) >= since_ms}

    def last_hellos(self) -> dict[str, tuple[int, int]]:
        """``{peer id: (session, hello ts_ms)}``: the newest HELLO that opened a session of
        each peer (meta ``p:<peer id>``, one entry per peer id that ever had a session).
        Loaded at broker start into the replay guard (``EnvelopeCodec.restore_hellos``), so
        that a HELLO accepted before the restart, or one signed earlier, is refused (REPLAY)."""
        out = {}
        for peer, v in self._meta_scan(schema.LAST_HELLO):
            session, ts_ms = schema.unpack(v)[:2]
            out[peer.decode()] = (int(session), int(ts_ms))
        return out

    def state_count(self, state: str) -> int:
        return self.num(schema.state_key(state))

    def counters(self) -> dict[str, int]:
        return {name: self.counter(name) for name in schema.COUNTERS}

    def states(self) -> dict[str, int]:
        return {s: self.state_count(s) for s in schema.STATES}

    def balanced(self) -> bool:
        return self.counter("received") == sum(self.states().values())

    def epoch(self) -> int:
        return self.num(schema.EPOCH)

    def gap_counts(self) -> dict[str, int]:
        return {w.id: self.num(schema.gap_key(w.id)) for w in gaps.WINDOWS}

    def rejects(self) -> dict[str, int]:
        """{reason: frames rejected} (meta ``r:<reason>``)."""
        return {code.decode(): schema.unpack_num(v) for code, v in self._meta_scan(schema.REJECT)}

    def kind_states(self) -> dict[str, dict[str, int]]:
        """{kind: {state: count}} (acknowledged counts keep purged items)."""
        out: dict[str, dict[str, int]] = {}
        for name, v in self._meta_scan(schema.KIND_STATE):
            kind, state = schema.parse_kind_state(schema.KIND_STATE + name)
            n = schema.unpack_num(v)
            if n:
                out.setdefault(kind, {})[state] = n
        return out

    def sample(self, n: int) -> dict | None:
        """Accounting sample number ``n`` (1-based), if still in the ring."""
        raw = self.txn.get(schema.sample_key(n), db=self.db["meta"])
        return schema.unpack(raw) if raw is not None else None

    def samples(self) -> list[dict]:
        """Every accounting sample in the ring, oldest first:
        ``{ts_ms, counters: {name: n}, states: {state: n}, kinds: {kind: {state: n}}}``."""
        out = [schema.unpack(v) for _, v in self._meta_scan(schema.SAMPLE)]
        out.sort(key=lambda d: d["ts_ms"])
        return out

    def nearest_deadlines(self, scan_limit: int = 10_000) -> dict[str, int]:
        """{kind: earliest deadline_ms} among ready and leased items, from the deadline
        index (at most ``scan_limit`` entries looked at, earliest first)."""
        out: dict[str, int] = {}
        for i, (k, _) in enumerate(self.txn.cursor(db=self.db["deadline"])):
            if i >= scan_limit:
                break
            deadline_ms, iid = schema.parse_timed(k)
            rec = self.get(iid.decode())
            if rec is not None and rec["state"] in (S.READY.value, S.LEASED.value):
                out.setdefault(rec["kind"], deadline_ms)
        return out

    def recent_events(self, window: str, limit: int) -> list[dict]:
        """The newest ``limit`` events of ``window``, newest first."""
        prefix = schema.event_prefix(window)
        cur = self.txn.cursor(db=self.db["events"])
        out: list[dict] = []
        if not cur.set_range(prefix + b"\xff" * 8):
            if not cur.last():
                return out
        else:
            if not cur.prev():
                return out
        while len(out) < limit:
            k = cur.key()
            if not k.startswith(prefix):
                break
            out.append(schema.unpack(cur.value()))
            if not cur.prev():
                break
        return out

    # --- idempotency keys ---
    def key_entry(self, key: str, digest: bytes | None = None) -> tuple[str, int, bytes] | None:
        """``(item_id, created_ms, entry)`` of idempotency key ``key`` in ``keys`` (``entry``:
        its key there: :func:`~ccsq.brokerd.ledger.schema.key_index`, or the raw UTF-8 key
        an older version wrote, looked up only while the ledger holds such entries), or None.
        ``digest``: ``key_index(key)`` when the caller has it already."""
        db = self.db["keys"]
        entry = schema.key_index(key) if digest is None else digest
        raw = self.txn.get(entry, db=db)
        if raw is None and self.ledger.legacy_keys:
            entry = key.encode()
            raw = self.txn.get(entry, db=db)
        if raw is None:
            return None
        item_id, created_ms = schema.unpack(raw)
        return item_id, created_ms, entry

    # --- items ---
    def get(self, item_id: str) -> Item | None:
        raw = self.txn.get(item_id.encode(), db=self.db["items"])
        return schema.unpack_item(raw, item_id) if raw is not None else None

    def payload(self, item_id: str) -> protocol.Blob:
        return schema.unpack_blob(self.txn.get(item_id.encode(), db=self.db["payloads"]))  # type: ignore[arg-type]  # written with the item

    def result(self, item_id: str) -> protocol.Blob | None:
        raw = self.txn.get(item_id.encode(), db=self.db["results"])
        return schema.unpack_blob(raw) if raw is not None else None

    def item_status(self, item_id: str) -> protocol.ItemStatus:
        rec = self.get(item_id)
        if rec is None:
            return protocol.ItemStatus(item_id, "unknown")
        result = self.result(item_id) if rec["state"] in (S.COMPLETED.value, S.ACKNOWLEDGED.value) else None
        return protocol.ItemStatus(item_id, rec["state"], rec["attempt"], rec["kind"], rec.get("error", ""), result)

    def blob_refs(self) -> Iterator[tuple[str, str, str]]:
        """``(item_id, state, sha256)`` of every claim-store reference the ledger holds:
        payloads and results stored by reference (inline blobs are not in the store)."""
        items = self.db["items"]
        for name in ("payloads", "results"):
            for k, v in self.txn.cursor(db=self.db[name]):
                sha = schema.blob_ref(v)
                if sha is None:
                    continue
                raw = self.txn.get(k, db=items)
                state = schema.item_state(raw) if raw is not None else "unknown"
                yield k.decode(), state, sha

    def leased_items(self) -> Iterator[tuple[str, int, str]]:
        """(item_id, token, worker) of every leased item (restart recovery)."""
        for k, v in self.txn.cursor(db=self.db["leased"]):
            token, worker = schema.unpack(v)
            yield k.decode(), token, worker

    def open_items(self) -> Iterator[tuple[str, str]]:
        """(item_id, state) of every item not done: ready, leased, completed and not
        acknowledged (from the state indexes)."""
        for _, v in self.txn.cursor(db=self.db["ready"]):
            yield v.decode(), S.READY.value
        for k, _ in self.txn.cursor(db=self.db["leased"]):
            yield k.decode(), S.LEASED.value
        for _, v in self.txn.cursor(db=self.db["completed"]):
            yield v.decode(), S.COMPLETED.value

    def dead_listed(self) -> int:
        """Dead items still listed (not purged); O(1) from the index's entry count.
        State ``dead`` also counts purged ones, so the balance holds."""
        return self.txn.stat(self.db["dead"])["entries"]

    def dead_items(self, limit: int) -> list[Item]:
        out = []
        for k, _ in self.txn.cursor(db=self.db["dead"]):
            rec = self.get(k.decode())
            if rec is not None:
                out.append(rec)
            if len(out) >= limit:
                break
        return out

    def ready_kinds(self) -> list[str]:
        """Kinds that have at least one ready item (skips from prefix to prefix)."""
        kinds = []
        cur = self.txn.cursor(db=self.db["ready"])
        ok = cur.first()
        while ok:
            kind = cur.key().split(b"\0", 1)[0]
            kinds.append(kind.decode())
            ok = cur.set_range(kind + b"\x01")
        return kinds

    def ready_ids(self, kind: str, limit: int) -> list[str]:
        """Up to ``limit`` ids of ready items of ``kind``, backing-off ones included, in
        dispatch order (``ccsq items cancel --kind``)."""
        out: list[str] = []
        prefix = schema.ready_prefix(kind)
        cur = self.txn.cursor(db=self.db["ready"])
        ok = cur.set_range(prefix)
        while ok and len(out) < limit and cur.key().startswith(prefix):
            out.append(cur.value().decode())
            ok = cur.next()
        return out

    def oldest_ready_created_ms(self) -> int | None:
        """Creation time of the oldest ready item (heads of each kind/priority bucket)."""
        best: int | None = None
        cur = self.txn.cursor(db=self.db["ready"])
        ok = cur.first()
        while ok:
            k = cur.key()
            kind, _, rest = k.partition(b"\0")
            pk, _nb, _seq = schema.parse_ready(rest)
            rec = self.get(cur.value().decode())
            if rec is not None:
                best = rec["created_ms"] if best is None else min(best, rec["created_ms"])
            if pk == schema.LAST_PRIO_KEY:
                ok = cur.set_range(kind + b"\x01")
            else:
                ok = cur.set_range(schema.ready_bucket_after(kind + b"\0", pk))
        return best

    def completed_ids(self, skip: Callable[[str], bool], limit: int, start_cseq: int = 0) -> tuple[list[str], int]:
        """Up to ``limit`` completed item ids, oldest completion first, except ``skip``ped
        ones, scanning the completed index from completion seq ``start_cseq`` on.

        Returns ``(ids, next_cseq)``: every entry in ``[start_cseq, next_cseq)`` was
        either skipped or returned, so a caller that delivers the returned ids (and
        still skips the skipped ones) may start its next scan at ``next_cseq``
        instead of rescanning in-flight deliveries from the start."""
        out: list[str] = []
        next_cseq = start_cseq
        cur = self.txn.cursor(db=self.db["completed"])
        if not cur.set_range(schema.seq_key(start_cseq)):
            return out, next_cseq
        k = None
        for k, v in cur:
            item_id = v.decode()
            if skip(item_id):
                continue
            out.append(item_id)
            if len(out) >= limit:
                break
        if k is not None:  # the last entry looked at
            next_cseq = schema.parse_seq(k) + 1
        return out, next_cseq

    def delivery(self, item_id: str, redelivery: bool, rec: Item | None = None) -> protocol.Delivery:
        """The RESULT record of completed ``item_id``; ``rec``: its record when the caller
        has just read it in this transaction (not read again)."""
        if rec is None:
            rec = self.get(item_id)
        if rec is None:
            raise LedgerError(f"completed index points at missing item {item_id}")
        result = self.result(item_id)
        if result is None:
            raise LedgerError(f"completed item {item_id} has no result")
        return schema.trusted_delivery(item_id, rec["key"], rec["kind"], result, rec["params"], rec["attempt"],
                                       rec.get("handler", ""), rec.get("handler_version", ""),
                                       rec.get("completed_ms", 0) / 1000.0, redelivery, b"", b"")

    def scan_ready(self, kinds: list[str] | None, limit: int, now_ms: int) -> tuple[list[str], int | None]:
        """Eligible ready item ids for ``kinds`` (None: every kind), best first.

        Returns ``(item_ids, next_not_before_ms)``: the earliest not-before time
        among skipped (backing-off) items, or None if none was seen.
        """
        kinds = self.ready_kinds() if kinds is None else sorted(set(kinds))
        cands: list[tuple[int, int, int, str]] = []
        ids: list[str] = []  # one kind: its entries come in key order, the order wanted
        one = len(kinds) == 1
        hint: int | None = None
        cur = self.txn.cursor(db=self.db["ready"])
        parse, last = schema.parse_ready, schema.LAST_PRIO_KEY
        for kind in kinds:
            prefix = schema.ready_prefix(kind)
            n = len(prefix)
            found = 0
            ok = cur.set_range(prefix)
            while ok and found < limit:
                k, v = cur.item()
                if not k.startswith(prefix):
                    break
                pk, nb, seq = parse(k[n:])
                if nb > now_ms:
                    hint = nb if hint is None else min(hint, nb)
                    if pk == last:
                        break
                    ok = cur.set_range(schema.ready_bucket_after(prefix, pk))
                    continue
                if one:
                    ids.append(v.decode())
                else:
                    cands.append((pk, nb, seq, v.decode()))
                found += 1
                ok = cur.next()
        if one:
            return ids, hint
        cands.sort()
        return [c[3] for c in cands[:limit]], hint

    # --- commit history (meta ``h:`` + >Q txnid -> [ts_ms, last_pgno, live_pages]) ---
    def history_after(self, txnid: int) -> tuple[int, list] | None:
        """The first commit-history entry with a transaction id above ``txnid``, as
        ``(txnid, [ts_ms, last_pgno, live_pages])``, or None."""
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(schema.history_key(txnid + 1)) and cur.key().startswith(schema.HISTORY):
            return schema.history_txnid(cur.key()), schema.unpack(cur.value())
        return None

    def history_at_or_before(self, txnid: int) -> tuple[int, list] | None:
        """The last commit-history entry with a transaction id <= ``txnid``, or None."""
        cur = self.txn.cursor(db=self.db["meta"])
        if cur.set_range(schema.history_key(txnid + 1)):
            ok = cur.prev()
        else:
            ok = cur.last()
        if ok and cur.key().startswith(schema.HISTORY):
            return schema.history_txnid(cur.key()), schema.unpack(cur.value())
        return None

    def blob_refs_page(self, name: str, after: bytes, limit: int) -> tuple[list[tuple[str, str, str]], bytes | None]:
        """One page of :meth:`blob_refs` for table ``name`` (payloads or results):
        up to ``limit`` entries with keys after ``after``. Returns ``(refs, last key
        looked at)``; the key is None when the table is exhausted."""
        items = self.db["items"]
        out: list[tuple[str, str, str]] = []
        cur = self.txn.cursor(db=self.db[name])
        ok = cur.set_range(after + b"\0") if after else cur.first()
        seen = 0
        last = None
        while ok and seen < limit:
            k, v = cur.key(), cur.value()
            last, seen = k, seen + 1
            sha = schema.blob_ref(v)
            if sha is not None:
                raw = self.txn.get(k, db=items)
                out.append((k.decode(), schema.item_state(raw) if raw is not None else "unknown", sha))
            ok = cur.next()
        return out, (last if ok else None)
