"""The peer servers on loopback: a private ``redis-server`` (AOF, ``appendfsync always``)
and a private RabbitMQ node, each in its own directory, started and stopped by the harness.

:func:`ensure_installed` installs the Debian packages when they are missing and
we are root (``apt-get update`` first), or says how to install them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ccsq.tools.procs import free_tcp_port, wait_until

PACKAGES = {"redis-server": "redis-server", "rabbitmq-server": "rabbitmq-server", "etcd": "etcd-server"}
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")


class PeerMissing(RuntimeError):
    """A peer server is not installed and cannot be installed here; the message says how."""


def ensure_installed(names: list[str]) -> None:
    """Install the missing Debian packages among ``names`` (as root), else raise PeerMissing."""
    missing = [n for n in names if shutil.which(n) is None and not (n == "rabbitmq-server" and RABBIT_BIN.exists())]
    if not missing:
        return
    pkgs = [PACKAGES[n] for n in missing]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PeerMissing(f"missing {', '.join(missing)}: run `sudo apt-get update && sudo apt-get install -y {' '.join(pkgs)}`"
                          " then `make bench` again")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs], check=True, env=env)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class EtcdServer:
    """A one-member ``etcd`` on 127.0.0.1 (client and peer port picked free) with its data in
    ``root`` (deleted first): the election and sync-set store of a replicated broker pair
    (bench/ha_sync.py). ``url`` is its client URL; ``pid`` its process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"http://127.0.0.1:{free_tcp_port()}"
        self.peer_url = f"http://127.0.0.1:{free_tcp_port()}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> EtcdServer:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        with open(self.root / "etcd.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "bench", "--data-dir", str(self.root / "data"), "--listen-client-urls", self.url,
                 "--advertise-client-urls", self.url, "--listen-peer-urls", self.peer_url,
                 "--initial-advertise-peer-urls", self.peer_url, "--initial-cluster", f"bench={self.peer_url}",
                 "--initial-cluster-state", "new", "--logger", "zap", "--log-outputs", "stderr"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, 30, f"etcd on {self.url}", interval_s=0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _ready(self) -> bool:
        import urllib.request

        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited {self.proc.returncode}; see {self.root / 'etcd.log'}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RedisServer:
    """``redis-server`` on 127.0.0.1:``port`` with AOF and ``appendfsync always``
    (every write fsynced before its reply), RDB snapshots off."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_tcp_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RedisServer:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--logfile", str(self.root / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._ready, 20, f"redis-server on port {self.port}")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited {self.proc.returncode}; see {self.root / 'redis.log'}")
        import redis

        try:
            return bool(redis.Redis(port=self.port).ping())
        except redis.ConnectionError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class RabbitServer:
    """A private RabbitMQ node (``bench-PORT@localhost``) on 127.0.0.1:``port``,
    its Mnesia/quorum data under ``root``; user guest/guest (loopback only)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_tcp_port()
        self.node = f"bench{self.port}@localhost"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RabbitServer:
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "log").mkdir(parents=True)
        (self.root / "enabled_plugins").write_text("[].\n")
        (self.root / "rabbitmq.conf").write_text(
            "loopback_users.guest = true\nlisteners.tcp.default = 127.0.0.1:%d\n" % self.port
        )
        dist_port = free_tcp_port()
        env = {
            **os.environ,
            "HOME": str(self.root),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq"),
            "RABBITMQ_PID_FILE": str(self.root / "rabbit.pid"),
        }
        binary = str(RABBIT_BIN) if RABBIT_BIN.exists() else "rabbitmq-server"
        self.log = open(self.root / "server.out", "wb")
        self.proc = subprocess.Popen([binary], env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_until(self._ready, 120, f"RabbitMQ node {self.node} on port {self.port}", interval_s=0.2)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited {self.proc.returncode}; see {self.root / 'server.out'}")
        if not _port_open(self.port):
            return False
        import pika

        try:
            pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.port, connection_attempts=1)).close()
            return True
        except pika.exceptions.AMQPError:
            return False

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def beam_pid(self) -> int:
        """The Erlang VM's pid (the process whose RSS matters)."""
        try:
            return int((self.root / "rabbit.pid").read_text().strip())
        except (OSError, ValueError):
            return self.proc.pid if self.proc else 0

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # epmd is shared and harmless; the node's beam processes are in our session
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _port_open(self.port):
            time.sleep(0.1)
        self.log.close()
