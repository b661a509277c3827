"""ONNX Runtime execution providers: what was asked for, what is really used (case C10).

``provider`` in the worker config names what the host is declared as:

    cpu       -> [CPUExecutionProvider]
    cuda      -> [CUDAExecutionProvider, CPUExecutionProvider]
    tensorrt  -> [TensorrtExecutionProvider, CUDAExecutionProvider, CPUExecutionProvider]

ONNX Runtime silently falls back along that list when a provider cannot load
(no CUDA libraries, wrong driver), so a declared GPU host can end up doing CPU
inference without anyone noticing. The check here therefore looks twice:
``onnxruntime.get_available_providers()`` (is the provider compiled in?) and
``session.get_providers()`` on a real session (did it actually load?). For a
GPU declaration the first provider of the session must be a GPU provider of
the requested chain; otherwise :class:`~ccsq.common.wire.errors.GpuUnavailable` is
raised with the reason, unless ``allow_cpu_fallback`` is set, in which case the
report says ``cpu_fallback=True`` (the worker puts that into its HELLO and logs
``gpu_fallback_to_cpu``).

Handlers without a model of their own (echo, sleep, fail) run the check on a
one-node ONNX model built in memory by :func:`tiny_model_bytes` (no ``onnx``
package needed); the OCR handler checks the sessions of its real models.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import structlog

from ccsq.common.wire.errors import GpuUnavailable

log = structlog.get_logger("ccsq.workerd.providers")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"

#: Provider chains, best first, for each ``WorkerConfig.provider`` value.
CHAINS: dict[str, tuple[str, ...]] = {
    "cpu": (CPU,),
    "cuda": (CUDA, CPU),
    "tensorrt": (TENSORRT, CUDA, CPU),
}
GPU_PROVIDERS = frozenset({CUDA, TENSORRT})


@dataclasses.dataclass(frozen=True, slots=True)
class ProviderReport:
    """Outcome of a provider check.

    ``requested``: the config value (cpu | cuda | tensorrt); ``provider``: the
    ONNX Runtime provider inference really uses; ``cpu_fallback``: a GPU was
    requested but CPU is used (only with ``allow_cpu_fallback``); ``reason``:
    why the GPU is not used ("" when it is, or when none was requested).
    """

    requested: str
    provider: str
    cpu_fallback: bool = False
    reason: str = ""


def chain_for(requested: str) -> tuple[str, ...]:
    """The provider chain for a config value (ValueError for an unknown one)."""
    try:
        return CHAINS[requested]
    except KeyError:
        raise ValueError(f"unknown provider {requested!r}; expected one of {sorted(CHAINS)}") from None


def choose(
    requested: str,
    available: Sequence[str],
    session_providers: Sequence[str],
    *,
    allow_cpu_fallback: bool,
    load_error: str = "",
) -> ProviderReport:
    """Decide from what ONNX Runtime offers (``available``) and what a real
    session uses (``session_providers``, first = used). Pure function.

    Raises GpuUnavailable (one-line reason) when a GPU was requested, is not
    used, and ``allow_cpu_fallback`` is false.
    """
    chain = chain_for(requested)
    actual = session_providers[0] if session_providers else CPU
    if requested == "cpu":
        return ProviderReport(requested, actual)
    gpu_chain = [p for p in chain if p in GPU_PROVIDERS]
    if actual in gpu_chain:
        return ProviderReport(requested, actual)
    wanted = " or ".join(gpu_chain)
    if load_error:
        reason = f"{wanted} could not be used: {load_error}"
    elif not any(p in available for p in gpu_chain):
        reason = (
            f"{wanted} is not among onnxruntime.get_available_providers() = {list(available)} "
            "(install onnxruntime-gpu matching the CUDA/cuDNN version)"
        )
    else:
        reason = (
            f"{wanted} is available but the session fell back to {actual} "
            f"(session providers {list(session_providers)}): the CUDA/cuDNN libraries or the driver could not load"
        )
    if not allow_cpu_fallback:
        raise GpuUnavailable(f"provider {requested!r} required but not usable: {reason}")
    return ProviderReport(requested, CPU, cpu_fallback=True, reason=reason)


def session_options(threads: int):  # -> onnxruntime.SessionOptions
    """SessionOptions with ``threads`` intra-op threads (0 = library default), quiet logs."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads > 0:
        opts.intra_op_num_threads = threads
    return opts


