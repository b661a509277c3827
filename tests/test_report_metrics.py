"""Observability of a real broker: the Prometheus scrape, the accounting time series
in the ledger, and ``ccsq gap-report --html`` (parsed back: inline SVG + numbers).

A real ``ccsq-brokerd`` with ``metrics_port`` set, driven by scripted peers
(tests/broker_harness.py) so the flow is exact: 5 items submitted, dispatched,
completed and acknowledged; 2 more of another kind left ready with a deadline.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from ccsq.brokerd.gap_report import load_report, queue_forecast, render_html
from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm, wait_for
from ccsq.tools import cli
from ccsq.common.wire import protocol
from ccsq.tools.procs import free_tcp_port

pytestmark = pytest.mark.timeout(60)


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def scrape(port: int) -> dict[str, float]:
    """{'name{labels}': value} of every sample on /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class _Html(html.parser.HTMLParser):
    """Collects tags (with attributes) and text; fails on nothing (html.parser is lenient),
    so the test checks structure explicitly."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.cells: dict[str, str] = {}
        self._cell: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        self._cell = a.get("data-counter") or (a.get("data-state") and "state:" + a["data-state"]) or None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell:
            self.cells[self._cell] = data
            self._cell = None


def test_metrics_scrape_series_and_html_report(tmp_path: Path, capsys) -> None:
    port = free_tcp_port()
    config = make_swarm(
        tmp_path, {"prod": "producer", "wA": "worker", "comp": "completion"},
        metrics_port=port, accounting_sample_interval_s=0.05,
    )
    broker = BrokerProcess(config).start()
    peers: list[ScriptedPeer] = []
    try:
        prod, w, comp = (ScriptedPeer(tmp_path, pid, broker.endpoint) for pid in ("prod", "wA", "comp"))
        peers += [prod, w, comp]
        prod.hello("producer")
        results = prod.submit([protocol.SubmitItem(f"k{i}", "echo", blob(f"doc {i}".encode())) for i in range(5)])
        deadline = time.time() + 3600
        prod.submit([protocol.SubmitItem(f"late{i}", "ocr", blob(f"scan {i}".encode()), deadline_ts=deadline) for i in range(2)])
        w.hello("worker", slots=3, credit=5, kinds=["echo"])
        tasks: list[protocol.Task] = []
        while len(tasks) < 5:
            tasks += w.recv_type(protocol.Dispatch).tasks
        w.heartbeat([protocol.LeaseRef(t.item_id, t.token) for t in tasks], busy=3, done=0)
        w.send(protocol.Complete([protocol.TaskResult(t.item_id, t.token, blob(b"r"), "echo", "1", 0.01) for t in tasks]))
        w.recv_type(protocol.CompleteAck)
        w.heartbeat([], busy=0, done=5)
        comp.hello("completion", credit=10)
        got: list[protocol.Delivery] = []
        while len(got) < 5:
            got += comp.recv_type(protocol.Result).deliveries
        comp.send(protocol.Ack([d.item_id for d in got]))
        assert sorted(comp.recv_type(protocol.AckOk).item_ids) == sorted(r.item_id for r in results)

        # --- the scrape (the snapshot is refreshed once a second) ---
        m = wait_for(lambda: (s := scrape(port)).get('ccsq_items_total{counter="acknowledged"}') == 5 and s, 10, what="scrape")
        assert m['ccsq_items_total{counter="received"}'] == 7 and m['ccsq_items_total{counter="routed"}'] == 5
        assert m['ccsq_items_total{counter="fenced_completions"}'] == 0
        assert m['ccsq_items_in_state{state="ready"}'] == 2
        assert m['ccsq_backlog_items{kind="ocr",state="ready"}'] == 2
        assert m['ccsq_backlog_items{kind="echo",state="acknowledged"}'] == 5
        assert m["ccsq_heartbeat_lag_seconds_count"] >= 2 and m["ccsq_commit_seconds_count"] >= 3
        assert m["ccsq_commit_records_sum"] >= 7 + 5 + 5 + 5  # submits, leases, completions, acks
        assert m['ccsq_worker_slots{worker="wA"}'] == 3 and m['ccsq_worker_items_done{worker="wA"}'] == 5
        assert m['ccsq_peers{role="worker"}'] == 1 and 0 < m["ccsq_map_used_bytes"] <= m["ccsq_map_size_bytes"]
        assert m["ccsq_oldest_ready_age_seconds"] >= 0 and m['ccsq_gap_events_total{window="G2"}'] == 0
        # every metric the shipped Grafana dashboard queries is exported
        dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json").read_text())
        queried = {n for pnl in dashboard["panels"] for t in pnl.get("targets", []) for n in re.findall(r"ccsq_[a-z_]+", t["expr"])}
        # worker and completion exporters: tests/test_prometheus_dashboard.py runs those queries on a real Prometheus
        other = ("ccsq_completion_", "ccsq_worker_gpu_", "ccsq_worker_handler_", "ccsq_worker_batch_", "ccsq_worker_journal_",
                 "ccsq_worker_store_", "ccsq_worker_jobs", "ccsq_worker_unconfirmed_", "ccsq_relay_")
        queried = {n for n in queried if not n.startswith(other)}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            families = set(re.findall(r"^# TYPE (\S+) ", r.read().decode(), flags=re.M))
        missing = {n for n in queried if n not in families and re.sub(r"_(total|bucket|sum|count)$", "", n) not in families}
        assert queried and not missing, missing

        # --- the accounting series in the ledger ---
        rep = wait_for(
            lambda: (r := load_report(tmp_path / "broker-data"))["series"]
            and r["series"][-1]["acknowledged"] == 5 and len(r["series"]) >= 2 and r,
            10, what="accounting samples",
        )
        assert rep["series"][0]["received"] == 0 and rep["series"][-1]["received"] == 7 and rep["balanced"]
        ocr = next(q for q in rep["queues"] if q["kind"] == "ocr")
        assert ocr["backlog"] == 2 and ocr["verdict"] == "stalled" and 3500 < ocr["deadline_in_s"] <= 3600
        assert next(q for q in rep["queues"] if q["kind"] == "echo")["verdict"] == "empty"

        # --- the HTML report through the CLI ---
        out = tmp_path / "report.html"
        capsys.readouterr()
        assert cli.main(["gap-report", "--config", str(config), "--html", str(out)]) == 0
        assert "BALANCED" in capsys.readouterr().out
        doc = _Html()
        doc.feed(out.read_text())
        tags = [t for t, _ in doc.tags]
        assert tags.count("svg") == 1 and "script" not in tags and "link" not in tags
        lines = {a["data-counter"]: a["points"] for t, a in doc.tags if t == "polyline"}
        assert set(lines) == {"received", "routed", "completed", "acknowledged"}
        assert all(len(pts.split()) >= 3 for pts in lines.values())
        assert doc.cells["received"] == "7" and doc.cells["acknowledged"] == "5" and doc.cells["state:ready"] == "2"
        text = " ".join(doc.text)
        assert "BALANCED" in text and "G10" in text and "stalled" in text and "acknowledged 5" in text
        assert not any(a.get("src", "").startswith("http") or a.get("href", "").startswith("http") for _, a in doc.tags)
        assert cli.main(["gap-report", "--config", str(config), "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["queues"][0]["kind"] == "echo"
        # grouped: flow counters under "counters", states under "states"; the old top-level keys stay (deprecated)
        assert rep["counters"]["received"] == 7 and rep["states"]["ready"] == 2 and rep["states"]["acknowledged"] == 5
        assert set(rep["deprecated_keys"]) == set(rep["counters"]) | {"ready", "leased"}
        assert all(rep[k] == (rep["counters"] | {"ready": rep["states"]["ready"], "leased": rep["states"]["leased"]})[k]
                   for k in rep["deprecated_keys"])
    finally:
        for sp in peers:
            sp.close()
        broker.stop()


def test_queue_forecast_against_the_nearest_deadline() -> None:
    """Drain estimate per queue: rate from the samples, verdict against the deadline."""
    now = 1_000_000_000
    samples = [
        {"ts_ms": now - 400_000, "kinds": {"ocr": {"acknowledged": 0}}},
        {"ts_ms": now - 300_000, "kinds": {"ocr": {"acknowledged": 100}}},  # the reference (>= 300 s old)
        {"ts_ms": now - 10_000, "kinds": {"ocr": {"acknowledged": 350}}},
    ]
    kinds = {"ocr": {"ready": 900, "leased": 100, "completed": 20, "acknowledged": 380}, "idle": {"acknowledged": 3}}
    q = {x["kind"]: x for x in queue_forecast(kinds, samples, {"ocr": now + 600_000}, now)}
    assert q["ocr"]["completed_per_s"] == 1.0 and q["ocr"]["drain_eta_s"] == 1000.0  # (400 - 100) / 300 s
    assert q["ocr"]["deadline_in_s"] == 600.0 and q["ocr"]["verdict"] == "late"
    q = {x["kind"]: x for x in queue_forecast(kinds, samples, {"ocr": now + 1_200_000}, now)}
    assert q["ocr"]["verdict"] == "on track" and q["idle"]["verdict"] == "empty"
    assert queue_forecast(kinds, [], {}, now)[1]["verdict"] == "stalled"  # no history: no rate
    # idle for an hour (no samples: the ledger samples while counters change), then 300 done in
    # the last minute: the recent rate, 300 / 300 s, not the hour's average 300 / 3600 s
    idle = [{"ts_ms": now - 3_600_000, "kinds": {"ocr": {"acknowledged": 0}}},
            {"ts_ms": now - 30_000, "kinds": {"ocr": {"acknowledged": 150}}}]
    q = {x["kind"]: x for x in queue_forecast({"ocr": {"ready": 600, "acknowledged": 300}}, idle, {}, now)}
    assert q["ocr"]["completed_per_s"] == 1.0 and q["ocr"]["drain_eta_s"] == 600.0, q
    page = render_html({
        "ledger_id": "x<y", "epoch": 1, "counters": {c: 0 for c in cli_counters()}, "states": {s: 0 for s in states()},
        "balanced": True, "windows": [], "queues": [], "series": [], "generated_ms": now,
    })
    assert "x&lt;y" in page and page.count("<svg") == 1


def cli_counters() -> tuple[str, ...]:
    from ccsq.brokerd.ledger.schema import COUNTERS

    return COUNTERS


def states() -> tuple[str, ...]:
    from ccsq.brokerd.ledger.schema import STATES

    return STATES


def test_gap_register_doc_and_code_list_the_same_windows() -> None:
    """docs/gap-register.md has one table row per window of ccsq.brokerd.gaps, same ids and names."""
    from ccsq.brokerd import gaps

    doc = (Path(__file__).resolve().parents[1] / "docs" / "gap-register.md").read_text()
    rows = dict(re.findall(r"^\| ([GF]\d+) \| ([^|]+) \|", doc, flags=re.M))  # F: federation windows
    assert {k: v.strip() for k, v in rows.items()} == {w.id: w.name for w in gaps.WINDOWS}


def test_accounting_samples_are_a_bounded_ring(tmp_path: Path, monkeypatch) -> None:
    """The ledger keeps at most SAMPLES_KEPT samples, newest kept; a sample is written
    only when the interval passed and the counters changed."""
    from ccsq.brokerd.ledger import maintenance, schema
    from ccsq.brokerd.ledger.store import Ledger

    monkeypatch.setattr(schema, "SAMPLES_KEPT", 4)
    led = Ledger(tmp_path / "l", map_size_bytes=1 << 22)
    try:
        t = 1_000_000
        for i in range(7):
            with led.begin() as txn:
                txn.submit(protocol.SubmitItem(f"k{i}", "echo", blob(b"x%d" % i)), t + i * 1000)
                assert maintenance.append_sample(txn, t + i * 1000, interval_s=1.0)
                txn.commit()
        with led.begin() as txn:
            assert not maintenance.append_sample(txn, t + 7000, interval_s=1.0)  # counters unchanged
            txn.submit(protocol.SubmitItem("k7", "echo", blob(b"x7")), t + 7000)
            assert not maintenance.append_sample(txn, t + 7500, interval_s=2.0)  # too soon after the last (t + 6000)
            txn.abort()
        with led.read() as view:
            got = view.samples()
        assert [d["ts_ms"] for d in got] == [t + i * 1000 for i in range(3, 7)]
        assert [d["counters"]["received"] for d in got] == [4, 5, 6, 7] and got[-1]["kinds"] == {"echo": {"ready": 7}}
    finally:
        led.close()


def test_static_report_chart_keeps_equal_lines_visible() -> None:
    """gap-report --html: when acknowledged equals completed (and both received), each line is
    drawn narrower than the ones under it, so the acknowledged line is not hidden under the
    completed one and every colour shows."""
    import re

    from ccsq.brokerd.gap_report import CHART_COUNTERS, render_chart_svg

    now = 1_700_000_000_000
    series = [{"ts_ms": now - 60_000 + i * 10_000, **dict.fromkeys(CHART_COUNTERS, i * 10)} for i in range(6)]
    svg = render_chart_svg(series, now_ms=now, counters=dict.fromkeys(CHART_COUNTERS, 60))
    drawn = re.findall(r'<polyline data-counter="(\w+)" fill="none" stroke="[^"]+" stroke-width="([\d.]+)"', svg)
    assert [c for c, _ in drawn] == list(CHART_COUNTERS) and drawn[-1][0] == "acknowledged"
    widths = [float(w) for _, w in drawn]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths), drawn
