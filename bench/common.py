"""Shared pieces of the benchmark harness: job payloads, percentiles, process
memory, machine facts, result tables (rich) and JSON files under ``bench/out/``.

Units: every duration is named with its unit (``_s``, ``_ms``); rates are
items per second; sizes are bytes.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
CLAIM_REF_BYTES = 1024  # the "1 KiB claim reference" every job carries

console = Console()


def claim_ref(i: int, size_bytes: int = CLAIM_REF_BYTES) -> bytes:
    """A unique ``size_bytes`` claim reference for job ``i`` (an s3-style URI padded to size)."""
    head = f"s3://bench-bucket/payloads/{i:012d}.png#".encode()
    return head + b"x" * max(0, size_bytes - len(head))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100, nearest rank) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return float(s[k])


def dist(values: Sequence[float], digits: int = 2) -> dict[str, float]:
    """p50 / p99 / max / mean / n of ``values`` (rounded)."""
    if not values:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), digits),
        "p99": round(percentile(values, 99), digits),
        "max": round(max(values), digits),
        "mean": round(sum(values) / len(values), digits),
    }


def pipeline_record(system: str, *, n: int, batch: int, window: int, rate_per_s: float | None,
                    elapsed_s: float, producer: dict, latencies_ms: Sequence[float]) -> dict[str, Any]:
    """The common fields of one benchmark-1 run (same shape for ccsq and every peer)."""
    return {
        "system": system,
        "n": n,
        "batch": batch,
        "window": window,
        "rate_per_s": rate_per_s,
        "elapsed_s": round(elapsed_s, 3),
        "jobs_per_s": round(n / elapsed_s, 1),
        "producer": producer,
        "latency_ms": dist(latencies_ms, 1),
    }


def scrape_histograms(metrics_port: int, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Histograms ``names`` from a broker's Prometheus endpoint on 127.0.0.1:
    ``{name: {"buckets": [(le, cumulative count)...], "sum", "count"}}`` (absent: not exported)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in names:
            continue
        h: dict[str, Any] = {"buckets": [], "sum": 0.0, "count": 0.0}
        for sample in fam.samples:
            if sample.name.endswith("_bucket"):
                h["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                h["sum"] = sample.value
            elif sample.name.endswith("_count"):
                h["count"] = sample.value
        out[fam.name] = h
    return out


def hist_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What a histogram observed between two scrapes (same buckets)."""
    return {"buckets": [(le, c - cb) for (le, c), (_, cb) in zip(after["buckets"], before["buckets"])],
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"]}


def hist_summary(h: dict[str, Any], scale: float = 1.0) -> dict[str, Any]:
    """``{"n", "mean", "p50_le", "p99_le", "max_le", "buckets"}`` of a scraped histogram,
    values times ``scale`` (1000: seconds -> ms). ``*_le`` are the upper bounds of the
    buckets holding that quantile (Prometheus' resolution); ``buckets`` cumulative."""
    n = h["count"]

    def q_le(q: float) -> float:
        for le, c in h["buckets"]:
            if n and c >= q * n:
                return round(le * scale, 3) if le != float("inf") else "+Inf"
        return "n/a"

    return {"n": int(n), "mean": round(scale * h["sum"] / n, 3) if n else 0.0,
            "p50_le": q_le(0.5), "p99_le": q_le(0.99), "max_le": q_le(1.0),
            "buckets": [[round(le * scale, 3) if le != float("inf") else "+Inf", int(c)] for le, c in h["buckets"]]}


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (0.0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_split_bytes(pid: int) -> dict[str, int]:
    """``{"anon", "file"}``: anonymous (heap) and file-backed (here: LMDB's mmapped
    pages, reclaimable page cache) parts of the RSS of ``pid``, in bytes."""
    out = {"anon": 0, "file": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                out["anon"] = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                out["file"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def disk_bytes(path: Path) -> int:
    """Bytes actually allocated on disk under ``path`` (st_blocks; LMDB files are sparse)."""
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "not installed"


def machine() -> dict[str, Any]:
    """Facts about this machine and the software versions in play."""
    import importlib.metadata

    def pkg(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = 0.0
    try:
        mem_gib = round(int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "ccsq": pkg("ccsq"),
        "pyzmq": pkg("pyzmq"),
        "lmdb": pkg("lmdb"),
        "redis-py": pkg("redis"),
        "aio-pika": pkg("aio-pika"),
        "celery": pkg("celery"),
        "kombu": pkg("kombu"),
        "dramatiq": pkg("dramatiq"),
        "redis-server": _version(["redis-server", "--version"]),
        "rabbitmq-server": _dpkg_version("rabbitmq-server"),
        "erlang": _dpkg_version("erlang-base"),
    }


def _dpkg_version(name: str) -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "not installed"
    except (OSError, subprocess.SubprocessError):
        return "not installed"


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/out/<name>.json`` (with a timestamp) and return its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    doc = {"benchmark": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **data}
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print one rich table; numbers are right-aligned."""
    rows = [list(r) for r in rows]
    table = Table(title=title)
    for i, col in enumerate(columns):
        numeric = bool(rows) and all(isinstance(r[i], (int, float)) for r in rows if i < len(r))
        table.add_column(col, justify="right" if numeric else "left")
    for r in rows:
        table.add_row(*[_fmt(v) for v in r])
    console.print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")
