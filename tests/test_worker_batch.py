"""Dynamic batching, the onnx handler, prefetch and the deadline check of the worker.

Units (no processes): the batch queue, the handlers' batch paths, the onnx
handler's signature checks. Processes: the real ``ccsq-workerd`` against the
scripted broker of ``tests/worker_harness.py``, and one real swarm for
the deadline rule end to end.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from ccsq.common.wire import protocol
from ccsq.common.storage.claimstore import FileStore, sha256_hex
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.wire.errors import ConfigError, HandlerError, PermanentHandlerError
from ccsq.workerd import providers
from ccsq.workerd.batching import BatchQueue
from ccsq.workerd.handlers import EchoHandler, SleepHandler, load_handler
from ccsq.workerd.worker_journal import EntryState, Journal
from ccsq.workerd.onnx_handler import OnnxHandler, decode_tensors, encode_tensors
from tests.swarm import Swarm
from tests.worker_harness import WorkerBroker, Workers, broker, task, wait_until, workers  # noqa: F401 (fixtures)


# --- the batch queue ------------------------------------------------------------------
def test_batch_queue_groups_fills_and_waits() -> None:
    """A full group goes at once; a partial one waits max_wait_s for more, or goes at
    once when nothing more can come; groups never mix; oldest group first."""

    async def scenario() -> None:
        more = [True]
        q: BatchQueue[str] = BatchQueue(3, 0.15, lambda: more[0])
        for i in range(4):
            q.put(("k", "m1"), f"a{i}")
        q.put(("k", "m2"), "b0")
        t0 = time.monotonic()
        assert await q.take() == (("k", "m1"), ["a0", "a1", "a2"])  # full: no wait
        assert time.monotonic() - t0 < 0.1
        key, items = await q.take()  # a3 is older than b0: its group goes first, after max_wait
        assert (key, items) == (("k", "m1"), ["a3"]) and time.monotonic() - t0 >= 0.15
        more[0] = False
        t1 = time.monotonic()
        assert await q.take() == (("k", "m2"), ["b0"]) and time.monotonic() - t1 < 0.1  # nothing more can come
        more[0] = True
        q.put(("k", "m1"), "c0")
        q.put(("k", "m1"), "c1")
        assert q.discard(("k", "m1"), "c0") and not q.discard(("k", "m1"), "zz")
        waiter = asyncio.ensure_future(q.take())
        await asyncio.sleep(0.01)
        q.put(("k", "m1"), "c2")
        q.put(("k", "m1"), "c3")  # the group fills while the taker waits: it wakes at once
        assert await asyncio.wait_for(waiter, 0.1) == (("k", "m1"), ["c1", "c2", "c3"])
        assert len(q) == 0

    asyncio.run(scenario())


def test_batch_queue_of_one_never_waits() -> None:
    async def scenario() -> None:
        q: BatchQueue[int] = BatchQueue(1, 10.0)
        q.put("k", 1)
        q.put("k", 2)
        assert await asyncio.wait_for(q.take(), 0.1) == ("k", [1])
        assert await asyncio.wait_for(q.take(), 0.1) == ("k", [2])

    asyncio.run(scenario())


def test_journal_marks_a_batch_started_in_one_call(tmp_path: Path) -> None:
    j = Journal.open(tmp_path / "j")
    j.hold([("a", 1, "k"), ("b", 2, "k"), ("c", 3, "k")])
    j.mark_started(("a", 1), ("b", 2))
    assert {e.item_id: e.state for e in j.entries()} == {
        "a": EntryState.STARTED, "b": EntryState.STARTED, "c": EntryState.HELD}
    j.close()


def test_default_and_builtin_batch_paths(tmp_path: Path) -> None:
    """The default run_batch keeps errors per item; sleep's batch path sleeps once."""
    cfg = WorkerConfig()
    sleep = SleepHandler(cfg)
    t0 = time.perf_counter()
    out = sleep.run_batch([(b"a", {"seconds": 0.2}), (b"b", {"seconds": -1}), (b"c", {"seconds": 0.1})])
    assert 0.2 <= time.perf_counter() - t0 < 0.35
    assert json.loads(out[0])["batch"] == 3 and json.loads(out[2])["slept_s"] == 0.1
    assert isinstance(out[1], PermanentHandlerError)
    assert EchoHandler(cfg).run_batch([(b"x", {}), (b"y", {})]) == [b"x", b"y"]

    class Half(EchoHandler):
        def run(self, payload, params):
            if params.get("bad"):
                raise HandlerError("bad item")
            return payload

    out = super(EchoHandler, Half(cfg)).run_batch([(b"1", {}), (b"2", {"bad": True})])  # the base class loop
    assert out[0] == b"1" and isinstance(out[1], HandlerError)


