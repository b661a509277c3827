"""Completion service as a real subprocess against a scripted broker: commit before ACK,
idempotent upsert across a crash, database outages (PostgreSQL stopped, SQLite locked)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import psycopg
import pytest

from ccsq.common.storage.claimstore import FileStore, sha256_hex
from ccsq.common.runtime.faults import env_for
from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port, wait_until
from ccsq.common.wire.protocol import Blob, Delivery
from tests.pg import pg_database, pg_server  # noqa: F401 (fixtures)
from tests.scripted_broker import ScriptedBroker, make_pki, write_config


def delivery(n: int, result: bytes | None = None, store: FileStore | None = None) -> Delivery:
    data = result if result is not None else json.dumps({"n": n, "text": f"result {n}"}).encode()
    blob = Blob(sha256_hex(data), len(data), None if store else data)
    if store is not None:
        store.put(data)
    return Delivery(item_id=f"item-{n:05d}", key=f"key-{n}", kind="echo", result=blob, params={"n": n, "raw": b"\x01"},
                    attempt=1, handler="echo", handler_version="1.0", completed_ts=time.time())


class Env:
    """Keys, a scripted broker and a completion service subprocess in ``root``."""

    def __init__(self, root: Path, **completion: object) -> None:
        self.root = root
        make_pki(root, {"broker": "broker", "completion-1": "completion"})
        self.endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.config = write_config(root, "completion", "completion-1", self.endpoint, claim_store="file://blobs",
                                   **{"database": "sqlite:///results.db", "credit": 16, "batch_max": 8,
                                      "batch_wait_ms": 5.0, "backoff_max_s": 0.3, **completion})
        self.broker = ScriptedBroker(root, self.endpoint).start()
        self.procs = ProcessGroup(root / "logs")
        self.store = FileStore(root / "blobs")

    def start(self, env: dict[str, str] | None = None):
        return self.procs.start("completion", [bin_path("ccsq"), "completion", "--config", str(self.config)],
                                env=env, ready_event="broker_link_ready")

    def count(self, event: str) -> int:
        return self.procs.procs["completion"].count(event)

    def close(self) -> None:
        self.procs.stop_all()
        self.broker.close()


@pytest.fixture
def env(tmp_path: Path):
    envs: list[Env] = []

    def make(**completion: object) -> Env:
        e = Env(tmp_path, **completion)
        envs.append(e)
        return e

    yield make
    for e in envs:
        e.close()


def sqlite_rows(db: Path) -> dict[str, dict]:
    if not db.exists():
        return {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    con.row_factory = sqlite3.Row
    try:
        return {r["item_id"]: dict(r) for r in con.execute("SELECT * FROM results")}
    except sqlite3.OperationalError:
        return {}
    finally:
        con.close()


def test_an_empty_results_database_has_its_schema_at_start(env) -> None:
    """Issue 22: the service makes the schema when it starts, so a reader of a database no
    result has reached yet finds an empty ``results`` table (before: no such table)."""
    e = env()
    e.start()
    db = e.root / "results.db"

    def tables() -> set[str]:
        if not db.exists():
            return set()
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()

    wait_until(lambda: "results" in tables(), 20, "the results table in an empty database")
    assert sqlite_rows(db) == {} and "results_quarantine" in tables()


def test_results_land_once_then_ack_within_credit(env) -> None:
    e = env()
    e.start()
    big = os.urandom(3000)
    e.broker.add_completed(delivery(0, result=big, store=e.store))  # result by claim-check reference
    for n in range(1, 200):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: len(e.broker.acked_ids()) == 200, 30, "200 results acknowledged")
    rows = sqlite_rows(e.root / "results.db")
    assert len(rows) == 200 and {r["deliveries"] for r in rows.values()} == {1}
    assert set(e.broker.ack_count.values()) == {1}
    assert e.broker.max_in_flight <= 16  # never more than the credit granted
    assert rows["item-00000"]["result"] == big and rows["item-00000"]["result_text"] is None
    r7 = rows["item-00007"]
    assert json.loads(r7["result_text"]) == {"n": 7, "text": "result 7"}
    assert json.loads(r7["params"]) == {"n": 7, "raw": {"$b64": "AQ=="}}
    assert (r7["idem_key"], r7["kind"], r7["attempt"], r7["handler"], r7["handler_version"]) == (
        "key-7", "echo", 1, "echo", "1.0")
    assert r7["landed_ts"] >= r7["completed_ts"] - 1


def test_a_result_frame_larger_than_batch_max_is_split_into_transactions_and_acks(env) -> None:
    """RESULT frames are queued whole and cut at ``batch_max``: one frame of 64 results with
    ``batch_max = 8`` lands as transactions (and ACKs) of at most 8, each result once, and the
    credit comes back so that the next frames follow."""
    e = env(credit=64, batch_max=8, batch_wait_ms=50.0)
    e.start()
    for n in range(150):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: len(e.broker.acked_ids()) == 150, 30, "150 results acknowledged")
    with e.broker.lock:
        sizes = [len(ids) for _, ids in e.broker.acks]
    assert max(sizes) <= 8 and sum(sizes) == 150 and len(sizes) >= 150 // 8
    assert set(e.broker.ack_count.values()) == {1}
    assert e.broker.max_in_flight > 8  # the broker did send frames larger than a batch
    rows = sqlite_rows(e.root / "results.db")
    assert len(rows) == 150 and {r["deliveries"] for r in rows.values()} == {1}


def test_killed_between_commit_and_ack_lands_once_and_counts_the_redelivery(env) -> None:
    """Crash between steps 5 and 6 (docs/architecture.md hops 7-8, gap G3): the first batch is
    committed but never acknowledged; after a restart the broker redelivers it and the
    upsert keeps one row per item with deliveries=2."""
    e = env(batch_max=4, batch_wait_ms=200.0)
    proc = e.start(env=env_for("completion.after_db_commit"))
    for n in range(4):
        e.broker.add_completed(delivery(n))
    assert e.procs.wait_exit("completion", timeout_s=20) == -signal.SIGKILL
    first = sqlite_rows(e.root / "results.db")
    assert len(first) == 4 and e.broker.ack_frames() == 0  # committed, never acknowledged
    e.start()
    for n in range(4, 10):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: len(e.broker.acked_ids()) == 10, 30, "10 results acknowledged")
    rows = sqlite_rows(e.root / "results.db")
    assert len(rows) == 10
    assert {i: r["deliveries"] for i, r in rows.items() if r["deliveries"] != 1} == {i: 2 for i in first}
    assert all(rows[i]["landed_ts"] == first[i]["landed_ts"] for i in first)  # the first write is kept
    assert set(e.broker.ack_count.values()) == {1}
    assert proc.starts == 2


def test_the_next_batch_lands_while_the_broker_commits_the_previous_ack(env) -> None:
    """ACKs are pipelined: the broker answers each ACK 3 s late (slow to commit it), and a result
    that arrives meanwhile is landed and ACKed without waiting for that ACK_OK (before: the
    second ACK came only after the first ACK_OK). Each result lands once, is ACKed once after its
    own commit (re-sent, as ever, when its ACK_OK is later than a liveness window), and the credit
    of both comes back with their ACK_OKs."""
    e = env(credit=4, batch_max=8, batch_wait_ms=0.0)
    e.broker.ack_ok_delay_s = 3.0
    e.start()
    e.broker.add_completed(delivery(0))
    wait_until(lambda: e.broker.ack_frames() >= 1, 20, "the first ACK")
    e.broker.add_completed(delivery(1))
    wait_until(lambda: e.broker.ack_frames() >= 2, 20, "the second ACK")
    with e.broker.lock:
        (t0, first), (t1, second) = e.broker.acks[:2]
    assert (first, second) == (["item-00000"], ["item-00001"])
    assert t1 - t0 < 2.0, t1 - t0  # not held back until the first ACK_OK (3 s)
    assert set(sqlite_rows(e.root / "results.db")) == {"item-00000", "item-00001"}  # each committed before its ACK
    wait_until(lambda: e.count("results_acked") == 2, 20, "both ACK_OKs")  # (re-sent after a liveness window: idempotent)
    e.broker.ack_ok_delay_s = 0.0
    for n in range(2, 10):  # the credit came back: more results flow
        e.broker.add_completed(delivery(n))
    wait_until(lambda: len(e.broker.acked_ids()) == 10, 60, "10 results acknowledged")
    rows = sqlite_rows(e.root / "results.db")
    assert len(rows) == 10 and {r["deliveries"] for r in rows.values()} == {1}
    assert {e.broker.ack_count[f"item-{n:05d}"] for n in range(2, 10)} == {1} and e.broker.max_in_flight <= 4


@pytest.mark.postgres
def test_postgres_outage_stops_acks_and_every_result_lands_once(env, pg_server, pg_database) -> None:  # noqa: F811
    e = env(database=pg_database, db_slow_s=2.0)
    e.start()
    for n in range(40):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: len(e.broker.acked_ids()) == 40, 30, "first 40 acknowledged")
    pg_server.stop()
    # from the server's stop (not from the first db_unhealthy line: an ACK sent before the
    # write goes out at once, before the write fails) nothing is acknowledged until it is back
    t_down = time.monotonic()
    acks_at_down = e.broker.ack_frames()
    for n in range(40, 120):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: e.count("db_unhealthy") >= 4, 30, "the service to keep backing off")
    t_up = time.monotonic()
    assert e.broker.ack_frames() == acks_at_down
    with e.broker.lock:
        assert not any(t_down <= t <= t_up for t, _ in e.broker.acks)
    pg_server.start()
    wait_until(lambda: len(e.broker.acked_ids()) == 120, 60, "all 120 acknowledged after the restart")
    assert e.count("db_recovered") >= 1
    with psycopg.connect(pg_database) as con:
        rows = con.execute("SELECT item_id, deliveries, result_text, params FROM results").fetchall()
    assert len(rows) == 120 and {r[1] for r in rows} == {1}
    assert set(e.broker.ack_count.values()) == {1}
    assert json.loads(dict((r[0], r[2]) for r in rows)["item-00041"])["n"] == 41


def test_slow_database_write_is_retried_without_ack(env) -> None:
    """A write blocked longer than db_slow_s (another writer holds the SQLite lock) is
    abandoned and retried with backoff; nothing is acknowledged until it commits."""
    e = env(db_slow_s=0.3)
    e.start()
    e.broker.add_completed(delivery(0))
    wait_until(lambda: len(e.broker.acked_ids()) == 1, 30, "first result acknowledged")
    locker = sqlite3.connect(e.root / "results.db", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        for n in range(1, 30):
            e.broker.add_completed(delivery(n))
        wait_until(lambda: e.count("db_unhealthy") >= 2, 30, "db_unhealthy after slow writes")
        assert e.count("db_slow") >= 1
        assert e.broker.ack_frames() == 1
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    wait_until(lambda: len(e.broker.acked_ids()) == 30, 30, "all acknowledged once the lock is gone")
    rows = sqlite_rows(e.root / "results.db")
    assert len(rows) == 30 and {r["deliveries"] for r in rows.values()} == {1}
    assert e.count("db_recovered") >= 1


def test_missing_result_blob_is_never_acknowledged(env) -> None:
    e = env()
    e.start()
    lost = b"stored nowhere" * 100
    e.broker.add_completed(Delivery(item_id="item-lost", key="k", kind="echo", result=Blob(sha256_hex(lost), len(lost)),
                                    params={}, attempt=1, handler="echo", handler_version="1", completed_ts=time.time()))
    e.broker.add_completed(delivery(1))
    wait_until(lambda: e.broker.acked_ids() == {"item-00001"}, 30, "the good result acknowledged")
    # (>= 1: a parked delivery is read again later and logged again; under load that can
    # happen before this check runs)
    wait_until(lambda: e.count("result_missing") >= 1, 30, "result_missing logged")
    assert "item-lost" not in sqlite_rows(e.root / "results.db")
    assert "item-lost" not in e.broker.acked_ids()


def test_sigterm_finishes_the_batch_says_bye_and_exits_0(env) -> None:
    e = env(batch_max=50, batch_wait_ms=50.0, credit=200)
    e.start()
    for n in range(150):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: e.count("results_acked") >= 1, 30, "a first acknowledged batch")
    e.procs.signal("completion", signal.SIGTERM)
    assert e.procs.wait_exit("completion", timeout_s=20) == 0
    rows = sqlite_rows(e.root / "results.db")
    assert set(rows) == e.broker.acked_ids()  # every committed batch was acknowledged before exit
    assert e.count("completion_stopped") == 1
    wait_until(lambda: "completion-1" in e.broker.byes, 5, "BYE from the completion service")


@pytest.mark.parametrize("how", ["ccsq completion", "ccsq-completiond", "ccsq-completiond, $CCSQ_CONFIG"])
def test_bad_database_url_is_a_config_error(env, how: str) -> None:
    """The unit's ``ccsq-completiond`` and the ``ccsq completion`` alias are one command:
    same config (``--config`` or the default from ``$CCSQ_CONFIG``), same refusal, same exit;
    the refusal begins with the name it was started by (``ccsq-completiond`` used to say
    ``ccsq completion:``)."""
    e = env(database="mysql://nope")
    argv = {"ccsq completion": [bin_path("ccsq"), "completion", "--config", str(e.config)],
            "ccsq-completiond": [bin_path("ccsq-completiond"), "--config", str(e.config)],
            "ccsq-completiond, $CCSQ_CONFIG": [bin_path("ccsq-completiond")]}[how]
    proc = e.procs.start("completion", argv, env={"CCSQ_CONFIG": str(e.config)})
    assert e.procs.wait_exit("completion", timeout_s=20) == 78
    tail = e.procs.tail("completion")
    assert "mysql://nope" in tail and proc.starts == 1
    prog = how.split(",")[0]
    assert f"{prog}: configuration error" in tail, tail
    assert f"{'ccsq completion' if prog == 'ccsq-completiond' else 'ccsq-completiond'}:" not in tail, tail


def test_results_database_in_a_missing_directory_is_a_config_error(env, tmp_path: Path) -> None:
    """A typo in the database path must not create a directory and acknowledge results into
    a file nobody reads: exit 78 naming the URL and the directory."""
    missing = tmp_path / "no-such-dir" / "r.db"
    e = env(database=f"sqlite:///{missing}")
    e.procs.start("completion", [bin_path("ccsq-completiond"), "--config", str(e.config)])
    assert e.procs.wait_exit("completion", timeout_s=20) == 78
    assert "does not exist" in e.procs.tail("completion") and not missing.parent.exists()


def test_sd_notify_ready_watchdog_and_stopping(env, tmp_path: Path) -> None:
    """Under systemd (Type=notify, WatchdogSec=): READY=1 once serving (broker and database
    need not be up), WATCHDOG=1 pings from the event loop, STOPPING=1 on SIGTERM."""
    import socket

    e = env()
    path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(0.1)
    seen: list[str] = []

    def drain() -> list[str]:
        try:
            while True:
                seen.extend(listener.recv(4096).decode().splitlines())
        except TimeoutError:
            return seen

    try:
        e.start(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
        wait_until(lambda: "READY=1" in drain() and "WATCHDOG=1" in seen, 10, "READY=1 and WATCHDOG=1")
        e.procs.signal("completion", signal.SIGTERM)
        assert e.procs.wait_exit("completion", timeout_s=20) == 0
        assert "STOPPING=1" in drain()
    finally:
        listener.close()


def test_unreadable_key_is_a_config_error_before_ready(env) -> None:
    e = env()
    (e.root / "keys" / "completion-1.key").chmod(0o644)
    e.procs.start("completion", [bin_path("ccsq"), "completion", "--config", str(e.config)])
    assert e.procs.wait_exit("completion", timeout_s=20) == 78
    assert "chmod 600" in e.procs.tail("completion")


def refused(n: int) -> bool:
    """Which test results the database's own rule refuses (items 3, 10, 17, ...)."""
    return n % 7 == 3