def probe(
    requested: str,
    *,
    allow_cpu_fallback: bool,
    threads: int = 0,
    model: bytes | Path | None = None,
) -> ProviderReport:
    """Create a real ONNX Runtime session for ``model`` (default: :func:`tiny_model_bytes`)
    with the chain for ``requested`` and :func:`choose` from what it really uses.

    Raises GpuUnavailable as :func:`choose` does. Without onnxruntime installed
    a ``cpu`` request passes (nothing to check) and a GPU request is unavailable.
    """
    chain = chain_for(requested)
    try:
        import onnxruntime as ort
    except ImportError as exc:
        if requested == "cpu":
            return ProviderReport(requested, CPU)
        return choose(requested, [], [], allow_cpu_fallback=allow_cpu_fallback, load_error=f"onnxruntime is not installed ({exc})")
    available = list(ort.get_available_providers())
    use = [p for p in chain if p in available] or [CPU]
    source = model if model is not None else tiny_model_bytes()
    load_error = ""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    session_errors = (RuntimeError, ort_errors.Fail, ort_errors.RuntimeException, ort_errors.EPFail)
    try:
        session = ort.InferenceSession(
            str(source) if isinstance(source, Path) else source,
            sess_options=session_options(threads),
            providers=use,
        )
        used = list(session.get_providers())
    except session_errors as exc:  # a GPU provider that cannot initialise
        used = []
        load_error = f"session creation failed: {exc}".splitlines()[0]
    return choose(requested, available, used, allow_cpu_fallback=allow_cpu_fallback, load_error=load_error)


# --- a one-node ONNX model (Identity on float[1]) encoded by hand -----------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, value: bytes | int) -> bytes:
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value)
    return _varint((num << 3) | 2) + _varint(len(value)) + value


#: ONNX TensorProto element types used by the builders below.
ELEM_FLOAT, ELEM_UINT8, ELEM_INT8, ELEM_INT32, ELEM_INT64, ELEM_BOOL, ELEM_DOUBLE = 1, 2, 3, 6, 7, 9, 11

ValueSpec = tuple[str, int, Sequence[int | str]]  # (name, element type, dims: int = fixed, str = symbolic)


def _value_info(spec: ValueSpec) -> bytes:
    name, elem_type, dims = spec
    dim_protos = b"".join(
        _field(1, _field(2, d.encode()) if isinstance(d, str) else _field(1, d)) for d in dims
    )  # TensorShapeProto.dim { dim_param | dim_value }
    tensor_type = _field(1, elem_type) + _field(2, dim_protos)  # elem_type, shape
    return _field(1, name.encode()) + _field(2, _field(1, tensor_type))  # ValueInfoProto{name, TypeProto{tensor_type}}


def model_bytes(op: str, inputs: Sequence[ValueSpec], outputs: Sequence[ValueSpec], *,
                node_inputs: Sequence[str] | None = None, opset: int = 13) -> bytes:
    """A valid one-node ONNX ModelProto (IR 8), encoded by hand (no ``onnx`` package):
    ``outputs = op(node_inputs or the input names)``. Dims: an int is fixed, a
    str is a symbolic dim (``dim_param``). Used for the provider probe and tests."""
    names = list(node_inputs) if node_inputs is not None else [spec[0] for spec in inputs]
    node = b"".join(_field(1, n.encode()) for n in names) + b"".join(_field(2, o[0].encode()) for o in outputs)
    node += _field(4, op.encode())
    graph = _field(1, node) + _field(2, b"ccsq_model")
    graph += b"".join(_field(11, _value_info(i)) for i in inputs) + b"".join(_field(12, _value_info(o)) for o in outputs)
    opset_import = _field(1, b"") + _field(2, opset)
    return _field(1, 8) + _field(2, b"ccsq") + _field(7, graph) + _field(8, opset_import)


def tiny_model_bytes() -> bytes:
    """A valid ONNX ModelProto: y = Identity(x), x and y float[1]; IR 8, opset 13."""
    return model_bytes("Identity", [("x", ELEM_FLOAT, [1])], [("y", ELEM_FLOAT, [1])])


# --- GPU health ---------------------------------------------------------------------------
def gpu_mem_free_bytes(device_id: int = 0, timeout_s: float = 2.0) -> int | None:
    """Free memory of GPU ``device_id`` in bytes from ``nvidia-smi``; None when unknown.
    Blocking (a subprocess): call it from a thread."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits", f"--id={device_id}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
        return int(out.strip().splitlines()[0]) * 1024 * 1024  # MiB
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
