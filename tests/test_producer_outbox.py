"""Producer outbox: submissions spool durably while the broker is away and flush in order
once it is back, each acknowledged exactly once (scripted broker + real completion service)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port, wait_until
from ccsq.producer import Client
from tests.scripted_broker import ScriptedBroker, make_pki, write_config


def _setup(root: Path) -> tuple[str, Path, Path]:
    make_pki(root, {"broker": "broker", "producer-1": "producer", "completion-1": "completion"})
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    producer = write_config(root, "producer", "producer-1", endpoint, claim_store="file://blobs",
                            outbox_dir="outbox", submit_timeout_s=0.5)
    completion = write_config(root, "completion", "completion-1", endpoint, claim_store="file://blobs",
                              database="sqlite:///results.db", credit=256, batch_max=256, batch_wait_ms=10.0)
    return endpoint, producer, completion


def test_outbox_1000_items_submitted_while_broker_down_are_acknowledged_once(tmp_path: Path) -> None:
    endpoint, producer_cfg, completion_cfg = _setup(tmp_path)
    t0 = time.monotonic()
    with Client.from_config_file(producer_cfg) as client:
        receipts = client.submit_many([(f"document {i}".encode(), "echo", {"i": i}) for i in range(1000)])
        one_more = client.submit(b"one more", "echo")  # joins the non-empty spool at once
        assert client.outbox_count() == 1001
    assert all(r.spooled and r.item_id == "" for r in receipts) and one_more.spooled
    assert time.monotonic() - t0 < 10
    keys = [r.key for r in receipts] + [one_more.key]

    # the producer process restarted meanwhile: the spool is on disk
    broker = ScriptedBroker(tmp_path, endpoint, auto_complete=True).start()
    with ProcessGroup(tmp_path / "logs") as procs:
        procs.start("completion", [bin_path("ccsq"), "completion", "--config", str(completion_cfg)],
                    ready_event="broker_link_ready")
        with Client.from_config_file(producer_cfg) as client:
            client.flush(timeout_s=60)
            assert client.outbox_count() == 0 and client.outbox_rejected() == []
        wait_until(lambda: len(broker.acked_ids()) == 1001, 60, "1001 results acknowledged")
    broker.close()
    assert broker.submitted_keys[: len(keys)] == keys  # flushed in submission order
    assert len(broker.items) == 1001 and set(broker.ack_count.values()) == {1}
    con = sqlite3.connect(tmp_path / "results.db")
    rows = con.execute("SELECT idem_key, deliveries FROM results").fetchall()
    con.close()
    assert len(rows) == 1001 and {k for k, _ in rows} == set(keys) and {d for _, d in rows} == {1}


def test_queue_full_spools_instead_of_failing(tmp_path: Path) -> None:
    endpoint, producer_cfg, _ = _setup(tmp_path)
    with ScriptedBroker(tmp_path, endpoint) as broker, Client.from_config_file(producer_cfg) as client:
        broker.queue_full_frames = 10_000
        receipt = client.submit(b"while full", "echo")
        assert receipt.spooled and client.outbox_count() == 1
        broker.queue_full_frames = 0
        client.flush(timeout_s=30)
        direct = client.submit(b"after", "echo")  # spool empty again: straight to the broker
    assert not direct.spooled and direct.item_id
    assert set(broker.item_by_key) == {receipt.key, direct.key}
