"""The ``ocr`` handler: RapidOCR 3.x (ONNX Runtime) on one page image.

Input: image bytes (PNG, JPEG, anything OpenCV decodes). Output: UTF-8 JSON::

    {"text": "line 1\\nline 2", "lines": [{"text", "score", "box": [[x, y] x 4]}],
     "first_line": str, "chars": int, "doc_type": str, "provider": str,
     "seconds": float, "width": int, "height": int}

Bytes that do not decode as an image raise PermanentHandlerError (dead-letter:
retrying cannot help).

Models: the ONNX files shipped inside the rapidocr wheel
(``rapidocr/models/*det*.onnx``, ``*cls*.onnx``, ``*rec*.onnx``) are passed
by explicit path, so RapidOCR never tries to download anything; if they are
missing, :meth:`OcrHandler.load` raises ConfigError.

Provider: for ``provider = "cuda"`` or ``"tensorrt"`` RapidOCR's onnxruntime
engine is built with ``use_cuda`` (RapidOCR has no TensorRT switch for its
onnxruntime engine, so ``tensorrt`` means CUDA here); the providers its three
sessions *really* use are then checked with :func:`providers.choose` (case
C10). ``handler_threads`` sets ONNX Runtime's intra-op threads.

Concurrency: RapidOCR keeps per-call settings on the engine object, so one
engine serves one thread at a time; ``load()`` builds one engine per slot.

Batching: none of its own. RapidOCR 3.x takes one image per call (it batches
the text lines of a page internally, ``rec_batch_num``), so with a configured
``max_batch`` > 1 the default ``run_batch`` runs the pages one after another.

``doc_type`` is a keyword vote over the lower-cased text: each type scores
its keywords' occurrences times its weight (licence 3, since licence pages
also say "must" and "shall" a lot; the others 1); the highest score wins,
the first listed on a tie, and a best score under 2 gives "other":

    licence  license, licence, copyright, warranty, liability, permission is hereby granted,
             terms and conditions, copying, redistribut(e/ion)
    code     def , import , return, class , #include, function, {, }, ();, =>
    spec     must, shall, should, specification, rfc, requirement, protocol, section
    manual   install, usage, configure, click, guide, manual, step, run the, example
    index    index, contents, chapter, table of contents, glossary
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.errors import ConfigError, PermanentHandlerError
from ccsq.workerd import providers
from ccsq.workerd.handlers import Handler

DOC_TYPE_KEYWORDS: dict[str, tuple[str, ...]] = {
    "licence": ("license", "licence", "copyright", "warranty", "liability", "permission is hereby granted",
                "terms and conditions", "copying", "redistribut"),
    "code": ("def ", "import ", "return", "class ", "#include", "function", "{", "}", "();", "=>"),
    "spec": ("must", "shall", "should", "specification", "rfc", "requirement", "protocol", "section"),
    "manual": ("install", "usage", "configure", "click", "guide", "manual", "step", "run the", "example"),
    "index": ("index", "contents", "chapter", "table of contents", "glossary"),
}
DOC_TYPE_WEIGHTS: dict[str, int] = {"licence": 3}
DOC_TYPE_MIN_SCORE = 2


def classify(text: str) -> str:
    """A simple keyword classification of a page (see module doc): one of
    licence, code, spec, manual, index, other."""
    low = text.lower()
    best, best_score = "other", 0
    for doc_type, words in DOC_TYPE_KEYWORDS.items():
        score = DOC_TYPE_WEIGHTS.get(doc_type, 1) * sum(low.count(w) for w in words)
        if score > best_score:
            best, best_score = doc_type, score
    return best if best_score >= DOC_TYPE_MIN_SCORE else "other"


def bundled_model_paths() -> dict[str, Path]:
    """``{"det", "cls", "rec"}`` -> the ONNX file shipped in the rapidocr wheel.
    Raises ConfigError if rapidocr or a model is missing."""
    try:
        import rapidocr
    except ImportError as exc:
        raise ConfigError(f"handler 'ocr' needs rapidocr ({exc}); pip install 'ccsq[cpu]' or 'ccsq[gpu]'") from None
    models = Path(rapidocr.__file__).resolve().parent / "models"
    found: dict[str, Path] = {}
    for task in ("det", "cls", "rec"):
        hits = sorted(models.glob(f"*{task}*.onnx"))
        if not hits:
            raise ConfigError(f"rapidocr model for {task!r} missing in {models}; reinstall rapidocr (ccsq never downloads models)")
        found[task] = hits[0]
    return found


def decode_image(payload: bytes):  # -> numpy.ndarray (H, W, 3) BGR
    """Decode image bytes with OpenCV; PermanentHandlerError if they are not an image."""
    import cv2
    import numpy as np

    if not payload:
        raise PermanentHandlerError("payload is not a decodable image (empty)")
    img = cv2.imdecode(np.frombuffer(payload, np.uint8), cv2.IMREAD_COLOR)
    if img is None or img.size == 0:
        raise PermanentHandlerError("payload is not a decodable image")
    return img


class OcrHandler(Handler):
    """RapidOCR on one page image -> JSON (see module doc)."""

    name = "ocr"
    version = "1"

    _engines: queue.Queue  # one RapidOCR engine per slot

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self._engines = queue.Queue()

    def rapidocr_params(self) -> dict[str, Any]:
        """RapidOCR ``params`` for this config (explicit model paths, provider, threads, quiet)."""
        paths = bundled_model_paths()
        params: dict[str, Any] = {
            "Global.log_level": "error",
            "Det.model_path": str(paths["det"]),
            "Cls.model_path": str(paths["cls"]),
            "Rec.model_path": str(paths["rec"]),
            "EngineConfig.onnxruntime.use_cuda": self.config.provider in ("cuda", "tensorrt"),
        }
        if self.config.handler_threads > 0:
            params["EngineConfig.onnxruntime.intra_op_num_threads"] = self.config.handler_threads
        return params

    def load(self) -> None:
        """Build one engine per slot, load all three models, and check the providers
        their sessions really use. Raises GpuUnavailable / ConfigError."""
        params = self.rapidocr_params()  # ConfigError if rapidocr or its models are missing
        try:
            import onnxruntime as ort
            from rapidocr import RapidOCR
        except ImportError as exc:
            raise ConfigError(f"handler 'ocr' needs onnxruntime and rapidocr ({exc}); pip install 'ccsq[cpu]'") from None

        for _ in range(self.config.slots):
            engine = RapidOCR(params=params)
            sessions = [engine._load_det_model(), engine._load_cls_model(), engine._load_rec_model()]
            used = [s.session.session.get_providers() for s in sessions]
            # the worst session decides: any session on CPU means CPU inference
            worst = next((u for u in used if not u or u[0] not in providers.GPU_PROVIDERS), used[0])
            report = providers.choose(
                self.config.provider,
                ort.get_available_providers(),
                worst,
                allow_cpu_fallback=self.config.allow_cpu_fallback,
            )
            self._engines.put(engine)
        self.apply_report(report)

    def run(self, payload: bytes, params: dict[str, Any]) -> bytes:
        img = decode_image(payload)
        height, width = img.shape[:2]
        engine = self._engines.get()
        try:
            t0 = time.perf_counter()
            out = engine(img)
            seconds = time.perf_counter() - t0
        finally:
            self._engines.put(engine)
        txts = list(out.txts or ())
        scores = list(out.scores or ())
        boxes = out.boxes.tolist() if out.boxes is not None else []
        lines = [
            {"text": t, "score": round(float(s), 4), "box": [[int(round(x)), int(round(y))] for x, y in b]}
            for t, s, b in zip(txts, scores, boxes)
        ]
        text = "\n".join(txts)
        doc = {
            "text": text,
            "lines": lines,
            "first_line": txts[0] if txts else "",
            "chars": len(text),
            "doc_type": classify(text),
            "provider": self.provider,
            "seconds": round(seconds, 4),
            "width": int(width),
            "height": int(height),
        }
        return json.dumps(doc, ensure_ascii=False).encode("utf-8")