def test_rows_the_database_refuses_are_quarantined_acknowledged_once_even_across_a_crash(env) -> None:
    """Gap G12: a trigger (an operator's rule) refuses some rows for a data reason. The
    batch is split until the refused rows stand alone; every other row lands in
    ``results``, each refused one in ``results_quarantine`` with the database's error,
    and the ACK names them. A crash after the commit (before the ACK) redelivers the
    batch: both tables absorb it (deliveries=2), nothing is acknowledged twice."""
    from ccsq.completiond.resultsdb import SqliteResults

    e = env(batch_max=8, batch_wait_ms=200.0)
    db = e.root / "results.db"
    SqliteResults(db).connect()  # the schema, then the operator's rule
    con = sqlite3.connect(db)
    con.execute("CREATE TRIGGER refuse_some BEFORE INSERT ON results WHEN json_extract(NEW.params, '$.n') % 7 = 3 "
                "BEGIN SELECT RAISE(ABORT, 'refused by the operator''s rule'); END")
    con.commit()
    con.close()
    e.start(env=env_for("completion.after_db_commit"))
    for n in range(8):
        e.broker.add_completed(delivery(n))
    assert e.procs.wait_exit("completion", timeout_s=20) == -signal.SIGKILL
    assert e.broker.ack_frames() == 0  # committed (both tables), never acknowledged
    e.start()
    for n in range(8, 40):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: len(e.broker.acked_ids()) == 40, 30, "40 results acknowledged")
    rows = sqlite_rows(db)
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    quarantine = {r["item_id"]: dict(r) for r in con.execute("SELECT * FROM results_quarantine")}
    con.close()
    bad = {f"item-{n:05d}" for n in range(40) if refused(n)}
    assert set(quarantine) == bad and set(rows) == {f"item-{n:05d}" for n in range(40)} - bad
    assert all("refused by the operator's rule" in q["error"] for q in quarantine.values())
    assert quarantine["item-00003"]["deliveries"] == 2 and rows["item-00000"]["deliveries"] == 2  # the redelivered batch
    assert quarantine["item-00010"]["result"] == json.dumps({"n": 10, "text": "result 10"}).encode()
    assert set(e.broker.quarantined) == bad and set(e.broker.ack_count.values()) == {1}
    assert e.count("result_quarantined") == len(bad) + 1  # item 3 twice: before and after the crash


