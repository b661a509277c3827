"""ZeroMQ endpoints in config files: checked at load (syntax) and at bind (locality).

Two kinds of endpoint appear in ccsq's configs:

* a *connect* endpoint (``broker_endpoint`` of every peer, the broker's advertised
  ``endpoint``): ``tcp://HOST:PORT`` (PORT 1..65535; HOST a name, an IPv4 address
  or ``[IPv6]``) or ``ipc://PATH``; a peer's ``broker_endpoint`` may be a
  comma-separated list of them (the brokers of a pair, docs/ha.md):
  :func:`check_endpoint_list`;
* a *bind* endpoint (the broker's ``bind``, or its ``endpoint`` when ``bind`` is
  empty): the same, plus PORT ``0`` or ``*`` (an ephemeral port) and HOST ``*``;
  at bind time HOST must name a local address (``0.0.0.0``, ``::``, an address of
  this host, or a network interface name such as ``eth0``).

:func:`check_endpoint` gives the syntax check, :func:`check_bind_local` the locality
check (it resolves a host name), :func:`bind_error` turns a ZeroMQ bind error into
a sentence. All raise or return :class:`~ccsq.common.wire.errors.ConfigError` text that
names the file, the key and the fix.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from urllib.parse import urlsplit

from ccsq.common.wire.errors import ConfigError

SCHEMES = ("tcp", "ipc")
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})$")
#: errno values of a ZeroMQ bind that mean "this address is not one of this host's":
#: a configuration error (exit 78), not a transient one.
NOT_LOCAL_ERRNOS = frozenset({errno.ENODEV, errno.EADDRNOTAVAIL, errno.EINVAL, errno.EPROTONOSUPPORT, errno.ENOENT})


def split_tcp(endpoint: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> (HOST, PORT) as written (brackets stripped from IPv6)."""
    rest = endpoint[len("tcp://"):]
    if ";" in rest:  # tcp://SOURCE;HOST:PORT: ZeroMQ's source-address form; check the destination
        rest = rest.split(";", 1)[1]
    if rest.startswith("["):
        host, sep, port = rest[1:].partition("]:")
        if not sep:
            raise ValueError("an IPv6 address needs the form [ADDRESS]:PORT")
        return host, port
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise ValueError("no port (the form is tcp://HOST:PORT)")
    return host, port


