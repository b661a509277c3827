"""``ccsq-brokerd --config DIR/brokerd.toml``: the broker daemon's entry point.

Exit codes (:class:`~ccsq.common.wire.errors.ExitCode`): 0 after SIGTERM/SIGINT;
``CONFIG`` (78) for a bad config, a missing or too-open key file, a bind endpoint
that is not an address of this host (one line on
stderr; systemd must not restart); ``TEMPFAIL`` (75) when another broker
holds the ledger lock or the endpoint is taken (transient: restart later); an
LMDB error exits with the code and sentence of
:func:`~ccsq.common.wire.errors.ledger_failure` (74 disk full / I/O error, 75 reader
table full at start, 78 map full, 80 corrupt or unreadable file).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import lmdb
import structlog
import uvloop
import zmq

from ccsq.brokerd.actor import Broker
from ccsq.brokerd.ledger.store import Ledger, LedgerError, Policy, data_paths, disk_free_bytes
from ccsq.brokerd.transport import EndpointInUse, Transport, check_exposure
from ccsq.common.runtime import log as logsetup
from ccsq.common.wire.config import BrokerConfig, load
from ccsq.common.runtime.daemon import config_path_from_argv, die, settle_gc
from ccsq.common.wire.endpoints import bind_error, check_bind_local
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import ConfigError, ExitCode, PortInUse, ledger_failure
from ccsq.common.wire.keys import AuthorizedKeys, load_curve_secret, load_private_key
from ccsq.common.runtime.systemd import Notifier, catch_early_stop, stop_signals_and_watchdog

log = structlog.get_logger("ccsq.brokerd")
#: Environment variable naming a file: the broker runs under cProfile and writes its stats there at exit
#: (``{pid}`` in it: this process's id, so the two brokers of a pair write two files).
PROFILE_ENV = "CCSQ_PROFILE_FILE"


class LedgerLocked(Exception):
    """Another process holds the ledger lock: transient (exit 75), the other broker may be exiting."""

    exit_code = ExitCode.TEMPFAIL


def acquire_lock(path: Path) -> int:
    """Take an exclusive, non-blocking flock on ``path``; returns the fd (keep it open).
    Raises LedgerLocked naming the holder's pid when it is taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        raise LedgerLocked(f"ledger lock {path} is held by another broker (pid {holder or '?'})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _bind_key(cfg: BrokerConfig) -> str:
    """``FILE: bind`` or ``FILE: endpoint``: the key whose endpoint the ROUTER binds."""
    return f"{cfg.config_path}: {'bind' if cfg.bind else 'endpoint'}"


def _fail(code: ExitCode | BaseException, message: str | None = None) -> int:
    return die("ccsq-brokerd", code, message)


_T = TypeVar("_T")


def _keyed(config_path: str, key: str, load: Callable[[], _T]) -> _T:
    """``load()``, its ConfigError prefixed with the file and key (``brokerd.toml: private_key: ...``)."""
    try:
        return load()
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {key}: {exc}") from None


def run(config_path: str) -> int:
    """Load, lock, open, bind, serve until SIGTERM; returns the exit code."""
    try:
        cfg = load(BrokerConfig, config_path)
        if cfg.max_map_size_bytes < cfg.map_size_bytes:
            raise ConfigError(f"{config_path}: max_map_size_bytes must be >= map_size_bytes")
        key = _keyed(config_path, "private_key", lambda: load_private_key(Path(cfg.private_key)))
        authorized = _keyed(config_path, "authorized_keys", lambda: AuthorizedKeys(Path(cfg.authorized_keys)))
        curve_secret = load_curve_secret(Path(cfg.curve_secret_key)) if cfg.curve else None
        check_bind_local(cfg.bind or cfg.endpoint, where=_bind_key(cfg))
        check_exposure(cfg, authorized, config_path)
        if cfg.trusted_swarms:  # federation trust file: refused at start, not at the first relayed item
            from ccsq.common.wire.federation import TrustedSwarms

            TrustedSwarms(Path(cfg.trusted_swarms))
        ha = _ha_start(cfg) if cfg.ha() else None  # a replicated pair (docs/ha.md); None: a single broker
        notifier = Notifier.from_env()
        catch_early_stop()  # a stop before the loop serves is a clean exit, not death by signal
    except ConfigError as exc:
        return _fail(exc, f"config error: {exc}")
    logsetup.configure(cfg.log_format)
    data_dir = Path(cfg.data_dir)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(ExitCode.CONFIG, f"config error: data_dir {data_dir}: {exc}")
    ledger_dir, lock_path = data_paths(data_dir)
    try:
        lock_fd = acquire_lock(lock_path)
    except LedgerLocked as exc:
        return _fail(exc)
    try:
        if ha is not None:
            from ccsq.brokerd import role

            return _profiled(lambda: role.serve(cfg, key, authorized, ledger_dir, data_dir, notifier, curve_secret, ha))
        return _serve(cfg, key, authorized, ledger_dir, data_dir, notifier, curve_secret)
    finally:
        os.close(lock_fd)
        if ha is not None:
            ha.close()


def _ha_start(cfg: BrokerConfig):  # -> role.HaStart
    """The HA keys checked at start (ConfigError, exit 78, naming file and key): the node
    key, the replication endpoint, one broker per node id on this host, etcd reachable."""
    from ccsq.brokerd import role

    return role.check_start(cfg)


