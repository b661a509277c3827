"""Completion service with the real broker and echo worker: a crash between DB commit
and ACK, and a PostgreSQL outage mid-stream."""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
import pytest

from ccsq.common.runtime.faults import env_for
from tests.pg import pg_database, pg_server  # noqa: F401 (fixtures)
from tests.swarm import Swarm, wait_until


def test_completion_killed_between_commit_and_ack_lands_once(tmp_path: Path) -> None:
    """Gap G3: the result is committed, the service dies before ACK; after the restart the
    broker redelivers it and the results table holds one row with deliveries=2."""
    with Swarm(tmp_path / "s", completion={"batch_max": 1}) as swarm:
        swarm.start_broker()
        swarm.start_worker(1)
        swarm.start_completion(env=env_for("completion.after_db_commit"))
        with swarm.client() as client:
            receipt = client.submit(b"crash me after the commit", "echo")
        assert swarm.procs.wait_exit("completion", timeout_s=30) == -signal.SIGKILL
        before = swarm.results()
        assert [r["item_id"] for r in before] == [receipt.item_id]
        assert swarm.report()["counters"]["acknowledged"] == 0
        swarm.start_completion()
        report = swarm.wait_acknowledged(1, timeout_s=60)
        rows = swarm.results()
    assert len(rows) == 1 and rows[0]["deliveries"] == 2
    assert rows[0]["landed_ts"] == before[0]["landed_ts"]  # the first write is kept
    assert report["counters"]["acknowledged"] == report["counters"]["received"] == 1 and report["balanced"]
    g3 = next(w for w in report["windows"] if w["id"] == "G3")
    assert g3["count"] >= 1


@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_postgres_outage_no_acks_while_down_every_result_lands_once(tmp_path: Path, pg_server, pg_database) -> None:  # noqa: F811
    with Swarm(tmp_path / "s", completion={"database": pg_database, "backoff_max_s": 0.3, "db_slow_s": 2.0},
               worker={"slots": 4, "prefetch": 16}) as swarm:
        swarm.start_all(workers=1)
        completion = swarm.procs.procs["completion"]
        with swarm.client() as client:
            client.submit_many([(f"before {i}".encode(), "echo") for i in range(30)])
            swarm.wait_acknowledged(30, timeout_s=60)
            pg_server.stop()
            client.submit_many([(f"during {i}".encode(), "echo") for i in range(60)])
        wait_until(lambda: completion.count("db_unhealthy") >= 1, 30, "db_unhealthy")
        acked_when_down = swarm.report()["counters"]["acknowledged"]
        wait_until(lambda: completion.count("db_unhealthy") >= 4, 30, "several failed retries")
        assert swarm.report()["counters"]["acknowledged"] == acked_when_down  # no ACK while the database is down
        assert swarm.report()["counters"]["completed"] >= 1  # results wait in the broker
        pg_server.start()
        report = swarm.wait_acknowledged(90, timeout_s=90)
        assert completion.count("db_recovered") >= 1
    with psycopg.connect(pg_database) as con:
        rows = con.execute("SELECT item_id, deliveries FROM results").fetchall()
    assert len(rows) == 90 and {d for _, d in rows} == {1}
    assert report["counters"]["received"] == report["counters"]["acknowledged"] == 90 and report["balanced"]


def _completed_with_result_blob(swarm, root):
    """Run one echo item whose result is stored by reference (over inline_max_bytes)
    up to state completed, with no completion service yet; returns (blob path, bytes)."""
    import os

    from ccsq.common.storage.claimstore import sha256_hex
    from tests.swarm import wait_until

    payload = os.urandom(40_000)
    digest = sha256_hex(payload)
    swarm.start_broker()
    swarm.start_worker(1)
    with swarm.client() as client:
        client.submit(payload, "echo")
    wait_until(lambda: swarm.report()["counters"]["completed"] >= 1, 30, "completed")
    blob = root / "blobs" / digest[:2] / digest[2:4] / digest
    return blob, blob.read_bytes()


def test_claim_store_read_failure_waits_then_lands_once(tmp_path) -> None:
    """A result blob that cannot be read (I/O error, not absence) is never ACKed:
    the completion service backs off and lands it once the store reads again."""
    import shutil

    from tests.swarm import Swarm, wait_until

    with Swarm(tmp_path / "s") as swarm:
        blob, saved = _completed_with_result_blob(swarm, tmp_path / "s")
        blob.unlink()
        blob.mkdir()  # reading it now raises IsADirectoryError (an OSError), not PayloadMissing
        comp = swarm.start_completion()
        wait_until(lambda: comp.count("result_read_failed") >= 2, 30, "read failures logged")
        assert swarm.report()["counters"]["acknowledged"] == 0 and comp.running
        shutil.rmtree(blob)
        blob.write_bytes(saved)
        rep = swarm.wait_acknowledged(1, timeout_s=30)
        assert rep["balanced"] and len(swarm.results()) == 1


