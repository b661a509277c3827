"""``ccsq-workerd --config DIR/workerd-N.toml``: the worker daemon's entry point.

Start order: config -> journal lock -> handler load and provider check ->
journal recovery -> READY=1 (systemd) -> serve. Exit codes
(:class:`~ccsq.common.wire.errors.ExitCode`), each with a one-line reason on stderr:

    0   stopped by SIGTERM/SIGINT after draining
    78  CONFIG: invalid config, keys, handler name or missing model files; a claim
        store root that does not exist, a missing bucket, credentials or access
    75  the claim store does not answer at start (transient: restarted)
    79  GPU_UNAVAILABLE: provider cuda/tensorrt required and not usable (case C10);
        set allow_cpu_fallback = true to run on CPU and say so in HELLO
    75  TEMPFAIL: another ccsq-workerd holds this journal_dir (transient)
    1   FAILURE: a bug; systemd restarts the worker
"""

from __future__ import annotations

import asyncio
import os
import sys

import structlog

from ccsq.common.wire import config as cfgmod
from ccsq.common.runtime import log as logsetup
from ccsq.common.storage.claimstore import open_configured_store
from ccsq.common.wire.config import WorkerConfig
from ccsq.common.runtime.daemon import config_path_from_argv, die, settle_gc
from ccsq.common.wire.errors import ConfigError, ExitCode, GpuUnavailable, PortInUse, StoreUnavailable, Unauthorized
from ccsq.common.runtime.metrics_exporter import parse_listen
from ccsq.common.link.peer import make_codec
from ccsq.common.runtime.systemd import Notifier, stop_signals_and_watchdog
from ccsq.workerd.handlers import load_handler
from ccsq.workerd.worker_journal import Journal, JournalCorrupt, JournalLocked
from ccsq.workerd.worker import Worker

log = structlog.get_logger("ccsq.workerd.main")


def _die(code: ExitCode | BaseException, reason: str | None = None) -> int:
    return die("ccsq-workerd", code, reason)


async def _serve(worker: Worker, notifier: Notifier) -> None:
    def on_signal(signame: str) -> None:
        log.info("stop_requested", signal=signame)
        notifier.stopping(f"draining (drain_timeout_s={worker.cfg.drain_timeout_s})")
        notifier.extend_timeout(worker.cfg.drain_timeout_s + 10.0)
        worker.request_stop()

    async with stop_signals_and_watchdog(notifier, on_signal, healthy=lambda: worker.gate.lost < worker.gate.slots):
        await worker.run(on_ready=lambda: notifier.ready(
            f"handler {worker.handler.name} on {worker.handler.provider}, broker {worker.cfg.broker_endpoint}"))


def run(argv: list[str] | None = None) -> tuple[int, bool]:
    """Run the daemon; returns (exit code, whether inference threads are still stuck)."""
    config_path = config_path_from_argv("ccsq-workerd", "ccsq worker daemon (one per GPU)", "path of workerd-N.toml", argv)
    try:
        cfg = cfgmod.load(WorkerConfig, config_path)
        notifier = Notifier.from_env()
    except ConfigError as exc:
        return _die(exc, f"config error: {exc}"), False
    logsetup.configure(cfg.log_format)

    def in_file(exc: Exception) -> str:  # name the file when the message does not (keys, handler, model)
        return f"config error: {exc}" if cfg.config_path in str(exc) else f"config error: {cfg.config_path}: {exc}"

    try:
        codec = make_codec(cfg)  # keys and authorized_keys, before any slow model load
        parse_listen(cfg.metrics_listen, where=f"{cfg.config_path}: metrics_listen")
    except ConfigError as exc:
        return _die(exc, in_file(exc)), False
    try:
        journal = Journal.open(cfg.journal_dir)
    except JournalLocked as exc:
        return _die(exc), False
    except OSError as exc:
        return _die(ExitCode.CONFIG, f"journal_dir {cfg.journal_dir}: {exc}"), False
    try:
        store = open_configured_store(cfg)  # a wrong root/bucket/credential: 78 before any slow model load
        handler = load_handler(cfg.handler, cfg)
        handler.load()
    except StoreUnavailable as exc:
        journal.close()
        return _die(exc, f"claim store unavailable (transient, restart later): {exc}"), False
    except GpuUnavailable as exc:
        log.error("gpu_unavailable", provider=cfg.provider, reason=str(exc))
        journal.close()
        return _die(exc), False
    except ConfigError as exc:
        journal.close()
        return _die(exc, in_file(exc)), False
    if handler.cpu_fallback:
        log.warning("gpu_fallback_to_cpu", requested=cfg.provider, provider=handler.provider, reason=handler.provider_reason)
    log.info(
        "handler_ready", handler=handler.name, version=handler.version, provider=handler.provider,
        requested_provider=cfg.provider, cpu_fallback=handler.cpu_fallback, slots=cfg.slots, prefetch=cfg.prefetch,
    )
    worker = Worker(cfg, handler, store, journal, codec=codec)
    settle_gc()  # start-up's heap (handler, model) out of the collector's way
    try:
        from ccsq.workerd.worker_metrics import start_worker_metrics

        metrics = start_worker_metrics(worker, cfg.metrics_listen, where=f"{cfg.config_path}: metrics_listen")
    except ConfigError as exc:
        journal.close()
        return _die(exc, in_file(exc)), False
    except PortInUse as exc:
        journal.close()
        return _die(exc, f"transient: {exc}"), False
    try:
        asyncio.run(_serve(worker, notifier))
    except JournalCorrupt as exc:
        return _die(exc), False
    finally:
        if metrics is not None:
            metrics.shutdown()
        journal.close()
    if isinstance(worker.fatal, (Unauthorized, ConfigError)):  # 77 / 78: not restarted
        return _die(worker.fatal), worker.stuck_threads > 0
    if worker.fatal is not None:
        return _die(ExitCode.FAILURE, f"stopped by an internal error: {worker.fatal!r}"), worker.stuck_threads > 0
    return int(ExitCode.OK), worker.stuck_threads > 0




def main(argv: list[str] | None = None) -> None:
    code, stuck = run(argv)
    if stuck:
        # an inference thread that cannot be interrupted would block interpreter exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