# --- the onnx handler ----------------------------------------------------------------------
def tensor(arr: np.ndarray) -> dict:
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.tobytes()}


def packed(**arrays: np.ndarray) -> bytes:
    return msgpack.packb({k: tensor(v) for k, v in arrays.items()}, use_bin_type=True)


def write_models(d: Path) -> Path:
    """add.onnx: y = a + b, a/b/y float32[N, 3]; fixed.onnx: y = Identity(x), x int64[2]."""
    d.mkdir(parents=True, exist_ok=True)
    f32 = providers.ELEM_FLOAT
    (d / "add.onnx").write_bytes(providers.model_bytes(
        "Add", [("a", f32, ["N", 3]), ("b", f32, ["N", 3])], [("y", f32, ["N", 3])]))
    (d / "fixed.onnx").write_bytes(providers.model_bytes(
        "Identity", [("x", providers.ELEM_INT64, [2])], [("y", providers.ELEM_INT64, [2])]))
    return d / "add.onnx"


def test_onnx_handler_checks_the_signature(tmp_path: Path) -> None:
    cfg = WorkerConfig(model_path=str(write_models(tmp_path)))
    assert type(load_handler("onnx", cfg)) is OnnxHandler  # the entry point is registered
    h = OnnxHandler(cfg)
    h.load()
    assert h.provider == "CPUExecutionProvider" and not h.cpu_fallback
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = decode_tensors(h.run(packed(a=a, b=a), {}))
    assert list(out) == ["y"] and np.array_equal(out["y"], a + a)
    fixed = decode_tensors(h.run(packed(x=np.array([7, 8], dtype=np.int64)), {"model": "fixed.onnx"}))
    assert fixed["y"].tolist() == [7, 8]
    bad = {
        "dtype": (packed(a=a.astype(np.float64), b=a), "dtype float64, the model expects float32"),
        "fixed dim": (packed(a=np.zeros((2, 4), np.float32), b=np.zeros((2, 4), np.float32)), "dim 1 is 4"),
        "rank": (packed(a=np.zeros(3, np.float32), b=a), "rank 1"),
        "symbol": (packed(a=a, b=np.zeros((5, 3), np.float32)), "'N' is 2"),
        "missing": (packed(a=a), "missing ['b']"),
        "unknown": (packed(a=a, b=a, c=a), "unknown ['c']"),
        "not msgpack": (b"\xc1", "not msgpack"),
        "short data": (msgpack.packb({"a": {"dtype": "float32", "shape": [2, 3], "data": b"x"}, "b": tensor(a)}),
                       "needs 24"),
    }
    for what, (payload, words) in bad.items():
        with pytest.raises(PermanentHandlerError, match=words.replace("[", r"\[").replace("]", r"\]")):
            h.run(payload, {})
    for name in ("../add.onnx", "/etc/passwd", "add.txt", ".hidden.onnx"):
        with pytest.raises(PermanentHandlerError, match="plain"):
            h.batch_key({"model": name})
    with pytest.raises(PermanentHandlerError, match="is not in"):
        h.run(packed(a=a, b=a), {"model": "nope.onnx"})
    with pytest.raises(ConfigError, match="needs model_path"):
        OnnxHandler(WorkerConfig()).load()
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        OnnxHandler(WorkerConfig(model_path=str(tmp_path / "junk.onnx"))).load()


