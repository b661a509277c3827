"""``ccsq console --config admin.toml [--listen HOST:PORT] [--token T] [--refresh-s S]``.

Safe by default: it listens on the loopback address; any other address needs at
least one token (``--token``, the environment variable ``CCSQ_CONSOLE_TOKEN``, or
``console_tokens`` in admin.toml: a TOML file of ``[tokens.NAME]`` tables with
``token`` and ``role`` = "admin" | "viewer", mode 0600). Refused at start with
:class:`~ccsq.common.wire.errors.ConfigError` (exit 78) otherwise.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog

from ccsq.common.wire.config import AdminConfig, read_toml
from ccsq.common.wire.endpoints import is_loopback_host
from ccsq.common.wire.errors import ConfigError, ExitCode

DEFAULT_LISTEN = "127.0.0.1:8750"
TOKEN_ENV = "CCSQ_CONSOLE_TOKEN"
MIN_TOKEN_CHARS = 16


_LINK_CHATTER = frozenset({"broker_link_ready", "broker_link_lost"})


def _drop_link_chatter(logger: object, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if event.get("event") in _LINK_CHATTER:
        raise structlog.DropEvent
    return event


def console_url(host: str, port: int) -> str:
    """The URL to open for a console listening on ``host:port``: a wildcard address (0.0.0.0,
    ::) is no address to browse to, so this host's name stands for it."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn() or "localhost"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ConfigError when malformed."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {listen!r}: give HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host, int(port)


is_loopback = is_loopback_host  # the one loopback check (common/wire/endpoints.py)


def load_tokens(path: str | Path) -> list:
    """Tokens from a TOML file ``[tokens.NAME] token = "...", role = "admin"|"viewer"``.
    ConfigError naming the file and key on any problem, or when group/others can read it."""
    from ccsq.console.app import ROLES

    path = Path(path)
    data = read_toml(path, "console_tokens file", writer="")
    st = path.stat()
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); run chmod 600 {path}")
    unknown = set(data) - {"tokens"}
    if unknown or not isinstance(data.get("tokens"), dict):
        raise ConfigError(f"{path}: expected only [tokens.NAME] tables (token, role), got keys {sorted(data)}")
    out = []
    for name, t in data["tokens"].items():
        if not isinstance(t, dict) or set(t) - {"token", "role"} or not isinstance(t.get("token"), str):
            raise ConfigError(f"{path}: tokens.{name} needs token = \"...\" and role = \"admin\" or \"viewer\" (nothing else)")
        role = t.get("role", "viewer")
        if role not in ROLES:
            raise ConfigError(f"{path}: tokens.{name}.role = {role!r} is not one of {list(ROLES)}")
        out.append(_token(name, t["token"], role, f"{path}: tokens.{name}.token"))
    return out


def _token(name: str, secret: str, role: str, where: str):
    from ccsq.console.app import Token

    if len(secret) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{where} is shorter than {MIN_TOKEN_CHARS} characters; make one with "
                          "`python3 -c 'import secrets; print(secrets.token_urlsafe(24))'`")
    return Token(name, secret, role)


def build(settings: AdminConfig, *, listen: str, token: str | None, refresh_s: float):
    """(Console, host, port) after the safety checks; ConfigError when unsafe or malformed."""
    from ccsq.console.app import Auth, Console
    from ccsq.console.data import Source

    host, port = parse_listen(listen)
    tokens = []
    if token:
        tokens.append(_token("cli-token", token, "admin", "--token"))
    if os.environ.get(TOKEN_ENV):
        tokens.append(_token("env-token", os.environ[TOKEN_ENV], "admin", TOKEN_ENV))
    if settings.console_tokens:
        tokens += load_tokens(settings.console_tokens)
    if not is_loopback(host) and not tokens:
        raise ConfigError(
            f"ccsq console would listen on {host}, which is not a loopback address, without a token: give --token, "
            f"set {TOKEN_ENV}, or console_tokens in {settings.config_path or 'admin.toml'} (or listen on 127.0.0.1)"
        )
    local = frozenset({host.lower(), "localhost", "127.0.0.1", "::1"})
    return Console(Source(settings), Auth(tokens), refresh_s=refresh_s, local_hosts=local), host, port


def run(settings: AdminConfig, *, listen: str | None = None, token: str | None = None, refresh_s: float = 5.0) -> int:
    """Serve until SIGINT/SIGTERM. Returns an ExitCode. ConfigError (exit 78) when the
    configuration is unsafe or the ``console`` extra is not installed."""
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn", "jinja2") if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("python_multipart") is None and importlib.util.find_spec("multipart") is None:
        missing.append("python-multipart")
    if missing:
        raise ConfigError(f"ccsq console needs {', '.join(missing)}: pip install 'ccsq[console]'")
    import uvicorn

    from ccsq.common.runtime import log as logsetup

    logsetup.configure("json" if settings.log_format == "auto" else settings.log_format, level=logging.INFO)
    # one admin session per page: its link's open/close lines would drown the console's own
    structlog.configure(processors=[_drop_link_chatter, *structlog.get_config()["processors"]])
    listen = listen or settings.console_listen or DEFAULT_LISTEN
    console, host, port = build(settings, listen=listen, token=token, refresh_s=refresh_s)
    log = structlog.get_logger("ccsq.console")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        log.error("console_listen_failed", listen=f"{host}:{port}", error=str(exc))
        return ExitCode.TEMPFAIL  # port busy (transient) or address not here
    log.info("console_started", listen=f"{host}:{port}", url=console_url(host, port), tokens=len(console.auth.tokens),
             broker=settings.broker_endpoint, data_dir=settings.data_dir, peer=settings.peer_id)
    config = uvicorn.Config(console.app, log_level="warning", access_log=False, lifespan="on", server_header=False)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the
    # handler that was there before it: make that one note it, so the console exits 0
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signals.append(signum))
    uvicorn.Server(config).run(sockets=[sock])
    log.info("console_stopped", signal=signal.Signals(signals[0]).name if signals else None)
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    """``ccsq-console ARGS`` = ``ccsq console ARGS`` (a console script for service managers)."""
    import sys

    from ccsq.tools.cli import main as ccsq_main

    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        from ccsq.common.runtime.daemon import version_string

        print(version_string("ccsq-console"))
        return 0
    return ccsq_main(["console", *args])


if __name__ == "__main__":
    raise SystemExit(main())
