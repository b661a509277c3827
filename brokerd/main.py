"""``ccsq-brokerd --config DIR/brokerd.toml``: the broker daemon's entry point.

Exit codes (:class:`~ccsq.common.errors.ExitCode`): 0 after SIGTERM/SIGINT;
``CONFIG`` (78) for a bad config, a missing or too-open key file (one line on
stderr; systemd must not restart); ``LEDGER_LOCKED`` (75) when another broker
holds the ledger lock or the endpoint is taken (transient: restart later).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import signal
import sys
from pathlib import Path

import lmdb
import structlog
import uvloop

from ccsq.brokerd.actor import Broker
from ccsq.brokerd.ledger import Ledger, LedgerError, Policy, data_paths
from ccsq.brokerd.transport import EndpointInUse, Transport
from ccsq.common import log as logsetup
from ccsq.common.config import BrokerConfig, load
from ccsq.common.envelope import EnvelopeCodec
from ccsq.common.errors import ConfigError, ExitCode
from ccsq.common.keys import AuthorizedKeys, load_curve_secret, load_private_key
from ccsq.common.systemd import Notifier, watchdog_task

log = structlog.get_logger("ccsq.brokerd")


class LedgerLocked(Exception):
    """Another process holds the ledger lock."""


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


def _fail(code: ExitCode, message: str) -> int:
    print(f"ccsq-brokerd: {message}", file=sys.stderr, flush=True)
    return int(code)


def run(config_path: str) -> int:
    """Load, lock, open, bind, serve until SIGTERM; returns the exit code."""
    try:
        cfg = load(BrokerConfig, config_path)
        if cfg.max_map_size_bytes < cfg.map_size_bytes:
            raise ConfigError(f"{config_path}: max_map_size_bytes must be >= map_size_bytes")
        key = load_private_key(Path(cfg.private_key))
        authorized = AuthorizedKeys(Path(cfg.authorized_keys))
        curve_secret = load_curve_secret(Path(cfg.curve_secret_key)) if cfg.curve else None
        if cfg.trusted_swarms:  # federation trust file: refused at start, not at the first relayed item
            from ccsq.brokerd.federation import TrustedSwarms

            TrustedSwarms(Path(cfg.trusted_swarms))
        notifier = Notifier.from_env()
    except ConfigError as exc:
        return _fail(ExitCode.CONFIG, f"config error: {exc}")
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
        return _fail(ExitCode.LEDGER_LOCKED, str(exc))
    try:
        return _serve(cfg, key, authorized, ledger_dir, data_dir, notifier, curve_secret)
    finally:
        os.close(lock_fd)


def _serve(cfg: BrokerConfig, key, authorized: AuthorizedKeys, ledger_dir: Path, data_dir: Path, notifier: Notifier,
           curve_secret: bytes | None = None) -> int:
    try:
        ledger = Ledger(
            ledger_dir,
            map_size_bytes=cfg.map_size_bytes,
            max_map_size_bytes=cfg.max_map_size_bytes,
            policy=Policy.from_config(cfg),
        )
    except LedgerError as exc:
        return _fail(ExitCode.FAILURE, str(exc))
    codec = EnvelopeCodec(
        cfg.peer_id,
        key,
        authorized,
        max_frame_bytes=cfg.max_frame_bytes,
        max_clock_skew_s=cfg.max_clock_skew_s,
        require_hello=True,
    )
    try:
        transport = Transport(cfg.endpoint, codec, sndhwm=cfg.sndhwm, max_frame_bytes=cfg.max_frame_bytes,
                              curve_secret_key=curve_secret)
    except EndpointInUse as exc:
        ledger.close()
        return _fail(ExitCode.LEDGER_LOCKED, str(exc))
    try:
        (data_dir / "endpoint").write_text(transport.endpoint + "\n")
        broker = Broker(cfg, ledger, transport)
        metrics = None
        if cfg.metrics_port:
            from ccsq.brokerd.metrics import start_metrics

            metrics = start_metrics(broker, cfg.metrics_port)
        try:
            uvloop.run(_main(broker, notifier, transport.endpoint))
        except lmdb.Error as exc:
            # disk full or an I/O error at commit: the transaction did not commit, so
            # nothing in it was confirmed to anyone; exit and let systemd restart us
            log.error("ledger_write_failed", error=f"{type(exc).__name__}: {exc}")
            return _fail(ExitCode.LEDGER_IO, f"ledger write failed ({exc}); free disk space, then restart")
        if metrics is not None:
            metrics.shutdown()
        transport.close(linger_ms=1000)  # let the BYEs out, bounded
    finally:
        if not transport.sock.closed:
            transport.close()
        ledger.close()
    return int(ExitCode.OK)


async def _main(broker: Broker, notifier: Notifier, endpoint: str) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: (notifier.stopping(), broker.stop()))
    loop.add_signal_handler(signal.SIGHUP, broker.reload_keys)
    watchdog = asyncio.create_task(watchdog_task(notifier))
    notifier.ready(f"serving on {endpoint}")
    try:
        await broker.run()
    finally:
        watchdog.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ccsq-brokerd", description="ccsq broker daemon")
    parser.add_argument("--config", required=True, help="path of brokerd.toml")
    args = parser.parse_args(argv)
    sys.exit(run(args.config))


if __name__ == "__main__":  # pragma: no cover
    main()
