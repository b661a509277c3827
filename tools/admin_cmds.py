"""The admin commands: ``ccsq status`` (and its screen, :func:`render_status`,
:func:`render_readers`, :func:`ha_lines`), ``items show|cancel``, ``dlq list|replay|purge``,
``drain``, ``failover``.

They talk to the broker as its admin peer (:mod:`ccsq.tools.admin_client`); the
read-only ones (status, items show, dlq list) read the ledger directly when the broker does
not answer, or with ``--offline``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ccsq.tools.progress import progress
from ccsq.common.wire.errors import ConfigError, ExitCode


def admin_settings(args: argparse.Namespace):
    """The ``AdminConfig`` of ``--config`` (admin.toml); also ``ccsq console``'s."""
    from ccsq.common.wire.config import AdminConfig, load

    return load(AdminConfig, args.config)


def _admin_mode(args: argparse.Namespace) -> str:
    return "offline" if getattr(args, "offline", False) else "auto"


def _read_query(args: argparse.Namespace, command: str, params: dict | None = None) -> dict:
    """Run a read-only admin ``command`` (status, items_show, dlq_list) against the
    broker, or against the ledger when it does not answer or with --offline."""
    from ccsq.tools.admin_client import run_command

    settings = admin_settings(args)
    mode = _admin_mode(args)
    doc = run_command(settings, command, params, mode=mode)
    if doc.get("source") != "broker" and mode != "offline":
        print(f"ccsq: warning: {doc.get('broker_unavailable') or f'the broker at {settings.broker_endpoint} did not answer'}"
              f"\nccsq: warning: the answer below is read from the ledger in {settings.data_dir} directly (no peers, no "
              "leases held in memory); --offline reads it without asking the broker", file=sys.stderr)
    return doc


def _cmd_status(args: argparse.Namespace) -> int:
    """Exit 0 with the broker's answer (or with --offline), 69 when the broker did not answer
    and the screen comes from the ledger: a health check must not pass on a down broker."""
    doc = _read_query(args, "status")
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(render_status(doc))
    return ExitCode.UNAVAILABLE if "broker_unavailable" in doc else ExitCode.OK


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
    for line in ha_lines(doc.get("ha")):
        console.print(line)
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
            if (peer.get("info") or {}).get("link_broken"):  # a relay whose link a swarm refused (docs/federation.md)
                info = peer["info"]
                since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.get("link_broken_since") or 0))
                console.print(f"{peer['peer_id']}: federation link BROKEN since {since}: {info['link_broken']} "
                              f"(it pulls nothing); fix: {info.get('link_broken_fix', '')}")
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
        served = sorted({k for w in workers for k in w.get("kinds") or []})
        for kind, per in sorted(doc.get("backlog", {}).items()):
            if per.get("ready") and not any(not w.get("kinds") or kind in w["kinds"] for w in workers):
                console.print(f"no connected worker serves kind {kind!r} ({per['ready']} ready item(s) wait for one; kinds "
                              f"served: {', '.join(map(repr, served)) or 'none'}; a mistaken kind: "
                              f"`ccsq items cancel --kind {kind}`)")
    return buf.getvalue()


def ha_lines(ha: dict | None) -> list[str]:
    """The status document's ``"ha"`` section (docs/ha.md) as lines: which broker is primary,
    its epoch and mode, whether it confirms, replies held, and each standby's lag (turns,
    bytes, seconds). ``[]`` when the section is absent or the broker is a single broker
    (``role`` ``single``): a one-broker swarm's screens stay as they were."""
    if not ha or ha.get("role") in (None, "single"):
        return []
    mode = ha.get("mode", "")
    need = ha.get("sync_standbys", 1)
    mode_text = (f"sync ({need} standby{'s' if need != 1 else ''} must acknowledge each turn)" if mode == "sync"
                 else "async (turns not yet shipped are lost on failover)" if mode == "async"
                 else "DEGRADED: sync, confirming without a standby (ha_on_standby_loss = degrade)" if mode == "degraded" else mode)
    held = ha.get("held_replies", 0)
    why = ha.get("waiting") or "no lease in etcd or too few standbys"
    confirming = "confirming" if ha.get("confirming") else f"NOT CONFIRMING (replies are held: {why})"
    etcd = ha.get("etcd", "")
    etcd_text = ", ".join(etcd) if isinstance(etcd, (list, tuple)) else str(etcd)
    lines = [f"ha: {ha.get('role', '')} {ha.get('node', '')}, epoch {ha.get('epoch', 0)}, {mode_text}, {confirming}; "
             f"held replies {held}" + (f"; etcd {etcd_text}" if etcd_text else "")]
    if ha.get("failover"):
        lines.append(f"ha: planned failover {ha['failover']}")
    if "sync_members" in ha:
        members = ", ".join(ha["sync_members"]) or "none"
        lines.append(f"ha: sync set in etcd: {members} (only these may take over)"
                     + (f"; degraded {ha['degraded_count']} time(s)" if ha.get("degraded_count") else ""))
    standbys = ha.get("standbys") or []
    if not standbys:
        lines.append("ha: no standby connected" + (" (sync mode: nothing is confirmed until one acknowledges)"
                                                   if mode == "sync" and need > 0 else ""))
    for sb in standbys:
        lag_s = sb.get("lag_s")
        state = "copying (catching up from a copy)" if sb.get("copying") else ("in sync" if sb.get("in_sync") else "not in sync")
        lines.append(f"ha: standby {sb.get('node', '?')}: seq {sb.get('seq', 0)}, lag {sb.get('lag_turns', 0)} turns / "
                     f"{_bytes(sb.get('lag_bytes', 0))} / {'-' if lag_s is None else f'{lag_s:.1f} s'}, {state}")
    if "last_seq" in ha:
        lines.append(f"ha: last turn {ha['last_seq']}, durable (acknowledged) {ha.get('durable_seq', 0)}")
    return lines


