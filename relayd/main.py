"""``ccsq-relayd --config relayd.toml``: the federation relay daemon's entry point.

Exit codes (:class:`~ccsq.common.wire.errors.ExitCode`), each with a one-line reason on stderr:
0 after SIGTERM/SIGINT; 77 UNAUTHORIZED (every link was refused by one of its brokers: a
key, CURVE key or trust entry is missing; one refused link among working ones only stops
that link, loudly); 78 CONFIG (bad relayd.toml, keys, trust or claim store URI);
75 TEMPFAIL (another ccsq-relayd holds the journal_dir; transient); 1 a bug.
"""

from __future__ import annotations

import asyncio
import sys

import structlog

from ccsq.common.runtime import log as logsetup
from ccsq.common.runtime.daemon import config_path_from_argv
from ccsq.common.wire.errors import ConfigError, ExitCode, PortInUse
from ccsq.common.runtime.systemd import Notifier, catch_early_stop, stop_signals_and_watchdog
from ccsq.relayd.config import load_relay_config
from ccsq.relayd.journal import RelayJournal
from ccsq.common.wire.errors import JournalCorrupt, JournalLocked

log = structlog.get_logger("ccsq.relayd.main")


def _die(code: ExitCode, reason: str) -> int:
    print(f"ccsq-relayd: {reason}", file=sys.stderr, flush=True)
    return int(code)


async def _serve(relay, notifier: Notifier) -> None:
    async with stop_signals_and_watchdog(notifier, lambda _sig: (notifier.stopping(), relay.request_stop())):
        await relay.run(on_ready=lambda: notifier.ready(f"{len(relay.links)} link(s)"))


def run(config_path: str) -> int:
    try:
        cfg = load_relay_config(config_path)
        notifier = Notifier.from_env()
        catch_early_stop()  # a stop before the loop serves is a clean exit, not death by signal
    except ConfigError as exc:
        return _die(ExitCode.CONFIG, f"config error: {exc}")
    logsetup.configure(cfg.log_format)
    try:
        journal = RelayJournal.open(cfg.journal_dir)
    except JournalLocked as exc:
        return _die(ExitCode.TEMPFAIL, str(exc))
    try:
        from ccsq.relayd.metrics import start_relay_metrics
        from ccsq.relayd.relay import Relay, RelayRefused

        try:
            relay = Relay(cfg, journal)
            metrics = start_relay_metrics(relay, cfg.metrics_listen, where=f"{cfg.config_path}: metrics_listen")
        except ConfigError as exc:
            return _die(ExitCode.CONFIG, f"config error: {exc}")
        except JournalCorrupt as exc:
            return _die(ExitCode.FAILURE, str(exc))
        except PortInUse as exc:  # the old instance still exiting: transient
            return _die(ExitCode.TEMPFAIL, f"transient: {exc}")
        try:
            asyncio.run(_serve(relay, notifier))
        except RelayRefused as exc:
            return _die(ExitCode.UNAUTHORIZED, f"every link was refused: {exc}")
        finally:
            if metrics is not None:
                metrics.shutdown()
    finally:
        journal.close()
    return int(ExitCode.OK)


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(config_path_from_argv("ccsq-relayd", "ccsq federation relay (docs/federation.md)", "path of relayd.toml", argv)))


if __name__ == "__main__":  # pragma: no cover
    main()
