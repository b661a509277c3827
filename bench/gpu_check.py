"""The GPU check (``bench/gpu_check.sh`` installs and checks the provider, then runs this).

Three measurements on one NVIDIA GPU, written to one JSON file:

1. **OCR**: benchmark 5 (``bench.ocr_overhead``) with ``provider = "cuda"``: pages/s through
   producer -> broker -> worker -> completion against a bare ``OcrHandler.run`` loop.
2. **ONNX classifier with dynamic batching**: a small MLP classifier (x float[N, 1024] ->
   MatMul 1024x2048 -> Relu -> MatMul 2048x1000 -> Softmax, built here with ``onnx.helper``,
   random weights, nothing downloaded); items/s of a bare ``InferenceSession.run`` at batch sizes
   1..64, and through ccsq (1 worker, 1 slot) at ``max_batch`` 1, 8 and 64: the gain is
   items/s at 64 over items/s at 1.
3. **GPU memory under many concurrent runs**: 2 workers x 4 slots (``max_batch`` 64) on the same
   GPU, rounds of ``--round-items`` items submitted at once; ``nvidia-smi`` memory.used after each
   round. Growth = last round - second round (the first round allocates the arenas).

Refuses (exit 79) when ONNX Runtime cannot put a session on CUDA. Units in the keys.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, machine

WORK = Path("/tmp/ccsq-gpu-check")
FEATURES, HIDDEN, CLASSES = 1024, 2048, 1000
GPU_UNAVAILABLE = 79
#: "cuda"; ``--dry-run-cpu`` (a rehearsal of the code paths on a machine without a GPU) sets "cpu"
PROVIDER = "cuda"
ORT_PROVIDER = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


def build_classifier(path: Path, seed: int = 0) -> Path:
    """Write the classifier (see module doc) to ``path`` with ``onnx.helper``; first dim ``N``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal((FEATURES, HIDDEN)) * 0.02).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((HIDDEN, CLASSES)) * 0.02).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("MatMul", ["hr", "w2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "ccsq_gpu_check_classifier",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", CLASSES])],
                              initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def gpu_memory_used_mib() -> list[int]:
    """memory.used of every GPU (MiB) from nvidia-smi."""
    if PROVIDER == "cpu":
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10, check=True).stdout
    return [int(v) for v in out.split()]


def require_cuda(model: Path) -> str:
    import onnxruntime as ort

    s = ort.InferenceSession(str(model), providers=list(dict.fromkeys([ORT_PROVIDER[PROVIDER], "CPUExecutionProvider"])))
    if s.get_providers()[0] != ORT_PROVIDER[PROVIDER]:
        print(f"gpu_check: refused: the session runs on {s.get_providers()}, not CUDA", file=sys.stderr)
        sys.exit(GPU_UNAVAILABLE)
    return s.get_providers()[0]


def bare_batches(model: Path, sizes: list[int], seconds: float) -> list[dict[str, Any]]:
    import numpy as np
    import onnxruntime as ort

    s = ort.InferenceSession(str(model), providers=[ORT_PROVIDER[PROVIDER]])
    out = []
    for b in sizes:
        x = np.random.default_rng(b).standard_normal((b, FEATURES)).astype(np.float32)
        s.run(None, {"x": x})  # warm-up (kernel selection)
        calls, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            s.run(None, {"x": x})
            calls += 1
        el = time.monotonic() - t0
        out.append({"batch": b, "calls": calls, "items_per_s": round(calls * b / el, 1)})
    return out


def payloads(n: int) -> list[bytes]:
    import numpy as np

    from ccsq.workerd.onnx_handler import encode_tensors

    rng = np.random.default_rng(1)
    return [encode_tensors({"x": rng.standard_normal((1, FEATURES)).astype(np.float32)}) for _ in range(n)]


