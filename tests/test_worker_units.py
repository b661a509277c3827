"""Worker parts without processes: the GPU semaphore, the journal, the claim store's health,
the one failure policy, provider resolution (case C10), the built-in handlers and the OCR
handler on a real page."""

from __future__ import annotations

import asyncio
import io
import json
import random
from pathlib import Path

import pytest

from ccsq.common.wire import protocol
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.errors import ConfigError, GpuUnavailable, HandlerError, PermanentHandlerError
from ccsq.workerd import providers
from ccsq.workerd.handlers import EchoHandler, FailHandler, SleepHandler, load_handler
from ccsq.workerd.worker_journal import EntryState, Journal, JournalLocked
from ccsq.workerd.slots import SlotGate

DOCS = Path(__file__).resolve().parent.parent / "examples" / "documents"


# --- the semaphore -------------------------------------------------------------------
def test_semaphore_survives_1000_randomly_cancelled_tasks() -> None:
    """1,000 tasks, a random third cancelled while queued or while holding a slot:
    never more than ``slots`` at once, and every permit comes back."""

    async def scenario() -> SlotGate:
        rng = random.Random(7)
        gate = SlotGate(3)
        over: list[int] = []

        async def job() -> None:
            async with gate.slot():
                if gate.busy > gate.slots:
                    over.append(gate.busy)
                await asyncio.sleep(rng.random() * 0.002)

        tasks = [asyncio.create_task(job()) for _ in range(1000)]
        for _ in range(40):
            await asyncio.sleep(0.001)
            for t in rng.sample(tasks, 10):
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert 0 < cancelled < 1000
        assert not over
        assert gate.peak == gate.slots and gate.busy == 0
        assert gate.free == gate.slots
        # and the permits really work: slots acquisitions succeed without waiting
        for _ in range(gate.slots):
            await asyncio.wait_for(gate._sem.acquire(), timeout=0.1)
        assert gate._sem.locked()
        return gate

    asyncio.run(scenario())


# --- the journal ---------------------------------------------------------------------
def _result(item_id: str, token: int, data: bytes = b"out") -> protocol.TaskResult:
    from ccsq.common.storage.claimstore import sha256_hex

    return protocol.TaskResult(item_id, token, protocol.Blob(sha256_hex(data), len(data), data), "echo", "1", 0.01)


def test_journal_round_trip_and_single_writer(tmp_path: Path) -> None:
    j = Journal.open(tmp_path / "j")
    with pytest.raises(JournalLocked):
        Journal.open(tmp_path / "j")
    j.hold([("a", 1, "echo"), ("b", 2, "echo"), ("c", 3, "echo")])
    j.mark_started(("b", 2))
    j.mark_started(("c", 3))
    j.record(_result("c", 3), "echo")
    j.record(protocol.TaskFailure("a", 1, "released", True, "bye"), "echo")
    j.close()

    j = Journal.open(tmp_path / "j")  # the lock was released with the journal
    by_key = {(e.item_id, e.token): e for e in j.entries()}
    assert by_key[("a", 1)].state is EntryState.FAILED
    assert by_key[("a", 1)].report == protocol.TaskFailure("a", 1, "released", True, "bye")
    assert by_key[("b", 2)].state is EntryState.STARTED and by_key[("b", 2)].report is None
    assert by_key[("c", 3)].report == _result("c", 3)
    j.forget([("a", 1), ("c", 3)])
    assert [(e.item_id, e.state) for e in j.entries()] == [("b", EntryState.STARTED)]
    j.close()