def test_onnx_batch_runs_the_model_once_and_fails_bad_items_alone(tmp_path: Path) -> None:
    h = OnnxHandler(WorkerConfig(model_path=str(write_models(tmp_path))))
    h.load()
    calls = []
    session = h._sessions[Path(h.config.model_path)][0]
    real_run = session.run

    class Counting:  # count the model calls without changing what they do
        def __getattr__(self, name):
            return getattr(session, name)

        def run(self, names, feeds):
            calls.append({k: v.shape for k, v in feeds.items()})
            return real_run(names, feeds)

    h._sessions[Path(h.config.model_path)] = (Counting(), h._sessions[Path(h.config.model_path)][1])
    x1 = np.ones((1, 3), np.float32)
    x3 = np.arange(9, dtype=np.float32).reshape(3, 3)
    out = h.run_batch([(packed(a=x1, b=x1), {}), (packed(a=x3, b=x1), {}), (packed(a=x3, b=x3), {})])
    assert calls == [{"a": (4, 3), "b": (4, 3)}]  # two good items, one call
    assert np.array_equal(decode_tensors(out[0])["y"], x1 + x1)
    assert isinstance(out[1], PermanentHandlerError)  # N differs between its inputs
    assert np.array_equal(decode_tensors(out[2])["y"], x3 + x3)
    # a model without a batch axis runs the items one by one
    fixed = [(packed(x=np.array([i, i], np.int64)), {"model": "fixed.onnx"}) for i in range(3)]
    assert [decode_tensors(o)["y"].tolist() for o in h.run_batch(fixed)] == [[0, 0], [1, 1], [2, 2]]
    assert encode_tensors({"z": np.zeros((0, 3), np.float32)})  # empty tensors round-trip
    assert decode_tensors(encode_tensors({"z": np.zeros((0, 3), np.float32)}))["z"].shape == (0, 3)


# --- the daemon --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_sleep_batches_of_four_finish_eight_items_in_two_batch_durations(broker: WorkerBroker, workers: Workers) -> None:
    """max_batch 4, slots 1, prefetch 4: credit is slots x max_batch + prefetch = 8; 8 items
    of 1 s finish in about 2 batch durations (one by one they would take 8 s); the log
    and the heartbeat show the batch sizes; each item is reported on its own."""
    batch_s = 1.0
    workers.start(handler="sleep", max_batch=4, max_wait_ms=300, prefetch=4)
    (hello,) = broker.wait_for(protocol.Hello)
    assert hello.msg.credit == 8 and hello.msg.info["max_batch"] == 4
    sent = time.monotonic()
    broker.dispatch(*[task(f"i{n}", "sleep", token=n + 1, params={"seconds": batch_s}) for n in range(8)])
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) == 8, 30, "8 results")
    last = max(s.mono for s in broker.of(protocol.Complete))
    assert 2 * batch_s <= last - sent < 3.5 * batch_s, last - sent
    results = [r for s in broker.of(protocol.Complete) for r in s.msg.results]
    assert sorted(r.item_id for r in results) == [f"i{n}" for n in range(8)]
    assert {json.loads(r.result.inline)["batch"] for r in results} == {4}
    events = workers.log_events(1)
    assert [e["size"] for e in events if e["event"] == "batch_started"] == [4, 4]
    assert sum(e["event"] == "job_started" for e in events) == 8
    beat = broker.wait_for(protocol.Heartbeat, lambda m: m.info.get("batches") == 2)[0]
    assert beat.msg.info["batch_size_max"] == 4 and beat.msg.info["batch_items"] == 8
    wait_until(lambda: sum(s.msg.credit for s in broker.of(protocol.Credit)) == 8, 10, "all 8 credits back")


