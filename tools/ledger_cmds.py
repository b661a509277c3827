"""The commands that read the ledger file itself: ``ccsq gap-report`` (the accounting and
every at-least-once window, :mod:`ccsq.brokerd.gap_report`), ``ccsq reconcile`` (the ledger
against the claim store, :mod:`ccsq.tools.reconcile`) and ``ccsq backup`` (a
consistent hot copy). They open the ledger read-only (short transactions), safe while the
broker runs; ``reconcile --apply`` changes it only through the broker (admin ``dead_letter``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ccsq.common.wire.errors import BrokerUnavailable, CantCreate, CcsqError, ConfigError, ExitCode


# --- ccsq gap-report ------------------------------------------------------------------
def _cmd_gap_report(args: argparse.Namespace) -> int:
    from ccsq.brokerd.gap_report import load_report, render_text
    from ccsq.common.wire.config import BrokerConfig, load

    cfg = load(BrokerConfig, args.config)
    report = load_report(cfg.data_dir)
    _name_unserved_queues(report, Path(args.config).resolve().parent / "admin.toml")
    if getattr(cfg, "ha_etcd_endpoints", ""):  # a broker pair: which broker is primary, the epoch, the standbys' lag
        ha = _ha_status(Path(args.config).resolve().parent / "admin.toml")
        if ha is not None:
            report["ha"] = ha
    if args.html:
        from ccsq.brokerd.gap_report import render_html

        try:
            Path(args.html).write_text(render_html(report))
        except OSError as exc:
            raise CantCreate.of("the HTML report", args.html, exc) from None
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif not args.html:
        from ccsq.tools.admin_cmds import ha_lines

        lines = ha_lines(report.get("ha"))
        if "ha" in report and not lines:
            lines = ["ha: " + report["ha"].get("unavailable", "no primary answered")]
        print("\n".join([*lines, render_text(report, verbose=args.verbose)]))
    else:
        print(f"wrote {args.html}: {'BALANCED' if report['balanced'] else 'UNBALANCED'}")
    return ExitCode.OK if report["balanced"] else ExitCode.UNBALANCED


def _ha_status(admin_path: Path) -> dict | None:
    """The primary's ``"ha"`` status section (docs/ha.md) through ``admin.toml`` next to
    ``brokerd.toml`` (its ``broker_endpoint`` lists every broker), within 2 s; ``{"unavailable":
    why}`` when no broker answered; None without an ``admin.toml``. The books themselves
    come from this host's ledger as always (on a standby: the replica, as of its last turn)."""
    if not admin_path.is_file():
        return None
    from ccsq.tools.admin_client import with_broker
    from ccsq.common.wire.config import AdminConfig, load

    async def status(session) -> dict:
        return await session.call("status", timeout_s=2.0)

    try:
        settings = load(AdminConfig, admin_path)
        doc = with_broker(settings, status, connect_timeout_s=min(settings.connect_timeout_s, 2.0))
    except CcsqError as exc:
        return {"unavailable": f"no broker answered as primary ({exc})"}
    return doc.get("ha") or {"unavailable": "the broker that answered has no ha section (a single broker)"}


def _name_unserved_queues(report: dict, admin_path: Path) -> None:
    """A stalled queue whose kind no connected worker serves says so ("stalled: no worker
    serves kind 'X'"), when the broker answers an admin status (``admin.toml`` next to
    ``brokerd.toml``) within 1 s; otherwise the verdict stays "stalled"."""
    stalled = [q for q in report.get("queues", []) if q.get("verdict") == "stalled"]
    if not stalled or not admin_path.is_file():
        return
    from ccsq.tools.admin_client import with_broker
    from ccsq.common.wire.config import AdminConfig, load

    async def status(session) -> dict:
        return await session.call("status", timeout_s=2.0)

    try:
        settings = load(AdminConfig, admin_path)
        doc = with_broker(settings, status, connect_timeout_s=min(settings.connect_timeout_s, 1.0))
    except CcsqError:
        return
    workers = [x for x in doc.get("peers", []) if x.get("role") == "worker"]
    for q in stalled:
        if not any(not w.get("kinds") or q["kind"] in w["kinds"] for w in workers):
            q["verdict"] = f"stalled: no worker serves kind {q['kind']!r}"


