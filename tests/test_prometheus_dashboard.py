"""Metrics from every process, scraped by a real Prometheus (Debian's ``prometheus``).

A swarm on loopback (broker, one worker, the completion service), each with
``metrics_listen``, and a federation relay (``ccsq-relayd``) linking it to a second
swarm's broker (kind ``ocr``, which nobody there runs: the link stays idle, its
books and state are exported all the same); a Prometheus server scraping the four
every second; items submitted and acknowledged. Then every query of docs/grafana-dashboard.json
goes through Prometheus's HTTP API: each must parse and evaluate (data or a
valid empty result), and every ``ccsq_*`` name it uses must be exported by one
of the processes (a typo or a metric nobody exports fails the test).
Skipped only where the ``prometheus`` binary is missing and CI is not set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ccsq.tools.procs import bin_path, free_tcp_port, wait_until
from ccsq.relayd.init import init_relay
from tests.swarm import Swarm

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"


def _prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus binary missing under CI (.ci/run installs Debian's prometheus)")
        pytest.skip("prometheus binary not installed (apt-get install prometheus)")
    return path


def _get(url: str, timeout_s: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read()


def _api(port: int, path: str, **params: str) -> dict:
    """GET Prometheus's HTTP API; returns the decoded body (errors come back as status=error)."""
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    try:
        body = _get(url)
    except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
        body = exc.read()
    return json.loads(body)