@pytest.mark.timeout(60)
def test_next_payload_is_fetched_and_verified_while_the_slot_runs(broker: WorkerBroker, workers: Workers,
                                                                 tmp_path: Path) -> None:
    """Prefetch: while item N runs (slots 1), the payload of item N+1 is already fetched
    from the claim store and its SHA-256 checked: a tampered blob is reported
    store_unavailable before N finishes, while the heartbeat still shows the slot busy."""
    store = FileStore(tmp_path / "blobs")
    good = b"the real payload" * 100
    digest = store.put(good)
    path = store._path(digest)
    path.chmod(0o644)
    path.write_bytes(b"tampered" + good[8:])  # same size, wrong content
    workers.start(handler="sleep")
    broker.wait_for(protocol.Hello)
    broker.dispatch(task("n", "sleep", params={"seconds": 1.5}, token=1))
    broker.wait_for(protocol.Heartbeat, lambda m: m.busy == 1)  # N runs
    broker.dispatch(protocol.Task("n+1", 2, "sleep", protocol.Blob(digest, len(good), None), {"seconds": 0.0}, 1))
    (fail,) = broker.wait_for(protocol.Fail)
    # corrupt in this worker's view of the store: its problem (store_unavailable, attempt not counted), not the item's
    assert [(f.item_id, f.reason, f.retryable) for f in fail.msg.failures] == [("n+1", "store_unavailable", True)]
    assert "corrupt" in fail.msg.failures[0].message
    assert not broker.of(protocol.Complete)  # N still runs
    (done,) = broker.wait_for(protocol.Complete)
    assert done.msg.results[0].item_id == "n" and done.mono > fail.mono
    assert [e["item_id"] for e in workers.log_events(1) if e["event"] == "job_started"] == ["n"]


@pytest.mark.timeout(60)
def test_item_past_its_deadline_is_given_back_not_run(broker: WorkerBroker, workers: Workers) -> None:
    """An item whose deadline_ts passes while it waits for the slot is not started:
    FAIL(released, retryable) so the broker expires it (no attempt counted)."""
    workers.start(handler="sleep", prefetch=2)
    broker.wait_for(protocol.Hello)
    soon = time.time() + 0.5
    broker.dispatch(task("busy", "sleep", params={"seconds": 1.0}, token=1),
                    task("late", "sleep", params={"seconds": 0.0}, token=2, deadline_ts=soon),
                    task("fine", "sleep", params={"seconds": 0.0}, token=3, deadline_ts=time.time() + 600))
    (fail,) = broker.wait_for(protocol.Fail)
    (f,) = fail.msg.failures
    assert (f.item_id, f.reason, f.retryable) == ("late", "released", True) and "deadline_ts" in f.message
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) == 2, 10, "2 results")
    events = workers.log_events(1)
    assert [e["item_id"] for e in events if e["event"] == "job_started"] == ["busy", "fine"]
    assert [e["item_id"] for e in events if e["event"] == "deadline_skipped"] == ["late"]


@pytest.mark.timeout(60)
def test_onnx_worker_batches_tensors_and_dead_letters_a_bad_one(broker: WorkerBroker, workers: Workers,
                                                                tmp_path: Path) -> None:
    """The real worker with handler onnx: three items in one batch; the good ones come
    back as the model's output, the one whose shape does not fit fails fatal alone."""
    model = write_models(tmp_path / "models")
    workers.start(handler="onnx", model_path=str(model), max_wait_ms=300, kinds=["onnx"])
    (hello,) = broker.wait_for(protocol.Hello)
    assert hello.msg.credit == 8 + 1 and hello.msg.info["handler"] == "onnx"
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    bad = np.zeros((2, 4), np.float32)
    broker.dispatch(task("ok1", "onnx", packed(a=a, b=a), token=1), task("bad", "onnx", packed(a=bad, b=bad), token=2),
                    task("ok2", "onnx", packed(a=a[:1], b=a[:1]), token=3))
    (fail,) = broker.wait_for(protocol.Fail)
    assert [(f.item_id, f.reason, f.retryable) for f in fail.msg.failures] == [("bad", "fatal", False)]
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) == 2, 10, "2 results")
    res = {r.item_id: decode_tensors(r.result.inline)["y"] for s in broker.of(protocol.Complete) for r in s.msg.results}
    assert np.array_equal(res["ok1"], a + a) and np.array_equal(res["ok2"], a[:1] + a[:1])
    assert [e["size"] for e in workers.log_events(1) if e["event"] == "batch_started"] == [3]