# --- ccsq reconcile ---------------------------------------------------------------------
def _cmd_reconcile(args: argparse.Namespace) -> int:
    from ccsq.brokerd.gap_report import iter_blob_refs
    from ccsq.common.storage.claimstore import open_store
    from ccsq.common.wire.config import AdminConfig, BrokerConfig, load
    from ccsq.tools.reconcile import ReconcileReport, reconcile

    cfg = load(BrokerConfig, args.config)
    s3 = {"endpoint_url": args.s3_endpoint_url, "region": args.s3_region, "profile": args.s3_profile}
    store_uri, base, where = args.store, Path(args.config).resolve().parent, "--store"
    if not store_uri:  # the broker has no claim store of its own: the producer's next to brokerd.toml
        from ccsq.common.wire.config import ProducerConfig

        producer_path = base / "producer.toml"
        if not producer_path.is_file():
            raise ConfigError(f"give --store URI (the claim store the producers use): "
                             f"no producer.toml next to {args.config} names one")
        pcfg = load(ProducerConfig, producer_path)
        store_uri, where = pcfg.claim_store, f"{producer_path}: claim_store"
        s3 = {"endpoint_url": s3["endpoint_url"] or pcfg.s3_endpoint_url, "region": s3["region"] or pcfg.s3_region,
              "profile": s3["profile"] or pcfg.s3_profile}
    store = open_store(store_uri, base, create=False, s3=s3, where=where)
    store.check(where=where)  # a root that does not exist is a typo, not a store with every payload missing (exit 78)
    report: ReconcileReport = reconcile(iter_blob_refs(cfg.data_dir), store, args.grace_s, dry_run=not args.apply)
    out = report.as_dict()
    ready_missing = sorted({m.item_id for m in report.missing if m.state == "ready"})
    if args.apply and ready_missing and len(report.missing) == report.needed and not args.force:
        raise ConfigError(f"{store.uri} holds none of the {len(report.missing)} payload(s) the ledger "
                          "still needs: wrong --store? Nothing was changed; check the URI (the producers' claim_store), "
                          "or add --force to dead-letter them anyway")
    out["dead_lettered"] = []
    out["not_dead_lettered"] = ready_missing if not args.apply else []
    out["leased_missing"] = sorted({m.item_id for m in report.missing if m.state != "ready"})
    status = ExitCode.OK
    if args.apply and ready_missing:
        from ccsq.tools.admin_client import with_broker

        admin_path = Path(args.admin_config) if args.admin_config else Path(args.config).resolve().parent / "admin.toml"
        settings = load(AdminConfig, admin_path)

        async def go(session) -> list[str]:
            dead: list[str] = []
            for i in range(0, len(ready_missing), 500):
                chunk = ready_missing[i : i + 500]
                doc = await session.call(
                    "dead_letter",
                    {"item_ids": ",".join(chunk), "reason": "payload_missing", "message": f"claim store {store.uri} lacks the payload"},
                )
                dead += doc["dead"]
            return dead

        try:
            out["dead_lettered"] = with_broker(settings, go)
        except BrokerUnavailable as exc:
            print(f"ccsq reconcile: {exc}: start the broker and run again to dead-letter them", file=sys.stderr)
            status = ExitCode.UNAVAILABLE
        out["not_dead_lettered"] = [i for i in ready_missing if i not in out["dead_lettered"]]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        mode = "applied" if args.apply else "dry run (add --apply to repair)"
        print(
            f"reconcile {store.uri} ({mode}): {out['referenced']} referenced, {out['stored']} stored, "
            f"{out['orphans']} orphan(s) ({out['orphans_young']} younger than {args.grace_s:g} s kept, "
            f"{out['orphans_deleted']} deleted), {len(out['missing'])} payload(s) missing: "
            f"{len(out['dead_lettered'])} dead-lettered (payload_missing), {len(out['not_dead_lettered'])} not, "
            f"{len(out['leased_missing'])} leased (their worker gives them back as store_unavailable: run again)"
        )
    return status


# --- ccsq backup ------------------------------------------------------------------------
def _cmd_backup(args: argparse.Namespace) -> int:
    """A consistent, compacting hot copy of the ledger into DEST (docs/ledger.md, Backups),
    then the copy's accounting read back from it."""
    import time

    from ccsq.brokerd.ledger import Ledger, data_paths
    from ccsq.common.wire.config import BrokerConfig, load

    cfg = load(BrokerConfig, args.config)
    ledger_dir, _lock = data_paths(Path(cfg.data_dir))
    dest = Path(args.dest)
    t0 = time.monotonic()
    ledger = Ledger(ledger_dir, readonly=True)
    try:
        out = ledger.backup(dest)
    finally:
        ledger.close()
    out["seconds"] = round(time.monotonic() - t0, 3)
    copy = Ledger(dest, readonly=True)  # check it opens and balances (its lock.mdb is removed after)
    try:
        with copy.read() as view:
            states = view.states()
            out.update(ledger_id=copy.ledger_id, received=view.counter("received"), balanced=view.balanced(), epoch=view.epoch(),
                       states=states, may_rerun=sum(states[s] for s in ("ready", "leased", "completed")))
    finally:
        copy.close()
        (dest / "lock.mdb").unlink(missing_ok=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        mib = 1 << 20
        print(f"backup {out['path']}: {out['bytes'] / mib:.1f} MiB (ledger file {out['source_bytes'] / mib:.1f} MiB), "
              f"snapshot txn {out['last_txnid']}, ledger {out['ledger_id']} epoch {out['epoch']}, {out['received']} received, "
              f"{'balanced' if out['balanced'] else 'UNBALANCED'}, {out['seconds']} s; {out['may_rerun']} items not done "
              "(ready, leased, completed): a restore of this copy may run or deliver them again (gap G13)")
    return ExitCode.OK if out["balanced"] else ExitCode.UNBALANCED