def through_ccsq(root: Path, model: Path, items: list[bytes], *, max_batch: int, workers: int = 1, slots: int = 1,
                 rounds: int = 1, watch_memory: bool = False) -> dict[str, Any]:
    """Submit ``items`` ``rounds`` times (each round at once, waiting until all acknowledged)."""
    from bench.ccsq_pipeline import AckCounter, check_alive, start_swarm
    from ccsq.tools.procs import wait_until
    from ccsq.producer.client import Client

    procs, configs = start_swarm(root, workers=workers, handler="onnx",
                                 worker={"slots": slots, "prefetch": max(64, max_batch), "kinds": ["onnx"],
                                         "model_path": str(model), "provider": PROVIDER, "max_batch": max_batch,
                                         "max_wait_ms": 2.0 if max_batch > 1 else -1.0})
    per_round: list[dict[str, Any]] = []
    try:
        with Client.from_config_file(configs["producer"]) as client, AckCounter(root) as acked:
            total = 0
            for r in range(rounds):
                t0 = time.monotonic()
                for k in range(0, len(items), 200):
                    client.submit_many([(d, "onnx", {"round": r, "k": k + j}) for j, d in enumerate(items[k:k + 200])])
                total += len(items)
                wait_until(lambda: check_alive(procs) or acked() >= total, 600, f"round {r} acknowledged",
                           interval_s=0.02)
                el = time.monotonic() - t0
                row = {"round": r, "items": len(items), "elapsed_s": round(el, 3),
                       "items_per_s": round(len(items) / el, 1)}
                if watch_memory:
                    row["gpu_memory_used_mib"] = gpu_memory_used_mib()
                per_round.append(row)
    finally:
        procs.stop_all()
    return {"max_batch": max_batch, "workers": workers, "slots": slots, "rounds": per_round,
            "items_per_s": per_round[-1]["items_per_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT_DIR / "gpu_check.json"))
    ap.add_argument("--items", type=int, default=3000, help="items per classifier run through ccsq")
    ap.add_argument("--round-items", type=int, default=2000, help="items per round of the memory watch")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the memory watch")
    ap.add_argument("--pages", type=int, default=6, help="OCR pages (plus one warm-up)")
    ap.add_argument("--skip-ocr", action="store_true")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="rehearse every code path on CPU (no GPU, no nvidia-smi; figures meaningless)")
    args = ap.parse_args(argv)
    global PROVIDER
    if args.dry_run_cpu:
        PROVIDER = "cpu"
    t_start = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    model = build_classifier(WORK / "classifier.onnx")
    res: dict[str, Any] = {"benchmark": "gpu_check", "machine": machine(), "provider": require_cuda(model),
                           "gpus": "none (dry run on CPU)" if args.dry_run_cpu else subprocess.run(
                               ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.strip(),
                           "command": "bench/gpu_check.sh"}
    res["classifier"] = {"model": f"MLP {FEATURES}-{HIDDEN}-{CLASSES}, float32, opset 13",
                         "bare": bare_batches(model, [1, 2, 4, 8, 16, 32, 64], 1.5)}
    items = payloads(args.items)
    runs = [through_ccsq(WORK / f"clf-{b}", model, items, max_batch=b) for b in (1, 8, 64)]
    res["classifier"]["ccsq"] = runs
    res["classifier"]["batching_gain"] = round(runs[-1]["items_per_s"] / runs[0]["items_per_s"], 2)
    print(f"gpu_check: classifier through ccsq {[r['items_per_s'] for r in runs]} items/s at max_batch 1/8/64; "
          f"gain {res['classifier']['batching_gain']}x", flush=True)
    mem = through_ccsq(WORK / "mem", model, payloads(args.round_items), max_batch=64, workers=2, slots=4,
                       rounds=args.rounds, watch_memory=True)
    used = [sum(r["gpu_memory_used_mib"]) for r in mem["rounds"]]
    mem["growth_mib"] = used[-1] - used[min(1, len(used) - 1)] if used else 0
    mem["target_growth_mib"] = 64
    mem["met"] = mem["growth_mib"] <= 64
    res["memory_watch"] = mem
    print(f"gpu_check: GPU memory after each round {used} MiB; growth {mem['growth_mib']} MiB", flush=True)
    if not args.skip_ocr:
        from bench import ocr_overhead

        res["ocr"] = ocr_overhead.run(WORK / "ocr", args.pages, provider=PROVIDER)
        print(f"gpu_check: OCR ratio {res['ocr']['ratio']} (ccsq {res['ocr']['ccsq']['pages_per_s']} vs bare "
              f"{res['ocr']['bare']['pages_per_s']} pages/s)", flush=True)
    res["elapsed_s"] = round(time.monotonic() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"gpu_check: wrote {out} ({res['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
