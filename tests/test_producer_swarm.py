"""Producer library against the real parts: ccsq-brokerd, ccsq-workerd (echo) and the
completion service as subprocesses (tests/swarm.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ccsq.common.storage.claimstore import FileStore
from ccsq.common.wire.errors import QueueFull
from ccsq.common.runtime.faults import env_for
from ccsq.tools.reconcile import reconcile
from tests.swarm import Swarm, wait_until


@pytest.mark.timeout(180)
def test_outbox_1000_items_with_broker_down_are_acknowledged_exactly_once(tmp_path: Path) -> None:
    """1,000 submissions while no broker runs are spooled durably; once the broker,
    an echo worker and the completion service start, every one is acknowledged once."""
    with Swarm(tmp_path / "s", producer={"outbox_dir": "outbox", "submit_timeout_s": 0.5},
               completion={"credit": 256, "batch_max": 256}, worker={"slots": 4, "prefetch": 64}) as swarm:
        with swarm.client() as client:
            receipts = client.submit_many([(f"document {i}".encode(), "echo", {"i": i}) for i in range(1000)])
            assert all(r.spooled for r in receipts) and client.outbox_count() == 1000
            swarm.start_all(workers=1)
            client.flush(timeout_s=60)
            assert client.outbox_rejected() == []
        report = swarm.wait_acknowledged(1000, timeout_s=120)
        rows = wait_until(lambda: (r := swarm.results()) and len(r) >= 1000 and r, 30, "1000 result rows")
    assert report["counters"]["received"] == report["counters"]["acknowledged"] == 1000 and report["balanced"]
    assert report["counters"]["duplicate_submits"] == 0
    # once each, but for results redelivered because the completion session ended before its
    # ACK (heartbeats starved on a loaded box): each of those is counted (G3), none silent
    extra = sum(r["deliveries"] - 1 for r in rows)
    assert len(rows) == 1000 and extra == report["counters"]["redelivered"], (extra, report["counters"])
    assert {r["idem_key"] for r in rows} == {r.key for r in receipts}


def test_dedup_status_and_wait_against_the_broker(tmp_path: Path) -> None:
    with Swarm(tmp_path / "s") as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            first = client.submit(b"same document" * 2000, "echo", params={"lang": "en"})  # claim check
            again = client.submit(b"same document" * 2000, "echo", params={"lang": "en"})
            other = client.submit(b"small", "echo")
            done = client.wait([first.item_id, other.item_id, "no-such-item"], timeout_s=60)
    assert again.duplicate and again.item_id == first.item_id and not first.duplicate
    assert done[first.item_id].state == done[other.item_id].state == "acknowledged"
    assert done["no-such-item"].state == "unknown"
    rows = {r["item_id"]: r for r in swarm.results()}
    assert rows[first.item_id]["result"] == b"same document" * 2000
    assert rows[first.item_id]["deliveries"] == 1 and len(rows) == 2


def test_queue_full_backpressure_then_drain(tmp_path: Path) -> None:
    """The broker refuses SUBMIT with QUEUE_FULL above max_ready_items: the producer
    raises QueueFull after its timeout, and a retrying submit succeeds once workers drain."""
    with Swarm(tmp_path / "s", broker={"max_ready_items": 3}) as swarm:
        swarm.start_broker()
        with swarm.client() as client:
            for i in range(3):
                client.submit(f"item {i}".encode(), "echo")
            t0 = time.monotonic()
            with pytest.raises(QueueFull):
                client.submit(b"one too many", "echo", timeout_s=1.0)
            assert time.monotonic() - t0 < 5
            out: dict = {}
            t = threading.Thread(target=lambda: out.update(r=client.submit(b"eventually", "echo", timeout_s=60)))
            t.start()
            swarm.start_worker(1)
            swarm.start_completion()
            t.join(timeout=60)
        assert out["r"].item_id
        report = swarm.wait_acknowledged(4, timeout_s=60)
    assert report["counters"]["received"] == 4 and report["balanced"]


_CRASHING_PRODUCER = """
import sys
from ccsq.producer import Client
with Client.from_config_file(sys.argv[1]) as client:
    client.submit(b"z" * 100_000, "echo")
