"""``CCSQ_PROFILE_FILE`` (brokerd/main.py): the broker's stats at exit, one file per process
(``{pid}``), the served function's value passed through (a pair's role loop returns its exit code)."""

from __future__ import annotations

import os
import pstats

from ccsq.brokerd import main


def test_profile_file_takes_the_pid_and_the_exit_code_passes_through(tmp_path, monkeypatch):
    monkeypatch.setenv(main.PROFILE_ENV, str(tmp_path / "broker-{pid}.prof"))
    assert main._profiled(lambda: sum(range(1000)) and 78) == 78
    out = tmp_path / f"broker-{os.getpid()}.prof"
    assert out.exists() and not (tmp_path / "broker-{pid}.prof").exists()
    assert pstats.Stats(str(out)).total_calls > 0
    monkeypatch.delenv(main.PROFILE_ENV)
    assert main._profiled(lambda: 75) == 75  # unprofiled: the same value, no file
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