def _exported(port: int) -> set[str]:
    """Every series name the process at ``port`` can export (families with no samples included)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(_get(f"http://127.0.0.1:{port}/metrics").decode()):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names.update(fam.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def _value(port: int, metric: str, **labels: str) -> float | None:
    """The value of one series in Prometheus now (None when absent)."""
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    res = _api(port, "query", query=f"{metric}{{{sel}}}")["data"]["result"]
    return float(res[0]["value"][1]) if len(res) == 1 else None


def test_every_dashboard_query_runs_on_a_real_prometheus(tmp_path):
    prom_bin = _prometheus_bin()
    t_start = time.monotonic()
    ports = {"broker": free_tcp_port(), "worker": free_tcp_port(), "completion": free_tcp_port(), "relay": free_tcp_port()}
    swarm = Swarm(tmp_path / "swarm", workers=1,
                  broker={"metrics_listen": f"127.0.0.1:{ports['broker']}"},
                  worker={"metrics_listen": f"127.0.0.1:{ports['worker']}"},
                  completion={"metrics_listen": f"127.0.0.1:{ports['completion']}"})
    downstream = Swarm(tmp_path / "b", workers=0)  # the relay's other end (a broker only)
    relay_cfg = init_relay(tmp_path / "relay", [(tmp_path / "swarm", tmp_path / "b")], kinds=["ocr"],
                           relay={"log_format": "json", "reconnect_backoff_max_s": 0.3,
                                  "metrics_listen": f"127.0.0.1:{ports['relay']}"})
    prom_port = free_tcp_port()
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    jobs = {"ccsq-brokerd": ports["broker"], "ccsq-workerd": ports["worker"], "ccsq-completion": ports["completion"],
            "ccsq-relayd": ports["relay"]}
    scrape_configs = "\n".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']" for job, port in jobs.items())
    (prom_dir / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n{scrape_configs}\n")
    with swarm, downstream:
        # the relay and its downstream boot alongside the swarm (the relay reconnects until both brokers answer)
        downstream.start_broker(wait=False)
        swarm.procs.start("relay", [bin_path("ccsq-relayd"), "--config", str(relay_cfg)])
        swarm.start_all()
        prom = swarm.procs.start("prometheus", [
            prom_bin, f"--config.file={prom_dir / 'prometheus.yml'}", f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn",
        ])
        with swarm.client() as client:
            ids = [client.submit(f"doc {i}".encode(), "echo").item_id for i in range(20)]
            client.submit(b"no worker takes this kind", "ocr")  # a backlog for the backlog panels
        swarm.wait_acknowledged(len(ids), timeout_s=30.0)

        def all_up() -> bool:
            assert prom.running, swarm.procs.tail("prometheus")
            try:
                targets = _api(prom_port, "targets")["data"]["activeTargets"]
            except OSError:
                return False
            return len(targets) == len(jobs) and all(t["health"] == "up" for t in targets)

        wait_until(all_up, 30.0, "every target up in Prometheus")
        # a few scrapes after the work so rate() has two samples with the traffic in between
        def scraped_since_work() -> int:
            """Fewest samples any target has in Prometheus (the work was done before the first)."""
            res = _api(prom_port, "query", query="ccsq_build_info[1m]")["data"]["result"]
            return min((len(r["values"]) for r in res), default=0) if len(res) == len(jobs) else 0

        wait_until(lambda: scraped_since_work() >= 3, 20.0, "three scrapes of every target")

        exported = set().union(*(_exported(port) for port in ports.values()))
        dashboard = json.loads(DASHBOARD.read_text())

        # the templating variable's source metric, and every process's build_info
        for var in dashboard["templating"]["list"]:
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]).groups()
            values = _api(prom_port, f"label/{label}/values", **{"match[]": metric})["data"]
            assert sorted(values) == sorted(jobs), (var["query"], values)

        failures, empty, with_data = [], [], 0
        for pnl in dashboard["panels"]:
            for target in pnl.get("targets", []):  # a row has none
                expr = target["expr"].replace("$job", ".*")
                unknown = {n for n in re.findall(r"\bccsq_[a-z0-9_]+", expr) if n not in exported}
                if unknown:
                    failures.append(f"panel {pnl['id']} {pnl['title']!r}: {sorted(unknown)} not exported by any process")
                res = _api(prom_port, "query", query=expr)
                if res.get("status") != "success":
                    failures.append(f"panel {pnl['id']} {pnl['title']!r}: {expr}: {res.get('error')}")
                elif res["data"]["result"]:
                    with_data += 1
                else:
                    empty.append(expr)
        assert not failures, "\n".join(failures)
        # most panels have data after real traffic; the empty ones are the quiet windows (errors, refusals, gaps)
        quiet = ("gap_events", "retried", "dead", "expired", "fenced", "duplicate", "lease_expiries", "frames_rejected",
                 "draining", "store_errors", "lost_slots", "zap_refused", "db_failures", "quarantined")
        unexpected_empty = [e for e in empty if not any(q in e for q in quiet)]
        assert not unexpected_empty, unexpected_empty
        assert with_data >= 30
        # the build of each process, by job
        builds = _api(prom_port, "query", query="ccsq_build_info")["data"]["result"]
        assert sorted(b["metric"]["process"] for b in builds) == ["brokerd", "completion", "relayd", "workerd"]
        # the relay's link: connected both ways, its books balance (nothing relayed: b runs no ocr)
        link = {"link": "swarm-to-b"}
        for side in ("upstream", "downstream"):
            wait_until(lambda: _value(prom_port, "ccsq_relay_connected", side=side, **link) == 1.0, 20.0, f"relay {side}")
        assert _value(prom_port, "ccsq_relay_balanced", **link) == 1.0
        assert _value(prom_port, "ccsq_relay_items_total", event="leased", **link) == 0.0
        # worker and completion figures saw the traffic
        landed = _api(prom_port, "query", query="ccsq_completion_results_landed_total")["data"]["result"]
        assert float(landed[0]["value"][1]) == len(ids)
        batches = _api(prom_port, "query", query="sum(ccsq_worker_batch_items_sum)")["data"]["result"]
        assert float(batches[0]["value"][1]) == len(ids)
    assert time.monotonic() - t_start < 60.0


def test_metrics_listen_is_validated(tmp_path):
    """A malformed metrics_listen is refused at start (exit 78) naming the key; the
    loopback default stays when only a port is given."""
    from ccsq.common.wire.errors import ConfigError
    from ccsq.common.runtime.metrics_exporter import parse_listen

    assert parse_listen("", where="x") is None
    assert parse_listen("9464", where="x") == ("127.0.0.1", 9464)
    assert parse_listen("0.0.0.0:9464", where="x") == ("0.0.0.0", 9464)
    assert parse_listen("[::]:9464", where="x") == ("::", 9464)
    assert parse_listen("gpu-1.internal:9464", where="x") == ("gpu-1.internal", 9464)
    for bad in ("9464x", "0.0.0.0:", ":9464", "0.0.0.0:70000", "a b:1", "::1:9464", "1.2.3:9"):
        with pytest.raises(ConfigError, match="metrics_listen"):
            parse_listen(bad, where="workerd-1.toml: metrics_listen")
    swarm = Swarm(tmp_path / "swarm", workers=1, worker={"metrics_listen": "0.0.0.0:not-a-port"},
                  completion={"metrics_listen": "nowhere:"})
    from ccsq.tools.procs import bin_path

    for argv in ([bin_path("ccsq-workerd"), "--config", str(swarm.configs["workerd-0"])],
                 [bin_path("ccsq"), "completion", "--config", str(swarm.configs["completion"])]):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 78 and "metrics_listen" in out.stderr, (argv, out.stderr)



def test_a_busy_metrics_port_is_transient_75_not_78(tmp_path):
    """Tester #8: a metrics_listen port held by another process (the old instance still
    exiting after a restart) exits 75 (TEMPFAIL: systemd restarts), not 78, for the
    broker, a worker, the completion service and a relay (real processes)."""
    import socket

    from ccsq.tools.procs import bin_path

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = f"127.0.0.1:{holder.getsockname()[1]}"
    try:
        swarm = Swarm(tmp_path / "swarm", workers=1, broker={"metrics_listen": busy}, worker={"metrics_listen": busy},
                      completion={"metrics_listen": busy})
        Swarm(tmp_path / "b", workers=0)
        relay_cfg = init_relay(tmp_path / "relay", [(tmp_path / "swarm", tmp_path / "b")], kinds=["ocr"],
                               relay={"metrics_listen": busy})
        for argv in ([bin_path("ccsq-brokerd"), "--config", str(swarm.configs["brokerd"])],
                     [bin_path("ccsq-relayd"), "--config", str(relay_cfg)],
                     [bin_path("ccsq-workerd"), "--config", str(swarm.configs["workerd-0"])],
                     [bin_path("ccsq"), "completion", "--config", str(swarm.configs["completion"])]):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert out.returncode == 75 and "in use" in out.stderr and "metrics_listen" in out.stderr, (argv, out.stderr)
    finally:
        holder.close()

def test_worker_store_errors_and_build_info_are_counted(tmp_path):
    """The worker's claim-store wrapper counts a missing payload and an I/O
    error by op (a real file store), and passes everything else through; the
    exporter adds ccsq_build_info with this process's labels."""
    import hashlib

    from prometheus_client import generate_latest

    from ccsq.common.wire import protocol
    from ccsq.common.storage.claimstore import open_store
    from ccsq.common.wire.errors import PayloadMissing
    from ccsq.common.runtime.metrics_exporter import BuildInfo
    from ccsq.workerd.worker_metrics import CountingStore, WorkerStats

    stats = WorkerStats("worker-1")
    store = CountingStore(open_store(f"file://{tmp_path / 'blobs'}"), stats)
    ref = store.put_blob(b"x" * 100_000, 16)
    assert store.get_blob(ref) == b"x" * 100_000 and store.inline_without_io(10, 16)
    digest = hashlib.sha256(b"gone").hexdigest()
    with pytest.raises(PayloadMissing):
        store.get_blob(protocol.Blob(sha256=digest, size=4, inline=None))
    (tmp_path / "blobs").chmod(0o500)
    try:
        if os.geteuid() != 0:  # root ignores the mode: only the missing case is checked then
            with pytest.raises(Exception):
                store.put_blob(b"y" * 100_000, 16)
    finally:
        (tmp_path / "blobs").chmod(0o700)
    stats.registry.register(BuildInfo("workerd"))  # type: ignore[arg-type]
    text = generate_latest(stats.registry).decode()
    assert 'ccsq_worker_store_errors_total{error="missing",op="get",worker="worker-1"} 1.0' in text
    assert 'ccsq_worker_store_errors_total{error="error",op="get",worker="worker-1"} 0.0' in text
    assert re.search(r'ccsq_build_info\{.*process="workerd".*\} 1\.0', text)
