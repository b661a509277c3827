"""The SQLite results schema: a database made by an earlier version (``result_text`` stored)
is opened and written as it is and keeps deduplicating; a new one stores each result once
(``result_text`` generated) and answers the documented queries the same way
(docs/results-schema.md). Real SQLite files, no service."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from ccsq.common.storage.claimstore import sha256_hex
from ccsq.completiond.resultsdb import ResultRow, SqliteResults, text_or_none

#: The DDL of ``results`` as versions before 2026-12 created it (a frozen copy: the test must
#: keep meaning "a database from the field", whatever the code's constants become).
OLD_DDL = """
CREATE TABLE IF NOT EXISTS results (
    item_id TEXT PRIMARY KEY,
    idem_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    params TEXT NOT NULL,
    result BLOB NOT NULL,
    result_sha256 TEXT NOT NULL,
    result_text TEXT,
    attempt INTEGER NOT NULL,
    handler TEXT NOT NULL,
    handler_version TEXT NOT NULL,
    completed_ts REAL NOT NULL,
    landed_ts REAL NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS results_idem_key_idx ON results(idem_key);
"""

#: the repair query of docs/results-schema.md (SQLite form): quarantined rows back into results
REPAIR_SQL = """
INSERT INTO results (item_id, idem_key, kind, params, result, result_sha256,
                     attempt, handler, handler_version, completed_ts, landed_ts, deliveries)
SELECT item_id, idem_key, kind, params, result, result_sha256,
       attempt, handler, handler_version, completed_ts, landed_ts, deliveries
FROM results_quarantine WHERE true ON CONFLICT (item_id) DO NOTHING;
"""


def _row(n: int, data: bytes) -> ResultRow:
    return ResultRow(item_id=f"item-{n:05d}", idem_key=f"key-{n}", kind="echo", params_json=json.dumps({"n": n}),
                     result=data, result_sha256=sha256_hex(data), result_text=text_or_none(data), attempt=1, handler="echo",
                     handler_version="1", completed_ts=time.time(), landed_ts=time.time())


ROWS = [_row(0, b'{"text": "caf\xc3\xa9"}'), _row(1, b"\xff\xfe binary"), _row(2, b"nul\0inside"), _row(3, b"plain")]


def _land_twice_and_check(path: Path) -> sqlite3.Connection:
    """Land ROWS, then a redelivery of two of them plus a new one; check what the documented
    queries answer. Returns a connection for more checks."""
    db = SqliteResults(path)
    try:
        assert db.land(ROWS) == []
        assert db.land([ROWS[0], ROWS[2], _row(4, b"late")]) == []  # a redelivery lands once
        # the same item id with ANOTHER idempotency key is no redelivery (an id issued twice):
        # quarantined with the database's error, the stored row untouched, its batch mates land
        reused = ROWS[1]._replace(idem_key="another-key", result=b"other", result_sha256=sha256_hex(b"other"),
                                  result_text="other")
        refused = db.land([reused, _row(9, b"nine")])
        assert [(r.item_id, "idem_key" in e) for r, e in refused] == [("item-00001", True)], refused
    finally:
        db.close()
    con = sqlite3.connect(path)
    got = {r[0]: r[1:] for r in con.execute("SELECT item_id, result, result_text, deliveries FROM results")}
    assert got == {
        "item-00000": (ROWS[0].result, "{\"text\": \"café\"}", 2),
        "item-00001": (ROWS[1].result, None, 1),
        "item-00002": (ROWS[2].result, None, 2),
        "item-00003": (b"plain", "plain", 1),
        "item-00004": (b"late", "late", 1),
        "item-00009": (b"nine", "nine", 1),
    }
    # the example queries of docs/results-schema.md, and the index they use
    assert con.execute("SELECT item_id, result_text FROM results WHERE idem_key = ?", ("key-3",)).fetchall() == [
        ("item-00003", "plain")]
    assert sorted(con.execute("SELECT item_id, deliveries FROM results WHERE deliveries > 1")) == [
        ("item-00000", 2), ("item-00002", 2)]
    plan = " ".join(r[-1] for r in con.execute("EXPLAIN QUERY PLAN SELECT * FROM results WHERE idem_key = 'key-3'"))
    assert "results_idem_key_idx" in plan
    return con


def test_an_old_schema_database_is_written_as_it_is_and_keeps_deduplicating(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.executescript(OLD_DDL)
    con.close()
    con = _land_twice_and_check(path)
    try:
        assert SqliteResults.schema_version(con) == 1  # not migrated: result_text still stored
        stored = [r[1] for r in con.execute("PRAGMA table_xinfo(results)") if r[-1] == 0]
        assert "result_text" in stored and "result_is_text" not in stored
    finally:
        con.close()


def test_a_new_database_stores_each_result_once_and_answers_the_same(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    con = _land_twice_and_check(path)
    try:
        assert SqliteResults.schema_version(con) == 2
        # a trigger on result_text (an operator's rule, docs: Quarantine) still sees the text
        con.execute("CREATE TRIGGER no_poison BEFORE INSERT ON results WHEN NEW.result_text LIKE '%poison%' "
                    "BEGIN SELECT RAISE(ABORT, 'poison'); END")
        con.commit()
    finally:
        con.close()
    db = SqliteResults(path)
    try:
        refused = db.land([_row(5, b"some poison here"), _row(6, b"fine")])
        assert [(r.item_id, "poison" in e) for r, e in refused] == [("item-00005", True)]
    finally:
        db.close()
    con = sqlite3.connect(path)
    try:
        con.execute("DROP TRIGGER no_poison")
        con.executescript(REPAIR_SQL)  # the documented repair works on this schema too
        assert con.execute("SELECT result, result_text FROM results WHERE item_id = 'item-00005'").fetchone() == (
            b"some poison here", None)
    finally:
        con.close()


def test_the_documented_repair_query_works_on_an_old_schema_database(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.executescript(OLD_DDL)
    con.execute("CREATE TRIGGER no_poison BEFORE INSERT ON results WHEN NEW.result_text LIKE '%poison%' "
                "BEGIN SELECT RAISE(ABORT, 'poison'); END")
    con.commit()
    con.close()
    db = SqliteResults(path)
    try:
        assert [r.item_id for r, _ in db.land([_row(5, b"poison"), _row(6, b"fine")])] == ["item-00005"]
    finally:
        db.close()
    con = sqlite3.connect(path)
    try:
        con.execute("DROP TRIGGER no_poison")
        con.executescript(REPAIR_SQL)
        assert sorted(r[0] for r in con.execute("SELECT item_id FROM results")) == ["item-00005", "item-00006"]
    finally:
        con.close()


def test_params_json_is_the_canonical_json_of_the_reference_encoder() -> None:
    """``params_to_json`` (a C encoder built once) writes exactly what
    ``json.dumps(sort_keys=True, separators=(",", ":"))`` writes: the stored text is unchanged."""
    import base64
    import math

    from ccsq.completiond.resultsdb import params_to_json

    cases = [
        {}, {"t": 1796153640.11778, "a": 1, "b": None, "c": True},
        {"z": [1, 2.5, {"y": "x", "b": [None, False]}], "é": "caf\u00e9 \u6587 \U0001f600 \"q\" \\ \n\0"},
        {"n": math.nan, "i": math.inf, "m": -math.inf, "big": 2**70, "neg": -0.0, "e": 1e-300},
        {"blob": b"\x00\xffraw", "s": "text"},
    ]
    for params in cases:
        plain = {k: {"$b64": base64.b64encode(v).decode("ascii")} if isinstance(v, bytes) else v
                 for k, v in params.items()}
        assert params_to_json(params) == json.dumps(plain, sort_keys=True, separators=(",", ":")), params


def test_a_batch_the_database_takes_lands_without_a_savepoint(tmp_path: Path) -> None:
    """The common case runs BEGIN, one INSERT per row, COMMIT: no SAVEPOINT (under one, SQLite
    copies every page the batch changes into a statement journal first). A batch refused for
    a data reason is rolled back whole and written again with savepoints: the good rows land
    once, the refused one is quarantined."""
    db = SqliteResults(tmp_path / "r.db")
    db.connect()
    statements: list[str] = []
    db._con.set_trace_callback(statements.append)
    try:
        assert db.land(ROWS) == []
        assert not [s for s in statements if "SAVEPOINT" in s.upper()]
        assert [s.split()[0] for s in statements if not s.startswith("INSERT")] == ["BEGIN", "COMMIT"]
        db._con.execute("CREATE TRIGGER no_late BEFORE INSERT ON results WHEN NEW.idem_key = 'key-5' "
                        "BEGIN SELECT RAISE(ABORT, 'late'); END")
        statements.clear()
        refused = db.land([_row(4, b"four"), _row(5, b"five"), _row(6, b"six")])
        assert [r.item_id for r, _ in refused] == ["item-00005"]
        assert [s.split()[0] for s in statements if not s.startswith(("INSERT", "SELECT"))][:3] == [
            "BEGIN", "ROLLBACK", "BEGIN"]
    finally:
        db.close()
    con = sqlite3.connect(tmp_path / "r.db")
    try:
        assert con.execute("SELECT count(*), sum(deliveries) FROM results").fetchone() == (6, 6)
        assert con.execute("SELECT item_id FROM results_quarantine").fetchall() == [("item-00005",)]
    finally:
        con.close()


def test_a_utf16_database_gets_the_stored_result_text(tmp_path: Path) -> None:
    """``CAST(result AS TEXT)`` reads bytes in the database's encoding: a file an operator
    made UTF-16 gets the table that stores ``result_text`` (right text, not mojibake)."""
    path = tmp_path / "u16.db"
    con = sqlite3.connect(path)
    con.execute("PRAGMA encoding = 'UTF-16le'")
    con.execute("CREATE TABLE unrelated (x)")
    con.close()
    db = SqliteResults(path)
    try:
        assert db.land(ROWS[:1]) == []
    finally:
        db.close()
    con = sqlite3.connect(path)
    try:
        assert SqliteResults.schema_version(con) == 1
        assert con.execute("SELECT result_text FROM results").fetchone() == ('{"text": "café"}',)
    finally:
        con.close()
