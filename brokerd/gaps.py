"""The gap register: every window where ccsq is at-least-once or at-most-once.

Each window has a stable id (G1, G2, ...) used in the ledger's event records,
in ``ccsq gap-report`` and in ``docs/gap-register.md`` (keep the three in step).
The broker appends an event (window id, item id, wall time, detail) in the same
ledger transaction as the state change that hit the window.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """One named window: ``where`` it opens, ``why`` it exists, what ``repair``s it,
    and which ``counter`` shows it (besides the window's own event count)."""

    id: str
    name: str
    where: str
    why: str
    repair: str
    counter: str = ""


G1_ORPHAN_BLOB = "G1"
G2_LEASE_EXPIRED = "G2"
G3_RESULT_REDELIVERED = "G3"
G4_FENCED_COMPLETION = "G4"
G5_DEDUP_WINDOW_PASSED = "G5"
G6_DEADLINE_EXPIRED = "G6"
G7_DEAD_LETTERED = "G7"
G8_LATE_RESULT_ACCEPTED = "G8"
G9_SUBMIT_RETRIED = "G9"
G10_DEAD_LETTER_REPLAYED = "G10"
G11_DEAD_LETTER_PURGED = "G11"
G12_RESULT_QUARANTINED = "G12"
G13_RESTORED_FROM_BACKUP = "G13"
# federation windows (a relay between swarms: docs/federation.md); F ids so they never
# collide with new single-swarm windows
F1_RELAY_LEASE_LOST = "F1"
F2_RELAYED_RESULT_LATE = "F2"
F3_RELAYED_RESUBMIT = "F3"
F4_RELAYED_ITEM_REFUSED = "F4"

WINDOWS: tuple[Window, ...] = (
    Window(
        G1_ORPHAN_BLOB,
        "orphan blob",
        "producer: between the claim-store PUT and the committed SUBMIT",
        "the producer crashed or gave up after storing the payload, so no item refers to the blob",
        "`ccsq reconcile --apply` deletes unreferenced blobs older than its grace period, which must exceed the longest"
        " outbox spool time (no broker event; reconcile reports it)",
    ),
    Window(
        G2_LEASE_EXPIRED,
        "lease expired, requeued",
        "broker: a lease ran out (worker lost, partitioned, or not listing it in heartbeats)",
        "the worker may still have run the item (at-least-once): the next attempt re-runs it",
        "automatic: the item is ready again with attempt+1 after a backoff; the fencing token keeps one result",
        "retried",
    ),
    Window(
        G3_RESULT_REDELIVERED,
        "result redelivered",
        "broker -> completion service: between RESULT and ACK",
        "the completion session ended (or the broker restarted) before it acknowledged a delivered result",
        "the result is sent again with redelivery=true; the consumer's upsert keyed by item id absorbs it",
        "redelivered",
    ),
    Window(
        G4_FENCED_COMPLETION,
        "late completion fenced",
        "worker -> broker: a COMPLETE quoting a lease token that is no longer current",
        "the lease moved on (expiry, requeue) while the first worker still finished the item: it ran twice",
        "the first valid completion wins; the late one is confirmed to its sender but discarded",
        "fenced_completions",
    ),
    Window(
        G5_DEDUP_WINDOW_PASSED,
        "dedup window passed",
        "producer -> broker: a SUBMIT whose idempotency key was last seen more than dedup_window_s ago",
        "the key is no longer protected, so the same document becomes a second item",
        "raise dedup_window_s above the longest producer retry/outbox delay; the consumer upsert keeps results single",
    ),
    Window(
        G6_DEADLINE_EXPIRED,
        "deadline expired",
        "broker: an item's deadline_ts passed before it completed",
        "the item will never run (at-most-zero): it is terminal in state expired",
        "operator: look at capacity (ccsq gap-report, admin status); resubmit with a later deadline if still wanted",
        "expired",
    ),
    Window(
        G7_DEAD_LETTERED,
        "dead-lettered",
        "broker: attempts exhausted (worker_lost, handler_error, timeout), a permanent failure (fatal, payload_missing),"
        " or `ccsq reconcile --apply` finding a ready item's payload missing (the only way a blob missing from the"
        " claim store dead-letters an item: a worker that cannot read it reports store_unavailable, not counted)",
        "the item is terminal in state dead and not done",
        "operator: fix the cause, then `ccsq dlq replay` (G10) makes it ready again with a fresh attempt budget",
        "dead",
    ),
    Window(
        G8_LATE_RESULT_ACCEPTED,
        "late result accepted after expiry",
        "worker -> broker: a COMPLETE for a lease that expired, arriving before anyone else leased the item",
        "the expiry counted a retry that did not happen: the same work is accepted instead of being re-run",
        "nothing to repair; the event explains why a G2 event has no second execution",
    ),
    Window(
        G9_SUBMIT_RETRIED,
        "submit retried (dedup hit)",
        "broker -> producer: between the SUBMIT commit and the producer receiving SUBMIT_ACK",
        "the ack was lost (crash, disconnect, timeout) or the producer resubmitted the same document",
        "the idempotency key returns the original item id with duplicate=true; no second item is made",
        "duplicate_submits",
    ),
    Window(
        G10_DEAD_LETTER_REPLAYED,
        "dead letter replayed",
        "operator -> broker: `ccsq dlq replay` makes a dead item ready again with a fresh attempt budget",
        "the item may already have run (partly or fully) in the attempts that dead-lettered it: it runs again",
        "intended by the operator; the fencing token and the consumer upsert keep one result",
        "replayed",
    ),
    Window(
        G11_DEAD_LETTER_PURGED,
        "dead letter purged",
        "operator -> broker: `ccsq dlq purge` deletes a dead item (record, payload reference, idempotency key)",
        "the item will never be done (at-most-zero) and is no longer listed; its blob becomes an orphan",
        "intended by the operator; resubmit the document to run it again (its key is free); reconcile collects the blob",
        "dead_purged",
    ),
    Window(
        G12_RESULT_QUARANTINED,
        "result quarantined",
        "completion service: its results table refused one row for a data reason (a constraint, a trigger, a value the"
        " column cannot hold), not an outage",
        "the result is acknowledged but stored in the table `results_quarantine` (with the database's error), not in"
        " `results`: a query of `results` alone misses it",
        "operator: fix the constraint or the data, then move the row (docs/results-schema.md, 'Quarantine')",
        "quarantined",
    ),
    Window(
        G13_RESTORED_FROM_BACKUP,
        "restored from a backup",
        "broker: the first start on a `ccsq backup` copy (m:restore_pending): one event per item ready, leased or"
        " completed and not acknowledged in the copy",
        "the broker the copy was taken from may have run, completed and delivered the item after the copy: it runs"
        " (or its result is delivered) again, so the results table counts a second delivery",
        "automatic: the fencing token keeps one result in the ledger and the consumer's upsert keyed by item id keeps"
        " one row (deliveries > 1); restore only a lost or corrupt ledger (docs/ledger.md, Backups)",
    ),
    Window(
        F1_RELAY_LEASE_LOST,
        "relay lease lost",
        "upstream broker: a lease held by a relay expired (relay dead, link cut longer than lease_ttl_s) or was dropped"
        " when the relay reconnected without it",
        "the item may already be running in the downstream swarm while it runs again here (at-least-once across swarms)",
        "automatic: requeued as G2; the relay still brings the downstream result back under the old token, where it is"
        " fenced (G4, F2) or accepted late (G8, F2); the downstream item is acknowledged either way",
        "retried",
    ),
    Window(
        F2_RELAYED_RESULT_LATE,
        "relayed result late",
        "upstream broker: a relay's COMPLETE whose lease had moved on (fenced) or expired (accepted late)",
        "the item ran in the downstream swarm after this swarm gave its lease up: it ran twice, or its retry never ran",
        "nothing to repair: the fencing token keeps one result; explains an F1/G2 event",
        "fenced_completions",
    ),
    Window(
        F3_RELAYED_RESUBMIT,
        "relayed item resubmitted",
        "downstream broker: a relay's SUBMIT of an item it already has (relay restarted between SUBMIT and journaling the"
        " SUBMIT_ACK, a lease taken again after F1, or a replayed frame)",
        "the relay could not know whether the first SUBMIT landed",
        "the origin key (origin:<swarm>:<item>) returns the existing item (a dedup hit, also counted as G9): no second item",
        "duplicate_submits",
    ),
    Window(
        F4_RELAYED_ITEM_REFUSED,
        "relayed item refused",
        "downstream broker: a relayed item whose origin signature does not verify against trusted_swarms, or that"
        " differs from its signed record (forged origin, tampered params, swapped payload, loop, max_hops)",
        "the item is not accepted here (at-most-zero in this swarm); the relay gives the lease back upstream (released)",
        "operator: find the cause in the broker's relayed_rejected log line (a rogue relay or key, or a stale"
        " trusted_swarms.toml); the upstream runs the item at home meanwhile",
    ),
)

WINDOWS_BY_ID: dict[str, Window] = {w.id: w for w in WINDOWS}

#: Events kept per window in the ledger (older ones are trimmed by the purge slice).
EVENTS_KEPT_PER_WINDOW = 1000