def _bytes(n: object) -> str:
    if not isinstance(n, (int, float)):
        return str(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


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


#: States in which an item's ``error``/``error_message``/``ended_ms`` are history, not its
#: present: the fields stay in the ledger (what the last failed attempt said and when it was
#: dead-lettered; a replay keeps them) and ``items show`` folds them into one row
#: "last error" marked as an earlier attempt's; only dead/expired items show them as theirs.
FAILED_STATES = ("dead", "expired")
_FAILURE_FIELDS = ("error", "error_message", "ended_ms")


#: ``items show`` (text) names the record's fields in words (``--json`` keeps the ledger's
#: names, docs/ledger.md); a field not listed here shows with its underscores as spaces.
ITEM_LABELS = {
    "id": "item id", "key": "idempotency key", "created_ms": "submitted", "nb_ms": "ready not before",
    "seq": "arrival seq", "cseq": "completion seq", "token": "fencing token", "lease_expires_ms": "lease expires",
    "completed_ms": "completed", "acked_ms": "acknowledged", "ended_ms": "ended", "deadline_ms": "deadline",
    "completed_token": "completed token", "completed_epoch": "completed epoch", "fail_token": "failed token",
    "max_attempts": "max attempts", "max_runtime_s": "max runtime (s)", "runtime_s": "runtime (s)",
    "worker_done": "done by worker", "token_worker": "token holder", "handler_version": "handler version",
    "error_message": "error message", "reply_to": "relay (reply to)",
}


def _item_rows(doc: dict) -> list[tuple[str, object]]:
    """The rows of ``items show`` (text), labelled by :data:`ITEM_LABELS`: times as ISO
    dates, 0 (unset) times as "-", ``max_attempts`` 0 as the broker default, an error of an
    earlier attempt (error, message, when it ended) in one row "last error" marked so;
    ``lease_expires_ms`` only while the item is leased (it stays in the record after the
    lease ends)."""
    rec = doc["item"]
    stale = rec.get("state") not in FAILED_STATES
    rows: list[tuple[str, object]] = []
    for k, v in rec.items():
        label = ITEM_LABELS.get(k, k.replace("_", " "))
        if k == "lease_expires_ms" and rec.get("state") != "leased":
            continue
        if k in _FAILURE_FIELDS and stale:
            if k == next((f for f in rec if f in _FAILURE_FIELDS), None) and (last := _last_error(rec)):
                rows.append(("last error", last))  # at the place of the first of them
            continue
        if k.endswith(("_ms", "_ts")) and v in (0, None):
            v = "-"
        elif k == "max_attempts" and v == 0:
            default = doc.get("default_max_attempts")
            v = f"broker default ({default})" if default else "broker default (max_attempts in brokerd.toml)"
        else:
            v = _when(k, v)
        rows.append((label, v))
    return rows


def _last_error(rec: dict) -> str:
    """The "last error" row of an item not dead/expired now: its earlier attempt's error and
    message, and when it ended (dead-lettered, before a replay); "" when it has none."""
    what = ": ".join(str(rec[f]) for f in ("error", "error_message") if rec.get(f))
    if not what:
        return ""
    ended = f", ended {_when('ended_ms', rec['ended_ms'])}" if rec.get("ended_ms") else ""
    return f"{what} (an earlier attempt{ended}; the item is {rec.get('state')} now)"


def broker_max_attempts(admin_config: str | None) -> int | None:
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
        for k, v in _item_rows({**doc, "default_max_attempts": broker_max_attempts(admin_settings(args).config_path)}):
            print(f"{k:>16}  {v}")
        if doc.get("lease_in_memory"):
            print(f"{'lease (memory)':>16}  {doc['lease_in_memory']}")
    return ExitCode.OK


CANCELLED_NOTE = ("cancelled items are dead letters with reason 'cancelled': `ccsq dlq list` shows them, "
                  "`ccsq dlq replay ID` makes one ready again, `ccsq dlq purge` deletes them")


def _cmd_items_cancel(args: argparse.Namespace) -> int:
    """items cancel ID... | --kind KIND [--yes]: ready items become dead (reason cancelled),
    through the broker (the transition of the protocol's CANCEL); each id is reported
    cancelled, not ready (its state), or unknown. Exit 0 when every named item was
    cancelled, 65 when one was not, 2 when --kind was not confirmed."""
    from ccsq.tools.admin_client import with_broker

    if bool(args.item_ids) == bool(args.kind):
        raise ConfigError("items cancel: give item ids or --kind KIND (not both)")
    settings = admin_settings(args)
    if args.kind:
        async def backlog(session) -> dict:
            return (await session.call("status"))["backlog"]

        queues = with_broker(settings, backlog)
        ready = queues.get(args.kind, {}).get("ready", 0)
        if not ready:
            others = ", ".join(f"{k} ({v['ready']})" for k, v in sorted(queues.items()) if v.get("ready"))
            print(f"ccsq items cancel: no ready item of kind {args.kind!r}; kinds with ready items: {others or 'none'}",
                  file=sys.stderr)
            return ExitCode.REFUSED
        if not args.yes:
            what = f"cancel {ready} ready item(s) of kind {args.kind!r} (they become dead letters, reason 'cancelled')"
            if not sys.stdin.isatty():
                print(f"ccsq items cancel: would {what}; no terminal to ask: run again with --yes", file=sys.stderr)
                return ExitCode.USAGE
            if input(f"{what}? [y/N] ").strip().lower() not in ("y", "yes"):
                print("ccsq items cancel: nothing cancelled", file=sys.stderr)
                return ExitCode.USAGE

    async def go(session) -> dict:
        out: dict = {"cancelled": [], "not_ready": {}, "unknown": []}
        if args.kind:
            while True:
                doc = await session.call("items_cancel", {"kind": args.kind})
                out["cancelled"] += doc["cancelled"]
                if not doc["more"] or not doc["cancelled"]:
                    break
        else:
            ids = list(dict.fromkeys(args.item_ids))  # an id named twice is cancelled once
            for start in range(0, len(ids), 1000):
                doc = await session.call("items_cancel", {"item_ids": ",".join(ids[start:start + 1000])})
                out["cancelled"] += doc["cancelled"]
                out["not_ready"].update(doc["not_ready"])
                out["unknown"] += doc["unknown"]
        return out

    out = with_broker(settings, go)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        if args.kind:
            print(f"cancelled {len(out['cancelled'])} ready item(s) of kind {args.kind!r}")
        else:
            for item_id in dict.fromkeys(args.item_ids):
                if item_id in out["not_ready"]:
                    print(f"{item_id}  not ready: state {out['not_ready'][item_id]} (left as it is)")
                elif item_id in out["unknown"]:
                    print(f"{item_id}  unknown (no such item in the ledger)")
                else:
                    print(f"{item_id}  cancelled")
        if out["cancelled"]:
            print(CANCELLED_NOTE)
    return ExitCode.OK if not out["not_ready"] and not out["unknown"] else ExitCode.REFUSED


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
    from ccsq.tools.admin_client import with_broker

    if bool(args.item_ids) == bool(args.all):
        raise ConfigError(f"dlq {args.action}: give item ids or --all (not both)")
    command, key = ("dlq_replay", "replayed") if args.action == "replay" else ("dlq_purge", "purged")

    async def go(session) -> dict:
        done: list[str] = []
        not_dead: list[str] = []
        unknown: list[str] = []
        with progress(not args.json) as bar:
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

    out = with_broker(admin_settings(args), go)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.action}: {len(out[key])} item(s)" + (f"; not dead: {', '.join(out['not_dead'])}" if out["not_dead"] else "")
              + (f"; unknown (no such item in the ledger): {', '.join(out['unknown'])}" if out["unknown"] else ""))
    return ExitCode.OK if not out["not_dead"] and not out["unknown"] else ExitCode.REFUSED


