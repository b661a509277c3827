"""Producer library against a scripted broker (real ZeroMQ, real signed envelopes):
durable confirm, dedup keys, resend on timeout and reconnect, back-pressure, claim check."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ccsq.common.storage.claimstore import FileStore
from ccsq.common.wire.errors import BrokerUnavailable, InvalidRequest, PayloadTooLarge, QueueFull
from ccsq.common.runtime.faults import env_for
from ccsq.tools.procs import bin_path, free_tcp_port, wait_until
from ccsq.common.wire.protocol import ItemState
from ccsq.producer import Client, derive_key
from ccsq.tools.reconcile import reconcile
from tests.scripted_broker import ScriptedBroker, make_pki, write_config


@pytest.fixture
def swarm(tmp_path: Path):
    """(root, endpoint, producer config path) with keys for broker, producer-1, completion-1."""
    make_pki(tmp_path, {"broker": "broker", "producer-1": "producer", "completion-1": "completion"})
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    cfg = write_config(tmp_path, "producer", "producer-1", endpoint, claim_store="file://blobs",
                       inline_max_bytes=1024, submit_timeout_s=0.5)
    return tmp_path, endpoint, cfg


def test_submit_inline_and_claim_check_with_default_dedup_key(swarm) -> None:
    root, endpoint, cfg = swarm
    doc = root / "scan.bin"
    doc.write_bytes(os.urandom(20_000))
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        small = client.submit(b"small payload", "echo")
        big = client.submit(doc, "echo", params={"lang": "en"})
        again = client.submit(doc.read_bytes(), "echo", params={"lang": "en"})  # same document: a no-op
        with doc.open("rb") as fh:
            other = client.submit(fh, "echo", params={"lang": "de"})  # other params: another item
        keyed = client.submit(b"small payload", "echo", key="my-key-1")
        with broker.lock:
            items = dict(broker.items)
    assert small.item_id and not small.duplicate and not small.spooled
    assert items[small.item_id].payload.inline == b"small payload"
    blob = items[big.item_id].payload
    assert blob.inline is None and FileStore(root / "blobs").get_blob(blob) == doc.read_bytes()
    assert again.duplicate and again.item_id == big.item_id and again.key == big.key
    assert big.key == derive_key(blob.sha256, "echo", {"lang": "en"})
    assert other.item_id not in (big.item_id, small.item_id)
    assert keyed.key == "my-key-1" and keyed.item_id != small.item_id
    assert len(items) == 4


def test_lost_submit_is_resent_with_the_same_key(swarm) -> None:
    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        broker.drop_submit_frames = 1
        receipt = client.submit(b"payload", "echo")
    assert broker.submit_frames == 2
    assert list(broker.item_by_key.values()) == [receipt.item_id]


def test_slow_ack_resends_and_the_broker_deduplicates(swarm) -> None:
    """A broker that confirms later than submit_timeout_s: the client re-sends the same
    key; there is one item and the receipt names it."""
    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        broker.submit_delay_s = 1.2
        t0 = time.monotonic()
        receipt = client.submit(b"slow", "echo", timeout_s=10)
        elapsed = time.monotonic() - t0
    assert 1.0 < elapsed < 5.0
    assert broker.submit_frames >= 2 and broker.duplicate_submits >= 1
    assert len(broker.items) == 1 and receipt.item_id in broker.items


def test_queue_full_is_retried_then_raised(swarm) -> None:
    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        broker.queue_full_frames = 2
        ok = client.submit(b"a", "echo")
        assert ok.item_id and broker.submit_frames == 3
        broker.queue_full_frames = 10_000
        t0 = time.monotonic()
        with pytest.raises(QueueFull):
            client.submit(b"b", "echo", timeout_s=1.0)
        assert time.monotonic() - t0 < 3.0
        assert len(broker.items) == 1


def test_queue_full_then_silence_raises_queue_full(swarm) -> None:
    """The broker refuses a SUBMIT with QUEUE_FULL, then does not answer the retry before
    the deadline (a loaded broker answers late): the producer raises QueueFull, the
    broker's own last word, not BrokerUnavailable "no answer" (seen as a CI flake of
    test_queue_full_backpressure_then_drain)."""
    import threading

    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        client.submit(b"a", "echo")  # the session is up
        frames = broker.submit_frames
        broker.queue_full_frames = 1
        stop = threading.Event()

        def silence_after_the_refusal() -> None:
            while not stop.is_set():
                with broker.lock:
                    if broker.submit_frames > frames:
                        broker.drop_submit_frames = 10_000
                        return
                time.sleep(0.001)

        watcher = threading.Thread(target=silence_after_the_refusal, daemon=True)
        watcher.start()
        try:
            with pytest.raises(QueueFull):
                client.submit(b"b", "echo", timeout_s=1.5)
        finally:
            stop.set()
            watcher.join(5)
        assert broker.submit_frames >= frames + 2  # refused once, the retry went unanswered


def test_broker_unreachable_without_outbox_raises_broker_unavailable(swarm) -> None:
    _, _, cfg = swarm
    with Client.from_config_file(cfg) as client:
        t0 = time.monotonic()
        with pytest.raises(BrokerUnavailable):
            client.submit(b"x", "echo", timeout_s=1.0)
        assert time.monotonic() - t0 < 3.0


def test_frozen_broker_submit_completes_after_reconnect(swarm) -> None:
    """The broker goes silent mid-stream: the link drops it after heartbeat x liveness,
    reconnects when it answers again, and re-sends the pending SUBMIT in on_connect."""
    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        first = client.submit(b"before", "echo")
        broker.set_silent(True)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=client.submit(b"during", "echo", timeout_s=20)))
        t.start()
        wait_until(lambda: not client.connected, 10, "the client to drop the silent broker")
        broker.set_silent(False)
        t.join(timeout=20)
        with broker.lock:
            hellos = [h for h in broker.hellos if h[0] == "producer-1"]
    assert out["r"].item_id and out["r"].item_id != first.item_id
    assert len(hellos) >= 2, (broker.hellos, broker.errors)
    assert len(broker.items) == 2


def test_submit_many_splits_frames_under_max_frame_bytes(swarm) -> None:
    root, endpoint, _ = swarm
    cfg = write_config(root, "producer-small", "producer-1", endpoint, claim_store="file://blobs",
                       inline_max_bytes=1000, submit_timeout_s=0.5, max_frame_bytes=4096)
    payloads = [os.urandom(900) for _ in range(20)]
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        receipts = client.submit_many([(pl, "echo", {"n": i}) for i, pl in enumerate(payloads)]
                                      + [{"payload": b"dict form", "kind": "echo", "priority": 3}])
        with broker.lock:
            items = dict(broker.items)
        with pytest.raises(PayloadTooLarge):
            client.submit(b"x", "echo", params={"big": "y" * 5000})
    assert len(receipts) == 21 and len({r.item_id for r in receipts}) == 21
    assert not any(r.duplicate for r in receipts)
    assert broker.submit_frames >= 5  # 20 x ~1 KB does not fit in 4 KiB frames
    assert [items[r.item_id].payload.inline for r in receipts[:20]] == payloads  # order kept
    assert items[receipts[20].item_id].priority == 3


def test_invalid_arguments_raise_invalid_request(swarm) -> None:
    _, _, cfg = swarm
    with Client.from_config_file(cfg) as client:
        for kwargs in ({"params": {"x": [1, 2]}}, {"max_attempts": 0}, {"params": {1: "a"}}):
            with pytest.raises(InvalidRequest):
                client.submit(b"x", "echo", **kwargs)
        with pytest.raises(InvalidRequest):
            client.submit(Path("/nonexistent/file"), "echo")
        with pytest.raises(InvalidRequest):
            client.submit(12345, "echo")


def test_status_and_wait(swarm) -> None:
    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        a = client.submit(b"a", "echo")
        b = client.submit(b"b", "echo")
        st = client.status([a.item_id, b.item_id, "nope"])
        assert st[a.item_id].state == ItemState.READY.value and st["nope"].state == "unknown"
        with broker.lock:
            broker.state[a.item_id] = ItemState.ACKNOWLEDGED.value
        t0 = time.monotonic()
        res = client.wait([a.item_id, b.item_id], timeout_s=0.6)
        assert time.monotonic() - t0 >= 0.5 and res[b.item_id].state == ItemState.READY.value

        def finish() -> None:
            time.sleep(0.3)
            with broker.lock:
                broker.state[b.item_id] = ItemState.DEAD.value

        threading.Thread(target=finish).start()
        res = client.wait([a.item_id, b.item_id], timeout_s=10)
    assert {i: s.state for i, s in res.items()} == {a.item_id: "acknowledged", b.item_id: "dead"}


_CRASHING_PRODUCER = """
import sys
from ccsq.producer import Client
with Client.from_config_file(sys.argv[1]) as client:
    client.submit(b"z" * 100_000, "echo")