@pytest.mark.postgres
def test_postgres_check_violation_is_quarantined_and_an_outage_is_not(env, pg_server, pg_database) -> None:  # noqa: F811
    """On PostgreSQL a CHECK constraint refusing a row is a data error (quarantine), while
    the server being down is an outage (no ACK, retried): the two are told apart."""
    from ccsq.completiond.resultsdb import PostgresResults

    PostgresResults(pg_database).connect()
    with psycopg.connect(pg_database) as con:
        con.execute("ALTER TABLE results ADD CONSTRAINT operator_rule CHECK ((params->>'n')::int % 7 <> 3)")
    e = env(database=pg_database, db_slow_s=2.0)
    e.start()
    for n in range(20):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: len(e.broker.acked_ids()) == 20, 30, "first 20 acknowledged")
    pg_server.stop()
    for n in range(20, 40):
        e.broker.add_completed(delivery(n))
    wait_until(lambda: e.count("db_unhealthy") >= 2, 30, "the outage retried, not quarantined")
    assert len(e.broker.acked_ids()) == 20
    pg_server.start()
    wait_until(lambda: len(e.broker.acked_ids()) == 40, 60, "all 40 acknowledged after the restart")
    with psycopg.connect(pg_database) as con:
        landed = {r[0] for r in con.execute("SELECT item_id FROM results")}
        quarantine = dict(con.execute("SELECT item_id, error FROM results_quarantine").fetchall())
    bad = {f"item-{n:05d}" for n in range(40) if refused(n)}
    assert set(quarantine) == bad and landed == {f"item-{n:05d}" for n in range(40)} - bad
    assert all("CheckViolation" in err and "operator_rule" in err for err in quarantine.values())
    assert set(e.broker.quarantined) == bad and set(e.broker.ack_count.values()) == {1}


