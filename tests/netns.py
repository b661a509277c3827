"""Test fixture: several "hosts" on one machine, each a real Linux network namespace.

A :class:`Network` creates one namespace per host plus a *switch* namespace that
holds a bridge; each host has one veth pair, ``eth0`` on its side, a port of the
bridge on the switch side. The root namespace is left untouched: the veth pairs
are created inside the switch namespace, no address or route is added outside
the test's namespaces, and nothing outside them can reach the test addresses::

      host "broker-host"      host "gpu-1"        host "gpu-2"   ...
      eth0 10.213.0.10/24     eth0 10.213.0.11    eth0 10.213.0.12
          |                       |                   |
      [h0]----------------[h1]---[ br0 (switch namespace) ]---[h2]

- Addresses come from a private test range (``10.213.0.0/24`` by default, from
  ``.10`` on) that exists only inside these namespaces, so two runs at once do
  not collide (each has its own switch).
- ``lo`` is up in every host; every host resolves every other host by name
  through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` bind-mounts
  over ``/etc/hosts`` for the processes it starts (:meth:`Host.argv`).
- :meth:`Host.cut` pulls a host's cable (the switch-side veth set down: the
  host's ``eth0`` loses carrier, packets in both directions are dropped, TCP
  connections stay open and retransmit) or, with ``how="iptables"``, adds DROP
  rules for everything but ``lo`` inside the host's namespace (needs
  ``iptables``). :meth:`Host.restore` undoes either. There is no ``netem`` on
  the machines this runs on, so delay/loss shaping is not offered.
- Namespace names are ``ccsqt-<pid>-<random>-<host>``: unique per run. On
  :meth:`Network.destroy` (always called by the :func:`netns` pytest fixture's
  finalizer, whether the test passed or not) every process still inside the
  namespaces is SIGKILLed by pid, the namespaces and their ``/etc/netns`` dirs
  are removed. Namespaces left by a run that was itself killed (its pid is
  gone) are removed by the next run (:func:`remove_stale`).

Where namespaces cannot be made (not root, no ``ip``, no permission in a
container) the fixture skips with the reason; with ``CI`` set (CI runs as root
and can) it fails instead. ``.ci/run`` installs ``iproute2`` and ``iptables``.

Used by ``tests/test_multihost.py``; meant to serve federation tests too (one
broker host per swarm, a relay host between them).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

PREFIX = "ccsqt-"
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")
DEFAULT_SUBNET = "10.213.0.0/24"
FIRST_HOST = 10  # hosts get .10, .11, ... of the subnet


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (the reason is the message)."""


