"""``ccsq``: the umbrella command line (init, keygen, submit, completion, gap-report,
status, items, dlq, drain, reconcile, completion-script).

``--config`` defaults to ``$CCSQ_CONFIG/<name>.toml`` (or ``/etc/ccsq/<name>.toml``):
:func:`default_config`. Each subcommand imports its part lazily so ``ccsq --help`` stays fast and a
host without onnxruntime can still run the broker-side commands.
Exit codes are :class:`ccsq.common.wire.errors.ExitCode` values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tomli_w

from ccsq.common.runtime.daemon import CONFIG_DIR, CONFIG_ENV, default_config
from ccsq.common.wire.errors import (
    AdminFailed,
    BrokerUnavailable,
    CantCreate,
    CcsqError,
    ConfigError,
    ExitCode,
    NoInput,
    QueueFull,
    Unauthorized,
)
from ccsq.common.wire.keys import public_key_b64, load_private_key, write_authorized_keys, write_curve_keypair, write_keypair


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
    bind: str = "",
) -> dict[str, Path]:
    """Write a ready-to-run swarm directory; returns ``{name: config path}``.

    ``endpoint`` is what peers connect to; ``bind`` (optional) what the broker binds
    when that differs (``tcp://0.0.0.0:5555`` behind ``tcp://gpu-broker.internal:5555``).

    Layout (all state lives under ``directory``)::

        brokerd.toml  workerd-0.toml ... workerd-<N-1>.toml  producer.toml  completion.toml
        authorized_keys.toml  keys/<peer>.key (0600) keys/<peer>.pub
        keys/<peer>.curve.key (0600) keys/<peer>.curve.pub (CURVE; curve = true when the endpoint is not loopback)
        blobs/ (file claim store)  broker-data/ (ledger)  worker-N-journal/  results.db

    Worker numbering: ``workerd-G.toml`` is named after the GPU index G (0-based, ``nvidia-smi``
    order) that ``ccsq-workerd@G.service`` drives and reads as ``/etc/ccsq/workerd-G.toml``; the
    peer inside is ``worker-<G+1>`` (worker-1..N, unique in the swarm: on another GPU host the
    file for its GPU 0 holds another peer id). Keys ``workerd-0`` ... in the returned dict.

    ``broker``/``worker``/``producer``/``completion`` override config keys.
    Raises ConfigError if the directory already holds a swarm.
    """
    from ccsq.brokerd.transport import is_loopback_endpoint

    directory = directory.resolve()
    from ccsq.common.wire.endpoints import check_endpoint

    check_endpoint(endpoint, bind=not bind, where="--endpoint")
    if bind:
        check_endpoint(bind, bind=True, where="--bind")
    if (directory / "brokerd.toml").exists():
        raise ConfigError(f"{directory} already holds a swarm (brokerd.toml exists); choose another directory")
    directory.mkdir(parents=True, exist_ok=True)
    keys_dir = directory / "keys"
    peers = {"broker": "broker", "producer-1": "producer", "completion-1": "completion", "admin": "admin"}
    peers.update({f"worker-{i}": "worker" for i in range(1, workers + 1)})
    authorized: dict[str, tuple[str, ...]] = {}
    for peer_id, role in peers.items():
        priv, _ = write_keypair(keys_dir, peer_id)
        _, curve_pub = write_curve_keypair(keys_dir, peer_id)  # CURVE: the broker's ZAP allow-list (docs/security.md)
        authorized[peer_id] = (role, public_key_b64(load_private_key(priv)), curve_pub.read_text().strip())
    write_authorized_keys(directory / "authorized_keys.toml", authorized)
    (directory / "blobs").mkdir(exist_ok=True)
    common = {"authorized_keys": "authorized_keys.toml", "broker_endpoint": endpoint, "broker_id": "broker"}
    # CURVE with the allow-list is on when the broker binds beyond loopback (it refuses to start without it)
    curve_on = not is_loopback_endpoint(bind or endpoint) or not is_loopback_endpoint(endpoint)

    def curve_lines(peer_id: str) -> dict:
        return {"curve": curve_on, "curve_secret_key": f"keys/{peer_id}.curve.key", "broker_curve_public_key": "keys/broker.curve.pub"}
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
            **({"bind": bind} if bind else {}),
            "data_dir": "broker-data",
            "curve": curve_on,
            "curve_secret_key": "keys/broker.curve.key",
            **(broker or {}),
        },
    )
    for i in range(1, workers + 1):  # peer worker-i drives GPU i-1: workerd-<GPU index>.toml
        write(
            f"workerd-{i - 1}.toml",
            {
                "peer_id": f"worker-{i}",
                "private_key": f"keys/worker-{i}.key",
                **common,
                "handler": handler,
                "claim_store": "file://blobs",
                "journal_dir": f"worker-{i}-journal",
                **curve_lines(f"worker-{i}"),
                **(worker or {}),
            },
        )
    write(
        "producer.toml",
        {"peer_id": "producer-1", "private_key": "keys/producer-1.key", **common, "claim_store": "file://blobs",
         "default_kind": handler, **curve_lines("producer-1"), **(producer or {})},
    )
    write(
        "completion.toml",
        {
            "peer_id": "completion-1",
            "private_key": "keys/completion-1.key",
            **common,
            "claim_store": "file://blobs",
            "database": "sqlite:///results.db",
            **curve_lines("completion-1"),
            **(completion or {}),
        },
    )
    write(
        "admin.toml",
        {"peer_id": "admin", "private_key": "keys/admin.key", **common, "data_dir": (broker or {}).get("data_dir", "broker-data"),
         **curve_lines("admin")},
    )
    return written


def _cmd_init(args: argparse.Namespace) -> int:
    from ccsq.common.wire.endpoints import default_bind

    bind = args.bind if args.bind is not None else default_bind(args.endpoint)
    try:
        written = init_swarm(Path(args.dir), endpoint=args.endpoint, workers=args.workers, handler=args.handler, bind=bind)
    except OSError as exc:
        raise CantCreate.of("the swarm directory", args.dir, exc) from None
    for name, path in written.items():
        print(f"{name:14} {path}")
    if bind:
        print(f"the broker binds {bind}; peers connect to {args.endpoint}")
    if args.hosts:
        from ccsq.common.tools.hosts import render_layout, write_host_layout

        print(render_layout(write_host_layout(Path(args.dir), gpu_hosts=args.gpu_hosts)))
    return ExitCode.OK


def _cmd_keygen(args: argparse.Namespace) -> int:
    if args.curve:
        from ccsq.common.wire.keys import write_curve_keypair

        secret, public = write_curve_keypair(Path(args.out), args.id)
        print(f"CURVE secret key {secret} (mode 0600)\nCURVE public key {public}: {public.read_text().strip()}")
        print("broker: curve = true, curve_secret_key = <secret path>; peers: curve = true, "
              "curve_secret_key = <their secret path>, broker_curve_public_key = <the broker's public path>")
        print(f'add to the [peers.{args.id}] entry of authorized_keys.toml (the broker admits only listed keys; '
              f'SIGHUP reloads):\ncurve_public_key = "{public.read_text().strip()}"')
        return ExitCode.OK
    priv, pub = write_keypair(Path(args.out), args.id)
    print(f"private key {priv} (mode 0600)\npublic key  {pub}: {pub.read_text().strip()}")
    print(f'add to authorized_keys.toml:\n[peers.{args.id}]\nrole = "{args.role}"\npublic_key = "{pub.read_text().strip()}"')
    return ExitCode.OK


def _peer_id_arg(text: str) -> str:
    """``--id``: a safe peer id (it names files under --out and a [peers.<id>] table), else exit 2."""
    from ccsq.common.wire.keys import check_peer_id

    try:
        return check_peer_id(text, where="--id")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- ccsq submit ----------------------------------------------------------------------
def _param(text: str) -> tuple[str, object]:
    """``K=V`` for ``--param``: V as int, float, true/false, else the string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param {text!r}: expected KEY=VALUE")
    value: object = raw
    if raw in ("true", "false"):
        value = raw == "true"
    else:
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                pass
    return key, value


def _progress(enabled: bool):
    """A rich progress bar on stderr when it is a terminal (and ``enabled``), else a no-op."""
    import contextlib

    if not (enabled and sys.stderr.isatty()):
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def _submit_state(r) -> str:
    """The state column of a submit without --wait."""
    return "spooled" if r.spooled else ("duplicate" if r.duplicate else "submitted")

#: ``ccsq submit`` without an outbox: connects refused (nothing listens) this long mean
#: "broker down" at once; a broker that accepts but answers slowly gets --connect-timeout-s.
SUBMIT_REFUSED_GRACE_S = 1.5


def _cmd_submit(args: argparse.Namespace) -> int:
    import time

    from ccsq.producer.client import DONE_STATES, UNANSWERED_STATE, Client

    items = [Path(f) for f in args.files]
    missing = [str(f) for f in items if not f.is_file()]
    if missing:
        raise NoInput(f"no such file: {', '.join(missing)}")
    params = dict(args.param or [])
    deadline_ts = None if args.deadline_s is None else time.time() + args.deadline_s

    def submit_one(client, f: Path):
        return client.submit(f, args.kind, params={"name": f.name, **params}, priority=args.priority,
                             deadline_ts=deadline_ts, timeout_s=args.submit_timeout_s)

    with Client.from_config_file(args.config) as client:
        if args.kind is None:  # the swarm's kind (init writes its --handler), else the historical default
            args.kind = client.config.default_kind or "ocr"
        if not client.config.outbox_dir and not client.wait_connected(args.connect_timeout_s,
                                                                      refused_grace_s=SUBMIT_REFUSED_GRACE_S):
            problem = client.connect_problem()
            if problem and problem.startswith(("CURVE mismatch", "CURVE handshake")):  # configuration, not a down broker
                raise ConfigError(problem)
            raise BrokerUnavailable(
                (f"{problem}: " if problem else
                 f"the broker at {client.config.broker_endpoint} did not answer within {args.connect_timeout_s:g} s: ")
                + f"start ccsq-brokerd (systemctl start ccsq-brokerd) or fix broker_endpoint in {args.config} "
                "(or set outbox_dir there to spool while it is down)"
            )
        with _progress(len(items) > 1 and not args.json) as bar:
            task = bar.add_task("submitting", total=len(items)) if bar else None
            receipts = []
            full = None
            for f in items:
                try:
                    receipts.append(submit_one(client, f))
                except QueueFull as exc:  # retryable: say what was accepted, exit 75 (TEMPFAIL)
                    full = exc
                    break
                if bar:
                    bar.advance(task)
        if full is not None:
            rows = [{"file": str(f), "item_id": r.item_id, "key": r.key, "duplicate": r.duplicate, "spooled": r.spooled,
                     "state": _submit_state(r)} for f, r in zip(items, receipts)]
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for row in rows:
                    print(f"{row['item_id'] or '(spooled)':>20}  {'dup ' if row['duplicate'] else ''}{row['state']}  {row['file']}")
            print(f"ccsq submit: QUEUE_FULL: the broker accepted {len(receipts)} of {len(items)} file(s) (listed above) and "
                  f"refused {items[len(receipts)]} and the rest: {full}. Retry later with the same command (accepted files are "
                  "recognised as duplicates), or set outbox_dir in the producer config to spool", file=sys.stderr)
            return ExitCode.TEMPFAIL
        unserved = sorted({args.kind for r in receipts if getattr(r, "unserved", False)})
        for kind in unserved:
            print(f"ccsq submit: warning: no worker seen by the broker recently (since it started, or in the day before) serves "
                  f"kind {kind!r}: the items wait in "
                  "`ready` until one connects (a worker serves the kinds in its workerd.toml `kinds`, default its "
                  "handler's name; `ccsq status` lists them)", file=sys.stderr)
        out = [{"file": str(f), "item_id": r.item_id, "key": r.key, "duplicate": r.duplicate, "spooled": r.spooled,
                "state": _submit_state(r)} for f, r in zip(items, receipts)]
        status_code = ExitCode.OK
        if args.wait:
            deadline = time.monotonic() + args.timeout_s
            if any(r.spooled for r in receipts):
                # spooled while the broker was away: let the outbox drain, then the same
                # submit (same idempotency key) answers the original item id
                client.flush(timeout_s=args.timeout_s)
                receipts = [submit_one(client, f) if r.spooled else r for f, r in zip(items, receipts)]
                for row, r in zip(out, receipts):
                    row["item_id"] = r.item_id
            ids = [r.item_id for r in receipts if r.item_id]
            states: dict = {}
            with _progress(not args.json) as bar:
                task = bar.add_task("acknowledged", total=len(ids)) if bar else None
                todo = list(ids)
                while todo:
                    left = deadline - time.monotonic()
                    got = client.wait(todo, timeout_s=max(0.1, min(left, 1.0)))
                    states.update({i: s for i, s in got.items() if s.state != UNANSWERED_STATE or i not in states})
                    todo = [i for i in todo if states[i].state not in DONE_STATES]
                    if bar:
                        bar.update(task, completed=sum(1 for i in ids if states[i].state == "acknowledged"))
                    if time.monotonic() >= deadline:
                        break
            for row in out:
                st = states.get(row["item_id"])
                row["state"] = st.state if st else "unknown"
                if st is not None and st.error:
                    row["error"] = st.error
            final = [row["state"] for row in out]
            if any(st in ("dead", "expired") for st in final):
                status_code = ExitCode.DEAD
            elif any(st != "acknowledged" for st in final):
                status_code = ExitCode.INCOMPLETE
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for row in out:
            err = f" ({row['error']})" if row.get("error") else ""
            print(f"{row['item_id'] or '(spooled)':>20}  {'dup ' if row['duplicate'] else ''}{row['state']}{err}  {row['file']}")
    if status_code == ExitCode.DEAD:
        print("ccsq submit: some items ended dead or expired: `ccsq dlq list` says why, `ccsq dlq replay ID` retries",
              file=sys.stderr)
    elif status_code == ExitCode.INCOMPLETE:
        print(f"ccsq submit: not every item was acknowledged within {args.timeout_s:g} s (`ccsq status` shows the backlog"
              " and the workers)", file=sys.stderr)
    return status_code


# --- ccsq gap-report ------------------------------------------------------------------
def _cmd_gap_report(args: argparse.Namespace) -> int:
    from ccsq.brokerd.report import load_report, render_text
    from ccsq.common.wire.config import BrokerConfig, load

    cfg = load(BrokerConfig, args.config)
    report = load_report(cfg.data_dir)
    _name_unserved_queues(report, Path(args.config).resolve().parent / "admin.toml")
    if args.html:
        from ccsq.brokerd.report import render_html

        try:
            Path(args.html).write_text(render_html(report))
        except OSError as exc:
            raise CantCreate.of("the HTML report", args.html, exc) from None
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif not args.html:
        print(render_text(report, verbose=args.verbose))
    else:
        print(f"wrote {args.html}: {'BALANCED' if report['balanced'] else 'UNBALANCED'}")
    return ExitCode.OK if report["balanced"] else ExitCode.UNBALANCED


def _name_unserved_queues(report: dict, admin_path: Path) -> None:
    """A stalled queue whose kind no connected worker serves says so ("stalled: no worker
    serves kind 'X'"), when the broker answers an admin status (``admin.toml`` next to
    ``brokerd.toml``) within 1 s; otherwise the verdict stays "stalled"."""
    stalled = [q for q in report.get("queues", []) if q.get("verdict") == "stalled"]
    if not stalled or not admin_path.is_file():
        return
    from ccsq.common.tools.admin_client import with_broker
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


# --- admin commands: status, items show, dlq, drain --------------------------------------
def _admin_settings(args: argparse.Namespace):
    from ccsq.common.wire.config import AdminConfig, load

    return load(AdminConfig, args.config)


def _admin_mode(args: argparse.Namespace) -> str:
    return "offline" if getattr(args, "offline", False) else "auto"


def _read_query(args: argparse.Namespace, command: str, params: dict | None = None) -> dict:
    """Run a read-only admin ``command`` (status, items_show, dlq_list) against the
    broker, or against the ledger when it does not answer or with --offline."""
    from ccsq.common.tools.admin_client import run_command

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
        for col in ("peer", "role", "kinds", "slots", "busy", "credit", "leases", "done", "healthy", "store", "draining", "last seen"):
            pt.add_column(col)
        for peer in doc.get("peers", []):
            kinds = ", ".join(peer.get("kinds") or []) or ("any" if peer["role"] == "worker" else "")
            pt.add_row(
                peer["peer_id"], peer["role"], kinds, str(peer["slots"]), str(peer["busy"]), str(peer["credit"]),
                str(peer["leases"]), str(peer["done"]), "yes" if peer["healthy"] else "NO", _store_cell(peer),
                "yes" if peer.get("draining") else "", f"{peer['last_seen_s']:.1f} s",
            )
        console.print(pt)
        for peer in doc.get("peers", []):
            if peer.get("store_ok") is False:
                console.print(f"{peer['peer_id']}: claim store failing: {peer.get('store_error', '')} "
                              "(no new items until it reports healthy; docs/deployment.md)")
    if (doc.get("ledger") or {}).get("full_since_ms"):
        console.print(f"LEDGER FULL: {doc['ledger'].get('full_advice', 'raise max_map_size_bytes and restart ccsq-brokerd')}")
    if doc.get("draining"):  # kept in the ledger: shown offline too
        console.print("draining: " + ", ".join(doc["draining"]))
    if doc.get("readers"):
        console.print(render_readers(doc["readers"]))
    bt = Table(title="backlog per queue (kind)")
    bt.add_column("kind")
    states = list(doc.get("states", {}))
    for st in states:
        bt.add_column(st, justify="right")
    for kind, per in sorted(doc.get("backlog", {}).items()):
        bt.add_row(kind, *(str(per.get(st, 0)) for st in states))
    console.print(bt)
    if doc.get("source") == "broker":
        workers = [x for x in doc.get("peers", []) if x["role"] == "worker"]
        for kind, per in sorted(doc.get("backlog", {}).items()):
            if per.get("ready") and not any(not w.get("kinds") or kind in w["kinds"] for w in workers):
                console.print(f"no connected worker serves kind {kind!r} ({per['ready']} ready item(s) wait for one)")
    return buf.getvalue()


def _store_cell(peer: dict) -> str:
    """The ``store`` column: a worker's claim-store health and its store_unavailable count."""
    if "store_ok" not in peer:
        return ""
    n = peer.get("store_failures", 0)
    return ("ok" if peer["store_ok"] else "FAILING") + (f" ({n} failed)" if n else "")


def render_readers(r: dict) -> str:
    """One or two lines on the ledger's readers: slots, the oldest snapshot (pid,
    commits behind, age, pages it pins) and disk use; WARNING past warn_age_s."""
    mib = 1 << 20
    line = (f"ledger readers: {r['slots']} of {r['max_readers']} slots, {r['snapshots']} snapshot(s); "
            f"data.mdb {r['file_bytes'] / mib:.1f} MiB: live {r['live_bytes'] / mib:.1f} MiB, "
            f"free or pinned {r['free_bytes'] / mib:.1f} MiB; stale slots cleared {r['stale_cleared']}")
    old = r.get("oldest")
    if old and old["lag_txns"]:
        age = f"{'>= ' if old['age_at_least'] else ''}{old['age_s']:.1f} s"
        pinned = f"{'<= ' if old['pinned_upper_bound'] else '~'}{old['pinned_bytes'] / mib:.1f} MiB"
        warn = r.get("warn_age_s")
        flag = "WARNING " if warn is not None and old["age_s"] >= warn and not old.get("self") else ""
        line += (f"\n{flag}oldest reader: pid {old['pid']}{' (this command)' if old.get('self') else ''}, "
                 f"snapshot {old['txnid']}, {old['lag_txns']} commits behind, {age} old, pins {pinned} "
                 "(pages freed since cannot be reused while it reads; docs/ledger.md)")
    return line


def _when(key: str, value: object) -> object:
    """Epoch-millisecond (``*_ms``) and epoch-second (``*_ts``) times as ISO 8601 UTC dates."""
    import datetime

    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return value
    if key.endswith("_ms") and value > 1e11:
        seconds = value / 1000.0
    elif key.endswith("_ts") and value > 1e8:
        seconds = float(value)
    else:
        return value
    when = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


#: States in which an item's ``error``/``error_message`` is history, not its present:
#: the fields stay in the ledger (what the last failed attempt said) and ``items show``
#: labels them "last error (attempt N)"; only dead/expired items show them as the error.
FAILED_STATES = ("dead", "expired")


def _item_rows(doc: dict) -> list[tuple[str, object]]:
    """The rows of ``items show`` (text): times as ISO dates, 0 (unset) times as "-",
    ``max_attempts`` 0 as the broker default, an error of an earlier attempt labelled so."""
    rec = doc["item"]
    stale = rec.get("state") not in FAILED_STATES
    rows: list[tuple[str, object]] = []
    for k, v in rec.items():
        if k.endswith(("_ms", "_ts")) and v in (0, None):
            v = "-"
        elif k == "max_attempts" and v == 0:
            default = doc.get("default_max_attempts")
            v = f"broker default ({default})" if default else "broker default (max_attempts in brokerd.toml)"
        elif k in ("error", "error_message") and stale:
            if not v:
                continue
            k = "last error" if k == "error" else "last error msg"
            v = f"{v} (an earlier attempt; the item is {rec.get('state')} now)" if k == "last error" else v
        else:
            v = _when(k, v)
        rows.append((k, v))
    return rows


def _broker_max_attempts(admin_config: str | None) -> int | None:
    """``max_attempts`` of the brokerd.toml next to ``admin_config`` (what an item's
    max_attempts 0 means), or None when there is none to read."""
    from ccsq.common.wire.config import BrokerConfig, load

    try:
        return load(BrokerConfig, Path(admin_config).with_name("brokerd.toml")).max_attempts if admin_config else None
    except Exception:  # noqa: BLE001 - only a label
        return None


def _cmd_items_show(args: argparse.Namespace) -> int:
    doc = _read_query(args, "items_show", {"item_id": args.item_id})
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        for k, v in _item_rows({**doc, "default_max_attempts": _broker_max_attempts(_admin_settings(args).config_path)}):
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
            print(f"{rec['id']}  {rec['kind']:12} attempt {rec['attempt']}  {rec.get('error', '')}: {rec.get('error_message', '')}")
        purged = doc.get("purged", 0)
        print(f"{len(doc['items'])} shown of {doc['total']} dead letters" + (f" (+{purged} purged)" if purged else ""))
    return ExitCode.OK


def _cmd_dlq_change(args: argparse.Namespace) -> int:
    """dlq replay / dlq purge: item ids, or --all (in calls of up to 1000)."""
    from ccsq.common.tools.admin_client import with_broker

    if bool(args.item_ids) == bool(args.all):
        raise ConfigError(f"dlq {args.action}: give item ids or --all (not both)")
    command, key = ("dlq_replay", "replayed") if args.action == "replay" else ("dlq_purge", "purged")

    async def go(session) -> dict:
        done: list[str] = []
        not_dead: list[str] = []
        unknown: list[str] = []
        with _progress(not args.json) as bar:
            task = bar.add_task(f"dlq {args.action}", total=None if args.all else len(args.item_ids)) if bar else None
            if args.all:
                while True:
                    doc = await session.call(command, {"all": True})
                    done += doc[key]
                    if bar:
                        bar.update(task, completed=len(done))
                    if not doc["more"] or not doc[key]:
                        break
            else:
                for item_id in args.item_ids:
                    doc = await session.call(command, {"item_id": item_id})
                    done += doc[key]
                    unknown += doc.get("unknown", [])  # brokers before this field: unknown ids count as not dead
                    not_dead += [i for i in doc["not_dead"] if i not in doc.get("unknown", [])]
                    if bar:
                        bar.advance(task)
        return {key: done, "not_dead": not_dead, "unknown": unknown}

    out = with_broker(_admin_settings(args), go)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.action}: {len(out[key])} item(s)" + (f"; not dead: {', '.join(out['not_dead'])}" if out["not_dead"] else "")
              + (f"; unknown (no such item in the ledger): {', '.join(out['unknown'])}" if out["unknown"] else ""))
    return ExitCode.OK if not out["not_dead"] and not out["unknown"] else ExitCode.REFUSED