def _row(n: int, key: str, handler: str = "echo") -> "ResultRow":  # noqa: F821 (imported in the body)
    from ccsq.completiond.resultsdb import ResultRow

    data = f"result {n}".encode()
    return ResultRow(item_id=f"item-{n:05d}", idem_key=key, kind="echo", params_json=json.dumps({"n": n}),
                     result=data, result_sha256=sha256_hex(data), result_text=data.decode(), attempt=1,
                     handler=handler, handler_version="1.0", completed_ts=time.time(), landed_ts=time.time())


@pytest.mark.postgres
def test_postgres_latin1_database_quarantines_text_it_cannot_hold_ascii_escaped(pg_server) -> None:  # noqa: F811
    """A LATIN1 database cannot store a CJK idempotency key (SQLSTATE 22P05) in either
    table: the row still lands in ``results_quarantine``, its text escaped to ASCII,
    in the same single transaction as the rest of the batch (one commit, deliveries 1)."""
    from ccsq.completiond.resultsdb import PostgresResults

    name = f"latin1_{os.getpid()}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    db = PostgresResults(pg_server.dsn_for(name))
    try:
        refused = db.land([_row(0, "plain-key"), _row(1, "文書-key"), _row(2, "other-key")])
        assert [(r.item_id, "UntranslatableCharacter" in e) for r, e in refused] == [("item-00001", True)]
        refused_again = db.land([_row(1, "文書-key")])  # a redelivery: absorbed by the quarantine upsert
        assert [r.item_id for r, _ in refused_again] == ["item-00001"]
    finally:
        db.close()
    with psycopg.connect(pg_server.dsn_for(name)) as con:
        landed = con.execute("SELECT item_id, deliveries FROM results ORDER BY item_id").fetchall()
        quarantined = con.execute("SELECT item_id, idem_key, deliveries FROM results_quarantine").fetchall()
    assert landed == [("item-00000", 1), ("item-00002", 1)]
    assert quarantined == [("item-00001", "\\u6587\\u66f8-key", 2)]


