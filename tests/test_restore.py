"""A restore re-runs work, and the gap register shows it (issue 27, defect 4), with the
whole swarm as real processes: broker, worker, completion service (SQLite results).

``ccsq backup`` is taken while items are ready, leased and completed; the swarm then
finishes everything; the documented swap (docs/ledger.md, Backups) puts the copy back.
The items not done in the copy run (or are delivered) again: every result row with
``deliveries > 1`` must have its window, G13, counted at the restore.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from ccsq.brokerd.ledger.store import Ledger, data_paths
from ccsq.tools.procs import bin_path
from tests.swarm import Swarm, wait_until


def _window(rep: dict, gid: str) -> int:
    return next((w["count"] for w in rep["windows"] if w["id"] == gid), 0)


def test_a_restore_counts_every_item_it_may_run_again_in_g13(tmp_path: Path) -> None:
    with Swarm(tmp_path / "s", handler="sleep", worker={"prefetch": 2}) as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            ids = [client.submit(f"doc {i}".encode(), "sleep", params={"seconds": 0.1}).item_id for i in range(40)]
            wait_until(lambda: 3 <= swarm.report()["counters"]["acknowledged"] <= 30, 60, "a few acknowledged, most not done")
            dest = tmp_path / "backup"
            done = subprocess.run([bin_path("ccsq"), "backup", "--config", str(swarm.configs["brokerd"]), str(dest), "--json"],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            copy = json.loads(done.stdout)
            snap = Ledger(dest, readonly=True)
            try:
                with snap.read() as view:
                    open_in_copy = {item_id for item_id, _state in view.open_items()}
            finally:
                snap.close()
                (dest / "lock.mdb").unlink(missing_ok=True)
            assert len(open_in_copy) == copy["may_rerun"] > 0
            states = client.wait(ids, timeout_s=120)  # the source broker finishes everything
            assert {s.state for s in states.values()} == {"acknowledged"}
            # the swap (docs/ledger.md): stop the broker, move the copy into place, start it
            assert swarm.procs.stop("broker") == 0
            ledger_dir = data_paths(swarm.root / "broker-data")[0]
            shutil.move(str(ledger_dir), str(ledger_dir.with_name("ledger.before-restore")))
            ledger_dir.mkdir()
            shutil.copy2(dest / "data.mdb", ledger_dir / "data.mdb")
            broker = swarm.start_broker()
            (restored,) = [e for e in broker.events() if e.get("event") == "ledger_restored_from_backup"]
            states = client.wait(ids, timeout_s=120)  # the restored broker runs what the copy had open
            assert {s.state for s in states.values()} == {"acknowledged"}
        rows = wait_until(lambda: (r := swarm.results()) and len(r) == 40 and r, 30, "40 result rows")
        rerun = {r["item_id"] for r in rows if r["deliveries"] > 1}
        assert rerun, "the restore re-ran nothing: the test did not reach its case"
        assert rerun <= open_in_copy  # only what the copy had open ran again
        ledger = Ledger(data_paths(swarm.root / "broker-data")[0], readonly=True)
        try:
            with ledger.read() as view:
                windowed = {e["item_id"] for e in view.recent_events("G13", 1000)}
        finally:
            ledger.close()
        assert rerun <= windowed, rerun - windowed  # every duplicate has its window
        assert windowed == open_in_copy
        rep = swarm.report()
        assert rep["balanced"] and _window(rep, "G13") == len(open_in_copy) == restored["may_rerun"]
