"""``ccsq submit``: files as items (claim check), optionally waiting until every one is
acknowledged (exit 4 on timeout, 5 when one ends dead or expired, 75 on QUEUE_FULL)."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from ccsq.tools.progress import progress
from ccsq.common.wire.errors import BrokerUnavailable, ConfigError, ExitCode, NoInput, QueueFull


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
        with progress(len(items) > 1 and not args.json) as bar:
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
        served = client.kinds_served() if unserved else []
        for kind in unserved:
            near = difflib.get_close_matches(kind, served, n=1)
            named = (f"; kinds served: {', '.join(map(repr, served))}" + (f" (did you mean {near[0]!r}?)" if near else "")
                     if served else "; `ccsq status` lists the kinds served")
            print(f"ccsq submit: warning: no worker seen by the broker recently (since it started, or in the day before) serves "
                  f"kind {kind!r}: the items wait in "
                  "`ready` until one connects (a worker serves the kinds in its workerd.toml `kinds`, default its "
                  f"handler's name){named}. `ccsq items cancel ID...` takes a mistaken item out", file=sys.stderr)
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
            with progress(not args.json) as bar:
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


def _cmd_outbox_flush(args: argparse.Namespace) -> int:
    """``ccsq outbox flush``: send what the producer's outbox spooled while the broker was away,
    and wait until it is empty. Exit 0 when empty (the items the broker refused for good are
    listed: they moved to the outbox's rejected table), 69 when the broker did not take
    them within --timeout-s (they stay spooled), 78 without an outbox_dir."""
    from ccsq.producer.client import Client

    with Client.from_config_file(args.config) as client:
        if not client.config.outbox_dir:
            raise ConfigError(f"{args.config}: no outbox_dir is set, so there is no outbox to flush (set outbox_dir "
                              "there to spool while the broker is away)")
        before = client.outbox_count()
        rejected_before = {key for key, _code, _msg in client.outbox_rejected()}
        problem = None
        if before:
            try:
                client.flush(timeout_s=args.timeout_s)
            except BrokerUnavailable as exc:
                problem = exc
        left = client.outbox_count()
        rejected = [r for r in client.outbox_rejected() if r[0] not in rejected_before]
        out: dict[str, Any] = {"outbox": str(client.config.outbox_dir), "spooled_before": before, "sent": before - left - len(rejected),
               "left": left, "rejected": [{"key": k, "error": c, "message": m} for k, c, m in rejected]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"outbox {out['outbox']}: {out['sent']} sent and confirmed, {len(rejected)} refused for good, "
              f"{left} still spooled (of {before})")
        for r in out["rejected"]:
            print(f"  refused {r['key']}: {r['error']}: {r['message']}")
    if problem is not None:
        raise BrokerUnavailable(f"{left} item(s) still spooled in {out['outbox']} after {args.timeout_s:g} s: {problem}; "
                                "run `ccsq outbox flush` again once the broker answers")
    return ExitCode.OK