def test_sqlite_rows_a_trigger_silently_skips_are_quarantined_not_lost(tmp_path: Path) -> None:
    """A trigger that drops a row without an error (``RAISE(IGNORE)``) must not turn into a
    result acknowledged but stored nowhere: the skipped row is refused like a data error
    and lands in the quarantine, the rest in ``results``, in one transaction."""
    from ccsq.completiond.resultsdb import SqliteResults

    db = SqliteResults(tmp_path / "r.db")
    db.connect()
    db._con.execute("CREATE TRIGGER skip_it BEFORE INSERT ON results WHEN NEW.idem_key = 'skip-me' "
                    "BEGIN SELECT RAISE(IGNORE); END")
    refused = db.land([_row(0, "a"), _row(1, "skip-me"), _row(2, "b")])
    assert [(r.item_id, "RowsIgnored" in e) for r, e in refused] == [("item-00001", True)]
    rows = sqlite_rows(tmp_path / "r.db")
    con = sqlite3.connect(tmp_path / "r.db")
    quarantined = [r[0] for r in con.execute("SELECT item_id FROM results_quarantine")]
    con.close()
    db.close()
    assert sorted(rows) == ["item-00000", "item-00002"] and quarantined == ["item-00001"]


@pytest.mark.postgres
def test_postgres_trigger_returning_null_is_quarantined_not_lost(pg_database) -> None:  # noqa: F811
    """PostgreSQL's silent skip: a BEFORE INSERT trigger that returns NULL."""
    from ccsq.completiond.resultsdb import PostgresResults

    db = PostgresResults(pg_database)
    db.connect()
    with psycopg.connect(pg_database) as con:
        con.execute("CREATE FUNCTION skip_it() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN IF NEW.idem_key = 'skip-me' THEN RETURN NULL; END IF; RETURN NEW; END $$")
        con.execute("CREATE TRIGGER skip_it BEFORE INSERT ON results FOR EACH ROW EXECUTE FUNCTION skip_it()")
    try:
        refused = db.land([_row(0, "a"), _row(1, "skip-me"), _row(2, "b")])
        assert [(r.item_id, "RowsIgnored" in e) for r, e in refused] == [("item-00001", True)]
        assert db.land([_row(3, "c")]) == []
    finally:
        db.close()
    with psycopg.connect(pg_database) as con:
        assert [r[0] for r in con.execute("SELECT item_id FROM results ORDER BY 1")] == ["item-00000", "item-00002", "item-00003"]
        assert [r[0] for r in con.execute("SELECT item_id FROM results_quarantine")] == ["item-00001"]


