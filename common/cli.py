"""``ccsq``: the umbrella command line (init, keygen, submit, completion, gap-report, ...).

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

from ccsq.common.errors import CcsqError, ConfigError, ExitCode
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
    write("admin.toml", {"peer_id": "admin", "private_key": "keys/admin.key", **common})
    return written


def _cmd_init(args: argparse.Namespace) -> int:
    written = init_swarm(Path(args.dir), endpoint=args.endpoint, workers=args.workers, handler=args.handler)
    for name, path in written.items():
        print(f"{name:14} {path}")
    return ExitCode.OK


def _cmd_keygen(args: argparse.Namespace) -> int:
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
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_text(report))
    return ExitCode.OK if report["balanced"] else ExitCode.UNBALANCED


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
    p.add_argument("--role", default="worker", choices=["broker", "worker", "producer", "completion", "admin"])
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
    p.set_defaults(func=_cmd_gap_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ccsq {args.command}: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except CcsqError as exc:
        print(f"ccsq {args.command}: {exc.code}: {exc}", file=sys.stderr)
        return ExitCode.FAILURE
    except KeyboardInterrupt:
        return ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
