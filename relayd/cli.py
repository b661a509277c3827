"""The ``ccsq`` subcommands of federation: ``init-relay`` and ``federation report``
(added to the umbrella parser by :func:`add_commands`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ccsq.common.wire.errors import ExitCode


def _cmd_init_relay(args: argparse.Namespace) -> int:
    from ccsq.common.wire.errors import ConfigError
    from ccsq.relayd.init import init_relay

    links = [(Path(args.upstream), Path(args.downstream))]
    if args.both_ways:
        links.append((Path(args.downstream), Path(args.upstream)))
    if args.store and not args.hosts:
        raise ConfigError("--store names a claim store as the relay host reaches it: it goes with --hosts")
    stores = {}
    for spec in args.store:
        swarm_id, sep, uri = spec.partition("=")
        if not sep or not swarm_id or not uri.startswith(("s3://", "file:///")):
            raise ConfigError(f"--store {spec!r}: write it as SWARM_ID=s3://bucket/prefix (or SWARM_ID=file:///absolute/path "
                              "of a mount on the relay host)")
        stores[swarm_id] = uri
    path = init_relay(Path(args.dir), links, kinds=args.kinds.split(","), relay_id=args.id, hosts=args.hosts,
                      stores=stores)
    print(f"wrote {path}; restart both brokers (they read trusted_swarms.toml at start), then:\n"
          f"  ccsq-relayd --config {path}\n  ccsq federation report --config {path}")
    if args.hosts:
        bundle = path.parent / "hosts" / "relay"
        print(f"relay host bundle {bundle}: copy its content to /etc/ccsq/ on the relay host and check it there with "
              f"sha256sum -c MANIFEST (docs/federation.md, Running it); start ccsq-relayd@{args.id}")
        for d in dict.fromkeys(d for pair in links for d in pair):
            if (d / "hosts" / "broker" / "MANIFEST").exists():
                print(f"refreshed {d / 'hosts' / 'broker'}: copy it to that broker host again "
                      "(brokerd.toml, trusted_swarms.toml, authorized_keys.toml), then restart ccsq-brokerd there")
    return ExitCode.OK


def _cmd_federation_report(args: argparse.Namespace) -> int:
    from ccsq.relayd.federation_report import load_federation_report, render_text

    report = load_federation_report(args.config)
    if args.html:
        from ccsq.relayd.federation_report import render_html

        Path(args.html).write_text(render_html(report))
    print(json.dumps(report, indent=2, default=str) if args.json else render_text(report))
    if not report["balanced"]:
        return ExitCode.UNBALANCED
    return ExitCode.OK if report["healthy"] else ExitCode.UNAUTHORIZED  # a link refused by a swarm: stopped pulling


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init-relay", help="write a relay config + key for two swarm directories and wire their trust")
    p.add_argument("dir", help="the relay's directory (relayd.toml, keys/, relay-journal/)")
    p.add_argument("--upstream", required=True, help="swarm directory that lends work (written by ccsq init)")
    p.add_argument("--downstream", required=True, help="swarm directory that lends GPUs")
    p.add_argument("--kinds", required=True, help="comma-separated item kinds the link carries")
    p.add_argument("--id", default="relay", help="the relay's peer id (default %(default)s)")
    p.add_argument("--both-ways", action="store_true", help="also a link downstream -> upstream")
    p.add_argument("--hosts", action="store_true", help="also write DIR/hosts/relay/: the relay host's /etc/ccsq (relayd-ID.toml, "
                   "its keys, each broker's public keys, MANIFEST), and refresh each swarm's hosts/broker/ "
                   "(docs/federation.md)")
    p.add_argument("--store", action="append", default=[], metavar="SWARM_ID=URI",
                   help="with --hosts: that swarm's claim store as the relay host reaches it (default: the swarm's own "
                   "when it is s3://; a swarm's file:// store is another host's directory and is refused)")
    p.set_defaults(func=_cmd_init_relay)

    fed = sub.add_parser("federation", help="federation between swarms").add_subparsers(dest="federation_command", required=True)
    p = fed.add_parser("report", help="per link: leased, submitted, completed, returned, in flight, fenced, forged; balance")
    p.add_argument("--config", required=True, help="relayd.toml")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page of the report to FILE")
    p.set_defaults(func=_cmd_federation_report)