def test_journal_group_commit_coalesces_writes_in_order(tmp_path: Path) -> None:
    """Writes queued together share one transaction, applied in the order queued;
    an error fails every waiter of that commit and writes nothing of it."""
    from concurrent.futures import ThreadPoolExecutor

    from ccsq.workerd.worker_journal import GroupCommit

    j = Journal.open(tmp_path / "j")
    pool = ThreadPoolExecutor(1)

    async def main() -> GroupCommit:
        gc = GroupCommit(j, pool, window_s=0.001)
        await asyncio.gather(
            gc.hold([("a", 1, "echo"), ("b", 2, "echo"), ("c", 3, "echo")]),
            gc.started([("a", 1), ("b", 2)]),
            gc.record([(_result("a", 1), "echo")]),
            gc.record([(protocol.TaskFailure("b", 2, "released", True, "bye"), "echo")]),
            gc.forget([("a", 1)]),
        )
        assert (gc.commits, gc.ops) == (1, 5)
        results = await asyncio.gather(gc.forget([("b", 2)]), gc.write("bogus", []), return_exceptions=True)
        assert isinstance(results[0], ValueError) and isinstance(results[1], ValueError)
        await gc.drain()
        return gc

    gc = asyncio.run(main())
    assert gc.commits == 1
    by_key = {(e.item_id, e.token): e.state for e in j.entries()}
    assert by_key == {("b", 2): EntryState.FAILED, ("c", 3): EntryState.HELD}  # b's forget rolled back
    pool.shutdown()
    j.close()


def test_journal_group_commit_without_a_timer_still_groups_the_writes_queued_during_a_commit(tmp_path: Path) -> None:
    """The default group commit sleeps no window before committing: a lone write starts its commit at
    once, and every write queued while that commit runs (held here until 12 writes wait) goes into
    the ONE next commit, in order."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ccsq.workerd.worker_journal import GroupCommit

    j = Journal.open(tmp_path / "j")
    pool = ThreadPoolExecutor(1)
    in_commit, release = threading.Event(), threading.Event()
    real_apply = j.apply

    def gated_apply(ops: list) -> None:
        in_commit.set()
        release.wait(10)
        real_apply(ops)

    j.apply = gated_apply  # type: ignore[method-assign]

    async def main() -> GroupCommit:
        gc = GroupCommit(j, pool)
        assert gc.window_s == 0.0
        first = asyncio.ensure_future(gc.hold([("a", 0, "echo")]))
        while not in_commit.is_set():  # the first commit runs (in the journal thread)
            await asyncio.sleep(0.001)
        rest = [asyncio.ensure_future(gc.hold([(f"b{n}", n, "echo")])) for n in range(1, 13)]
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(first, *rest)
        return gc

    gc = asyncio.run(main())
    assert (gc.commits, gc.ops) == (2, 13)
    assert [e.item_id for e in j.entries()] == ["a"] + [f"b{n}" for n in range(1, 13)]
    pool.shutdown()
    j.close()


def test_journal_lazy_forget_rides_with_the_next_commit_or_its_timer(tmp_path: Path) -> None:
    """A lazy forget (confirmed reports) starts no commit: it joins the next eager write,
    else it is committed lazy_s later, and drain() commits what is still queued."""
    from concurrent.futures import ThreadPoolExecutor

    from ccsq.workerd.worker_journal import GroupCommit

    j = Journal.open(tmp_path / "j")
    pool = ThreadPoolExecutor(1)

    async def main() -> None:
        gc = GroupCommit(j, pool, window_s=0.001, lazy_s=30.0)
        await gc.hold([("a", 1, "echo"), ("b", 2, "echo"), ("c", 3, "echo")])
        lazy = asyncio.ensure_future(gc.forget([("a", 1)], lazy=True))
        await asyncio.sleep(0.05)
        assert not lazy.done() and gc.commits == 1  # waits for company
        await gc.started([("b", 2)])
        await lazy
        assert (gc.commits, gc.ops) == (2, 3)  # one commit for the started and the forget
        gc.lazy_s = 0.01
        await gc.forget([("b", 2)], lazy=True)  # alone: its timer commits it
        assert gc.commits == 3
        gc.lazy_s = 30.0
        left = asyncio.ensure_future(gc.forget([("c", 3)], lazy=True))
        await asyncio.sleep(0)
        await gc.drain()
        assert left.done() and gc.commits == 4

    asyncio.run(main())
    assert j.entries() == []
    pool.shutdown()
    j.close()


def test_journal_report_rows_are_the_one_element_complete_and_fail_bodies() -> None:
    """encode_report's shortcut writes exactly the bytes of the message it stands for."""
    import msgpack

    from ccsq.workerd.worker_journal import decode_report, encode_report

    res = _result("a", 1)
    fail = protocol.TaskFailure("b", 2, "released", True, "bye")
    for rep, msg, state in ((res, protocol.Complete(results=[res]), EntryState.FINISHED),
                            (fail, protocol.Fail(failures=[fail]), EntryState.FAILED)):
        assert encode_report(rep) == msgpack.packb(protocol.encode_body(msg), use_bin_type=True)
        assert decode_report(state, encode_report(rep)) == rep


