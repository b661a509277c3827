"""The ``onnx`` handler: any ONNX model file, tensors in and out as msgpack maps.

Payload and result are both a msgpack map of tensor name -> tensor::

    {"x": {"dtype": "float32", "shape": [2, 3], "data": <bytes>}, ...}

``dtype`` is a numpy dtype name (float16/32/64, int8/16/32/64, uint8/16/32/64,
bool); ``data`` is the C-order, little-endian buffer of exactly
``prod(shape) x itemsize`` bytes. The result maps every model output to such
a tensor.

Model: ``model_path`` in the worker config (required; ConfigError at start
when missing or unloadable). An item may name another model with
``params["model"]``: a plain file name ending in ``.onnx`` in the same
directory (no path separators, so a producer cannot make the worker open an
arbitrary file). Sessions are created once per model file (lazily for the
others) and shared by the slots (``InferenceSession.run`` is thread safe).

Checks before inference, against the model's signature, each failing the item
with :class:`~ccsq.common.wire.errors.PermanentHandlerError` (dead-lettered at once:
retrying cannot help): payload not a msgpack map of well-formed tensors;
missing or unknown input names; dtype different from the input's element
type; rank different; a fixed dimension different; a symbolic dimension
(``dim_param`` such as ``"N"``, or unnamed) accepts any size, but one symbol
must have one size across the inputs of an item; data length not matching
the shape. An unknown ``params["model"]`` is also permanent; a model file
that exists but fails to load is retryable (HandlerError).

Batching: ``max_batch`` 8 and ``max_wait_ms`` 5 by default (worker config
overrides). Items are grouped per model (:meth:`OnnxHandler.batch_key`). When
every input and every output of the model has the same named symbolic first
dimension (e.g. ``"N"``),
``run_batch`` checks each item alone (a bad item fails alone), concatenates
the good ones along axis 0 per input, runs the model ONCE, and splits every
output back by each item's first-dimension size; otherwise it runs the items
one by one.

Provider: the session of ``model_path`` is created with the chain of the
configured provider and checked with :func:`providers.choose` (case C10),
exactly as the other handlers' probe.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgpack

from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.errors import ConfigError, HandlerError, PermanentHandlerError
from ccsq.workerd import providers
from ccsq.workerd.handlers import Handler

#: ONNX Runtime type strings -> numpy dtype names.
ORT_DTYPES: dict[str, str] = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(float16)": "float16",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
}
MAX_RANK = 16


class Signature:
    """The inputs and outputs of one model: name -> (dtype name or None, dims),
    a dim being an int (fixed) or a str / None (symbolic)."""

    inputs: dict[str, tuple[str | None, list[int | str | None]]]
    outputs: dict[str, tuple[str | None, list[int | str | None]]]

    def __init__(self, session: Any) -> None:
        self.inputs = {i.name: (ORT_DTYPES.get(i.type), list(i.shape or [])) for i in session.get_inputs()}
        self.outputs = {o.name: (ORT_DTYPES.get(o.type), list(o.shape or [])) for o in session.get_outputs()}

    @property
    def batch_symbol(self) -> str | None:
        """The named symbolic dim that is the first dim of every input and output
        (axis 0 is a batch axis), else None."""
        firsts = {dims[0] if dims else None for _, dims in (*self.inputs.values(), *self.outputs.values())}
        if len(firsts) != 1:
            return None
        (first,) = firsts
        return first if isinstance(first, str) and first else None


def decode_tensors(payload: bytes) -> dict[str, Any]:
    """msgpack map -> {name: numpy array}; PermanentHandlerError on any malformed part."""
    import numpy as np

    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=len(payload),
                              max_str_len=len(payload), max_array_len=len(payload), max_map_len=len(payload))
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad input
        raise PermanentHandlerError(f"payload is not msgpack: {exc}") from None
    if not isinstance(doc, dict) or not doc:
        raise PermanentHandlerError("payload must be a non-empty msgpack map of name -> tensor")
    out: dict[str, Any] = {}
    for name, t in doc.items():
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data"}:
            raise PermanentHandlerError(f"tensor {name!r} must be a map with exactly dtype, shape, data")
        dtype, shape, data = t["dtype"], t["shape"], t["data"]
        if not isinstance(dtype, str) or dtype not in ORT_DTYPES.values():
            raise PermanentHandlerError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(set(ORT_DTYPES.values()))}")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise PermanentHandlerError(f"tensor {name!r}: shape must be a list of at most {MAX_RANK} ints >= 0, got {shape!r}")
        if not isinstance(data, bytes):
            raise PermanentHandlerError(f"tensor {name!r}: data must be bytes")
        dt = np.dtype(dtype).newbyteorder("<")
        want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if len(data) != want:
            raise PermanentHandlerError(f"tensor {name!r}: {len(data)} data bytes, shape {shape} of {dtype} needs {want}")
        out[name] = np.frombuffer(data, dtype=dt).reshape(shape)
    return out


def encode_tensors(arrays: dict[str, Any]) -> bytes:
    """{name: numpy array} -> msgpack map of tensors (little endian, C order)."""
    import numpy as np

    doc = {}
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder not in ("|", "=", "<") else a.dtype
        doc[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.astype(dt, copy=False).tobytes()}
    return msgpack.packb(doc, use_bin_type=True)


def check_inputs(sig: Signature, tensors: dict[str, Any]) -> None:
    """Raise PermanentHandlerError unless ``tensors`` fit the model's inputs (see module doc)."""
    missing = sorted(set(sig.inputs) - set(tensors))
    unknown = sorted(set(tensors) - set(sig.inputs))
    if missing or unknown:
        raise PermanentHandlerError(f"inputs do not match the model: missing {missing}, unknown {unknown}; "
                                    f"the model takes {sorted(sig.inputs)}")
    symbols: dict[str, tuple[int, str]] = {}
    for name, (dtype, dims) in sig.inputs.items():
        arr = tensors[name]
        if dtype is None:
            raise PermanentHandlerError(f"input {name!r}: the model's input type is not a supported tensor type")
        if arr.dtype.name != dtype:
            raise PermanentHandlerError(f"input {name!r}: dtype {arr.dtype.name}, the model expects {dtype}")
        if arr.ndim != len(dims):
            raise PermanentHandlerError(f"input {name!r}: shape {list(arr.shape)} has rank {arr.ndim}, "
                                        f"the model expects rank {len(dims)} {dims}")
        for axis, (want, got) in enumerate(zip(dims, arr.shape)):
            if isinstance(want, int):
                if want != got:
                    raise PermanentHandlerError(f"input {name!r}: dim {axis} is {got}, the model expects {want} (shape {dims})")
            elif isinstance(want, str) and want:
                seen = symbols.setdefault(want, (got, name))
                if seen[0] != got:
                    raise PermanentHandlerError(f"input {name!r}: dim {axis} ({want!r}) is {got} but {want!r} is "
                                                f"{seen[0]} in input {seen[1]!r}")