def test_missing_result_blob_lands_once_restored_without_restart(tmp_path) -> None:
    """A result blob that is missing when delivered is never ACKed; once an operator
    restores it, the running completion service lands it (no restart needed)."""
    from tests.swarm import Swarm, wait_until

    with Swarm(tmp_path / "s") as swarm:
        blob, saved = _completed_with_result_blob(swarm, tmp_path / "s")
        blob.unlink()
        comp = swarm.start_completion()
        wait_until(lambda: comp.count("result_missing") >= 2, 30, "the missing result re-read")
        assert swarm.report()["counters"]["acknowledged"] == 0
        blob.write_bytes(saved)
        rep = swarm.wait_acknowledged(1, timeout_s=30)
        assert rep["balanced"] and len(swarm.results()) == 1 and comp.running


def test_a_result_the_database_refuses_is_quarantined_and_the_ledger_shows_g12(tmp_path: Path) -> None:
    """With the real broker: a result refused by the results table's own rule is
    acknowledged (the books balance), counted as ``quarantined`` with a G12 event, and
    its ledger record carries the database's error (what `ccsq items show` prints)."""
    import sqlite3

    from ccsq.completiond.resultsdb import SqliteResults

    root = tmp_path / "s"
    with Swarm(root) as swarm:
        SqliteResults(root / "results.db").connect()
        con = sqlite3.connect(root / "results.db")
        con.execute("CREATE TRIGGER no_poison BEFORE INSERT ON results WHEN NEW.result_text LIKE '%poison%' "
                    "BEGIN SELECT RAISE(ABORT, 'poisoned result refused'); END")
        con.commit()
        con.close()
        swarm.start_all(workers=1)
        with swarm.client() as client:
            good = [client.submit(f"page {i}".encode(), "echo").item_id for i in range(5)]
            bad = client.submit(b"a poison page", "echo").item_id
        report = swarm.wait_acknowledged(6, timeout_s=60)
        with swarm.client() as client:
            statuses = {i: s.state for i, s in client.status([*good, bad]).items()}
    assert report["balanced"] and report["counters"]["acknowledged"] == report["counters"]["received"] == 6
    assert set(statuses.values()) == {"acknowledged"}
    assert [r["item_id"] for r in swarm.results()] == sorted(good)
    g12 = next(w for w in report["windows"] if w["id"] == "G12")
    assert g12["count"] == 1 and g12["recent"][0]["item_id"] == bad and "poisoned result refused" in g12["recent"][0]["detail"]
    assert report["counters"]["quarantined"] == 1
    from ccsq.brokerd.ledger.store import Ledger, data_paths

    ledger = Ledger(data_paths(root / "broker-data")[0], readonly=True)
    try:
        with ledger.read() as view:
            assert "poisoned result refused" in view.get(bad)["quarantined"]
    finally:
        ledger.close()


def test_worker_claim_store_outage_dead_letters_nothing(tmp_path: Path) -> None:
    """A worker that cannot read payloads from the claim store (an outage: the store's
    directory replaced by a file) reports store_unavailable: the attempt is not
    counted, so with max_attempts 2 and many failed fetches nothing is dead-lettered;
    once the store is back every item completes once (a fresh-clone tester saw all
    items of a 25 s outage dead-lettered before this)."""
    import shutil

    import subprocess

    from ccsq.tools.procs import bin_path

    root = tmp_path / "s"
    with Swarm(root, broker={"max_attempts": 2}, producer={"inline_max_bytes": 0}) as swarm:
        swarm.start_broker()
        swarm.start_completion()

        def drain(*undo: str) -> None:  # a worker refuses a broken store at start: start it healthy, drained
            subprocess.run([bin_path("ccsq"), "drain", "worker-1", *undo, "--config", str(swarm.configs["admin"])],
                           check=True, capture_output=True, timeout=30)

        drain()
        with swarm.client() as client:
            ids = [client.submit(f"stored page {i}".encode() * 50, "echo").item_id for i in range(5)]
        worker = swarm.start_worker(1)
        blobs = root / "blobs"
        shutil.move(blobs, root / "blobs-away")
        blobs.write_bytes(b"the store is down")
        drain("--undo")
        # the worker reports itself unhealthy for 1-2, 1-3, 1-5 ... s after each episode: fewer fetches than before
        wait_until(lambda: worker.count("payload_fetch_failed") >= 4, 60, "fetches failing during the outage")
        rep = swarm.report()
        assert rep["counters"]["dead"] == 0 and rep["counters"]["acknowledged"] == 0 and worker.running
        blobs.unlink()
        shutil.move(root / "blobs-away", blobs)
        rep = swarm.wait_acknowledged(5, timeout_s=60)
    assert rep["balanced"] and rep["counters"]["dead"] == 0 and rep["counters"]["acknowledged"] == rep["counters"]["received"] == 5
    assert sorted(r["item_id"] for r in swarm.results()) == sorted(ids)
