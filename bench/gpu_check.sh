#!/usr/bin/env bash
# bench/gpu_check.sh: the GPU check of docs/benchmarks.md in one command (< 5 minutes on one GPU).
#
#   bench/gpu_check.sh [OUT.json]          (default bench/out/gpu_check.json)
#
# 1. refuses to run without an NVIDIA GPU (exit 79, ExitCode.GPU_UNAVAILABLE): no nvidia-smi or no GPU
#    listed -> refused before anything is installed; after installing, ONNX Runtime must create a
#    session on CUDAExecutionProvider (the provider check), else refused as well;
# 2. installs `.[gpu]` (onnxruntime-gpu, rapidocr) and onnx into a separate venv (.venv-gpu: the CPU
#    and GPU builds of onnxruntime cannot share one environment);
# 3. runs bench/gpu_check.py: OCR through ccsq vs a bare loop, an ONNX classifier (built locally with
#    onnx.helper, nothing downloaded) with dynamic batching at max_batch 1..64, and many concurrent
#    runs while nvidia-smi samples GPU memory; writes JSON.
# Env: PYTHON (default python3.11 or python3), GPU_CHECK_VENV (default .venv-gpu), GPU_CHECK_SKIP_INSTALL=1.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/out/gpu_check.json}"
GPU_UNAVAILABLE=79

refuse() { echo "gpu_check: refused: $*" >&2; exit "$GPU_UNAVAILABLE"; }

if ! command -v nvidia-smi >/dev/null 2>&1; then
  refuse "no nvidia-smi on this machine: this check needs an NVIDIA GPU (run it where one is lent; nothing was installed)"
fi
if ! GPUS="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1)" || [ -z "$GPUS" ]; then
  refuse "nvidia-smi lists no usable GPU: ${GPUS:-nothing}"
fi
echo "gpu_check: GPU(s): $GPUS"

PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV="${GPU_CHECK_VENV:-.venv-gpu}"
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e '.[gpu]' 'onnx>=1.15'   # onnx: as in the bench extra (the classifier is built locally)
fi
# the provider check: a real session on CUDA, or refuse (never measure a CPU fallback as "GPU")
if ! "$VENV/bin/python" - <<'PY'
import sys
import onnxruntime as ort
from ccsq.workerd.providers import tiny_model_bytes
avail = ort.get_available_providers()
if "CUDAExecutionProvider" not in avail:
    sys.exit(f"CUDAExecutionProvider not available (providers: {avail})")
s = ort.InferenceSession(tiny_model_bytes(), providers=["CUDAExecutionProvider"])
if s.get_providers()[0] != "CUDAExecutionProvider":
    sys.exit(f"the session fell back to {s.get_providers()}")
print("gpu_check: provider check ok:", s.get_providers())
PY
then
  refuse "ONNX Runtime cannot run on the GPU here (see above)"
fi
exec "$VENV/bin/python" -m bench.gpu_check --out "$OUT"
