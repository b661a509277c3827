"""``ccsq federation report --config relayd.toml [--json]``: the books of each link.

Reads the relay's journal read-only (whether the relay runs or not). Per link: leased
from the upstream, submitted downstream (and dedup hits), completed downstream,
returned upstream (accepted / fenced / duplicate / proof rejected), in flight by state,
refused (forged origin, other), failed downstream, released, and whether the link
balances::

    leased == in_flight + ended_acked + ended_failed + ended_released

and whether the link is **broken**: a swarm refused the relay, its origins or its proofs,
so the link stopped pulling (since when, why, the fix; kept in the journal until the
cause is seen fixed). ``ccsq federation report`` exits 3 when a link does not balance,
else 77 when one is broken, else 0.

Each swarm's own books are its ``ccsq gap-report``; a relayed item is one lease in the
upstream's and one item in the downstream's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ccsq.relayd.config import load_relay_config
from ccsq.relayd.relay_journal import RelayJournal


def load_federation_report(config_path: str | Path) -> dict[str, Any]:
    """``{"links": [{name, upstream, downstream, kinds, counters, in_flight, states, balanced,
    broken}], "balanced", "healthy"}``; ``broken``: None or ``{cause, reason, fix, since_ts, since}``."""
    cfg = load_relay_config(config_path)
    try:
        journal = RelayJournal.open_readonly(cfg.journal_dir)
    except FileNotFoundError:
        journal = None
    links = []
    try:
        for link in cfg.links:
            counters = journal.counters(link.name) if journal else {}
            rows = journal.rows(link.name) if journal else []
            states: dict[str, int] = {}
            for r in rows:
                states[r.state] = states.get(r.state, 0) + 1
            ended = sum(counters.get(k, 0) for k in ("ended_acked", "ended_failed", "ended_released"))
            broken = journal.broken(link.name) if journal else None
            if broken is not None:
                broken["since"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(broken["since_ts"]))
            links.append({
                "name": link.name,
                "upstream": link.upstream_endpoint,
                "downstream": link.downstream_endpoint,
                "kinds": list(link.kinds),
                "counters": counters,
                "in_flight": len(rows),
                "lost_leases": sum(1 for r in rows if r.lost),
                "states": states,
                "balanced": counters.get("leased", 0) == len(rows) + ended,
                "broken": broken,
            })
    finally:
        if journal is not None:
            journal.close()
    return {"relay": cfg.peer_id, "journal": cfg.journal_dir, "links": links,
            "balanced": all(link["balanced"] for link in links),
            "healthy": not any(link["broken"] for link in links)}


def render_text(report: dict[str, Any]) -> str:
    broken = [link["name"] for link in report["links"] if link.get("broken")]
    out = [f"relay {report['relay']} (journal {report['journal']}): {'BALANCED' if report['balanced'] else 'UNBALANCED'}"
           + (f"; LINK BROKEN: {', '.join(broken)} (stopped pulling)" if broken else "")]
    for link in report["links"]:
        c = link["counters"]
        out.append(f"\nlink {link['name']}  {link['upstream']} -> {link['downstream']}  kinds {','.join(link['kinds'])}")
        if link.get("broken"):
            b = link["broken"]
            out.append(f"  BROKEN since {b['since']} ({b['cause']}): {b['reason']}")
            out.append(f"  fix: {b['fix']}")
        out.append(f"  leased from upstream   {c.get('leased', 0):>8}")
        out.append(f"  submitted downstream   {c.get('submitted', 0):>8}  (dedup hits {c.get('dedup_hits', 0)})")
        out.append(f"  completed downstream   {c.get('completed', 0):>8}")
        out.append(f"  returned (accepted)    {c.get('returned', 0):>8}")
        out.append(f"  fenced upstream (G4)   {c.get('fenced', 0):>8}  duplicate {c.get('duplicate', 0)}, "
                   f"proof rejected {c.get('proof_rejected', 0)}")
        out.append(f"  rejected as forged     {c.get('forged_rejected', 0):>8}  other refusals {c.get('refused', 0)}, "
                   f"dead/expired downstream {c.get('failed_down', 0)}, released {c.get('released', 0)}")
        states = ", ".join(f"{k} {v}" for k, v in sorted(link["states"].items())) or "none"
        out.append(f"  in flight              {link['in_flight']:>8}  ({states}; lost leases {link['lost_leases']})")
        out.append(f"  leases lost            {c.get('lost_leases', 0):>8}  (results accepted late {c.get('accepted_late', 0)}, "
                   "fenced ones count above)")
        out.append(f"  ended: acked {c.get('ended_acked', 0)}, failed {c.get('ended_failed', 0)}, "
                   f"released {c.get('ended_released', 0)}; orphan results {c.get('orphan_results', 0)}, "
                   f"blobs copied {c.get('blobs_copied', 0)}")
        out.append(f"  leased == in flight + ended: {'yes' if link['balanced'] else 'NO'}")
    return "\n".join(out)


def render_html(report: dict[str, Any]) -> str:
    """A self-contained HTML page of the federation report (one table per link)."""
    from html import escape

    rows = [("leased from upstream", "leased"), ("submitted downstream", "submitted"), ("dedup hits", "dedup_hits"),
            ("completed downstream", "completed"), ("returned (accepted upstream)", "returned"),
            ("fenced upstream (G4, F2)", "fenced"), ("duplicate", "duplicate"), ("proof rejected", "proof_rejected"),
            ("rejected as forged", "forged_rejected"), ("other refusals", "refused"),
            ("dead/expired downstream", "failed_down"), ("released", "released"), ("ended: acknowledged", "ended_acked"),
            ("ended: failed", "ended_failed"), ("ended: released", "ended_released"), ("blobs copied", "blobs_copied"),
            ("leases lost", "lost_leases"), ("accepted late", "accepted_late")]
    out = ["<!doctype html><meta charset='utf-8'><title>ccsq federation report</title>",
           "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
           "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}th{text-align:left}"
           ".bad{color:#b00;font-weight:bold}.ok{color:#070}</style>",
           f"<h1>Federation: relay {escape(report['relay'])} "
           f"<span class='{'ok' if report['balanced'] else 'bad'}'>{'BALANCED' if report['balanced'] else 'UNBALANCED'}</span></h1>"]
    for link in report["links"]:
        c = link["counters"]
        out.append(f"<h2>link {escape(link['name'])}: {escape(link['upstream'])} &rarr; {escape(link['downstream'])} "
                   f"(kinds {escape(', '.join(link['kinds']))})</h2>")
        if link.get("broken"):
            b = link["broken"]
            out.append(f"<p class='bad'>BROKEN since {escape(b['since'])} ({escape(b['cause'])}): {escape(b['reason'])}"
                       f"<br>fix: {escape(b['fix'])}</p>")
        out.append("<table>")
        out += [f"<tr><th>{escape(label)}</th><td>{c.get(key, 0)}</td></tr>" for label, key in rows]
        states = ", ".join(f"{escape(k)} {v}" for k, v in sorted(link["states"].items())) or "none"
        out.append(f"<tr><th>in flight</th><td>{link['in_flight']} ({states})</td></tr>")
        cls = "ok" if link["balanced"] else "bad"
        out.append(f"<tr><th>leased == in flight + ended</th><td class='{cls}'>{'yes' if link['balanced'] else 'NO'}</td></tr></table>")
    return "\n".join(out) + "\n"