def _ip(*args: str, check: bool = True, timeout_s: float = 15.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout_s)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_pids_in(ns: str) -> None:
    """SIGKILL the processes still inside namespace ``ns`` (all started by this fixture's user)."""
    res = _ip("netns", "pids", ns, check=False)
    for tok in res.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _delete_ns(ns: str) -> None:
    _kill_pids_in(ns)
    _ip("netns", "delete", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces (and /etc/netns dirs) named ``<prefix><pid>-...`` whose pid is gone:
    left over by a run that was killed before its finalizer ran. Returns the names removed."""
    names: set[str] = set()
    for d in (NETNS_RUN, NETNS_ETC):
        if d.is_dir():
            names.update(p.name for p in d.iterdir() if p.name.startswith(prefix))
    removed = []
    for name in sorted(names):
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _delete_ns(name)
            removed.append(name)
    return removed


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can (a probe namespace is made and removed)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root or in CI"
    if shutil.which("ip") is None:
        return "the ip command is missing (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        res = _ip("netns", "add", probe, check=False)
        if res.returncode != 0:
            return f"ip netns add failed: {res.stderr.strip()}"
        res = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if res.returncode != 0:
            return f"cannot create a bridge inside a namespace: {res.stderr.strip()}"
        res = _ip("-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb", check=False)
        if res.returncode != 0:
            return f"cannot create a veth pair inside a namespace: {res.stderr.strip()}"
    finally:
        _delete_ns(probe)
    return None


class Host:
    """One host of a :class:`Network`: a namespace with ``eth0`` at :attr:`addr`."""

    def __init__(self, net: "Network", name: str, ns: str, addr: str, index: int) -> None:
        self.net, self.name, self.ns, self.addr, self.index = net, name, ns, addr, index
        self.port = f"h{index}"  # its veth end in the switch namespace (a bridge port)
        self.cut_how: str | None = None

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr}, ns={self.ns})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec``: its network, its /etc/hosts).
        The process keeps the pid of ``ip`` (it execs), so signals reach it directly."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0, check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to completion (text output captured)."""
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout_s, check=check, **kw)

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), **kw)

    def cut(self, how: str = "link") -> None:
        """Cut this host off the network until :meth:`restore`.

        ``how="link"``: the switch-side veth down (the cable pulled: no carrier,
        every packet dropped, nobody is told). ``how="iptables"``: DROP every
        packet in and out of the host except on ``lo`` (needs iptables)."""
        if self.cut_how is not None:
            raise RuntimeError(f"{self.name} is already cut ({self.cut_how})")
        if how == "link":
            _ip("-n", self.net.switch_ns, "link", "set", self.port, "down")
        elif how == "iptables":
            if shutil.which("iptables") is None:
                raise NetnsUnavailable("iptables is missing (apt-get install iptables)")
            for rule in self._drop_rules():
                subprocess.run(["ip", "netns", "exec", self.ns, "iptables", "-I", *rule], check=True, capture_output=True, timeout=15)
        else:
            raise ValueError(f"how must be 'link' or 'iptables', not {how!r}")
        self.cut_how = how

    def restore(self) -> None:
        """Undo :meth:`cut` (no-op when the host is not cut)."""
        if self.cut_how == "link":
            _ip("-n", self.net.switch_ns, "link", "set", self.port, "up")
        elif self.cut_how == "iptables":
            for rule in self._drop_rules():
                subprocess.run(["ip", "netns", "exec", self.ns, "iptables", "-D", *rule], check=True, capture_output=True, timeout=15)
        self.cut_how = None

    def iptables_usable(self) -> bool:
        """True when ``iptables`` is installed and works inside this host (nf_tables in the kernel)."""
        if shutil.which("iptables") is None:
            return False
        return subprocess.run(self.argv(["iptables", "-S", "INPUT"]), capture_output=True, timeout=15).returncode == 0

    @staticmethod
    def _drop_rules() -> list[list[str]]:
        return [["INPUT", "!", "-i", "lo", "-j", "DROP"], ["OUTPUT", "!", "-o", "lo", "-j", "DROP"]]