def check_endpoint(value: str, *, bind: bool, where: str = "") -> str:
    """Check an endpoint's syntax; returns it unchanged.

    ``bind``: allow port 0 / ``*`` and host ``*``. Raises ConfigError with ``where``
    (``"FILE: KEY"``) and an example of a valid value."""
    example = "tcp://0.0.0.0:5555" if bind else "tcp://broker-host.example:5555"
    prefix = f"{where} = {value!r}" if where else f"endpoint {value!r}"

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{prefix}: {why}; write it as {example} (or ipc:///run/ccsq/broker.sock)")

    if not isinstance(value, str) or "://" not in value:
        raise bad("no scheme")
    scheme = value.split("://", 1)[0]
    if scheme not in SCHEMES:
        raise bad(f"unknown scheme {scheme!r} (ccsq uses {' or '.join(s + '://' for s in SCHEMES)})")
    if scheme == "ipc":
        if not value[len("ipc://"):]:
            raise bad("ipc:// needs a socket path")
        return value
    try:
        host, port = split_tcp(value)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if not host:
        raise bad("no host")
    if port == "*" and bind:
        pass
    elif not port.isdigit():
        raise bad(f"port {port!r} is not a number")
    elif not (0 if bind else 1) <= int(port) <= 65535:
        raise bad(f"port {port} is out of range ({0 if bind else 1}..65535)")
    if host == "*":
        if not bind:
            raise bad("host * can only be bound, peers need a host name or address to connect to")
        return value
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOST_RE.match(host) or ".." in host:
            raise bad(f"host {host!r} is not a host name or IP address") from None
    return value


def split_endpoints(value: str) -> tuple[str, ...]:
    """The entries of a comma-separated endpoint list (``broker_endpoint`` of a peer of a
    broker pair: ``"tcp://b1:5555,tcp://b2:5555"``), whitespace around each stripped, in
    order. One endpoint is a list of one. No checks (:func:`check_endpoint_list` does)."""
    return tuple(part.strip() for part in value.split(","))


def check_endpoint_list(value: str, *, where: str = "") -> tuple[str, ...]:
    """Check a comma-separated list of *connect* endpoints, each as :func:`check_endpoint`
    checks one; returns the entries. Raises ConfigError naming ``where``, the bad entry and
    its position (an empty entry, a repeated one, a malformed one). A value without a
    comma is checked exactly as one endpoint."""
    if "," not in value:
        check_endpoint(value, bind=False, where=where)
        return (value,)
    entries = split_endpoints(value)
    prefix = f"{where} = {value!r}" if where else f"endpoint list {value!r}"
    for i, entry in enumerate(entries, 1):
        if not entry:
            raise ConfigError(f"{prefix}: entry {i} of {len(entries)} is empty; write the brokers of a pair as "
                              "\"tcp://broker-1.example:5555,tcp://broker-2.example:5555\"")
        if entry in entries[:i - 1]:
            raise ConfigError(f"{prefix}: entry {i} ({entry!r}) is listed twice; list each broker once")
        check_endpoint(entry, bind=False, where=f"{where} entry {i} of {len(entries)}" if where else f"entry {i}")
    return entries


def _is_wildcard_or_ip_local(host: str) -> bool | None:
    """True/False for an IP address (local or not), None for a name."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if addr.is_unspecified or addr.is_loopback:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


def check_bind_local(value: str, *, where: str = "") -> None:
    """Check that a bind endpoint's host is an address of this machine (or ``*``,
    an interface name). Raises ConfigError naming ``where`` and the fix."""
    check_endpoint(value, bind=True, where=where)
    if not value.startswith("tcp://"):
        return
    host, _ = split_tcp(value)
    if host == "*":
        return
    prefix = f"{where} = {value!r}" if where else f"bind endpoint {value!r}"
    fix = ("set bind = \"tcp://0.0.0.0:PORT\" (all interfaces) or an address of this host, and keep "
           "the name peers connect to in endpoint (ccsq init --bind ... --endpoint ...)")
    local = _is_wildcard_or_ip_local(host)
    if local is None:
        try:
            if host in {name for _, name in socket.if_nameindex()}:
                return  # ZeroMQ binds an interface by name
        except OSError:  # no AF_NETLINK (a sandboxed unit): ZeroMQ's bind will tell
            return
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            raise ConfigError(f"{prefix}: host {host!r} does not resolve here ({exc.strerror}); {fix}") from None
        if any(_is_wildcard_or_ip_local(str(info[4][0])) for info in infos):
            return
        raise ConfigError(f"{prefix}: {host!r} is not an address of this host, so it cannot be bound; {fix}")
    if not local:
        raise ConfigError(f"{prefix}: {host} is not an address of this host, so it cannot be bound; {fix}")


def bind_error(value: str, err: int | None, strerror: str, *, where: str = "") -> ConfigError | None:
    """A ZeroMQ bind failure as a ConfigError when it means "not a local address"
    (``No such device``, ``Cannot assign requested address``, ...), else None
    (e.g. EADDRINUSE stays transient)."""
    if err not in NOT_LOCAL_ERRNOS:
        return None
    prefix = f"{where} = {value!r}" if where else f"bind endpoint {value!r}"
    return ConfigError(
        f"{prefix}: cannot bind ({strerror}): not an address or interface of this host; set bind = "
        "\"tcp://0.0.0.0:PORT\" (or an address of this host) and keep the name peers connect to in endpoint"
    )


def default_bind(endpoint: str) -> str:
    """What ``ccsq init`` binds for ``endpoint`` when ``--bind`` is not given: ``""``
    (bind the endpoint itself) for ipc://, a ``*`` host or an address of this host
    (loopback included), else ``tcp://0.0.0.0:PORT`` (a name such as
    ``gpu-broker.internal`` is what peers resolve; the broker binds every interface)."""
    if not endpoint.startswith("tcp://"):
        return ""
    try:
        host, port = split_tcp(endpoint)
    except ValueError:
        return ""
    if host == "*" or _is_wildcard_or_ip_local(host):
        return ""
    return f"tcp://0.0.0.0:{port}"


def is_loopback_host(host: str) -> bool:
    """True when ``host`` (a name or an IPv4/IPv6 address, no brackets) can only be
    reached from this host: ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_endpoint(endpoint: str) -> bool:
    """True when ``endpoint`` can only be reached from this host: ``ipc://``,
    ``inproc://``, or ``tcp://`` on a loopback address (127.0.0.0/8, ::1, localhost).
    ``tcp://*``, ``0.0.0.0``, an interface name or any other address is beyond loopback."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    return is_loopback_host(urlsplit(endpoint).hostname or "")
