"""``ccsq``: the umbrella command line (init, keygen, submit, completion, gap-report,
status, items, dlq, drain, reconcile).

Each subcommand imports its part lazily so ``ccsq --help`` stays fast and a
host without onnxruntime can still run the broker-side commands.
Exit codes are :class:`ccsq.common.errors.ExitCode` values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tomli_w

from ccsq.common.errors import AdminFailed, BrokerUnavailable, CcsqError, ConfigError, ExitCode
from ccsq.common.keys import public_key_b64, load_private_key, write_authorized_keys, write_keypair


# --- ccsq init ------------------------------------------------------------------------
def init_swarm(
    directory: Path,
    *,
    endpoint: str = "tcp://127.0.0.1:5555",
    workers: int = 2,
    handler: str = "echo",
    broker: dict | None = None,
    worker: dict | None = None,
    producer: dict | None = None,
    completion: dict | None = None,
) -> dict[str, Path]:
    """Write a ready-to-run swarm directory; returns ``{name: config path}``.

    Layout (all state lives under ``directory``)::

        brokerd.toml  workerd-1.toml ... workerd-N.toml  producer.toml  completion.toml
        authorized_keys.toml  keys/<peer>.key (0600) keys/<peer>.pub
        blobs/ (file claim store)  broker-data/ (ledger)  worker-N-journal/  results.db

    ``broker``/``worker``/``producer``/``completion`` override config keys.
    Raises ConfigError if the directory already holds a swarm.
    """
    directory = directory.resolve()
    if (directory / "brokerd.toml").exists():
        raise ConfigError(f"{directory} already holds a swarm (brokerd.toml exists); choose another directory")
    directory.mkdir(parents=True, exist_ok=True)
    keys_dir = directory / "keys"
    peers = {"broker": "broker", "producer-1": "producer", "completion-1": "completion", "admin": "admin"}
    peers.update({f"worker-{i}": "worker" for i in range(1, workers + 1)})
    authorized: dict[str, tuple[str, str]] = {}
    for peer_id, role in peers.items():
        priv, _ = write_keypair(keys_dir, peer_id)
        authorized[peer_id] = (role, public_key_b64(load_private_key(priv)))
    write_authorized_keys(directory / "authorized_keys.toml", authorized)
    (directory / "blobs").mkdir(exist_ok=True)
    common = {"authorized_keys": "authorized_keys.toml", "broker_endpoint": endpoint, "broker_id": "broker"}
    written: dict[str, Path] = {}

    def write(name: str, doc: dict) -> None:
        path = directory / name
        path.write_text(tomli_w.dumps(doc))
        written[name.removesuffix(".toml")] = path

    write(
        "brokerd.toml",
        {
            "peer_id": "broker",
            "private_key": "keys/broker.key",
            "authorized_keys": "authorized_keys.toml",
            "endpoint": endpoint,
            "data_dir": "broker-data",
            **(broker or {}),
        },
    )
    for i in range(1, workers + 1):
        write(
            f"workerd-{i}.toml",
            {
                "peer_id": f"worker-{i}",
                "private_key": f"keys/worker-{i}.key",
                **common,
                "handler": handler,
                "claim_store": "file://blobs",
                "journal_dir": f"worker-{i}-journal",
                **(worker or {}),
            },
        )
    write(
        "producer.toml",
        {"peer_id": "producer-1", "private_key": "keys/producer-1.key", **common, "claim_store": "file://blobs", **(producer or {})},
    )
    write(
        "completion.toml",
        {
            "peer_id": "completion-1",
            "private_key": "keys/completion-1.key",
            **common,
            "claim_store": "file://blobs",
            "database": "sqlite:///results.db",
            **(completion or {}),
        },
    )
    write(
        "admin.toml",
        {"peer_id": "admin", "private_key": "keys/admin.key", **common, "data_dir": (broker or {}).get("data_dir", "broker-data")},
    )
    return written


def _cmd_init(args: argparse.Namespace) -> int:
    written = init_swarm(Path(args.dir), endpoint=args.endpoint, workers=args.workers, handler=args.handler)
    for name, path in written.items():
        print(f"{name:14} {path}")
    return ExitCode.OK


def _cmd_keygen(args: argparse.Namespace) -> int:
    if args.curve:
        from ccsq.common.keys import write_curve_keypair

        secret, public = write_curve_keypair(Path(args.out), args.id)
        print(f"CURVE secret key {secret} (mode 0600)\nCURVE public key {public}: {public.read_text().strip()}")
        print("broker: curve = true, curve_secret_key = <secret path>; peers: curve = true, broker_curve_public_key = <public path>")
        return ExitCode.OK
    priv, pub = write_keypair(Path(args.out), args.id)
    print(f"private key {priv} (mode 0600)\npublic key  {pub}: {pub.read_text().strip()}")
    print(f'add to authorized_keys.toml:\n[peers.{args.id}]\nrole = "{args.role}"\npublic_key = "{pub.read_text().strip()}"')
    return ExitCode.OK


# --- ccsq submit ----------------------------------------------------------------------
def _cmd_submit(args: argparse.Namespace) -> int:
    from ccsq.producer.client import Client

    items = [Path(f) for f in args.files]
    for f in items:
        if not f.is_file():
            raise ConfigError(f"{f}: no such file")
    with Client.from_config_file(args.config) as client:
        receipts = [client.submit(f, args.kind, params={"name": f.name}) for f in items]
        out = [{"file": str(f), "item_id": r.item_id, "key": r.key, "duplicate": r.duplicate, "spooled": r.spooled} for f, r in zip(items, receipts)]
        status_code = ExitCode.OK
        if args.wait:
            if any(r.spooled for r in receipts):
                # spooled while the broker was away: let the outbox drain, then the same
                # submit (same idempotency key) answers the original item id
                client.flush(timeout_s=args.timeout_s)
                receipts = [client.submit(f, args.kind, params={"name": f.name}) if r.spooled else r
                            for f, r in zip(items, receipts)]
                for row, r in zip(out, receipts):
                    row["item_id"] = r.item_id
            ids = [r.item_id for r in receipts if r.item_id]
            states = client.wait(ids, timeout_s=args.timeout_s)
            for row in out:
                st = states.get(row["item_id"])
                row["state"] = st.state if st else "unknown"
            if any(row.get("state") != "acknowledged" for row in out):
                status_code = ExitCode.INCOMPLETE
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for row in out:
            print(f"{row['item_id'] or '(spooled)':>20}  {'dup ' if row['duplicate'] else ''}{row.get('state', '')}  {row['file']}")
    return status_code


# --- ccsq gap-report ------------------------------------------------------------------
def _cmd_gap_report(args: argparse.Namespace) -> int:
    from ccsq.brokerd.report import load_report, render_text
    from ccsq.common.config import BrokerConfig, load

    cfg = load(BrokerConfig, args.config)
    report = load_report(cfg.data_dir)
    if args.html:
        from ccsq.brokerd.report import render_html

        Path(args.html).write_text(render_html(report))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif not args.html:
        print(render_text(report, verbose=args.verbose))
    else:
        print(f"wrote {args.html}: {'BALANCED' if report['balanced'] else 'UNBALANCED'}")
    return ExitCode.OK if report["balanced"] else ExitCode.UNBALANCED


# --- admin commands: status, items show, dlq, drain --------------------------------------
def _admin_settings(args: argparse.Namespace):
    from ccsq.common.config import AdminConfig, load

    return load(AdminConfig, args.config)


def _admin_mode(args: argparse.Namespace) -> str:
    return "offline" if getattr(args, "offline", False) else "auto"


def _read_query(args: argparse.Namespace, command: str, params: dict | None = None) -> dict:
    """Run a read-only admin ``command`` (status, items_show, dlq_list) against the
    broker, or against the ledger when it does not answer or with --offline."""
    from ccsq.common.admin_client import run_command

    settings = _admin_settings(args)
    mode = _admin_mode(args)
    doc = run_command(settings, command, params, mode=mode)
    if doc.get("source") != "broker" and mode != "offline":
        print(f"(broker not answering: read the ledger at {settings.data_dir} directly)", file=sys.stderr)
    return doc


def _cmd_status(args: argparse.Namespace) -> int:
    doc = _read_query(args, "status")
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(render_status(doc))
    return ExitCode.OK


def render_status(doc: dict, *, width: int = 120) -> str:
    """The ``ccsq status`` screen: peers (slots, leases, draining), backlog per queue,
    oldest ready item, balance."""
    import io

    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    age = doc.get("oldest_ready_age_s")
    listed = doc.get("dead_listed", doc.get("dead", 0))
    purged = doc.get("dead", 0) - listed
    dead_note = f"{listed}" + (f" (+{purged} purged)" if purged else "")
    console.print(
        f"ledger {doc.get('ledger_id', '')} epoch {doc.get('epoch', 0)} ({doc.get('source', '')}): "
        f"{'balanced' if doc.get('balanced') else 'UNBALANCED'}; oldest ready item: "
        f"{'none' if age is None else f'{age:.1f} s old'}; dead letters: {dead_note}"
    )
    if doc.get("source") == "broker":
        pt = Table(title="peers")
        for col in ("peer", "role", "slots", "busy", "credit", "leases", "done", "healthy", "draining", "last seen"):
            pt.add_column(col)
        for peer in doc.get("peers", []):
            pt.add_row(
                peer["peer_id"], peer["role"], str(peer["slots"]), str(peer["busy"]), str(peer["credit"]),
                str(peer["leases"]), str(peer["done"]), "yes" if peer["healthy"] else "NO",
                "yes" if peer.get("draining") else "", f"{peer['last_seen_s']:.1f} s",
            )
        console.print(pt)
    if doc.get("draining"):  # kept in the ledger: shown offline too
        console.print("draining: " + ", ".join(doc["draining"]))
    bt = Table(title="backlog per queue (kind)")
    bt.add_column("kind")
    states = list(doc.get("states", {}))
    for st in states:
        bt.add_column(st, justify="right")
    for kind, per in sorted(doc.get("backlog", {}).items()):
        bt.add_row(kind, *(str(per.get(st, 0)) for st in states))
    console.print(bt)
    return buf.getvalue()


def _cmd_items_show(args: argparse.Namespace) -> int:
    doc = _read_query(args, "items_show", {"item_id": args.item_id})
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        for k, v in doc["item"].items():
            print(f"{k:>16}  {v}")
        if doc.get("lease_in_memory"):
            print(f"{'lease (memory)':>16}  {doc['lease_in_memory']}")
    return ExitCode.OK


def _cmd_dlq_list(args: argparse.Namespace) -> int:
    doc = _read_query(args, "dlq_list", {"limit": args.limit})
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        for rec in doc["items"]:
            print(f"{rec['id']}  {rec['kind']:12} attempt {rec['attempt']}  {rec.get('error', '')}: {rec.get('error_message', '')[:80]}")
        purged = doc.get("purged", 0)
        print(f"{len(doc['items'])} shown of {doc['total']} dead letters" + (f" (+{purged} purged)" if purged else ""))
    return ExitCode.OK


def _cmd_dlq_change(args: argparse.Namespace) -> int:
    """dlq replay / dlq purge: item ids, or --all (in calls of up to 1000)."""
    from ccsq.common.admin_client import with_broker

    if bool(args.item_ids) == bool(args.all):
        raise ConfigError(f"dlq {args.action}: give item ids or --all (not both)")
    command, key = ("dlq_replay", "replayed") if args.action == "replay" else ("dlq_purge", "purged")

    async def go(session) -> dict:
        done: list[str] = []
        not_dead: list[str] = []
        if args.all:
            while True:
                doc = await session.call(command, {"all": True})
                done += doc[key]
                if not doc["more"] or not doc[key]:
                    break
        else:
            for item_id in args.item_ids:
                doc = await session.call(command, {"item_id": item_id})
                done += doc[key]
                not_dead += doc["not_dead"]
        return {key: done, "not_dead": not_dead}

    out = with_broker(_admin_settings(args), go)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.action}: {len(out[key])} item(s)" + (f"; not dead: {', '.join(out['not_dead'])}" if out["not_dead"] else ""))
    return ExitCode.OK if not out["not_dead"] else ExitCode.REFUSED


def _cmd_drain(args: argparse.Namespace) -> int:
    import time

    from ccsq.common.admin_client import with_broker

    async def go(session) -> dict:
        import asyncio

        doc = await session.call("drain", {"worker": args.worker, "undo": args.undo})
        if args.wait and not args.undo:
            deadline = time.monotonic() + args.timeout_s
            while doc["leases"] > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                st = await session.call("status")
                doc["leases"] = next((x["leases"] for x in st["peers"] if x["peer_id"] == args.worker), 0)
        return doc

    doc = with_broker(_admin_settings(args), go)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        state = "draining (no new items)" if doc["draining"] else "dispatching again"
        print(f"{doc['worker']}: {state}; {'connected' if doc['connected'] else 'not connected'}; {doc['leases']} lease(s) held")
    return ExitCode.INCOMPLETE if args.wait and not args.undo and doc["leases"] > 0 else ExitCode.OK


# --- ccsq reconcile ---------------------------------------------------------------------
def _cmd_reconcile(args: argparse.Namespace) -> int:
    from ccsq.brokerd.report import iter_blob_refs
    from ccsq.common.claimstore import open_store
    from ccsq.common.config import AdminConfig, BrokerConfig, load
    from ccsq.producer.reconcile import ReconcileReport, reconcile

    cfg = load(BrokerConfig, args.config)
    store = open_store(args.store, Path(args.config).resolve().parent)
    report: ReconcileReport = reconcile(iter_blob_refs(cfg.data_dir), store, args.grace_s, dry_run=not args.apply)
    out = report.as_dict()
    ready_missing = sorted({m.item_id for m in report.missing if m.state == "ready"})
    out["dead_lettered"] = []
    out["not_dead_lettered"] = ready_missing if not args.apply else []
    out["leased_missing"] = sorted({m.item_id for m in report.missing if m.state != "ready"})
    status = ExitCode.OK
    if args.apply and ready_missing:
        from ccsq.common.admin_client import with_broker

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
            f"{len(out['leased_missing'])} leased (their worker reports payload_missing)"
        )
    return status


def _cmd_completion(args: argparse.Namespace) -> int:
    from ccsq.producer.completion import main as completion_main

    return completion_main(args.config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ccsq", description="ccsq: durable job broker for GPU inference")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="write a ready-to-run swarm directory (configs, keys, authorized keys)")
    p.add_argument("dir")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="broker endpoint (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="number of worker configs (default %(default)s)")
    p.add_argument("--handler", default="echo", help="worker handler: ocr, echo, sleep, fail (default %(default)s)")
    p.set_defaults(func=_cmd_init)

    p = sub.add_parser("keygen", help="create an Ed25519 key pair for a peer")
    p.add_argument("--out", required=True, help="directory for <id>.key and <id>.pub")
    p.add_argument("--id", required=True, help="peer id")
    p.add_argument("--role", default="worker", choices=["broker", "worker", "producer", "completion", "admin", "relay"])
    p.add_argument("--curve", action="store_true", help="create a ZeroMQ CURVE key pair (transport encryption) instead")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("submit", help="submit files as items (claim check) and optionally wait")
    p.add_argument("--config", required=True, help="producer.toml")
    p.add_argument("--kind", default="ocr", help="item kind (default %(default)s)")
    p.add_argument("--wait", action="store_true", help="wait until every item is acknowledged")
    p.add_argument("--timeout-s", type=float, default=600.0, help="with --wait: give up after this (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser("completion", help="run the completion service (results -> database, then ACK)")
    p.add_argument("--config", required=True, help="completion.toml")
    p.set_defaults(func=_cmd_completion)

    p = sub.add_parser("gap-report", help="accounting, balance and gap-register windows (reads the ledger)")
    p.add_argument("--config", required=True, help="brokerd.toml")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with a chart to FILE")
    p.add_argument("--verbose", action="store_true", help="show where/why/repair of each window")
    p.set_defaults(func=_cmd_gap_report)

    def admin_parser(name: str, help_: str, parent=sub, *, read_only: bool = False) -> argparse.ArgumentParser:
        ap = parent.add_parser(name, help=help_)
        ap.add_argument("--config", required=True, help="admin.toml")
        ap.add_argument("--json", action="store_true", help="print JSON")
        if read_only:
            ap.add_argument("--offline", action="store_true", help="read the ledger directly (also automatic when the broker does not answer)")
        return ap

    p = admin_parser("status", "peers, slots, leases, backlog per queue, oldest ready item", read_only=True)
    p.set_defaults(func=_cmd_status)

    items = sub.add_parser("items", help="look at items").add_subparsers(dest="items_command", required=True)
    p = admin_parser("show", "one item's ledger record", items, read_only=True)
    p.add_argument("item_id")
    p.set_defaults(func=_cmd_items_show)

    dlq = sub.add_parser("dlq", help="dead letters: list, replay, purge").add_subparsers(dest="dlq_command", required=True)
    p = admin_parser("list", "list dead items", dlq, read_only=True)
    p.add_argument("--limit", type=int, default=100, help="at most this many, 1..1000 (default %(default)s)")
    p.set_defaults(func=_cmd_dlq_list)
    for action, help_ in (("replay", "make dead items ready again with a fresh attempt budget"),
                          ("purge", "delete dead items (their idempotency keys are freed)")):
        p = admin_parser(action, help_, dlq)
        p.add_argument("item_ids", nargs="*")
        p.add_argument("--all", action="store_true", help="every dead item")
        p.set_defaults(func=_cmd_dlq_change, action=action)

    p = admin_parser("drain", "stop dispatching to a worker; its leases finish")
    p.add_argument("worker")
    p.add_argument("--undo", action="store_true", help="dispatch to it again")
    p.add_argument("--wait", action="store_true", help="wait until it holds no lease (exit 4 on timeout)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="with --wait (default %(default)s)")
    p.set_defaults(func=_cmd_drain)

    p = sub.add_parser("reconcile", help="compare the ledger with the claim store; collect orphans, dead-letter missing payloads")
    p.add_argument("--config", required=True, help="brokerd.toml")
    p.add_argument("--store", required=True, help="claim store URI (file://PATH or s3://bucket/prefix)")
    p.add_argument("--grace-s", type=float, default=3600.0, help="orphans younger than this are kept (default %(default)s)")
    p.add_argument("--apply", action="store_true", help="delete old orphans and dead-letter ready items whose payload is missing")
    p.add_argument("--admin-config", help="admin.toml for --apply (default: next to brokerd.toml)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_reconcile)

    from ccsq.relayd.cli import add_commands as add_federation_commands  # init-relay, federation report

    add_federation_commands(sub)
    return parser


#: Commands whose log lines (structlog) go to stderr at WARNING, keeping stdout for the answer.
QUIET_LOG_COMMANDS = frozenset({"gap-report", "status", "items", "dlq", "drain", "reconcile", "submit", "init", "keygen"})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in QUIET_LOG_COMMANDS:
        import logging

        from ccsq.common import log as logsetup

        logsetup.configure("auto", level=logging.WARNING)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ccsq {args.command}: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except BrokerUnavailable as exc:
        print(f"ccsq {args.command}: {exc.code}: {exc}", file=sys.stderr)
        return ExitCode.UNAVAILABLE
    except AdminFailed as exc:
        print(f"ccsq {args.command}: {exc.code}: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    except CcsqError as exc:
        print(f"ccsq {args.command}: {exc.code}: {exc}", file=sys.stderr)
        return ExitCode.FAILURE
    except KeyboardInterrupt:
        return ExitCode.FAILURE
    except BrokenPipeError:  # `ccsq status | head -1`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
