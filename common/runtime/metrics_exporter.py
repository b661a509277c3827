"""The one way a ccsq process exposes Prometheus metrics.

Every daemon (broker, worker, completion service, and a future relay) calls
:func:`start_exporter` with its own registry and ``metrics_listen`` value;
it adds ``ccsq_build_info`` and serves ``/metrics`` from a thread
(prometheus_client's HTTP server). A new daemon needs nothing else::

    registry = CollectorRegistry(auto_describe=True)
    ...  # its instruments / collectors, names prefixed ccsq_<process>_
    server = start_exporter(registry, cfg.metrics_listen, process="relayd", where=f"{path}: metrics_listen")
    ...
    server.shutdown()

``metrics_listen`` syntax: ``""`` (off), ``PORT`` (= ``127.0.0.1:PORT``, the
default stays loopback), ``HOST:PORT`` (``0.0.0.0:9464`` = every IPv4
interface) or ``[IPV6]:PORT``. Port 0 picks a free port (tests; the bound
port is ``server.server_port``).
"""

from __future__ import annotations

import errno
import ipaddress
import platform
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from ccsq.common.wire.errors import ConfigError, PortInUse

LOOPBACK = "127.0.0.1"


def parse_listen(value: str, *, where: str) -> tuple[str, int] | None:
    """``metrics_listen`` -> (host, port), or None when off. ConfigError naming ``where`` on bad syntax."""
    text = value.strip()
    if not text:
        return None
    hint = "use PORT, HOST:PORT or [IPV6]:PORT, e.g. 127.0.0.1:9464 or 0.0.0.0:9464"
    if text.isdigit():
        host, port_s = LOOPBACK, text
    elif text.startswith("["):
        host, sep, port_s = text[1:].partition("]:")
        if not sep:
            raise ConfigError(f"{where} = {value!r}: {hint}")
    else:
        host, sep, port_s = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise ConfigError(f"{where} = {value!r}: {hint}")
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ConfigError(f"{where} = {value!r}: the port must be 0..65535 ({hint})")
    if host != "localhost" and not _is_hostname(host):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"{where} = {value!r}: {host!r} is not an IP address or host name ({hint})") from None
    return host, int(port_s)


def _is_hostname(host: str) -> bool:
    labels = host.split(".")
    return all(lab and len(lab) <= 63 and lab.replace("-", "").isalnum() and not lab[0] == "-" for lab in labels) \
        and not all(lab.isdigit() for lab in labels)


def ccsq_version() -> str:
    """The installed ccsq distribution's version ("unknown" when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ccsq")
    except PackageNotFoundError:
        return "unknown"


class BuildInfo:
    """``ccsq_build_info{version, process, python, libzmq} 1``: which build each process runs."""

    def __init__(self, process: str) -> None:
        import zmq

        self.labels = {"version": ccsq_version(), "process": process, "python": platform.python_version(),
                       "libzmq": zmq.zmq_version()}

    def collect(self) -> Any:
        g = GaugeMetricFamily("ccsq_build_info", "ccsq build of this process (always 1)", labels=list(self.labels))
        g.add_metric(list(self.labels.values()), 1.0)
        yield g


def start_exporter(registry: CollectorRegistry, listen: str, *, process: str, where: str) -> Any:
    """Serve ``registry`` (plus ``ccsq_build_info``) on ``/metrics`` at ``listen``.

    Returns the server (``shutdown()`` it; ``server_port`` is the bound port) or
    None when ``listen`` is empty. Raises ConfigError (bad syntax, or the address
    cannot be bound: taken, not local, no permission) naming ``where``."""
    addr = parse_listen(listen, where=where)
    if addr is None:
        return None
    registry.register(BuildInfo(process))
    host, port = addr
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:  # another process holds it (the old instance?): transient, exit 75
            raise PortInUse(f"{where} = {listen!r}: {host}:{port} is in use by another process (the previous instance "
                            "still exiting?); restart later, or choose another port") from None
        raise ConfigError(f"{where} = {listen!r}: cannot listen on {host}:{port}: {exc.strerror or exc}; "
                          "choose a free port or a local address") from None
    return server
