"""``make demo``: the main job end to end on real document pages.

Starts ccsq-brokerd, two ccsq-workerd (OCR handler, rapidocr on ONNX Runtime)
and the completion service (SQLite) as separate processes in a fresh swarm
directory ``.demo/``, submits every page in ``examples/documents/`` through the
producer library (claim check), waits until every page is acknowledged (or
``--deadline-s`` passes), prints a results table, the ground-truth check and
the gap report, stops everything, and exits 0 only if every submitted page was
acknowledged, the accounting balances and every ground-truth line was found.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ccsq.brokerd.gap_report import load_report, render_text
from ccsq.tools.init import init_swarm
from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port, wait_until
from ccsq.producer.client import Client

HERE = Path(__file__).resolve().parent
DOCS = HERE / "documents"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(HERE.parent / ".demo"), help="swarm directory (recreated)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pages", type=int, default=0, help="only the first N pages (0 = all)")
    ap.add_argument("--deadline-s", type=float, default=900.0)
    args = ap.parse_args()
    console = Console()

    pages = sorted(DOCS.glob("*.png"))
    if args.pages:
        pages = pages[: args.pages]
    if not pages:
        console.print(f"[red]no pages in {DOCS}[/red]")
        return 1
    truth = json.loads((DOCS / "ground_truth.json").read_text()) if (DOCS / "ground_truth.json").exists() else {}

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    configs = init_swarm(
        root,
        endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
        workers=args.workers,
        handler="ocr",
        worker={"handler_threads": 1, "kinds": ["ocr"]},
    )
    console.print(f"swarm in {root} ({len(pages)} pages, {args.workers} OCR workers)")
    ok = False
    with ProcessGroup(root / "logs") as procs:
        procs.start("broker", [bin_path("ccsq-brokerd"), "--config", str(configs["brokerd"])], ready_event="broker_started")
        for n in range(1, args.workers + 1):
            procs.start(f"worker-{n}", [bin_path("ccsq-workerd"), "--config", str(configs[f"workerd-{n - 1}"])],
                        ready_event="broker_link_ready", ready_timeout_s=120)
        procs.start("completion", [bin_path("ccsq"), "completion", "--config", str(configs["completion"])],
                    ready_event="broker_link_ready")
        providers = {e.get("provider") for n in range(1, args.workers + 1) for e in procs.procs[f"worker-{n}"].events()
                     if e.get("event") == "handler_ready"}
        t0 = time.monotonic()
        with Client.from_config_file(configs["producer"]) as client:
            receipts = [client.submit(page, "ocr", params={"name": page.name}) for page in pages]
        submitted = len({r.item_id for r in receipts})
        console.print(f"submitted {submitted} pages (durably confirmed by the broker) in {time.monotonic() - t0:.1f}s")

        last = [-1]

        def done() -> bool:
            rep = load_report(str(root / "broker-data"))
            if rep["counters"]["acknowledged"] != last[0]:
                last[0] = rep["counters"]["acknowledged"]
                console.print(f"  {time.monotonic() - t0:6.1f}s  acknowledged {rep['counters']['acknowledged']}/{submitted}")
            return rep["counters"]["acknowledged"] >= submitted

        try:
            wait_until(done, args.deadline_s, "every page acknowledged", interval_s=0.5)
        except TimeoutError as exc:
            console.print(f"[red]{exc}[/red]")
        elapsed = time.monotonic() - t0
        procs.stop_all()

    report = load_report(str(root / "broker-data"))
    rows = _results(root / "results.db")
    table = Table(title=f"OCR results ({len(rows)} pages)")
    for col in ("page", "type", "first line", "chars", "s"):
        table.add_column(col, justify="right" if col in ("chars", "s") else "left")
    misses: list[str] = []
    for row in rows:
        params = json.loads(row["params"] or "{}")
        result = json.loads(row["result_text"] or "{}")
        name = params.get("name", row["item_id"])
        text = result.get("text", "")
        for line in truth.get(name, []):
            if line not in text:
                misses.append(f"{name}: {line!r}")
        table.add_row(name, result.get("doc_type", "?"), (result.get("first_line") or "")[:48],
                      str(result.get("chars", 0)), f"{result.get('seconds', 0):.2f}")
    console.print(table)
    checked = sum(len(v) for k, v in truth.items() if any(json.loads(r["params"] or "{}").get("name") == k for r in rows))
    console.print(f"ground truth: {checked - len(misses)}/{checked} lines found" + ("" if not misses else f"; missing: {misses}"))
    print(render_text(report), flush=True)
    rate = report["counters"]["acknowledged"] / elapsed if elapsed > 0 else 0.0
    console.print(f"execution provider(s): {', '.join(sorted(p for p in providers if p)) or 'unknown'}; "
                  f"{report['counters']['acknowledged']} pages acknowledged in {elapsed:.1f}s = {rate:.2f} pages/s")
    ok = (report["counters"]["acknowledged"] == report["counters"]["received"] == submitted and report["balanced"] and not misses
          and len(rows) == submitted)
    console.print("[green]DEMO OK[/green]" if ok else "[red]DEMO FAILED[/red]")
    return 0 if ok else 4


def _results(db: Path) -> list[sqlite3.Row]:
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        return list(con.execute("SELECT * FROM results ORDER BY params"))
    finally:
        con.close()


if __name__ == "__main__":
    sys.exit(main())
