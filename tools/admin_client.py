"""The admin side of ``ccsq status / items / dlq / drain / reconcile``.

Online: a :class:`~ccsq.common.link.peer.BrokerLink` with role ``admin`` sends
``Admin(req, command, args)`` and waits for the ``AdminReply`` with the same
``req``. Offline (``--offline``, or the broker gave no WELCOME within
``connect_timeout_s``): the read-only commands (``status``, ``items_show``,
``dlq_list``) read one snapshot of the ledger directly, with the same functions
the broker uses (:mod:`ccsq.brokerd.admin`), so both paths answer the same.
Commands that change state need the running broker (only its actor writes the
ledger) and raise :class:`~ccsq.common.wire.errors.BrokerUnavailable` offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack

from ccsq.common.wire import protocol
from ccsq.common.wire.config import AdminConfig
from ccsq.common.link.requests import RequestTracker
from ccsq.common.wire.envelope import Envelope
from ccsq.common.wire.errors import AdminFailed, BrokerUnavailable, ConfigError, Unauthorized

T = TypeVar("T")
READ_ONLY = ("status", "items_show", "dlq_list")
OFFLINE = "ledger (offline)"
REPLY_TIMEOUT_S = 30.0


class AdminSession:
    """One admin session with the broker (made by :func:`with_broker`)."""

    def __init__(self) -> None:
        self.link: Any = None
        self._requests: RequestTracker[protocol.Admin, protocol.AdminReply] = RequestTracker()

    def on_message(self, env: Envelope) -> None:
        msg = env.message
        if isinstance(msg, protocol.AdminReply):
            self._requests.resolve(msg.req, msg)
        elif isinstance(msg, protocol.Error):
            self._requests.fail_all(AdminFailed(f"{msg.code}: {msg.message}"))

    def on_disconnect(self, reason: str) -> None:
        """The session ended (the broker restarted, failed over to its standby, or went
        silent): a command sent in it gets no reply; fail it now, not after its timeout.
        Not re-sent: a state-changing command may have taken effect (``ccsq status`` says)."""
        self._requests.fail_all(BrokerUnavailable(
            f"the broker session ended before the reply ({reason}); check with `ccsq status` whether the command "
            "took effect, then run it again if it did not"))

    async def call(self, command: str, args: dict | None = None, timeout_s: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """Run one command; returns the reply document. Raises AdminFailed (the broker
        said no), BrokerUnavailable (session lost or no reply within ``timeout_s``)."""
        req = self._requests.next_id()
        fut = self._requests.register(req)
        if not self.link.send(protocol.Admin(req, command, dict(args or {}))):
            self._requests.discard(req)
            raise BrokerUnavailable("the broker session ended before the command was sent; run it again")
        try:
            reply: protocol.AdminReply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise BrokerUnavailable(f"no reply to {command!r} within {timeout_s:.0f}s; check `ccsq status`") from None
        finally:
            self._requests.discard(req)
        if not reply.ok:
            raise AdminFailed(reply.error)
        return msgpack.unpackb(reply.body, raw=False)


async def _with_broker(settings: AdminConfig, fn: Callable[[AdminSession], Awaitable[T]], connect_timeout_s: float) -> T:
    from ccsq.common.link.peer import BrokerLink

    session = AdminSession()
    link = BrokerLink(settings, hello=lambda: protocol.Hello(role=protocol.Role.ADMIN.value), on_message=session.on_message,
                      on_disconnect=session.on_disconnect)
    session.link = link
    runner = asyncio.create_task(link.run(), name="admin-link")
    try:
        ready = asyncio.ensure_future(link.ready.wait())
        deadline = time.monotonic() + connect_timeout_s
        try:
            # until a session, the link stops, the time is up or a CURVE mismatch shows (a
            # configuration error: said at once, not after the timeout as "broker down");
            # refused ID_IN_USE (another live session holds this admin id), the link retries
            # until that session would lapse (a crashed one's window), then gives up
            while not link.curve_mismatch:
                until = link.in_use_until_mono
                left = (deadline if until is None else max(deadline, until + 2.0)) - time.monotonic()
                if left <= 0:
                    break
                done, _ = await asyncio.wait({ready, runner}, timeout=min(left, 0.05), return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break
        finally:
            ready.cancel()
        if link.curve_mismatch and not link.ready.is_set():
            raise ConfigError(link.connect_problem or f"CURVE handshake with {settings.broker_endpoint} failed")
        if link.refused is not None:
            from ccsq.common.link.peer import refusal_fix

            raise Unauthorized(refusal_fix(settings, protocol.Role.ADMIN.value, link.refused), code=link.refused.code)
        if not link.ready.is_set() and link.replaced:  # another live process holds this admin id (exit 78)
            from ccsq.common.link.peer import id_in_use_message

            raise ConfigError(id_in_use_message(settings, link))
        if not link.ready.is_set():
            if link.last_refusal:
                why = f"{link.last_refusal.code}: {link.last_refusal.message}"
            else:
                why = link.connect_problem or ("no connection was made, or no WELCOME came (a wrong host or port, a "
                                               "firewall dropping packets, or a broker too busy to answer)")
            raise BrokerUnavailable(
                f"the broker at {settings.broker_endpoint} did not answer within {connect_timeout_s:g} s ({why}); "
                + broker_down_fix(settings)
            ) from None
        return await fn(session)
    finally:
        if link.ready.is_set():
            await link.stop("admin command done")  # BYE, so the broker ends the session now
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(runner), 2.0)
        runner.cancel()  # no session (or a slow close): nothing left to say
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await runner


def ledger_lock_holder(data_dir: str | Path) -> int | None:
    """The pid holding the broker's ``broker.lock`` under ``data_dir`` (a broker runs on this
    host with that ledger), from ``/proc/locks``; None when nobody holds it or it cannot be told.
    Reads only: taking the lock, even shared for a moment, could make a starting broker fail."""
    from ccsq.brokerd.ledger import data_paths

    _ledger_dir, lock_path = data_paths(Path(data_dir))
    try:
        st = lock_path.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    import os

    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (blocked waiters are "1: -> FLOCK ...")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].lower() == dev:
            try:
                return int(fields[4])
            except ValueError:
                return None
    return None


def broker_down_fix(settings: AdminConfig) -> str:
    """What to do when the broker at ``settings.broker_endpoint`` does not answer, one
    sentence: a broker that holds this ledger on this host runs elsewhere than the endpoint
    (fix broker_endpoint), else none runs here (start it)."""
    from ccsq.common.wire.endpoints import split_endpoints

    where = settings.config_path or "admin.toml"
    holder = ledger_lock_holder(settings.data_dir)
    if holder:
        brokerd = Path(settings.config_path).with_name("brokerd.toml") if settings.config_path else None
        endpoint = ""
        if brokerd is not None and brokerd.is_file():
            import tomllib

            try:
                endpoint = str(tomllib.loads(brokerd.read_text()).get("endpoint", ""))
            except (OSError, tomllib.TOMLDecodeError):
                endpoint = ""
        if endpoint in split_endpoints(settings.broker_endpoint):
            return (f"fix: a broker (pid {holder}) holds the ledger in {settings.data_dir} on this host and {brokerd} "
                    "names this endpoint, so it runs but did not answer: it may be stopped or overloaded (journalctl -u "
                    "ccsq-brokerd; systemctl status ccsq-brokerd), or run with another brokerd.toml")
        said = f" ({brokerd} says endpoint = {endpoint!r})" if endpoint else ""
        return (f"fix: a broker (pid {holder}) holds the ledger in {settings.data_dir} on this host, so it runs but not at "
                f"{settings.broker_endpoint}: set broker_endpoint in {where} to the endpoint of its brokerd.toml{said}")
    return (f"fix: start the broker (systemctl start ccsq-brokerd, or ccsq-brokerd --config brokerd.toml) or, if it runs "
            f"on another host, set broker_endpoint in {where} to its endpoint")


def with_broker(settings: AdminConfig, fn: Callable[[AdminSession], Awaitable[T]], *, connect_timeout_s: float | None = None) -> T:
    """Open an admin session, run ``await fn(session)``, close it. Raises
    BrokerUnavailable when the broker gives no WELCOME within ``connect_timeout_s``
    (default: the config's ``connect_timeout_s``)."""
    timeout = settings.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
    return asyncio.run(_with_broker(settings, fn, timeout))


@contextlib.contextmanager
def offline_view(data_dir: str | Path) -> Iterator[Any]:
    """A read-only snapshot (:class:`~ccsq.brokerd.ledger.LedgerView`) of the ledger
    under a broker's ``data_dir``; safe whether or not the broker runs.
    Raises LedgerError when there is no ledger there."""
    from ccsq.brokerd.ledger import Ledger, data_paths

    ledger_dir, _lock = data_paths(Path(data_dir))
    ledger = Ledger(ledger_dir, readonly=True)
    try:
        with ledger.read() as view:
            yield view
    finally:
        ledger.close()


def offline(data_dir: str | Path, command: str, args: dict | None = None) -> dict[str, Any]:
    """Answer a read-only command from the ledger (no broker): ``status`` (ledger part;
    no peers), ``items_show``, ``dlq_list``. Raises BrokerUnavailable for other
    commands, AdminFailed for bad arguments or an unknown item."""
    from ccsq.brokerd import admin

    if command not in READ_ONLY:
        raise BrokerUnavailable(f"{command!r} changes the ledger, so it needs the running broker (only the broker writes the ledger)")
    args = args or {}
    with offline_view(data_dir) as view:  # the ledger queries raise AdminFailed themselves
        if command == "status":
            from ccsq.brokerd.ledger import reader_report

            from ccsq.common.wire.config import BrokerConfig

            readers = reader_report(view.ledger, view, int(time.time() * 1000), warn_age_s=BrokerConfig.reader_warn_age_s)
            return {"source": OFFLINE, **admin.ledger_status(view), "peers": [], "readers": readers}
        if command == "items_show":
            item_id = args.get("item_id")
            if not isinstance(item_id, str) or not item_id:
                raise AdminFailed("argument 'item_id' (a non-empty string) is required")
            return {"source": OFFLINE, **admin.item_doc(view, item_id), "lease_in_memory": None}
        return {"source": OFFLINE, **admin.dlq_doc(view, admin.limit_arg(args))}


def run_command(settings: AdminConfig, command: str, args: dict | None = None, *, mode: str = "auto") -> dict[str, Any]:
    """One command, online or offline. ``mode``: ``online`` (broker required),
    ``offline`` (ledger only; read-only commands) or ``auto`` (online, else offline
    for read-only commands). The document gets ``"source"``: ``broker`` or
    ``ledger (offline)``."""
    if mode == "offline":
        return offline(settings.data_dir, command, args)

    async def one(session: AdminSession) -> dict[str, Any]:
        return await session.call(command, args)

    try:
        doc = with_broker(settings, one)
    except BrokerUnavailable as exc:
        if mode == "online" or command not in READ_ONLY:
            raise
        from ccsq.brokerd.ledger import data_paths

        ledger_dir, _lock = data_paths(Path(settings.data_dir))
        if not (ledger_dir / "data.mdb").exists():  # nothing to read offline either: the broker is needed (69)
            raise BrokerUnavailable(f"{exc}, and there is no ledger at {ledger_dir} to read offline: start ccsq-brokerd "
                                    "(systemctl start ccsq-brokerd) and run again, or fix data_dir in the admin config") from None
        doc = offline(settings.data_dir, command, args)
        doc["broker_unavailable"] = str(exc)  # why the answer comes from the ledger (endpoint, cause, fix)
    doc.setdefault("source", "broker")
    return doc