def test_sqlite_rollback_trigger_is_an_outage_and_writes_nothing(tmp_path: Path) -> None:
    """``RAISE(ROLLBACK)`` ends the whole transaction: nothing of the batch may be
    written (each later statement would commit on its own); the batch fails as an
    outage (retried), never half-landed."""
    from ccsq.completiond.resultsdb import SqliteResults

    db = SqliteResults(tmp_path / "r.db")
    db.connect()
    db._con.execute("CREATE TRIGGER rb BEFORE INSERT ON results WHEN NEW.idem_key = 'rb' "
                    "BEGIN SELECT RAISE(ROLLBACK, 'rolled back'); END")
    with pytest.raises(sqlite3.OperationalError, match="rolled the whole transaction back"):
        db.land([_row(0, "a"), _row(1, "rb"), _row(2, "b")])
    db.close()
    con = sqlite3.connect(tmp_path / "r.db")
    assert con.execute("SELECT count(*) FROM results").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM results_quarantine").fetchone() == (0,)
    con.close()


def test_a_redelivery_refused_only_as_an_update_is_not_quarantined(tmp_path: Path) -> None:
    """An append-only rule on ``results`` (no UPDATE) refuses the redelivery's
    ``deliveries + 1``; the result is already stored, so it must not also go to the
    quarantine (found by a fresh-clone tester: 30 results in both tables)."""
    from ccsq.completiond.resultsdb import SqliteResults

    db = SqliteResults(tmp_path / "r.db")
    db.connect()
    assert db.land([_row(0, "a"), _row(1, "b")]) == []
    db._con.execute("CREATE TRIGGER append_only BEFORE UPDATE ON results BEGIN SELECT RAISE(ABORT, 'append-only'); END")
    assert db.land([_row(0, "a"), _row(1, "b"), _row(2, "c")]) == []  # a redelivery plus a new one
    db.close()
    con = sqlite3.connect(tmp_path / "r.db")
    assert con.execute("SELECT item_id, deliveries FROM results ORDER BY 1").fetchall() == [
        ("item-00000", 1), ("item-00001", 1), ("item-00002", 1)]
    assert con.execute("SELECT count(*) FROM results_quarantine").fetchone() == (0,)
    con.close()