def _cmd_drain(args: argparse.Namespace) -> int:
    import time

    from ccsq.common.tools.admin_client import with_broker

    async def go(session) -> dict:
        import asyncio

        doc = await session.call("drain", {"worker": args.worker, "undo": args.undo})
        if args.wait and not args.undo:
            deadline = time.monotonic() + args.timeout_s
            with _progress(not args.json and doc["leases"] > 0) as bar:
                task = bar.add_task(f"{args.worker}: leases finished", total=doc["leases"]) if bar else None
                start = doc["leases"]
                while doc["leases"] > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    st = await session.call("status")
                    doc["leases"] = next((x["leases"] for x in st["peers"] if x["peer_id"] == args.worker), 0)
                    if bar:
                        bar.update(task, completed=max(0, start - doc["leases"]))
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
    from ccsq.common.storage.claimstore import open_store
    from ccsq.common.wire.config import AdminConfig, BrokerConfig, load
    from ccsq.common.tools.reconcile import ReconcileReport, reconcile

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
        from ccsq.common.tools.admin_client import with_broker

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


def _cmd_completion(args: argparse.Namespace) -> int:
    from ccsq.completiond.completion import main as completion_main  # = ccsq-completiond

    return completion_main(args.config)


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
            out.update(ledger_id=copy.ledger_id, received=view.counter("received"), balanced=view.balanced(), epoch=view.epoch())
    finally:
        copy.close()
        (dest / "lock.mdb").unlink(missing_ok=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        mib = 1 << 20
        print(f"backup {out['path']}: {out['bytes'] / mib:.1f} MiB (ledger file {out['source_bytes'] / mib:.1f} MiB), "
              f"snapshot txn {out['last_txnid']}, ledger {out['ledger_id']} epoch {out['epoch']}, {out['received']} received, "
              f"{'balanced' if out['balanced'] else 'UNBALANCED'}, {out['seconds']} s")
    return ExitCode.OK if out["balanced"] else ExitCode.UNBALANCED


def _cmd_console(args: argparse.Namespace) -> int:
    from ccsq.console.main import run

    return run(_admin_settings(args), listen=args.listen, token=args.token, refresh_s=args.refresh_s)


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

    p = sub.add_parser("completion", help="run the completion service (results -> database, then ACK; = ccsq-completiond)")
    _config_arg(p, "completion")
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

    p = sub.add_parser("completion-script", help="print a shell completion script (bash, zsh or tcsh)",
                       epilog="examples:\n  ccsq completion-script bash > /etc/bash_completion.d/ccsq\n"
                              "  ccsq completion-script zsh > ~/.zfunc/_ccsq",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])
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
  source <(ccsq completion-script bash)         # tab completion

