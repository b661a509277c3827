"""Smoke test of the benchmark harness (``make bench``) so it cannot rot.

Runs the ccsq side of benchmark 1 with a tiny N through the real daemons
(broker, 2 echo workers, completion service on SQLite) and checks the shape of
what the harness reports. The peers (Redis, RabbitMQ) run only under ``make bench``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# bench/ is a top-level directory of the repository, not part of the installed package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ccsq_pipeline  # noqa: E402
from bench.common import dist, percentile  # noqa: E402
from bench.profile import top  # noqa: E402


@pytest.mark.timeout(60)
def test_ccsq_pipeline_smoke(tmp_path: Path) -> None:
    n = 150
    res = ccsq_pipeline.run(tmp_path / "swarm", n, batch=50, window=2)
    assert res["n"] == n and res["jobs_per_s"] > 0
    assert res["latency_ms"]["n"] == n  # every job acknowledged and carries its submit time
    assert 0 <= res["latency_ms"]["p50"] <= res["latency_ms"]["p99"] <= res["latency_ms"]["max"]
    assert res["ledger_disk_bytes"] > 0 and res["broker_rss_bytes"]["after"] > 0


def test_percentiles_and_profile_summary(tmp_path: Path) -> None:
    assert percentile([], 50) == 0.0
    assert percentile(list(range(1, 101)), 50) == 50 and percentile(list(range(1, 101)), 99) == 99
    assert dist([1.0, 2.0, 3.0])["max"] == 3.0
    raw = tmp_path / "prof.txt"
    raw.write_text("process 1;run (a/b.py:1);commit (c/ledger.py:10) 30\n"
                   "process 1;run (a/b.py:1);decode (c/envelope.py:5) 10\n")
    summary = top(raw)
    assert summary["self"][0] == ("commit (c/ledger.py)", 75.0)
    assert ("run (a/b.py)", 100.0) in summary["inclusive"]


@pytest.mark.timeout(30)
def test_gpu_check_refuses_without_a_gpu(tmp_path: Path) -> None:
    """bench/gpu_check.sh on a machine without an NVIDIA GPU: exit 79 (GPU_UNAVAILABLE) with the
    reason, before anything is installed (no venv created, no JSON written)."""
    import os
    import shutil
    import subprocess

    from ccsq.common.wire.errors import ExitCode

    root = Path(__file__).resolve().parent.parent
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: the refusal path is not reachable here")
    venv, out = tmp_path / "venv", tmp_path / "gpu.json"
    proc = subprocess.run([str(root / "bench" / "gpu_check.sh"), str(out)], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "GPU_CHECK_VENV": str(venv)})
    assert proc.returncode == ExitCode.GPU_UNAVAILABLE == 79, proc.stderr
    assert "refused" in proc.stderr and "nvidia-smi" in proc.stderr
    assert not venv.exists() and not out.exists()


def test_cpu_per_job_table_names_every_process() -> None:
    from bench.run import CPU_TARGET_US, cpu_per_job

    per = cpu_per_job({"broker": 1.0, "worker-1": 0.5, "worker-2": 0.25, "completion": 0.2,
                       "producer (this process, incl. polling)": 0.1}, 20_000)
    assert per == {"broker": 50, "worker-1": 25, "worker-2": 12, "completion": 10, "producer": 5, "total": 102}
    assert set(CPU_TARGET_US) == {"broker", "worker", "completion", "producer"}


@pytest.mark.timeout(150)
def test_ccsq_kill_run_smoke(tmp_path: Path) -> None:
    """The kill run of benchmark 1 on the ccsq side: worker-1 SIGKILLed once 30 % are
    acknowledged, restarted; nothing is lost and no result is delivered twice."""
    n = 300
    res = ccsq_pipeline.run(tmp_path / "swarm", n, batch=50, window=2, kill_at=0.3, settle_s=90)
    kill = res["kill"]
    assert kill["worker_killed"] == "worker-1" and kill["killed_at_landed"] == 90
    assert kill["lost"] == 0 and kill["doubled"] == 0, kill
    assert "worker-1" not in res["cpu_s"]  # a killed process's CPU is not comparable


@pytest.mark.timeout(60)
def test_federation_bench_smoke() -> None:
    """The federation figure of ``make bench`` (bench/federation.py) with a tiny backlog:
    both runs drain, the link balances, every figure is there and positive."""
    from bench import federation

    res = federation.run(20, 1)
    assert res["link_balanced"] is True
    assert res["one_swarm_items_per_s"] > 0 and res["across_link_items_per_s"] > 0
    assert res["spill_time_s"] > 0 and res["relay_cpu_ms_per_item"] > 0


@pytest.mark.timeout(60)
def test_completion_cpu_smoke() -> None:
    """``python -m bench.completion_cpu``: one real completion service fed by the scripted
    broker, every result acknowledged in ACKs of at most ``batch_max``; and its ``--phases``."""
    from bench import completion_cpu

    res = completion_cpu.run(300)
    assert res["results"] == 300 and res["cpu_s"] >= 0 and res["results_per_s"] > 0 and res["ack_frames"] >= 2
    steps = completion_cpu.phases(300)
    assert len(steps) == 4 and all(v["user_us"] >= 0 and v["sys_us"] >= 0 for v in steps.values())


@pytest.mark.timeout(240)
def test_ha_sync_bench_smoke(tmp_path: Path) -> None:
    """``--only ha_sync`` (bench/ha_sync.py) with a tiny N: one broker, then a primary with a sync
    standby (two real ccsq-brokerd, a real etcd), each unpaced and paced; every job acknowledged,
    every acknowledged item on the standby's ledger too, every figure there."""
    import os
    import shutil

    pytest.importorskip("etcd3gw")
    if shutil.which("etcd") is None:
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed (.ci/run installs Debian's etcd-server)")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    from bench import ha_sync

    n = 200  # the light runs: 50
    res = ha_sync.run(tmp_path, n, batch=50, window=2)
    assert set(res["runs"]) == {"single", "pair"}
    for kind in ("single", "pair"):
        for mode in ("max", "paced", "light"):
            r = res["runs"][kind][mode]
            assert r["jobs_per_s"] > 0 and r["latency_ms"]["n"] == (50 if mode == "light" else n), (kind, mode)
            assert {"broker", "workers", "completion", "producer", "total"} <= set(r["cpu_us_per_job"])
    assert {"standby", "etcd"} <= set(res["runs"]["pair"]["max"]["cpu_us_per_job"])
    assert res["runs"]["pair"]["max"]["cpu_s"]["standby"] > 0  # the standby applied and fsynced the turns
    assert res["standby_missing_acknowledged"] == {"max": 0, "paced": 0, "light": 0}
    assert set(res["not_acknowledged"].values()) == {0}
    assert res["ratio"]["pair_over_single"] > 0 and isinstance(res["p50_added_ms"]["ms"], float)


def test_bench_run_starts(capsys) -> None:
    """`make bench`'s entry point parses its options (two merges once each added an `--only`:
    argparse refused to start with 'conflicting option string')."""
    from bench import run as bench_run

    with pytest.raises(SystemExit) as stop:
        bench_run.main(["--help"])
    assert stop.value.code == 0
    assert "--only" in capsys.readouterr().out