class Network:
    """Hosts named ``hosts`` on one bridge; use as a context manager or call
    :meth:`create` / :meth:`destroy`. ``net["gpu-1"]`` is a :class:`Host`.

    Raises NetnsUnavailable (from :meth:`create`) when a namespace, bridge or
    veth cannot be made; everything made so far is removed first."""

    def __init__(self, hosts: Sequence[str], *, subnet: str = DEFAULT_SUBNET, prefix: str = PREFIX) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError("host names must be distinct and at least one")
        self.subnet = ipaddress.ip_network(subnet)
        if self.subnet.num_addresses < FIRST_HOST + len(hosts) + 2:
            raise ValueError(f"subnet {subnet} too small for {len(hosts)} hosts")
        self.tag = f"{prefix}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch_ns = f"{self.tag}-switch"
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(hosts):
            addr = str(self.subnet.network_address + FIRST_HOST + i)
            self.hosts[name] = Host(self, name, f"{self.tag}-{name}", addr, i)
        self._made: list[str] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Network":
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def hosts_file(self) -> str:
        """The /etc/hosts every host sees."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.addr}\t{h.name}" for h in self.hosts.values()]
        return "\n".join(lines) + "\n"

    def create(self) -> "Network":
        try:
            self._create()
        except subprocess.CalledProcessError as exc:
            self.destroy()
            raise NetnsUnavailable(f"{' '.join(exc.cmd)}: {(exc.stderr or '').strip()}") from None
        except BaseException:
            self.destroy()
            raise
        return self

    def _create(self) -> None:
        prefixlen = self.subnet.prefixlen
        _ip("netns", "add", self.switch_ns)
        self._made.append(self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch_ns, "link", "set", "br0", "up")
        _ip("-n", self.switch_ns, "link", "set", "lo", "up")
        hosts_text = self.hosts_file()
        for h in self.hosts.values():
            _ip("netns", "add", h.ns)
            self._made.append(h.ns)
            etc = NETNS_ETC / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_text)
            _ip("-n", self.switch_ns, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _ip("-n", self.switch_ns, "link", "set", h.port, "master", "br0")
            _ip("-n", self.switch_ns, "link", "set", h.port, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/{prefixlen}", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")

    def destroy(self) -> None:
        """Kill what still runs inside, remove every namespace and /etc/netns dir of this network."""
        for ns in reversed(self._made):
            _delete_ns(ns)
        for h in self.hosts.values():  # also dirs written before a failed `netns add`
            shutil.rmtree(NETNS_ETC / h.ns, ignore_errors=True)
        self._made.clear()


def require_netns() -> None:
    """Skip the calling test (fail it under ``CI``) when namespaces cannot be made here."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the multi-host tests must run, not skip)")
    pytest.skip(reason)


def _factory() -> Iterator:
    remove_stale()
    require_netns()
    made: list[Network] = []

    def make(hosts: Sequence[str], **kw) -> Network:
        net = Network(hosts, **kw)
        made.append(net)
        return net.create()

    try:
        yield make
    finally:
        for net in made:
            net.destroy()


#: pytest fixture: a factory ``netns(["broker-host", "gpu-1", ...], subnet=...) -> Network``;
#: every network made is destroyed when the test ends, passed or failed. Import it into
#: a test module (``from tests.netns import netns``); ``netns_module`` is the same, one per module.
netns = pytest.fixture(_factory, name="netns")
netns_module = pytest.fixture(_factory, name="netns_module", scope="module")


# --- the federation tests' first fixture, on this one -------------------------------------


def netns_available() -> bool:
    """True when namespaces can be made here (see :func:`unavailable_reason` for why not)."""
    return unavailable_reason() is None


class NetNs:
    """Two swarm hosts ``a`` and ``b`` and a relay host ``r`` (the interface of the first
    federation fixture, ``tests/test_federation_netns.py``, kept on :class:`Network`).

    ``with NetNs() as net:`` ``net.wrap(h)`` is the argv prefix that runs a command on
    host ``h``; ``net.HOSTS`` maps ``a``/``b`` to their addresses; ``net.cut(h)`` pulls
    ``h``'s cable (it reaches neither the relay nor the other swarm) until
    ``net.restore(h)``."""

    def __init__(self, subnet: str = "10.77.0.0/24") -> None:
        self.net = Network(["r", "a", "b"], subnet=subnet)
        self.HOSTS = {h: self.net[h].addr for h in ("a", "b")}

    def ns(self, host: str) -> str:
        return self.net[host].ns

    def wrap(self, host: str) -> list[str]:
        return self.net[host].argv([])

    def __enter__(self) -> "NetNs":
        self.net.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.net.destroy()

    def cut(self, host: str, how: str = "link") -> None:
        """``how="link"``: the cable pulled; ``how="iptables"``: DROP rules inside the host (see :meth:`Host.cut`)."""
        self.net[host].cut(how)

    def restore(self, host: str) -> None:
        self.net[host].restore()