print("unreachable: the crash point did not fire")
"""


def test_producer_killed_after_blob_put_reconcile_finds_the_orphan(tmp_path: Path) -> None:
    """Crash between PUT and SUBMIT with the real broker: the ledger never heard of the
    item, the blob is an orphan that reconcile reports and then collects."""
    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        proc = subprocess.run([sys.executable, "-c", _CRASHING_PRODUCER, str(swarm.configs["producer"])],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, **env_for("producer.after_blob_put")})
        assert proc.returncode == -9, proc.stdout + proc.stderr
        report = swarm.report()
    assert report["counters"]["received"] == 0
    store = FileStore(swarm.root / "blobs")
    found = reconcile([], store, grace_s=3600, dry_run=True, now_s=time.time() + 7200)
    assert (found.stored, found.orphans, found.orphans_deleted) == (1, 1, 0)
    done = reconcile([], store, grace_s=3600, dry_run=False, now_s=time.time() + 7200)
    assert done.orphans_deleted == 1 and list(store.list()) == []


def test_broker_killed_after_submit_commit_resubmit_returns_the_same_item(tmp_path: Path) -> None:
    """The broker dies after committing a SUBMIT and before its SUBMIT_ACK: the producer
    re-sends the same key to the restarted broker and gets the original item id back."""
    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker(env=env_for("broker.after_submit_commit"))
        with swarm.client() as client:
            out: dict = {}
            t = threading.Thread(target=lambda: out.update(r=client.submit(b"committed once", "echo", timeout_s=60)))
            t.start()
            assert swarm.procs.wait_exit("broker", timeout_s=30) == -9
            swarm.start_broker()
            t.join(timeout=60)
            receipt = out["r"]
            status = client.status([receipt.item_id])[receipt.item_id]
        report = swarm.report()
    assert receipt.duplicate and status.state == "ready"
    assert report["counters"]["received"] == 1 and report["counters"]["duplicate_submits"] == 1 and report["balanced"]


def test_peer_without_the_producer_role_gets_unauthorized(tmp_path: Path) -> None:
    from ccsq.common.wire.config import ProducerConfig, load
    from ccsq.common.wire.errors import Unauthorized
    from ccsq.producer import Client

    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        cfg = load(ProducerConfig, swarm.configs["producer"])
        wrong = dataclasses.replace(cfg, peer_id="completion-1", private_key=str(swarm.root / "keys" / "completion-1.key"))
        with Client(wrong) as client, pytest.raises(Unauthorized, match="ROLE"):
            client.submit(b"x", "echo", timeout_s=1.5)


def test_a_producer_whose_peer_id_a_live_session_holds_fails_with_a_config_error(tmp_path: Path) -> None:
    """Two live producers with one peer id: the live session keeps it (issue 27). The
    newcomer is refused ID_IN_USE and, after one liveness window (0.2 s x 5 here), its
    calls fail with ConfigError (exit 78 in ``ccsq submit``) naming the peer id and the
    holder, not after its whole timeout blaming the broker; the first keeps working."""
    import os

    from ccsq.common.wire.errors import ConfigError

    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        with swarm.client() as first:
            assert first.submit(b"one", "echo").item_id
            with swarm.client() as second:  # same producer.toml: same peer id (another link instance)
                t0 = time.monotonic()
                with pytest.raises(ConfigError, match="another live process uses peer id 'producer-1'") as exc:
                    second.submit(b"two", "echo", timeout_s=30)
                assert time.monotonic() - t0 < 10
                assert f"/{os.getpid()}/" in str(exc.value)  # the holder: host/pid/instance
                assert first.submit(b"three", "echo").item_id


def test_cancel_dead_letters_ready_items_only(tmp_path) -> None:
    """cancel(): a READY item becomes DEAD (cancelled, G7 event); an acknowledged one is untouched."""
    from tests.swarm import Swarm

    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        with swarm.client() as client:
            ready = client.submit(b"not yet run", "echo")
            out = client.cancel([ready.item_id, "no-such-item"])
            assert out[ready.item_id].state == "dead" and out[ready.item_id].error == "cancelled"
            assert out["no-such-item"].state == "unknown"
            assert client.cancel([ready.item_id])[ready.item_id].state == "dead"  # idempotent
            swarm.start_worker(1)
            swarm.start_completion()
            done = client.submit(b"runs to the end", "echo")
            assert client.wait([done.item_id], timeout_s=30)[done.item_id].state == "acknowledged"
            assert client.cancel([done.item_id])[done.item_id].state == "acknowledged"
        rep = swarm.report()
        assert rep["counters"]["dead"] == 1 and rep["counters"]["acknowledged"] == 1 and rep["balanced"]
        g7 = next(w for w in rep["windows"] if w["id"] == "G7")
        assert g7["count"] == 1 and "cancelled" in g7["recent"][0]["detail"]


def test_items_no_database_can_store_are_refused_at_the_edge(tmp_path) -> None:
    """A NUL in the key or NaN/Infinity in params would make the results database
    refuse the row forever (and wedge the completion service): the client raises
    InvalidRequest before writing anything, and the broker answers MALFORMED for
    a producer that skips the check."""
    import math

    import pytest

    from ccsq.common.wire import protocol
    from ccsq.common.wire.errors import InvalidRequest
    from tests.swarm import Swarm

    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        with swarm.client() as client:
            for kwargs in ({"key": "k\x00r2"}, {"params": {"x": float("nan")}}, {"params": {"x": math.inf}},
                           {"params": {"s": "a\x00b"}}, {"deadline_ts": float("nan")}):
                with pytest.raises(InvalidRequest):
                    client.submit(b"x" * 20_000, "echo", **kwargs)
            assert client.submit(b"fine", "echo", params={"x": 1.5}).item_id
        assert swarm.report()["counters"]["received"] == 1
        assert not list((tmp_path / "s" / "blobs").glob("??/??/*"))  # nothing written for refused input
    blob = protocol.Blob("0" * 64, 0, b"")
    assert "finite" in protocol.submit_item_problem(protocol.SubmitItem("k", "echo", blob, {"x": float("nan")}))
    assert "control" in protocol.submit_item_problem(protocol.SubmitItem("k\x00", "echo", blob))


def test_cli_submit_wait_with_outbox_follows_spooled_items_and_leaves_outbox_empty(tmp_path) -> None:
    """`ccsq submit --wait` with an outbox: items spooled while the broker is down are
    followed to acknowledged once it is up, and the outbox is empty afterwards
    (confirmed items are removed, not re-sent by the next run)."""
    import json
    import sqlite3
    import subprocess

    from ccsq.tools.procs import bin_path
    from tests.swarm import Swarm, wait_until

    with Swarm(tmp_path / "s", producer={"outbox_dir": "outbox", "submit_timeout_s": 1.0}) as swarm:
        files = []
        for i in range(3):
            f = tmp_path / f"doc{i}.txt"
            f.write_text(f"document {i}")
            files.append(str(f))
        outbox = tmp_path / "s" / "outbox" / "outbox.sqlite3"

        def spooled() -> int:
            if not outbox.exists():
                return 0
            con = sqlite3.connect(f"file:{outbox}?mode=ro", uri=True, timeout=5)
            try:
                return con.execute("SELECT count(*) FROM outbox").fetchone()[0]
            except sqlite3.OperationalError:
                return 0
            finally:
                con.close()

        cli = subprocess.Popen([bin_path("ccsq"), "submit", "--config", str(swarm.configs["producer"]), "--kind", "echo",
                                "--wait", "--timeout-s", "60", "--json", *files], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: spooled() >= 3, 30, "three spooled items")
            swarm.start_all(workers=1)
            out, err = cli.communicate(timeout=90)
        finally:
            if cli.poll() is None:
                cli.kill()
        assert cli.returncode == 0, err.decode()[-2000:]
        rows = json.loads(out)
        assert [r["state"] for r in rows] == ["acknowledged"] * 3 and all(r["item_id"] for r in rows)
        assert spooled() == 0
        rep = swarm.report()
        assert rep["counters"]["received"] == rep["counters"]["acknowledged"] == 3 and rep["balanced"]


def test_wait_on_results_larger_than_one_status_frame(tmp_path: Path) -> None:
    """STATUS_REPLY of 120 items with 12 KB inline results is split by the broker over
    several frames (its frame budget); wait() and status() merge them: every item is
    acknowledged, none reported "unknown" (a tester saw 'unknown' and exit 4 for 215 of 300)."""
    with Swarm(tmp_path / "s", producer={"inline_max_bytes": 16384}) as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            receipts = client.submit_many([(os.urandom(12000), "echo", {"i": i}) for i in range(120)])
            ids = [r.item_id for r in receipts]
            done = client.wait(ids, timeout_s=90)
            states = client.status(ids)
    assert {s.state for s in done.values()} == {"acknowledged"}, {s.state for s in done.values()}
    assert len(states) == 120 and all(states[i].state == "acknowledged" for i in ids)
    assert all(states[i].result is not None and states[i].result.size == 12000 for i in ids)