print("unreachable: the crash point did not fire")
"""


def test_producer_killed_after_blob_put_leaves_an_orphan_that_reconcile_collects(swarm) -> None:
    """Crash between PUT and SUBMIT (docs/architecture.md hops 1-2): the blob is an orphan, the
    broker never heard of it, reconcile finds it and deletes it after the grace period."""
    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker:
        proc = subprocess.run([sys.executable, "-c", _CRASHING_PRODUCER, str(cfg)], capture_output=True, text=True,
                              timeout=60, env={**os.environ, **env_for("producer.after_blob_put")})
        assert proc.returncode == -9, proc.stdout + proc.stderr
        assert broker.submit_frames == 0
    store = FileStore(root / "blobs")
    ledger_refs: list[tuple[str, str, str]] = []  # the broker holds no reference
    found = reconcile(ledger_refs, store, grace_s=3600, dry_run=True, now_s=time.time() + 7200)
    assert (found.orphans, found.orphans_deleted) == (1, 0)
    kept = reconcile(ledger_refs, store, grace_s=3600, dry_run=False)  # younger than the grace period
    assert (kept.orphans_young, kept.orphans_deleted) == (1, 0)
    done = reconcile(ledger_refs, store, grace_s=3600, dry_run=False, now_s=time.time() + 7200)
    assert done.orphans_deleted == 1 and list(store.list()) == []


def test_client_waits_for_a_broker_that_starts_late(swarm) -> None:
    root, endpoint, cfg = swarm
    broker = ScriptedBroker(root, endpoint)
    try:
        with Client.from_config_file(cfg) as client:
            timer = threading.Timer(0.8, broker.start)
            timer.start()
            receipt = client.submit(b"late", "echo", timeout_s=15)
            timer.join()
        assert receipt.item_id in broker.items
    finally:
        broker.close()


def test_submit_many_with_the_same_document_twice(swarm) -> None:
    root, endpoint, cfg = swarm
    with ScriptedBroker(root, endpoint) as broker, Client.from_config_file(cfg) as client:
        a, b, c = client.submit_many([(b"doc", "echo"), (b"other", "echo"), (b"doc", "echo")])
    assert (a.duplicate, b.duplicate, c.duplicate) == (False, False, True)
    assert c.item_id == a.item_id and len(broker.items) == 2


def test_wait_keeps_waiting_through_a_frozen_broker(swarm) -> None:
    """Tester #4: a broker that stops answering is not a terminal state. ``Client.wait``
    waits its whole timeout and never reports "unknown" (purged / never existed);
    ``ccsq submit --wait`` (a real process) likewise runs to --timeout-s."""
    root, endpoint, cfg = swarm
    doc = root / "a.txt"
    doc.write_bytes(b"frozen broker")
    with ScriptedBroker(root, endpoint) as broker:
        cli = subprocess.Popen([bin_path("ccsq"), "submit", "--config", str(cfg), "--kind", "echo", "--wait",
                                "--timeout-s", "5", "--json", str(doc)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: broker.items, 20, "the CLI's item reached the broker")
        (item_id,) = list(broker.items)
        broker.set_silent(True)
        t0 = time.monotonic()
        out, err = cli.communicate(timeout=30)
        t_cli = time.monotonic() - t0
        with Client.from_config_file(cfg) as client:
            t0 = time.monotonic()
            st = client.wait([item_id], timeout_s=2.5)[item_id]
            assert time.monotonic() - t0 >= 2.4 and st.state != "unknown", st
    import json

    (row,) = json.loads(out)
    assert row["state"] != "unknown" and t_cli >= 2.5, (row, t_cli, err)
    assert cli.returncode == 4, err  # INCOMPLETE: not acknowledged within --timeout-s