# --- the claim store's health, and failures through the one policy -----------------------
def test_unhealthy_pause_is_a_floor_plus_the_one_backoff() -> None:
    """The pause after the n-th claim-store episode in a row: never under 1 s, never over
    60 s, 1 s plus exactly the one backoff's draw (full jitter: it varies)."""
    from ccsq.common.wire.backoff import backoff_delay_s
    from ccsq.workerd.claims import unhealthy_pause_s

    for streak in range(1, 12):
        a, b = random.Random(streak), random.Random(streak)
        pauses = [unhealthy_pause_s(streak, a) for _ in range(200)]
        assert pauses == [1.0 + backoff_delay_s(streak - 1, 1.0, 59.0, b) for _ in range(200)]
        assert all(1.0 <= x <= min(60.0, 1.0 + 2 ** (streak - 1)) for x in pauses), streak
        assert max(pauses) - min(pauses) > 0.5 * min(59.0, 2 ** (streak - 1)), streak
    assert max(unhealthy_pause_s(40) for _ in range(200)) <= 60.0


def test_claim_store_trouble_is_one_episode_until_the_pause_ends() -> None:
    """A failure turns the worker unhealthy and says so once per episode; the rest of a
    batch failing within the pause counts failures, not episodes; a fetch resets the streak."""
    import structlog

    from ccsq.workerd.claims import Claims

    said: list[int] = []
    claims = Claims(None, None, on_unhealthy=lambda: said.append(1), log=structlog.get_logger("test"))  # type: ignore[arg-type]
    assert claims.ok and claims.info() == {"store_ok": True, "store_failures": 0}
    claims.trouble("blob absent")
    claims.trouble("blob absent too")
    assert (len(said), claims.failures, claims.streak, claims.ok) == (1, 2, 1, False)
    assert claims.info() == {"store_ok": False, "store_failures": 2, "store_error": "blob absent too"}
    claims._bad_until_mono = 0.0  # the pause is over (1-2 s): the next failure is a new episode
    claims.trouble("again")
    assert (len(said), claims.streak) == (2, 2)
    claims.fetched()
    claims._bad_until_mono = 0.0
    claims.trouble("after a good fetch")
    assert (len(said), claims.streak) == (3, 1)


