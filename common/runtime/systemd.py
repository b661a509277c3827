"""sd_notify for ccsq daemons: readiness, stopping, status text and the watchdog.

The units in ``systemd/`` are ``Type=notify`` with ``NotifyAccess=main`` and
``WatchdogSec=``: systemd considers a daemon started only when its main process
sends ``READY=1``, and kills and restarts it when ``WATCHDOG=1`` stops arriving.

Why the standard library and not the ``sdnotify`` package: the protocol is one
``AF_UNIX``/``SOCK_DGRAM`` datagram of newline-separated ``KEY=VALUE`` lines
to the address in ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace), about twenty lines of code. ``sdnotify`` (0.3.2) has had no release
since 2017 and swallows every send error unless constructed with
``debug=True``; a dependency that hides failures and is unmaintained costs more
than the code it saves. This module never raises on a failed send either (a
daemon must not die because its supervisor is busy) but logs each failure as
``sd_notify_failed`` and returns ``False``, so nothing is hidden.

Everything here is a no-op outside systemd: without ``$NOTIFY_SOCKET`` every
method returns ``False`` and sends nothing; without ``$WATCHDOG_USEC`` (or when
``$WATCHDOG_PID`` names another process) :func:`watchdog_task` returns at once.

Use from a daemon's async main (the watchdog pings come from the event loop
itself, so a blocked loop stops them and systemd restarts the process)::

    notifier = Notifier.from_env()
    watchdog = asyncio.create_task(watchdog_task(notifier))
    ...                                     # bind, open the ledger, connect
    notifier.ready("serving on tcp://...")  # systemd: started
    ...
    notifier.stopping()                     # on SIGTERM, before draining
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass, field

import structlog

from ccsq.common.wire.errors import ConfigError

log = structlog.get_logger("ccsq.systemd")

#: Environment variables systemd sets for a notify-type service.
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"

_MAX_STATUS_CHARS = 1024  # STATUS= is shown by `systemctl status`; keep it to one short line


def _socket_address(value: str) -> str | bytes:
    """``$NOTIFY_SOCKET`` -> the address for ``socket.sendto``.

    ``/path`` is a filesystem socket, ``@name`` an abstract one (sent as
    ``b"\\0name"``). Raises ConfigError for anything else (systemd >= 253 also
    offers ``vsock:``, which ccsq daemons do not need).
    """
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    raise ConfigError(
        f"{NOTIFY_SOCKET_ENV}={value!r} is not an AF_UNIX socket path ('/...') or abstract name ('@...'); "
        "run the daemon from the units in systemd/ or unset it"
    )


@dataclass
class Notifier:
    """Sends sd_notify messages from this process to the service manager.

    Build it with :meth:`from_env` once, at the top of a daemon's main.
    ``address`` is ``None`` outside systemd (every call then returns ``False``).
    ``watchdog_interval_s`` is half of ``$WATCHDOG_USEC`` in seconds, or
    ``None`` when systemd does not watch this process.
    """

    address: str | bytes | None = None
    watchdog_interval_s: float | None = None
    _sock: socket.socket | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = True) -> "Notifier":
        """Read ``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID``.

        With ``unset`` (default) the three variables are removed from
        ``environ`` (default ``os.environ``) so child processes (inference
        processes, handler subprocesses) do not inherit them and talk to
        systemd, which ``NotifyAccess=main`` would reject with a warning.
        Raises ConfigError for a ``$NOTIFY_SOCKET`` that is not an AF_UNIX
        address, or a ``$WATCHDOG_USEC`` that is not a positive integer.
        """
        env = os.environ if environ is None else environ
        raw_socket = env.get(NOTIFY_SOCKET_ENV, "")
        raw_usec = env.get(WATCHDOG_USEC_ENV, "")
        raw_pid = env.get(WATCHDOG_PID_ENV, "")
        if unset:
            for key in (NOTIFY_SOCKET_ENV, WATCHDOG_USEC_ENV, WATCHDOG_PID_ENV):
                env.pop(key, None)
        address = _socket_address(raw_socket) if raw_socket else None
        interval_s = None
        if raw_usec:
            try:
                usec = int(raw_usec)
            except ValueError:
                usec = 0
            if usec <= 0:
                raise ConfigError(f"{WATCHDOG_USEC_ENV}={raw_usec!r} is not a positive number of microseconds")
            # WATCHDOG_PID names the process systemd watches; another pid means the
            # variable leaked from a parent and is not ours to answer.
            if not raw_pid or raw_pid == str(os.getpid()):
                interval_s = usec / 2 / 1_000_000
        return cls(address=address, watchdog_interval_s=interval_s)

    @property
    def enabled(self) -> bool:
        """True when running under a service manager that listens for notifications."""
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` fields in one datagram; True if it was sent.

        A failed send (systemd gone, socket full) is logged as
        ``sd_notify_failed`` and returns False; it never raises.
        """
        if self.address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            log.warning("sd_notify_failed", fields=[f.split("=", 1)[0] for f in fields], error=str(exc))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: the daemon is serving (sockets bound, state open). Optional status line."""
        return self.notify("READY=1", *([_status_field(status)] if status else []))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: shutdown has begun (call on SIGTERM, before draining)."""
        return self.notify("STOPPING=1", *([_status_field(status)] if status else []))

    def status(self, text: str) -> bool:
        """``STATUS=text``: one line shown by ``systemctl status`` (newlines become spaces)."""
        return self.notify(_status_field(text))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: one keep-alive ping (normally sent by :func:`watchdog_task`)."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, timeout_s: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask for ``timeout_s`` more seconds to finish starting or stopping
        (for example a worker draining a long inference past ``TimeoutStopSec``)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(1, int(timeout_s * 1_000_000))}")

    def close(self) -> None:
        """Close the datagram socket (it reopens on the next send)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status_field(text: str) -> str:
    one_line = " ".join(text.split())
    return "STATUS=" + one_line[:_MAX_STATUS_CHARS]


async def watchdog_task(notifier: Notifier, healthy: Callable[[], bool] | None = None) -> None:
    """Send ``WATCHDOG=1`` every ``notifier.watchdog_interval_s`` (half of ``$WATCHDOG_USEC``).

    Runs on the event loop on purpose: if the loop blocks for longer than
    ``WatchdogSec=``, the pings stop and systemd kills the process with SIGABRT
    and restarts it (``Restart=on-failure``). ``healthy``, if given, is called
    on the loop before each ping; when it returns False the ping is skipped
    (logged as ``watchdog_skipped``), so a wedged actor that leaves the loop
    running is caught too. Returns at once when systemd does not watch this
    process; otherwise runs until cancelled.
    """
    interval_s = notifier.watchdog_interval_s
    if interval_s is None or not notifier.enabled:
        return
    log.info("watchdog_started", interval_s=interval_s)
    while True:
        if healthy is None or healthy():
            notifier.watchdog()
        else:
            log.warning("watchdog_skipped", reason="unhealthy")
        await asyncio.sleep(interval_s)


#: The first SIGTERM/SIGINT that arrived before the event loop took the signals over
#: (``None``: none); set only after :func:`catch_early_stop`.
_early_stop: signal.Signals | None = None


def catch_early_stop() -> bool:
    """Call first thing in a daemon's start-up (before it binds, opens its ledger or
    journal): a SIGTERM or SIGINT that arrives before :func:`stop_signals_and_watchdog`
    runs is remembered instead of ending the process by the signal, and is delivered
    to that block's ``on_stop`` as soon as it is entered, so a stop during start-up
    is a clean exit 0 like any other stop. Returns False (and does nothing) outside
    the main thread, where Python cannot install signal handlers (daemons run
    in-process by tests)."""
    if threading.current_thread() is not threading.main_thread():
        return False

    def remember(signum: int, _frame: object) -> None:
        global _early_stop
        if _early_stop is None:
            _early_stop = signal.Signals(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, remember)
    return True


@contextlib.asynccontextmanager
async def stop_signals_and_watchdog(
    notifier: Notifier, on_stop: Callable[[str], object], healthy: Callable[[], bool] | None = None
) -> AsyncIterator[None]:
    """The serving boilerplate of every daemon: while the block runs, SIGTERM and SIGINT
    call ``on_stop(signal name)`` (which tells systemd STOPPING and asks the daemon to
    stop) and :func:`watchdog_task` pings systemd (``healthy`` as there). On exit the
    watchdog task is cancelled and awaited. Must be entered on the running event loop.
    A stop signal remembered by :func:`catch_early_stop` is delivered to ``on_stop``
    right after the block starts."""
    global _early_stop
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig.name)
    if _early_stop is not None:
        early, _early_stop = _early_stop, None
        log.info("stop_signal_during_startup", signal=early.name)
        loop.call_soon(on_stop, early.name)
    watchdog = asyncio.create_task(watchdog_task(notifier, healthy), name="systemd-watchdog")
    try:
        yield
    finally:
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)