@pytest.mark.postgres
def test_postgres_params_with_a_nul_land_as_an_escaped_literal(pg_database) -> None:  # noqa: F811
    """JSONB cannot hold \\u0000: such params land with the escape kept as text, not refused,
    and plain rows in the same batch (a plain tuple is a row too) land as they are."""
    from ccsq.completiond.resultsdb import PostgresResults, params_to_json

    nul = _row(0, "a")._replace(params_json=params_to_json({"s": "x\0y"}))
    plain = tuple(_row(1, "b"))
    db = PostgresResults(pg_database)
    try:
        assert db.land([nul, plain]) == []
    finally:
        db.close()
    with psycopg.connect(pg_database) as con:
        rows = dict(con.execute("SELECT item_id, params FROM results").fetchall())
    assert rows == {"item-00000": {"s": "x\\u0000y"}, "item-00001": {"n": 1}}


def test_an_unreachable_claim_store_is_read_again_not_fatal(tmp_path: Path) -> None:
    """A result stored by reference while the store is unreachable (S3: StoreUnavailable,
    a mount: OSError) is read again with backoff until it comes, as the same row."""
    import asyncio

    from ccsq.common.wire.config import CompletionConfig, load
    from ccsq.common.wire.errors import StoreUnavailable
    from ccsq.completiond.completion import CompletionService

    class Flaky(FileStore):
        failures = [StoreUnavailable("endpoint down"), OSError("mount gone")]

        def get(self, sha256: str) -> bytes:
            if self.failures:
                raise self.failures.pop(0)
            return super().get(sha256)

    e = Env(tmp_path)
    try:
        store = Flaky(tmp_path / "blobs")
        d = delivery(3, result=b"stored by reference", store=store)
        svc = CompletionService(load(CompletionConfig, e.config), store=store)
        try:
            rows, missing = asyncio.run(svc._resolve([(1, [d])]))
        finally:
            svc.db.close()
            svc._io_exec.shutdown()
            svc._db_exec.shutdown()
        assert missing == [] and not Flaky.failures
        assert [(r[0], r[4]) for r in rows] == [("item-00003", b"stored by reference")]
    finally:
        e.close()


@pytest.mark.postgres
def test_postgres_an_item_id_with_another_key_is_quarantined_not_taken_for_a_redelivery(pg_server, pg_database) -> None:  # noqa: F811
    """The same item id with another idempotency key (an id issued twice) must not count as a
    redelivery of the stored result and be dropped: it is quarantined, the stored row stays."""
    from ccsq.completiond.resultsdb import PostgresResults

    db = PostgresResults(pg_database)
    try:
        assert db.land([_row(0, "first-key"), _row(1, "k1")]) == []
        assert db.land([_row(1, "k1")]) == []  # a true redelivery
        refused = db.land([_row(0, "second-key"), _row(2, "k2")])
        assert [(r.item_id, "idem_key" in e) for r, e in refused] == [("item-00000", True)], refused
    finally:
        db.close()
    with psycopg.connect(pg_database) as con:
        landed = con.execute("SELECT item_id, idem_key, deliveries FROM results ORDER BY item_id").fetchall()
        quarantined = con.execute("SELECT item_id, idem_key FROM results_quarantine").fetchall()
    assert landed == [("item-00000", "first-key", 1), ("item-00001", "k1", 2), ("item-00002", "k2", 1)]
    assert quarantined == [("item-00000", "second-key")]