def test_inline_results_made_on_the_loop_are_what_put_result_makes(tmp_path: Path) -> None:
    """``Claims.inline_result`` (the worker's loop, ``Reports._finish``) gives the blob
    ``put_result`` gives exactly when that needs no I/O, else None: on the file store and on
    a store with a ``put_blob`` of its own, for sizes around ``INLINE_RESULT_MAX_BYTES``."""
    import concurrent.futures

    import structlog

    from ccsq.common.storage.claimstore import FileStore
    from ccsq.workerd.claims import INLINE_RESULT_MAX_BYTES, Claims

    class OwnPutBlob(FileStore):
        def put_blob(self, data: bytes, inline_max_bytes: int) -> protocol.Blob:
            return super().put_blob(data, inline_max_bytes)

    rng = random.Random(26)
    sizes = [0, 1, INLINE_RESULT_MAX_BYTES - 1, INLINE_RESULT_MAX_BYTES, INLINE_RESULT_MAX_BYTES + 1,
             *(rng.randrange(2 * INLINE_RESULT_MAX_BYTES) for _ in range(30))]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    async def main() -> None:
        for store in (FileStore(tmp_path / "plain"), OwnPutBlob(tmp_path / "own")):
            claims = Claims(store, pool, on_unhealthy=lambda: None, log=structlog.get_logger("test"))
            made_here = 0
            for n in sizes:
                data = rng.randbytes(n)
                here = claims.inline_result(data)
                stored = await claims.put_result(data)
                if store.inline_without_io(n, INLINE_RESULT_MAX_BYTES):
                    assert here == stored and type(here) is protocol.Blob and here.inline is not None, n
                    made_here += 1
                else:
                    assert here is None, n
            assert made_here == (0 if isinstance(store, OwnPutBlob) else sum(n <= INLINE_RESULT_MAX_BYTES for n in sizes))

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_workerd_makes_every_failure_through_the_policy() -> None:
    """The worker names a reason only: no TaskFailure is built in workerd/ except by
    ``jobs.failure``, which is ``policy.task_failure`` (retryable from FAIL_POLICY)."""
    import ast

    from ccsq.common.wire.policy import FAIL_POLICY
    from ccsq.workerd.jobs import failure

    root = Path(__file__).resolve().parent.parent / "workerd"
    calls: dict[str, list[str]] = {}
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("TaskFailure", "task_failure"):
                    calls.setdefault(name, []).append(path.name)
    assert "TaskFailure" not in calls and calls["task_failure"] == ["jobs.py"], calls
    for reason, rule in FAIL_POLICY.items():
        f = failure(("i", 3), reason, "m")
        assert (f.item_id, f.token, f.reason, f.retryable, f.message) == ("i", 3, reason.value, rule.retryable, "m")


# --- providers (C10) -----------------------------------------------------------------------
def test_provider_choice_matrix() -> None:
    """Case C10 as a pure decision: what was asked, what ORT offers, what the session uses."""
    cpu_only = ["AzureExecutionProvider", "CPUExecutionProvider"]
    gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers.choose("cpu", cpu_only, ["CPUExecutionProvider"], allow_cpu_fallback=False).provider == "CPUExecutionProvider"
    ok = providers.choose("cuda", gpu, gpu, allow_cpu_fallback=False)
    assert (ok.provider, ok.cpu_fallback) == ("CUDAExecutionProvider", False)
    # tensorrt may run on CUDA (next in its chain)
    assert providers.choose("tensorrt", gpu, gpu, allow_cpu_fallback=False).provider == "CUDAExecutionProvider"
    with pytest.raises(GpuUnavailable, match="not among onnxruntime.get_available_providers"):
        providers.choose("cuda", cpu_only, ["CPUExecutionProvider"], allow_cpu_fallback=False)
    # compiled in but the libraries did not load: ORT silently fell back
    with pytest.raises(GpuUnavailable, match="fell back"):
        providers.choose("cuda", gpu, ["CPUExecutionProvider"], allow_cpu_fallback=False)
    fb = providers.choose("cuda", gpu, ["CPUExecutionProvider"], allow_cpu_fallback=True)
    assert (fb.provider, fb.cpu_fallback) == ("CPUExecutionProvider", True) and "fell back" in fb.reason


def test_provider_probe_on_real_sessions() -> None:
    """C10 against real ONNX Runtime sessions on this CPU-only machine: the tiny
    built-in model and the OCR handler's real detection model."""
    assert providers.probe("cpu", allow_cpu_fallback=False).provider == "CPUExecutionProvider"
    from ccsq.workerd.ocr import bundled_model_paths

    model = bundled_model_paths()["cls"]
    with pytest.raises(GpuUnavailable, match="CUDAExecutionProvider"):
        providers.probe("cuda", allow_cpu_fallback=False, model=model)
    fb = providers.probe("cuda", allow_cpu_fallback=True, model=model, threads=1)
    assert fb.cpu_fallback and fb.provider == "CPUExecutionProvider"
    free = providers.gpu_mem_free_bytes()  # None without nvidia-smi (this machine), bytes with it
    assert free is None or free > 0


