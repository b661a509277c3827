"""Test fixture: three network namespaces joined by veth pairs, one per swarm host.

    ns a (10.77.1.2) --veth-- ns r (10.77.1.1 | 10.77.2.1) --veth-- ns b (10.77.2.2)

The relay runs in ``r``, each swarm in its own namespace, so the relay's links are
real network links that :meth:`NetNs.cut` takes down (``ip link set ... down``; this
kernel has no netem) and :meth:`NetNs.restore` brings back. Created and removed by the
fixture (names carry the pid); needs root and ``ip`` (iproute2), else
:func:`netns_available` is False and the tests run their loopback versions only.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"ccsqprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError):
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return True


class NetNs:
    """``with NetNs() as net:`` ``net.wrap("a")`` is the argv prefix that runs a command in a's namespace."""

    HOSTS = {"a": "10.77.1.2", "b": "10.77.2.2"}

    def __init__(self) -> None:
        self.tag = f"cf{os.getpid() % 100000}"
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def wrap(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def _veth(self, host: str) -> str:
        return f"{self.tag}r{host}"  # the relay's end, in ns r

    def __enter__(self) -> "NetNs":
        try:
            for host in ("a", "b", "r"):
                _ip("netns", "add", self.ns(host))
                self.made.append(self.ns(host))
                _ip("-n", self.ns(host), "link", "set", "lo", "up")
            for host, sub in (("a", 1), ("b", 2)):
                near, far = self._veth(host), f"{self.tag}{host}r"
                _ip("link", "add", near, "type", "veth", "peer", "name", far)
                _ip("link", "set", near, "netns", self.ns("r"))
                _ip("link", "set", far, "netns", self.ns(host))
                _ip("-n", self.ns("r"), "addr", "add", f"10.77.{sub}.1/24", "dev", near)
                _ip("-n", self.ns(host), "addr", "add", f"10.77.{sub}.2/24", "dev", far)
                _ip("-n", self.ns("r"), "link", "set", near, "up")
                _ip("-n", self.ns(host), "link", "set", far, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self.made):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()

    def cut(self, host: str) -> None:
        """Take the relay's link to ``host`` down (packets are lost, connections stall)."""
        _ip("-n", self.ns("r"), "link", "set", self._veth(host), "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.ns("r"), "link", "set", self._veth(host), "up")
