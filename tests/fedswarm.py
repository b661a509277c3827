"""Test harness: two real swarms (``tests.swarm.Swarm``) wired by ``ccsq init-relay``
and a real ``ccsq-relayd`` subprocess between them (loopback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ccsq.tools.procs import bin_path, wait_until
from ccsq.relayd.init import init_relay
from tests.swarm import Swarm


class FedPair:
    """Upstream swarm ``a`` (lends work), downstream swarm ``b`` (lends GPUs), relay in ``relay/``.
    ``broker`` overrides both brokerd.toml files, ``b_broker`` b's on top of it."""

    def __init__(self, root: Path, *, a_workers: int = 1, b_workers: int = 1, kinds: tuple[str, ...] = ("echo",),
                 broker: dict | None = None, relay: dict | None = None, producer: dict | None = None,
                 handler: str = "echo", both_ways: bool = False, net=None, link: dict | None = None,
                 worker: dict | None = None, b_broker: dict | None = None) -> None:
        self.net = net  # tests.netns.NetNs: each swarm and the relay in its own network namespace
        hosts = {h: dict(host=net.HOSTS[h], wrap=net.wrap(h)) if net else {} for h in ("a", "b")}
        self.a = Swarm(root / "a", workers=a_workers, broker=broker, producer=producer, handler=handler, worker=worker, **hosts["a"])
        self.b = Swarm(root / "b", workers=b_workers, broker={**(broker or {}), **(b_broker or {})}, producer=producer, handler=handler,
                       worker=worker, **hosts["b"])
        self.relay_dir = root / "relay"
        links = [(root / "a", root / "b")] + ([(root / "b", root / "a")] if both_ways else [])
        self.relay_cfg = init_relay(self.relay_dir, links, kinds=list(kinds),
                                    relay={"resend_interval_s": 0.5, "status_interval_s": 1.0,
                                           "reconnect_backoff_max_s": 0.3, "hello_timeout_s": 2.0,
                                           "log_format": "json", **(relay or {})}, link=link)
        self.procs = self.a.procs  # the relay runs in a's process group (stopped with it)
        self.link = "a-to-b"

    def __enter__(self) -> "FedPair":
        return self

    def __exit__(self, *exc: object) -> None:
        self.procs.stop("relay") if "relay" in self.procs.procs else None
        self.a.procs.stop_all()
        self.b.procs.stop_all()

    def start_relay(self, env: dict[str, str] | None = None, wait: bool = True):
        wrap = self.net.wrap("r") if self.net else []
        proc = self.procs.start("relay", [*wrap, bin_path("ccsq-relayd"), "--config", str(self.relay_cfg)], env=env,
                                ready_event="relay_started" if wait else None)
        return proc

    def report(self) -> dict[str, Any]:
        from ccsq.relayd.federation_report import load_federation_report

        return load_federation_report(self.relay_cfg)

    def counters(self, link: int = 0) -> dict[str, int]:
        return self.report()["links"][link]["counters"]

    def wait_connected(self, timeout_s: float = 30.0) -> None:
        proc = self.procs.procs["relay"]
        n = len(self.report()["links"])
        wait_until(lambda: proc.count("upstream_connected") >= n and proc.count("downstream_connected") >= n,
                   timeout_s, "relay connected upstream and downstream")


SUBMIT_SCRIPT = """
import sys
from ccsq.producer.client import Client
cfg, n, seconds, tag = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
with Client.from_config_file(cfg) as client:
    for i in range(n):
        print("ITEM", client.submit(f"{tag}-{i}".encode(), "sleep", params={"seconds": seconds}).item_id)
"""


def submit_in(swarm: Swarm, n: int, seconds: float, tag: str) -> list[str]:
    """Submit ``n`` sleep items from a producer process run where the swarm runs (its namespace)."""
    import subprocess
    import sys

    out = subprocess.run([*swarm.wrap, sys.executable, "-c", SUBMIT_SCRIPT, str(swarm.configs["producer"]), str(n),
                          str(seconds), tag], capture_output=True, text=True, timeout=120, check=True)
    return [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ITEM ")]


def deauthorize(swarm: Swarm, peer_id: str, *, curve_only: bool = False) -> None:
    """Take ``peer_id`` out of ``swarm``'s authorized_keys.toml (before its broker starts),
    or with ``curve_only`` only its CURVE key (the broker's ZAP allow-list then refuses it)."""
    from ccsq.common.wire.keys import parse_authorized_keys, public_key_b64, write_authorized_keys

    path = swarm.root / "authorized_keys.toml"
    entries = {pid: (k.role.value, public_key_b64(k.public_key), (k.curve_public_key or b"").decode())
               for pid, k in parse_authorized_keys(path).items()}
    if curve_only:
        role, pub, _ = entries[peer_id]
        entries[peer_id] = (role, pub, "")
    else:
        del entries[peer_id]
    write_authorized_keys(path, entries)
