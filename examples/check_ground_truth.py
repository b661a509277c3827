#!/usr/bin/env python3
"""Check examples/documents/ground_truth.json against real RapidOCR output.

For every page named in ground_truth.json: decode the PNG the way the ``ocr``
handler does (``cv2.imdecode(..., cv2.IMREAD_COLOR)``), run RapidOCR on it,
join ``out.txts`` with "\\n", and require every ground-truth line to be an
exact substring of that text. Prints wall-clock (and process CPU) seconds per
page and a summary; wall time is only meaningful on an otherwise idle machine.

Exit status: 0 all lines found; 1 some line missing; 2 setup problem
(missing page, malformed ground_truth.json, rapidocr not importable).

RapidOCR is built with the ONNX models shipped inside the rapidocr wheel,
passed by explicit path, so it never tries to download anything (the same
params as ccsq's ``ocr`` handler). Models load lazily on the first call, so
one warm-up call runs first and is reported separately.

Usage (from the repository root)::

    .venv/bin/python examples/check_ground_truth.py            # ground-truth pages only
    .venv/bin/python examples/check_ground_truth.py --all      # also time every other page
    .venv/bin/python examples/check_ground_truth.py --threads 1
    .venv/bin/python examples/check_ground_truth.py --cuda     # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent / "documents"
MIN_LINE_CHARS = 12


def load_ground_truth(path: Path) -> dict[str, list[str]]:
    gt = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(gt, dict) or not gt:
        raise ValueError(f"{path}: expected a non-empty JSON object")
    for name, lines in gt.items():
        if not isinstance(lines, list) or not 2 <= len(lines) <= 4:
            raise ValueError(f"{path}: {name}: expected a list of 2-4 lines")
        for line in lines:
            if not isinstance(line, str) or len(line) < MIN_LINE_CHARS:
                raise ValueError(f"{path}: {name}: line {line!r} is not a string of >= {MIN_LINE_CHARS} chars")
    return gt


def bundled_models() -> dict[str, Path]:
    import rapidocr

    models = Path(rapidocr.__file__).resolve().parent / "models"
    found = {}
    for task in ("det", "cls", "rec"):
        hits = sorted(models.glob(f"*{task}*.onnx"))
        if not hits:
            raise FileNotFoundError(f"no *{task}*.onnx in {models}")
        found[task] = hits[0]
    return found


def build_engine(threads: int, cuda: bool):
    from rapidocr import RapidOCR

    models = bundled_models()
    params = {
        "Global.log_level": "error",  # default "info" logs several lines per engine to stderr
        "Det.model_path": str(models["det"]),
        "Cls.model_path": str(models["cls"]),
        "Rec.model_path": str(models["rec"]),
        "EngineConfig.onnxruntime.use_cuda": cuda,
    }
    if threads > 0:
        params["EngineConfig.onnxruntime.intra_op_num_threads"] = threads
    return RapidOCR(params=params), models


def decode(path: Path):
    import cv2
    import numpy as np

    img = cv2.imdecode(np.frombuffer(path.read_bytes(), np.uint8), cv2.IMREAD_COLOR)
    if img is None:
        raise ValueError(f"{path}: not a decodable image")
    return img


def page_text(engine, img) -> str:
    out = engine(img)
    return "\n".join(out.txts or ())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DOCS, help="corpus folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = ORT default)")
    ap.add_argument("--cuda", action="store_true", help="use the CUDA execution provider")
    ap.add_argument("--all", action="store_true", help="also OCR (and time) pages without ground truth")
    args = ap.parse_args(argv)

    try:
        gt = load_ground_truth(args.dir / "ground_truth.json")
        missing = [n for n in gt if not (args.dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"pages named in ground_truth.json not found: {missing}")
        engine, models = build_engine(args.threads, args.cuda)
    except Exception as exc:  # setup problem, not an OCR miss
        print(f"setup error: {exc}", file=sys.stderr)
        return 2

    names = list(gt)
    if args.all:
        names += sorted(p.name for p in args.dir.glob("*.png") if p.name not in gt)

    t0 = time.perf_counter()
    page_text(engine, decode(args.dir / names[0]))  # loads det/cls/rec sessions
    warmup = time.perf_counter() - t0
    sessions = [engine.text_det, engine.text_cls, engine.text_rec]
    providers = sorted({p for s in sessions if s is not None for p in s.session.session.get_providers()[:1]})
    print(f"models: {', '.join(p.name for p in models.values())}")
    print(f"provider: {', '.join(providers)}; intra-op threads: {args.threads or 'ORT default'}")
    print(f"warm-up (model load + first page): {warmup:.2f}s")

    seconds: list[float] = []
    cpu: list[float] = []  # process CPU time, all threads: > wall means threads ran in parallel
    misses = 0
    for name in names:
        img = decode(args.dir / name)
        t, c = time.perf_counter(), time.process_time()
        text = page_text(engine, img)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        seconds.append(dt)
        cpu.append(dc)
        lost = [line for line in gt.get(name, []) if line not in text]
        misses += len(lost)
        status = "no-gt" if name not in gt else ("ok" if not lost else f"MISS {len(lost)}/{len(gt[name])}")
        print(f"{name:24s} {dt:6.2f}s  (cpu {dc:5.2f}s)  {status}")
        for line in lost:
            print(f"    missing: {line!r}")

    print(
        f"{len(names)} pages ({len(gt)} with ground truth, {sum(map(len, gt.values()))} lines): "
        f"mean {statistics.mean(seconds):.2f}s, median {statistics.median(seconds):.2f}s, "
        f"max {max(seconds):.2f}s; cpu mean {statistics.mean(cpu):.2f}s; {misses} missing line(s)"
    )
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