exit codes: 0 ok, 1 unexpected failure, 2 usage, 3 gap report unbalanced, 4 not acknowledged in time,
5 an item ended dead or expired, 65 the broker refused the request, 66 an input file is missing,
69 the broker did not answer, 74 ledger write failed, 75 ledger locked / port busy,
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


def _cmd_completion_script(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell))
    return ExitCode.OK


#: Commands whose log lines (structlog) go to stderr at WARNING, keeping stdout for the answer.
QUIET_LOG_COMMANDS = frozenset({"gap-report", "status", "items", "dlq", "drain", "reconcile", "submit", "init", "keygen",
                                "completion-script", "backup"})


def _not_refusal(record) -> bool:
    return (getattr(record, "ccsq_event", None) or {}).get("event") != "broker_refused_peer"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config_name", None) and args.config is None:
        args.config = default_config(args.config_name)
        if not Path(args.config).exists():
            print(f"ccsq {args.command}: no --config given and {args.config} does not exist: pass --config "
                  f"FILE, or set {CONFIG_ENV} to the directory `ccsq init` wrote", file=sys.stderr)
            return ExitCode.CONFIG
    if args.command in QUIET_LOG_COMMANDS:
        import logging

        from ccsq.common.runtime import log as logsetup

        logsetup.configure("auto", level=logging.WARNING)
        logging.getLogger("ccsq.peer").addFilter(_not_refusal)  # the command prints the refusal as a sentence
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ccsq {args.command}: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except NoInput as exc:
        print(f"ccsq {args.command}: {exc}", file=sys.stderr)
        return ExitCode.NOINPUT
    except Unauthorized as exc:
        print(f"ccsq {args.command}: {exc}", file=sys.stderr)
        return ExitCode.UNAUTHORIZED
    except BrokerUnavailable as exc:
        print(f"ccsq {args.command}: {exc.code}: {exc}", file=sys.stderr)
        return ExitCode.UNAVAILABLE
    except AdminFailed as exc:
        print(f"ccsq {args.command}: {exc.code}: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    except CcsqError as exc:
        print(f"ccsq {args.command}: {exc.code}: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", ExitCode.FAILURE)  # a LedgerError says which (ledger_failure)
    except KeyboardInterrupt:
        return ExitCode.FAILURE
    except BrokenPipeError:  # `ccsq status | head -1`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