def _cmd_failover(args: argparse.Namespace) -> int:
    """``ccsq failover [--to NODE] [--timeout-s N]``: a planned switchover (docs/ha.md). The
    primary stops confirming, waits until a standby in the sync set (``--to``: that one; refused
    at once unless it is a connected standby in sync) holds its last turn, pins etcd's sync set
    to it, resigns its etcd key and rejoins as a standby (the broker's admin command ``failover``);
    this then waits until a broker answers as primary with a higher epoch. Exit 0 when one
    does, 4 when none did within ``--timeout-s`` (the swarm may still be electing: ``ccsq
    status``), 65 when the primary refused (no standby caught up in time: nothing changed),
    69 when no broker answered."""
    import time as _time

    from ccsq.common.wire.errors import BrokerUnavailable, CcsqError
    from ccsq.tools.admin_client import with_broker

    settings = admin_settings(args)
    params: dict = {"timeout_s": args.timeout_s}
    if args.to:
        params["to"] = args.to

    async def before(session) -> dict:
        st = await session.call("status")
        ha = st.get("ha") or {}
        if ha.get("role") in (None, "single"):
            raise ConfigError(f"the broker at {settings.broker_endpoint} is a single broker (no ha section in its status: "
                              "ha_etcd_endpoints is not set in its brokerd.toml); failover needs a broker pair "
                              "(`ccsq init --standby HOST --etcd URLS`, docs/ha.md)")
        reply = await session.call("failover", params, timeout_s=args.timeout_s + 10.0)
        return {"before": ha, "reply": reply}

    first = with_broker(settings, before)
    old = first["before"]
    deadline = _time.monotonic() + args.timeout_s
    after: dict = {}
    while _time.monotonic() < deadline:  # the new primary: a session (the link follows NOT_PRIMARY) with a higher epoch

        async def status(session) -> dict:
            return (await session.call("status", timeout_s=5.0)).get("ha") or {}

        try:
            after = with_broker(settings, status, connect_timeout_s=min(5.0, max(0.5, deadline - _time.monotonic())))
        except (BrokerUnavailable, CcsqError):
            after = {}
        if after.get("role") == "primary" and after.get("epoch", 0) > old.get("epoch", 0):
            break
        _time.sleep(0.2)
    done = after.get("role") == "primary" and after.get("epoch", 0) > old.get("epoch", 0)
    doc = {"from": old.get("node"), "from_epoch": old.get("epoch"), "reply": first["reply"], "done": done,
           "primary": after.get("node") if done else None, "epoch": after.get("epoch") if done else None}
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    elif done:
        print(f"failover done: {doc['primary']} is primary at epoch {doc['epoch']} (was {doc['from']} at epoch {doc['from_epoch']}, "
              f"now a standby; it handed over at seq {first['reply'].get('seq', '?')})")
    else:
        print(f"failover: {doc['from']} resigned at epoch {doc['from_epoch']}, but no broker answered as primary with a higher "
              f"epoch within {args.timeout_s:g} s; see `ccsq status` (an election may still be under way)")
    return ExitCode.OK if done else ExitCode.INCOMPLETE


def _cmd_drain(args: argparse.Namespace) -> int:
    import time

    from ccsq.tools.admin_client import with_broker

    async def go(session) -> dict:
        import asyncio

        doc = await session.call("drain", {"worker": args.worker, "undo": args.undo})
        if args.wait and not args.undo:
            deadline = time.monotonic() + args.timeout_s
            with progress(not args.json and doc["leases"] > 0) as bar:
                task = bar.add_task(f"{args.worker}: leases finished", total=doc["leases"]) if bar else None
                start = doc["leases"]
                while doc["leases"] > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    st = await session.call("status")
                    doc["leases"] = next((x["leases"] for x in st["peers"] if x["peer_id"] == args.worker), 0)
                    if bar:
                        bar.update(task, completed=max(0, start - doc["leases"]))
        return doc

    doc = with_broker(admin_settings(args), go)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        state = "draining (no new items)" if doc["draining"] else "dispatching again"
        print(f"{doc['worker']}: {state}; {'connected' if doc['connected'] else 'not connected'}; {doc['leases']} lease(s) held")
    return ExitCode.INCOMPLETE if args.wait and not args.undo and doc["leases"] > 0 else ExitCode.OK
