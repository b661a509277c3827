"""``ccsq``: the umbrella command line (init, keygen, submit, completion, gap-report,
status, items, dlq, drain, failover, reconcile, completion-script).

``--config`` defaults to ``$CCSQ_CONFIG/<name>.toml`` (or ``/etc/ccsq/<name>.toml``):
:func:`default_config`. Each subcommand imports its part lazily so ``ccsq --help`` stays fast and a
host without onnxruntime can still run the broker-side commands.
Exit codes are :class:`ccsq.common.wire.errors.ExitCode` values; :func:`main` maps the error
types to them.

This module is the command line itself (:func:`build_parser`, :func:`main`, the shared
argument helpers); each command lives with its kin:
:mod:`.init` (init, keygen), :mod:`.submit_cmd` (submit), :mod:`.admin_cmds` (status,
items show, dlq, drain), :mod:`.ledger_cmds` (gap-report, reconcile, backup); federation's
in :mod:`ccsq.relayd.cli`. The progress bar they share is :mod:`.progress`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ccsq.common.runtime.daemon import CONFIG_DIR, CONFIG_ENV, default_config, die, missing_default_config
from ccsq.tools.admin_cmds import (
    _cmd_dlq_change,
    _cmd_dlq_list,
    _cmd_drain,
    _cmd_failover,
    _cmd_items_cancel,
    _cmd_items_show,
    _cmd_status,
    admin_settings,
)
from ccsq.tools.init import _cmd_init, _cmd_keygen
from ccsq.tools.ledger_cmds import _cmd_backup, _cmd_gap_report, _cmd_reconcile
from ccsq.tools.submit_cmd import SUBMIT_REFUSED_GRACE_S, _cmd_outbox_flush, _cmd_submit, _param
from ccsq.common.wire.errors import (
    CcsqError,
    ConfigError,
    ExitCode,
    NoInput,
    Unauthorized,
)


def _peer_id_arg(text: str) -> str:
    """``--id``: a safe peer id (it names files under --out and a [peers.<id>] table), else exit 2."""
    from ccsq.common.wire.keys import check_peer_id

    try:
        return check_peer_id(text, where="--id")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_completion(args: argparse.Namespace) -> int:
    if args.shell:  # `ccsq completion bash`, as kubectl/gh users type it: the shell script, not the service
        return _cmd_completion_script(args)
    from ccsq.completiond.completion import main as completion_main  # = ccsq-completiond

    return completion_main(args.config)


def _cmd_console(args: argparse.Namespace) -> int:
    from ccsq.console.main import run

    return run(admin_settings(args), listen=args.listen, token=args.token, refresh_s=args.refresh_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ccsq", description="ccsq: durable job broker for GPU inference",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ccsq {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="write a ready-to-run swarm directory (configs, keys, authorized keys)")
    p.add_argument("dir")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="broker endpoint peers connect to (default %(default)s)")
    p.add_argument("--bind", default=None, help="endpoint the broker binds, e.g. tcp://0.0.0.0:5555 (default: the endpoint "
                   "itself when its host is a loopback/local address or *, else tcp://0.0.0.0:PORT)")
    p.add_argument("--hosts", action="store_true", help="also write hosts/<host>/: each host's configs, its own private "
                   "key(s) and the public keys it needs (docs/deployment.md)")
    p.add_argument("--gpu-hosts", type=int, default=0, help="with --hosts: spread the workers over this many GPU hosts "
                   "(default: one host per worker)")
    p.add_argument("--workers", type=int, default=2, help="number of worker configs (default %(default)s)")
    p.add_argument("--handler", default="echo", help="worker handler: ocr, echo, sleep, fail (default %(default)s)")
    p.add_argument("--swarm-id", default=None, help="this swarm's name in federation (brokerd.toml swarm_id; default: the "
                   "directory's name and a random suffix, so two sites never share one)")
    p.add_argument("--standby", action="append", metavar="HOST[:PORT]", help="a standby broker host (repeatable): writes "
                   "a broker pair, brokerd.toml for broker-1 on --endpoint's host and brokerd-N.toml per standby, failover "
                   "through etcd (needs --etcd; docs/ha.md)")
    p.add_argument("--etcd", metavar="URLS", help="with --standby: etcd client URLs, http://HOST:2379[,...] (three members "
                   "in production; docs/ha.md)")
    p.add_argument("--etcd-ca", metavar="FILE", help="with --etcd https://...: PEM CA of etcd's server certificates "
                   "(every brokerd's ha_etcd_ca_cert; a path on the broker hosts, relative to the config file)")
    p.add_argument("--etcd-user", metavar="NAME", help="with --etcd: etcd v3 authentication user (ha_etcd_user; needs "
                   "--etcd-password-file)")
    p.add_argument("--etcd-password-file", metavar="FILE", help="with --etcd-user: file with its password, mode 0600, on "
                   "the broker hosts (ha_etcd_password_file)")
    p.set_defaults(func=_cmd_init)

    p = sub.add_parser("keygen", help="create an Ed25519 key pair for a peer")
    p.add_argument("--out", required=True, help="directory for <id>.key and <id>.pub")
    p.add_argument("--id", required=True, type=_peer_id_arg,
                   help="peer id: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    p.add_argument("--role", default="worker", choices=["broker", "worker", "producer", "completion", "admin", "relay"])
    p.add_argument("--curve", action="store_true", help="create a ZeroMQ CURVE key pair (transport encryption) instead")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("submit", help="submit files as items (claim check) and optionally wait",
                       epilog=SUBMIT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_arg(p, "producer")
    p.add_argument("--kind", default=None, help="item kind (default: default_kind in producer.toml, which `ccsq init` "
                                                "sets to its --handler; else ocr)")
    p.add_argument("--wait", action="store_true",
                   help="wait until every item is acknowledged (exit 4 on timeout, 5 if one ends dead or expired)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="with --wait: give up after this (default %(default)s)")
    p.add_argument("--param", type=_param, action="append", metavar="K=V",
                   help="an item parameter for the handler (repeatable; numbers and true/false are typed)")
    p.add_argument("--priority", type=int, default=0, help="higher is dispatched first (default %(default)s)")
    p.add_argument("--deadline-s", type=float, help="the items expire if not completed within this many seconds")
    p.add_argument("--connect-timeout-s", type=float, default=10.0,
                   help="without an outbox: exit 69 when the broker does not answer within this (default %(default)s; "
                        f"a refused connection, nothing listening, fails after {SUBMIT_REFUSED_GRACE_S:g} s)")
    p.add_argument("--submit-timeout-s", type=float, default=60.0,
                   help="how long one file's SUBMIT is retried on QUEUE_FULL/DISK_FULL or silence before exit 75/69 "
                        "(default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("files", nargs="+").complete = FILE_COMPLETION  # type: ignore[attr-defined]
    p.set_defaults(func=_cmd_submit)

    outbox = sub.add_parser("outbox", help="the producer's local outbox (outbox_dir): flush what it spooled")
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True)
    p = outbox_sub.add_parser("flush", help="send the items spooled while the broker was away and wait until the "
                                            "outbox is empty (exit 69 if the broker does not take them in time)")
    _config_arg(p, "producer")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up after this (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_outbox_flush)

    p = sub.add_parser("completion", help="run the completion service (results -> database, then ACK; = ccsq-completiond); "
                                          "`ccsq completion SHELL` prints shell completion instead")
    _config_arg(p, "completion")
    p.add_argument("shell", nargs="?", choices=SHELLS, help="print the completion script for this shell and exit "
                   "(= ccsq completion-script SHELL) instead of running the service")
    p.set_defaults(func=_cmd_completion)

    p = sub.add_parser("gap-report", help="accounting, balance and gap-register windows (reads the ledger)")
    _config_arg(p, "brokerd")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with a chart to FILE")
    p.add_argument("--verbose", action="store_true", help="show where/why/repair of each window")
    p.set_defaults(func=_cmd_gap_report)

    def admin_parser(name: str, help_: str, parent=sub, *, read_only: bool = False) -> argparse.ArgumentParser:
        ap = parent.add_parser(name, help=help_)
        _config_arg(ap, "admin")
        ap.add_argument("--json", action="store_true", help="print JSON")
        if read_only:
            ap.add_argument("--offline", action="store_true",
                            help="read the ledger directly (also automatic when the broker does not answer)")
        return ap

    p = admin_parser("status", "peers, slots, leases, backlog per queue, oldest ready item", read_only=True)
    p.set_defaults(func=_cmd_status)

    def group(name: str, help_: str, dest: str):
        """A command family (``items show``, ``dlq list``...): ``--config`` is accepted before
        the action too (``ccsq dlq --config admin.toml list``), as users type it."""
        gp = sub.add_parser(name, help=help_)
        gp.add_argument("--config", dest="group_config", default=None, metavar="CONFIG",
                        help="admin.toml (same as the action's --config)").complete = FILE_COMPLETION  # type: ignore[attr-defined]
        return gp.add_subparsers(dest=dest, required=True)

    items = group("items", "items: show one, cancel ready ones", "items_command")
    p = admin_parser("show", "one item's ledger record", items, read_only=True)
    p.add_argument("item_id")
    p.set_defaults(func=_cmd_items_show)
    p = admin_parser("cancel", "cancel ready items (by id, or every ready item of --kind): they become dead with "
                     "reason cancelled; a leased or finished item is left as it is", items)
    p.add_argument("item_ids", nargs="*")
    p.add_argument("--kind", default="", help="every ready item of this kind (asks first; --yes does not)")
    p.add_argument("--yes", action="store_true", help="with --kind: do not ask (a script, or no terminal)")
    p.set_defaults(func=_cmd_items_cancel)

    dlq = group("dlq", "dead letters: list, replay, purge", "dlq_command")
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

    p = admin_parser("failover", "planned switchover of a broker pair: the primary hands over to a caught-up standby "
                     "and rejoins as one (docs/ha.md)")
    p.add_argument("--to", metavar="NODE", default="", help="the standby node to hand over to, e.g. broker-2 (default: any "
                   "standby of the sync set that holds the last turn); refused at once unless it is a connected standby in sync")
    p.add_argument("--timeout-s", type=float, default=30.0, help="refuse (nothing changes) when no standby caught up within "
                   "this; also how long to wait for the new primary (default %(default)s)")
    p.set_defaults(func=_cmd_failover)

    p = sub.add_parser("reconcile", help="compare the ledger with the claim store; collect orphans, dead-letter missing payloads")
    _config_arg(p, "brokerd")
    p.add_argument("--store", default="", help="claim store URI (file://PATH or s3://bucket/prefix; default: claim_store "
                   "of producer.toml next to brokerd.toml); a file:// root that does not exist is refused (exit 78)")
    p.add_argument("--force", action="store_true", help="with --apply: dead-letter even when the store holds none of the payloads")
    p.add_argument("--grace-s", type=float, default=3600.0, help="orphans younger than this are kept (default %(default)s)")
    p.add_argument("--apply", action="store_true", help="delete old orphans and dead-letter ready items whose payload is missing")
    p.add_argument("--admin-config", help="admin.toml for --apply (default: next to brokerd.toml)")
    p.add_argument("--s3-endpoint-url", default="", help="for s3://: the S3-compatible server (as s3_endpoint_url in the configs)")
    p.add_argument("--s3-region", default="", help="for s3://: the region")
    p.add_argument("--s3-profile", default="", help="for s3://: a profile of the AWS credential chain")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_reconcile)

    from ccsq.relayd.cli import add_commands as add_federation_commands  # init-relay, federation report

    add_federation_commands(sub)
    p = sub.add_parser("backup", help="consistent compacting hot copy of the ledger (safe while the broker runs)")
    _config_arg(p, "brokerd")
    p.add_argument("dest", help="new or empty directory for the copy's data.mdb")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_backup)

    p = sub.add_parser("console", help="the live console in the browser: accounting, workers, items, dead letters, gaps")
    _config_arg(p, "admin")
    p.add_argument("--listen", help="HOST:PORT (default: console_listen in admin.toml, 127.0.0.1:8750); "
                   "a non-loopback address needs a token")
    p.add_argument("--token", help="access token (admin role); also CCSQ_CONSOLE_TOKEN or console_tokens in admin.toml")
    p.add_argument("--refresh-s", type=float, default=5.0, help="pages reload this often, 0 = never (default %(default)s)")
    p.set_defaults(func=_cmd_console)

    p = sub.add_parser("completion-script", help="print a shell completion script (bash, zsh, tcsh or fish)",
                       epilog="examples:\n  ccsq completion-script bash > /etc/bash_completion.d/ccsq\n"
                              "  ccsq completion-script zsh > ~/.zfunc/_ccsq\n"
                              "  ccsq completion-script fish > ~/.config/fish/completions/ccsq.fish",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shell", choices=SHELLS)
    p.set_defaults(func=_cmd_completion_script)
    return parser


EXAMPLES = """\
examples:
  ccsq init swarm && cd swarm                   # a ready-to-run swarm directory
  export CCSQ_CONFIG=$PWD                       # then --config can be left out (default: /etc/ccsq/<name>.toml)
  ccsq submit --kind ocr --wait scans/*.png     # submit files and wait until acknowledged
  ccsq status                                   # peers, their kinds, backlog per kind
  ccsq dlq list && ccsq dlq replay --all        # dead letters: why, and retry
  ccsq gap-report --html report.html            # accounting and every at-least-once window
  source <(ccsq completion bash)                # tab completion (zsh, tcsh, fish too)

exit codes: 0 ok, 1 unexpected failure, 2 usage, 3 gap report unbalanced, 4 not acknowledged in time,
5 an item ended dead or expired, 65 the broker refused the request, 66 an input file is missing,
69 the broker did not answer (status: shown from the ledger), 74 ledger write failed,
75 temporary: queue full, claim store unreachable, ledger locked, port busy,
77 the broker refused this peer (unknown id, wrong key, wrong role), 78 configuration error,
79 GPU required but unusable, 80 ledger file corrupt or unreadable (restore a `ccsq backup`)
"""

SUBMIT_EXAMPLES = """\
examples:
  ccsq submit --kind ocr scan-1.png scan-2.png
  ccsq submit --kind classify --param model=resnet50.onnx --param top_k=5 --priority 10 --wait photo.jpg
  ccsq submit --kind ocr --deadline-s 3600 --wait --timeout-s 3600 --json batch/*.png
"""

#: shtab.FILE (file-name completion), without importing shtab for every command.
FILE_COMPLETION = {"bash": "_shtab_compgen_files", "zsh": "_files", "tcsh": "f"}



def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ccsq")
    except PackageNotFoundError:
        return "unknown"


def _config_arg(parser: argparse.ArgumentParser, name: str) -> None:
    """``--config`` of a command that reads ``<name>.toml`` (default: see :func:`default_config`)."""
    parser.add_argument("--config", default=None,
                        help=f"{name}.toml (default: ${CONFIG_ENV}/{name}.toml when ${CONFIG_ENV} is a directory, "
                             f"${CONFIG_ENV} when it is a file, else {CONFIG_DIR}/{name}.toml)",
                        ).complete = FILE_COMPLETION  # type: ignore[attr-defined]
    parser.set_defaults(config_name=name)


def _other_kind_of_config(command: str, name: str, path: str) -> str | None:
    """``$CCSQ_CONFIG`` names one file (not a directory), so every command reads it: when it is
    not a ``<name>.toml`` (its name differs and it does not load as one), the sentence that
    says which file this command needs; None when it is fine or cannot be told."""
    import os

    env = os.environ.get(CONFIG_ENV)
    if not env or Path(env).is_dir() or Path(path).name == f"{name}.toml":
        return None
    from ccsq.common.wire.config import AdminConfig, BrokerConfig, CompletionConfig, ProducerConfig, load

    cls = {"brokerd": BrokerConfig, "producer": ProducerConfig, "completion": CompletionConfig, "admin": AdminConfig}.get(name)
    if cls is None:
        return None
    try:
        load(cls, path)
    except ConfigError as exc:
        return (f"configuration error: {CONFIG_ENV}={env} names one file, which every command then "
                f"reads, but `ccsq {command}` needs {name}.toml and {path} does not load as one ({exc}): set "
                f"{CONFIG_ENV} to the directory that holds {name}.toml (the one `ccsq init` wrote), or pass "
                f"--config {name}.toml")
    return None


SHELLS = ("bash", "zsh", "tcsh", "fish")


def _cmd_completion_script(args: argparse.Namespace) -> int:
    if args.shell == "fish":  # shtab has no fish: made from the same parser
        print(fish_completion(build_parser()))
        return ExitCode.OK
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell))
    return ExitCode.OK


def fish_completion(parser: argparse.ArgumentParser) -> str:
    """A fish completion script for ``parser`` (``complete -c PROG ...`` lines): each
    command and sub-command with its help, each option of each, choices, files for
    arguments that complete files."""
    prog = parser.prog
    lines = [f"# fish completion for {prog} (ccsq completion-script fish)", f"complete -c {prog} -f"]

    def quote(text: str | None) -> str:
        return "'" + (text or "").replace("\\", "\\\\").replace("'", "\\'") + "'"

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        names = [n for a in subs for n in a.choices]
        seen = [f"__fish_seen_subcommand_from {w}" for w in path]
        cond = "; and ".join(seen) or "__fish_use_subcommand"  # this (sub)command's options
        here = "; and ".join([*seen, f"not __fish_seen_subcommand_from {' '.join(names)}"])  # its sub-commands
        for a in subs:
            helps = {c.dest: c.help for c in a._choices_actions}
            for name in a.choices:
                lines.append(f"complete -c {prog} -n {quote(here)} -a {name} -d {quote(helps.get(name))}")
        for action in p._actions:
            if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
                continue
            opt = ""
            for o in action.option_strings:
                opt += f" -l {o[2:]}" if o.startswith("--") else f" -s {o[1:]}"
            extra = ""
            if action.choices and not isinstance(action.choices, dict):
                extra = f" -x -a {quote(' '.join(map(str, action.choices)))}"
            elif getattr(action, "complete", None) is not None:
                extra = " -r -F"
            elif action.option_strings and action.nargs != 0:
                extra = " -r"
            if not opt and not extra:
                continue
            try:
                text = (action.help or "") % {**vars(action), "default": action.default}
            except (KeyError, TypeError, ValueError):
                text = action.help or ""
            lines.append(f"complete -c {prog} -n {quote(cond)}{opt}{extra} -d {quote(text)}")
        for a in subs:
            for name, child in a.choices.items():
                walk(child, [*path, name])

    walk(parser, [])
    return "\n".join(lines)


#: Commands whose log lines (structlog) go to stderr at WARNING, keeping stdout for the answer.
QUIET_LOG_COMMANDS = frozenset({"gap-report", "status", "items", "dlq", "drain", "failover", "reconcile", "submit", "init", "keygen",
                                "completion-script", "backup", "outbox"})


#: The link's own log lines about why it got no session: a command prints that as its sentence.
QUIET_LINK_EVENTS = frozenset({"broker_refused_peer", "broker_unreachable", "curve_mismatch", "curve_handshake_failed"})


def _not_refusal(record) -> bool:
    return (getattr(record, "ccsq_event", None) or {}).get("event") not in QUIET_LINK_EVENTS


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "group_config", None) and args.config is None:
        args.config = args.group_config
    if getattr(args, "config_name", None) and args.config is None and not (args.command == "completion" and args.shell):
        args.config = default_config(args.config_name)
        if not Path(args.config).exists():
            return die(f"ccsq {args.command}", missing_default_config(args.config))
        wrong = _other_kind_of_config(args.command, args.config_name, args.config)
        if wrong:
            return die(f"ccsq {args.command}", ExitCode.CONFIG, wrong)
    if args.command in QUIET_LOG_COMMANDS:
        import logging

        from ccsq.common.runtime import log as logsetup

        logsetup.configure("auto", level=logging.WARNING)
        logging.getLogger("ccsq.peer").addFilter(_not_refusal)  # the command prints the refusal as a sentence
    try:
        return int(args.func(args))
    except CcsqError as exc:  # the code: exit_code_for (a LedgerError's own, ConfigError 78, BrokerUnavailable 69, ...)
        reason = (f"configuration error: {exc}" if isinstance(exc, ConfigError) else str(exc) if isinstance(exc, (NoInput, Unauthorized))
                  else f"{exc.code}: {exc}")
        return die(f"ccsq {args.command}", exc, reason)
    except KeyboardInterrupt:
        return ExitCode.FAILURE
    except BrokenPipeError:  # `ccsq status | head -1`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
