"""Test harness: a real swarm (``ccsq init`` layout) of real subprocesses on an ephemeral port."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

from ccsq.tools.init import init_swarm
from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port, wait_until

__all__ = ["Swarm", "wait_until"]


class Swarm:
    """A swarm directory plus its processes. Names: ``broker``, ``worker-N``, ``completion``.

    Config overrides are passed to :func:`ccsq.tools.init.init_swarm`. Defaults
    are tuned for fast tests: heartbeat 0.2 s, liveness 5, lease 3 s.
    """

    def __init__(self, root: Path, *, workers: int = 1, handler: str = "echo", broker: dict | None = None,
                 worker: dict | None = None, producer: dict | None = None, completion: dict | None = None,
                 host: str = "127.0.0.1", wrap: list[str] | None = None) -> None:
        self.root = root
        self.port = free_tcp_port()
        self.endpoint = f"tcp://{host}:{self.port}"
        self.wrap = list(wrap or [])  # argv prefix of every process, e.g. ["ip", "netns", "exec", NS]
        self.configs = init_swarm(
            root,
            endpoint=self.endpoint,
            # tests name links after the directories (a-to-b); a name no swarm id allows: ccsq init's default
            swarm_id=root.name if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,23}", root.name) else None,
            workers=workers,
            handler=handler,
            broker={"heartbeat_interval_s": 0.2, "liveness": 5, "lease_ttl_s": 3.0, "retry_backoff_base_s": 0.05,
                    "retry_backoff_max_s": 0.5, "min_free_disk_bytes": 0, **(broker or {})},
            worker={"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0, **(worker or {})},
            producer={"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0, "submit_timeout_s": 3.0, **(producer or {})},
            completion={"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0, **(completion or {})},
        )
        self.procs = ProcessGroup(root / "logs")

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.procs.stop_all()

    # --- processes ---
    def start_broker(self, env: dict[str, str] | None = None, wait: bool = True):
        return self.procs.start("broker", [*self.wrap, bin_path("ccsq-brokerd"), "--config", str(self.configs["brokerd"])],
                                env=env, ready_event="broker_started" if wait else None)

    def start_worker(self, n: int = 1, env: dict[str, str] | None = None, wait: bool = True):
        return self.procs.start(f"worker-{n}", [*self.wrap, bin_path("ccsq-workerd"), "--config", str(self.configs[f"workerd-{n - 1}"])],
                                env=env, ready_event="broker_link_ready" if wait else None, ready_timeout_s=60.0)

    def start_completion(self, env: dict[str, str] | None = None, wait: bool = True):
        return self.procs.start("completion", [*self.wrap, bin_path("ccsq"), "completion", "--config", str(self.configs["completion"])],
                                env=env, ready_event="broker_link_ready" if wait else None)

    def start_all(self, workers: int = 1) -> None:
        self.start_broker()
        for n in range(1, workers + 1):
            self.start_worker(n)
        self.start_completion()

    # --- observations ---
    def report(self) -> dict[str, Any]:
        from ccsq.brokerd.gap_report import load_report

        return load_report(str(self.root / "broker-data"))

    def results(self) -> list[dict[str, Any]]:
        db = self.root / "results.db"
        if not db.exists():
            return []
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        con.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in con.execute("SELECT * FROM results ORDER BY item_id")]
        except sqlite3.OperationalError:
            return []
        finally:
            con.close()

    def client(self):
        from ccsq.producer.client import Client

        return Client.from_config_file(self.configs["producer"])

    def wait_acknowledged(self, n: int, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until the ledger counts ``n`` acknowledged items; returns the report."""
        return wait_until(lambda: (r := self.report())["counters"]["acknowledged"] >= n and r, timeout_s, f"{n} acknowledged items")