def _serve(cfg: BrokerConfig, key, authorized: AuthorizedKeys, ledger_dir: Path, data_dir: Path, notifier: Notifier,
           curve_secret: bytes | None = None) -> int:
    try:
        ledger = Ledger(
            ledger_dir,
            map_size_bytes=cfg.map_size_bytes,
            max_map_size_bytes=cfg.max_map_size_bytes,
            policy=Policy.from_config(cfg),
            max_readers=cfg.max_readers,
        )
    except LedgerError as exc:
        return _fail(exc)
    if ledger.restored_from:
        log.warning("ledger_restored_from_backup", ledger_id=ledger.ledger_id, id_prefix_before=ledger.restored_from,
                    id_prefix=ledger.id_prefix, may_rerun=ledger.restore_reruns,
                    note="new item ids begin with the new prefix: ids the broker issued after the backup was taken "
                    "are never issued again; items not done in the copy may run or be delivered again (gap G13)")
    codec = EnvelopeCodec(
        cfg.peer_id,
        key,
        authorized,
        max_frame_bytes=cfg.max_frame_bytes,
        max_clock_skew_s=cfg.max_clock_skew_s,
        require_hello=True,
        session_macs=True,  # answer the peers' session-MAC offers (docs/security.md)
    )
    try:
        transport = Transport(cfg.bind or cfg.endpoint, codec, sndhwm=cfg.sndhwm, max_frame_bytes=cfg.max_frame_bytes,
                              curve_secret_key=curve_secret, curve_allow=authorized.curve_allowed)
    except EndpointInUse as exc:
        ledger.close()
        return _fail(exc)
    except zmq.ZMQError as exc:  # e.g. "No such device": a host name that is not this host's (exit 78, not a restart loop)
        ledger.close()
        err = bind_error(cfg.bind or cfg.endpoint, exc.errno, exc.strerror, where=_bind_key(cfg))
        if err is None:
            raise
        return _fail(ExitCode.CONFIG, f"config error: {err}")
    try:
        (data_dir / "endpoint").write_text(transport.endpoint + "\n")
        try:
            broker = Broker(cfg, ledger, transport)
        except LedgerError as exc:
            return _fail(exc)
        except lmdb.Error as exc:
            code, why = ledger_failure(exc, ledger.path / "data.mdb", "starting on the ledger")
            return _fail(code, why)
        metrics = None
        if cfg.metrics_port or cfg.metrics_listen:
            from ccsq.brokerd.metrics import broker_listen, start_metrics

            try:
                metrics = start_metrics(broker, broker_listen(cfg.metrics_listen, cfg.metrics_port),
                                        where=f"{cfg.config_path}: metrics_listen")
            except ConfigError as exc:
                return _fail(exc, f"config error: {exc}")
            except PortInUse as exc:
                return _fail(exc, f"transient: {exc}")
        settle_gc()  # start-up's heap out of the collector's way; young collections less often
        try:
            _profiled(lambda: uvloop.run(_main(broker, notifier, transport.endpoint)))
        except lmdb.Error as exc:
            # disk full or an I/O error at commit: the transaction did not commit, so
            # nothing in it was confirmed to anyone; exit and let systemd restart us
            code, why = ledger_failure(exc, ledger.path / "data.mdb", "a ledger write", free_bytes=_free_bytes(ledger.path))
            log.error("ledger_write_failed", error=f"{type(exc).__name__}: {exc}", exit_code=int(code), advice=why)
            return _fail(code, why)
        except LedgerError as exc:  # e.g. ReadersFull at a read that must succeed
            log.error("ledger_failed", error=str(exc), exit_code=int(exc.exit_code))
            return _fail(exc)
        if metrics is not None:
            metrics.shutdown()
        transport.close(linger_ms=1000)  # let the BYEs out, bounded
    finally:
        if not transport.sock.closed:
            transport.close()
        ledger.close()
    return int(ExitCode.OK)




def _profiled(serve: Callable[[], _T]) -> _T:
    """Run ``serve`` and return its value; with ``CCSQ_PROFILE_FILE`` set, under cProfile (the
    main thread), its stats written to that path (``{pid}`` replaced by this process's id;
    pstats format, ``python -m pstats FILE``) when it returns or raises: a benchmark's view of
    the broker's CPU per function, a primary's or a standby's as well (docs/benchmarks.md; the
    profiler roughly doubles its CPU)."""
    out = os.environ.get(PROFILE_ENV)
    if not out:
        return serve()
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        return serve()
    finally:
        prof.disable()
        prof.dump_stats(out.replace("{pid}", str(os.getpid())))


def _free_bytes(path: Path) -> int | None:
    try:
        return disk_free_bytes(path)
    except OSError:
        return None


async def _main(broker: Broker, notifier: Notifier, endpoint: str) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, broker.reload_keys)
    def on_stop(_sig: str) -> None:
        notifier.stopping()
        broker.stop()

    async with stop_signals_and_watchdog(notifier, on_stop):
        notifier.ready(f"serving on {endpoint}")
        await broker.run()


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(config_path_from_argv("ccsq-brokerd", "ccsq broker daemon", "path of brokerd.toml", argv)))


if __name__ == "__main__":  # pragma: no cover
    main()
