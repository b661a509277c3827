"""``ccsq reconcile``: compare what the ledger references with what the claim store holds.

Two kinds of drift (docs/architecture.md, "The path of one item": PUT before SUBMIT):

- an **orphan** blob: in the store, referenced by no item (a producer crashed
  between PUT and SUBMIT, or a purge already forgot the item). Safe to delete
  once it is older than a grace period, so that a PUT whose SUBMIT is still in
  flight is never collected (stores refresh a blob's mtime on every re-put).
- a **missing** payload: an item that still needs its payload (ready or
  leased) references a blob the store does not hold. Nothing here can repair
  that; it is reported so the broker can dead-letter the item
  (reason ``payload_missing``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable


from ccsq.common.storage.claimstore import ClaimStore
from ccsq.common.wire.protocol import ItemState
from ccsq.common.runtime.log import get_logger

log = get_logger("ccsq.reconcile")

#: Items in these states will still be run, so their payload must exist.
NEEDS_PAYLOAD = frozenset({ItemState.READY.value, ItemState.LEASED.value})


@dataclasses.dataclass(frozen=True)
class MissingPayload:
    item_id: str
    state: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class ReconcileReport:
    """Counts of one reconcile pass (``orphans_deleted`` stays 0 in a dry run)."""

    referenced: int  # distinct sha256 referenced by the ledger
    stored: int  # blobs in the store
    orphans: int  # stored but unreferenced
    orphans_young: int  # of those, younger than the grace period (kept)
    orphans_deleted: int
    missing: tuple[MissingPayload, ...]  # ready/leased items whose payload is absent
    dry_run: bool
    needed: int = 0  # references of items that still need their payload (ready/leased)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["missing"] = [dataclasses.asdict(m) for m in self.missing]
        return d


def reconcile(
    report_of_refs: Iterable[tuple[str, str, str]],
    store: ClaimStore,
    grace_s: float,
    dry_run: bool,
    *,
    now_s: float | None = None,
) -> ReconcileReport:
    """Compare ledger references with the claim store and repair what is safe.

    ``report_of_refs`` yields ``(item_id, state, sha256)`` for every claim-check
    reference the ledger holds (payloads and stored results; inline blobs need
    not be listed). ``state`` is an :class:`ItemState` value. Orphan blobs whose
    store timestamp is older than ``grace_s`` seconds are deleted unless
    ``dry_run``. Store errors propagate (nothing is deleted after one).
    """
    now = time.time() if now_s is None else now_s
    referenced: set[str] = set()
    needed: list[tuple[str, str, str]] = []
    for item_id, state, sha256 in report_of_refs:
        referenced.add(sha256)
        state = state.value if isinstance(state, ItemState) else state
        if state in NEEDS_PAYLOAD:
            needed.append((item_id, state, sha256))

    stored: dict[str, float] = dict(store.list())
    orphans = [(sha, mtime) for sha, mtime in stored.items() if sha not in referenced]
    old = [sha for sha, mtime in orphans if now - mtime >= grace_s]
    deleted = 0
    for sha in old:
        if dry_run:
            log.info("reconcile_orphan_found", sha256=sha, store=store.uri)
            continue
        store.delete(sha)
        deleted += 1
        log.info("reconcile_orphan_deleted", sha256=sha, store=store.uri)

    missing = tuple(MissingPayload(i, s, sha) for i, s, sha in needed if sha not in stored)
    for m in missing:
        log.warning("reconcile_payload_missing", item_id=m.item_id, state=m.state, sha256=m.sha256)
    return ReconcileReport(
        referenced=len(referenced),
        stored=len(stored),
        orphans=len(orphans),
        orphans_young=len(orphans) - len(old),
        orphans_deleted=deleted,
        missing=missing,
        dry_run=dry_run,
        needed=len(needed),
    )