# --- handlers --------------------------------------------------------------------------
def test_builtin_handlers() -> None:
    cfg = WorkerConfig()
    echo = load_handler("echo", cfg)
    assert isinstance(echo, EchoHandler)
    echo.load()
    assert echo.provider == "CPUExecutionProvider" and not echo.cpu_fallback
    assert echo.run(b"abc", {}) == b"abc"
    out = json.loads(SleepHandler(cfg).run(b"xy", {"seconds": 0.01, "burn": True}))
    assert out == {"slept_s": 0.01, "burn": True, "payload_bytes": 2}
    with pytest.raises(PermanentHandlerError):
        SleepHandler(cfg).run(b"", {"seconds": "soon"})
    with pytest.raises(HandlerError):
        FailHandler(cfg).run(b"", {})
    with pytest.raises(PermanentHandlerError):
        FailHandler(cfg).run(b"", {"permanent": True})
    with pytest.raises(ConfigError, match="known handlers"):
        load_handler("nope", cfg)


def test_doc_type_classification() -> None:
    from ccsq.workerd.ocr import classify

    assert classify("MIT License\nCopyright 2024\nTHE SOFTWARE IS PROVIDED WITHOUT WARRANTY") == "licence"
    assert classify("def main():\n    import os\n    return 0") == "code"
    assert classify("The sender MUST sign. A receiver SHALL reject it (Section 4).") == "spec"
    assert classify("Install the package, then configure it: step 1") == "manual"
    assert classify("Table of Contents\nChapter 1 ... 3\nIndex ... 99") == "index"
    assert classify("a quiet afternoon by the river") == "other"


def _page_png() -> tuple[bytes, list[str]]:
    """The smallest real corpus page (with its ground-truth lines when the corpus
    has them), else a rendered text page; returns (png, lines expected in the text)."""
    pages = sorted(DOCS.glob("*.png"), key=lambda path: path.stat().st_size)
    truth_path = DOCS / "ground_truth.json"
    if pages:
        truth = json.loads(truth_path.read_text()) if truth_path.exists() else {}
        with_truth = [path for path in pages if truth.get(path.name)]
        page = (with_truth or pages)[0]
        return page.read_bytes(), list(truth.get(page.name, []))[:3]
    from PIL import Image, ImageDraw, ImageFont

    lines = ["Permission is hereby granted, free of charge", "THE SOFTWARE IS PROVIDED WITHOUT WARRANTY"]
    img = Image.new("RGB", (900, 300), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=28)
    for i, line in enumerate(lines):
        draw.text((30, 60 + 70 * i), line, fill="black", font=font)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue(), lines


@pytest.mark.timeout(120)
def test_ocr_handler_on_a_real_page_with_cuda_fallback() -> None:
    """OCR smoke on one page; configured for CUDA on this CPU-only host with
    allow_cpu_fallback, the handler reports the CPU provider its real sessions
    use (C10). Without the fallback it refuses to load."""
    from ccsq.workerd.ocr import OcrHandler

    with pytest.raises(GpuUnavailable, match="CUDAExecutionProvider"):
        OcrHandler(WorkerConfig(handler="ocr", provider="cuda", handler_threads=1)).load()
    h = OcrHandler(WorkerConfig(handler="ocr", provider="cuda", allow_cpu_fallback=True, handler_threads=2))
    h.load()
    assert (h.provider, h.cpu_fallback) == ("CPUExecutionProvider", True)
    png, expected = _page_png()
    doc = json.loads(h.run(png, {}))
    assert set(doc) == {"text", "lines", "first_line", "chars", "doc_type", "provider", "seconds", "width", "height"}
    for line in expected:
        assert line.replace(" ", "") in doc["text"].replace(" ", ""), (line, doc["text"])
    assert doc["chars"] == len(doc["text"]) > 20
    assert doc["provider"] == "CPUExecutionProvider"
    assert doc["first_line"] == doc["lines"][0]["text"] and len(doc["lines"][0]["box"]) == 4
    assert doc["width"] > 0 and doc["height"] > 0
    with pytest.raises(PermanentHandlerError, match="not a decodable image"):
        h.run(b"definitely not a png", {})
