"""Benchmark 5: worker overhead on real inference.

Pages/s of :class:`ccsq.workerd.ocr.OcrHandler` on the same pages
(``examples/documents/*.png``, the first ``pages`` + one warm-up page):

- bare: one process, ``handler.run(page)`` in a loop;
- ccsq: producer -> broker -> 1 ccsq-workerd (ocr, 1 slot) -> completion service
  (SQLite), from the first submit until the last page is acknowledged;
- ccsq batched: the same with dynamic batching (``max_batch`` = :data:`BATCHED`,
  ``max_wait_ms`` 50): pages reach the handler in groups (rapidocr 3.x takes one
  image per call, so the handler's batch path is a loop: the gain measured is
  the worker's per-item overhead saved, not a batched kernel).

Both load the model first and run one warm-up page untimed; both use the same
``handler_threads``. Ratio = ccsq pages/s / bare pages/s (target >= 0.95).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.ccsq_pipeline import AckCounter, check_alive, start_swarm
from bench.common import ROOT
from ccsq.tools.procs import wait_until

DOCS = ROOT / "examples" / "documents"
BATCHED = 4  # max_batch of the batched run


def pages(n: int) -> list[Path]:
    found = sorted(DOCS.glob("*.png"))
    if len(found) < n + 1:
        raise FileNotFoundError(f"need {n + 1} pages in {DOCS}, found {len(found)}")
    return found[: n + 1]


def bare(files: list[Path], handler_threads: int, provider: str = "cpu") -> dict[str, Any]:
    from ccsq.common.wire.config import WorkerConfig
    from ccsq.workerd.ocr import OcrHandler

    handler = OcrHandler(WorkerConfig(handler="ocr", handler_threads=handler_threads, provider=provider))
    handler.load()
    handler.run(files[0].read_bytes(), {"name": files[0].name})  # warm-up
    datas = [(f.read_bytes(), f.name) for f in files[1:]]
    t0 = time.monotonic()
    for data, name in datas:
        handler.run(data, {"name": name})
    elapsed_s = time.monotonic() - t0
    return {"pages": len(datas), "elapsed_s": round(elapsed_s, 3), "pages_per_s": round(len(datas) / elapsed_s, 3),
            "provider": handler.provider}


def through_ccsq(root: Path, files: list[Path], handler_threads: int, max_batch: int = 1,
                 provider: str = "cpu") -> dict[str, Any]:
    from ccsq.producer.client import Client

    procs, configs = start_swarm(root, workers=1, handler="ocr",
                                 worker={"slots": 1, "prefetch": 1, "kinds": ["ocr"], "handler_threads": handler_threads,
                                         "max_batch": max_batch, "max_wait_ms": 50.0 if max_batch > 1 else -1.0,
                                         "provider": provider})
    try:
        with Client.from_config_file(configs["producer"]) as client, AckCounter(root) as acked:
            client.submit(files[0], "ocr", params={"name": files[0].name})  # warm-up
            wait_until(lambda: check_alive(procs) or acked() >= 1, 300, "warm-up page acknowledged", interval_s=0.02)
            t0 = time.monotonic()
            client.submit_many([(f, "ocr", {"name": f.name}) for f in files[1:]])
            wait_until(lambda: check_alive(procs) or acked() >= len(files), 900, "every page acknowledged", interval_s=0.02)
            elapsed_s = time.monotonic() - t0
    finally:
        procs.stop_all()
    n = len(files) - 1
    return {"pages": n, "max_batch": max_batch, "elapsed_s": round(elapsed_s, 3), "pages_per_s": round(n / elapsed_s, 3)}


def run(root: Path, n_pages: int = 6, handler_threads: int = 0, provider: str = "cpu") -> dict[str, Any]:
    files = pages(n_pages)
    b1 = bare(files, handler_threads, provider)  # bare before and after ccsq: cancels slow drift of a shared machine
    c = through_ccsq(root, files, handler_threads, provider=provider)
    cb = through_ccsq(root, files, handler_threads, max_batch=BATCHED, provider=provider)
    b2 = bare(files, handler_threads, provider)
    b = {"pages": b1["pages"], "elapsed_s": round((b1["elapsed_s"] + b2["elapsed_s"]) / 2, 3),
         "provider": b1["provider"], "runs_pages_per_s": [b1["pages_per_s"], b2["pages_per_s"]]}
    b["pages_per_s"] = round(b["pages"] / b["elapsed_s"], 3)
    ratio = c["pages_per_s"] / b["pages_per_s"] if b["pages_per_s"] else 0.0
    return {"pages": n_pages, "handler_threads": handler_threads, "bare": b, "ccsq": c, "ratio": round(ratio, 3),
            "target": 0.95, "met": ratio >= 0.95, "ccsq_batched": cb,
            "batching_gain": round(cb["pages_per_s"] / c["pages_per_s"], 3) if c["pages_per_s"] else 0.0}