class OnnxHandler(Handler):
    """Any ONNX model (see module doc)."""

    name = "onnx"
    version = "1"
    max_batch = 8
    max_wait_ms = 5.0

    _sessions: dict[Path, tuple[Any, Signature]]
    _lock: threading.Lock  # guards _sessions (lazy loads from inference threads)
    _model_dir: Path | None

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._sessions = {}
        self._lock = threading.Lock()
        self._model_dir = None

    # --- loading ---
    def _open(self, path: Path) -> tuple[Any, Signature]:
        import onnxruntime as ort

        chain = providers.chain_for(self.config.provider)
        use = [p for p in chain if p in ort.get_available_providers()] or [providers.CPU]
        session = ort.InferenceSession(str(path), sess_options=providers.session_options(self.config.handler_threads),
                                       providers=use)
        return session, Signature(session)

    def load(self) -> None:
        """Open ``model_path`` and check the provider its session really uses.
        Raises ConfigError (no model_path, missing or invalid file, no onnxruntime)
        or GpuUnavailable (case C10)."""
        if not self.config.model_path:
            raise ConfigError("handler 'onnx' needs model_path (the .onnx file) in the worker config")
        path = Path(self.config.model_path)
        if not path.is_file():
            raise ConfigError(f"model_path {path} is not a file")
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ConfigError(f"handler 'onnx' needs onnxruntime ({exc}); pip install 'ccsq[cpu]'") from None
        try:
            session, sig = self._open(path)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own types for a bad file
            raise ConfigError(f"model_path {path} cannot be loaded: {str(exc).splitlines()[0]}") from None
        self.apply_report(providers.choose(self.config.provider, ort.get_available_providers(), session.get_providers(),
                                           allow_cpu_fallback=self.config.allow_cpu_fallback))
        self._model_dir = path.parent
        self._sessions[path] = (session, sig)

    def model_file(self, params: dict[str, Any]) -> Path:
        """The model an item asks for: ``params["model"]`` in model_path's directory, else
        model_path. PermanentHandlerError for a name that is not a plain ``*.onnx`` file name."""
        name = params.get("model")
        if name is None:
            return Path(self.config.model_path)
        if (not isinstance(name, str) or not name.endswith(".onnx") or name.startswith(".")
                or "/" in name or "\\" in name or "\0" in name):
            raise PermanentHandlerError(f"params['model'] must be a plain *.onnx file name, got {name!r}")
        if self._model_dir is None:
            raise HandlerError("handler 'onnx' used before load()")
        return self._model_dir / name

    def session(self, params: dict[str, Any]) -> tuple[Any, Signature]:
        """The (session, signature) for an item's model, loading it once."""
        path = self.model_file(params)
        with self._lock:
            hit = self._sessions.get(path)
            if hit is not None:
                return hit
            if not path.is_file():
                raise PermanentHandlerError(f"model {path.name!r} is not in {path.parent}")
            try:
                hit = self._open(path)
            except Exception as exc:  # noqa: BLE001
                raise HandlerError(f"model {path.name} cannot be loaded: {str(exc).splitlines()[0]}") from None
            self._sessions[path] = hit
            return hit

    def batch_key(self, params: dict[str, Any]) -> Any:
        return str(self.model_file(params))

    # --- inference ---
    def run(self, payload: bytes, params: dict[str, Any]) -> bytes:
        session, sig = self.session(params)
        tensors = decode_tensors(payload)
        check_inputs(sig, tensors)
        outputs = session.run(None, tensors)
        return encode_tensors(dict(zip(sig.outputs, outputs)))

    def run_batch(self, items: list[tuple[bytes, dict[str, Any]]]) -> list[bytes | BaseException]:
        """One model call for the whole batch when the model has a batch axis (module doc)."""
        import numpy as np

        session, sig = self.session(items[0][1])  # one batch = one model (batch_key)
        if sig.batch_symbol is None:
            return super().run_batch(items)
        out: list[bytes | BaseException | None] = [None] * len(items)
        good: list[tuple[int, dict[str, Any]]] = []
        for i, (payload, _) in enumerate(items):
            try:
                tensors = decode_tensors(payload)
                check_inputs(sig, tensors)
                good.append((i, tensors))
            except PermanentHandlerError as exc:
                out[i] = exc
        if good:
            joined = {name: np.concatenate([t[name] for _, t in good], axis=0) for name in sig.inputs}
            results = session.run(None, joined)
            sizes = [next(iter(t.values())).shape[0] for _, t in good]
            total = sum(sizes)
            for name, arr in zip(sig.outputs, results):
                if arr.ndim == 0 or arr.shape[0] != total:
                    raise HandlerError(f"output {name!r} has first dim {arr.shape[:1]}, batch total is {total}")
            cuts = np.cumsum(sizes)[:-1]
            parts = [np.split(arr, cuts, axis=0) for arr in results]
            for k, (i, _) in enumerate(good):
                out[i] = encode_tensors({name: parts[j][k] for j, name in enumerate(sig.outputs)})
        return out  # type: ignore[return-value]