@pytest.mark.timeout(90)
def test_deadline_passed_at_the_worker_ends_expired_at_the_broker(tmp_path: Path) -> None:
    """End to end: an item whose deadline passes while it is prefetched behind a long job
    is given back by the worker and the broker moves it to expired (G6 event); it never
    runs; the long job is acknowledged; the ledger balances."""
    with Swarm(tmp_path / "s", handler="sleep", worker={"prefetch": 1}) as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            long = client.submit(b"long", "sleep", params={"seconds": 1.5})
            late = client.submit(b"late", "sleep", params={"seconds": 0.0}, deadline_ts=time.time() + 0.7)
            done = client.wait([long.item_id, late.item_id], timeout_s=30)
        assert done[long.item_id].state == "acknowledged" and done[late.item_id].state == "expired"
        rep = swarm.report()
        worker = swarm.procs.procs["worker-1"]
    assert worker.count("deadline_skipped", item_id=late.item_id) == 1
    assert worker.count("job_started", item_id=late.item_id) == 0
    assert rep["counters"]["expired"] == 1 and rep["counters"]["acknowledged"] == 1 and rep["balanced"]
    assert next(w for w in rep["windows"] if w["id"] == "G6")["count"] == 1


@pytest.mark.timeout(60)
def test_claim_store_read_error_fails_the_item_not_the_worker(broker: WorkerBroker, workers: Workers,
                                                              tmp_path: Path) -> None:
    """A claim-store error other than a missing/corrupt blob (here an I/O error: the
    blob's path is a directory) fails that attempt as store_unavailable (retried, the
    attempt not counted); the
    worker keeps serving (the next item completes)."""
    store = FileStore(tmp_path / "blobs")
    digest = sha256_hex(b"unreadable")
    path = store._path(digest)
    path.mkdir(parents=True)
    workers.start()
    broker.wait_for(protocol.Hello)
    broker.dispatch(protocol.Task("io", 1, "echo", protocol.Blob(digest, 10, None), {}, 1))
    (fail,) = broker.wait_for(protocol.Fail)
    (f,) = fail.msg.failures
    assert (f.item_id, f.reason, f.retryable) == ("io", "store_unavailable", True) and "IsADirectoryError" in f.message
    broker.dispatch(task("next", "echo", b"still alive", token=2))
    (done,) = broker.wait_for(protocol.Complete)
    assert done.msg.results[0].result.inline == b"still alive"


@pytest.mark.timeout(60)
def test_log_each_job_off_logs_one_line_per_batch_and_report_frame(broker: WorkerBroker, workers: Workers) -> None:
    """``log_each_job = false``: no job_started/job_completed per item; one batch_started line
    naming every (item_id, token, attempt) of the batch, one results_reported per report frame;
    every item still journaled and reported."""
    workers.start(handler="sleep", max_batch=4, max_wait_ms=300, prefetch=4, log_each_job=False)
    broker.wait_for(protocol.Hello)
    broker.dispatch(*[task(f"q{n}", "sleep", token=n + 1, params={"seconds": 0.05}) for n in range(8)])
    wait_until(lambda: sum(len(s.msg.results) for s in broker.of(protocol.Complete)) == 8, 30, "8 results")
    events = workers.log_events(1)
    assert not [e for e in events if e["event"] in ("job_started", "job_completed")]
    started = [e for e in events if e["event"] == "batch_started"]
    assert sorted(i[0] for e in started for i in e["items"]) == [f"q{n}" for n in range(8)]
    assert all(e["size"] == len(e["items"]) for e in started)
    wait_until(lambda: sum(e["items"] for e in workers.log_events(1) if e["event"] == "results_reported") == 8, 10,
               "results_reported lines for the 8 results")


def test_group_commit_merges_adjacent_ops_of_one_name() -> None:
    """The group commit applies adjacent same-name ops as one op (one executemany), rows in
    order, without touching the callers' lists; different names keep their order."""
    from ccsq.workerd.worker_journal import OpKind, _merge_adjacent

    record, forget = OpKind.RECORD, OpKind.FORGET
    a, b = [("x", 1)], [("y", 2)]
    merged = _merge_adjacent([(record, a), (record, b), (forget, [("x", 1)]), (record, [("z", 3)])])
    assert merged == [(record, [("x", 1), ("y", 2)]), (forget, [("x", 1)]), (record, [("z", 3)])]
    assert a == [("x", 1)] and b == [("y", 2)]
