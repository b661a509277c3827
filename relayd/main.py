"""``ccsq-relayd --config relayd.toml``: the federation relay daemon's entry point.

Exit codes (:class:`~ccsq.common.wire.errors.ExitCode`), each with a one-line reason on stderr:
0 after SIGTERM/SIGINT; 77 UNAUTHORIZED (every link was refused by one of its brokers: a
key, CURVE key or trust entry is missing; one refused link among working ones only stops
that link, loudly); 78 CONFIG (bad relayd.toml, keys, trust, claim store URI, or a store it
copies through that is not there: :func:`check_link_stores`; a journal row that does not decode,
as for the worker: a restart would read it again; another live process holds a link's peer id);
75 TEMPFAIL (another ccsq-relayd holds the journal_dir, an S3 endpoint does not answer;
transient); 1 a bug.
"""

from __future__ import annotations

import asyncio
import sys

import structlog

from ccsq.common.runtime import log as logsetup
from ccsq.common.runtime.daemon import config_path_from_argv, die
from ccsq.common.wire.errors import ConfigError, ExitCode, PortInUse, StoreUnavailable
from ccsq.common.runtime.systemd import Notifier, catch_early_stop, stop_signals_and_watchdog
from ccsq.relayd.config import load_relay_config
from ccsq.relayd.relay_journal import RelayJournal
from ccsq.common.wire.errors import JournalCorrupt, JournalLocked

log = structlog.get_logger("ccsq.relayd.main")


def _die(code: ExitCode | BaseException, reason: str | None = None) -> int:
    return die("ccsq-relayd", code, reason)


async def _serve(relay, notifier: Notifier) -> None:
    async with stop_signals_and_watchdog(notifier, lambda _sig: (notifier.stopping(), relay.request_stop())):
        await relay.run(on_ready=lambda: notifier.ready(f"{len(relay.links)} link(s)"))


def check_link_stores(cfg) -> None:
    """The start-up check of the claim stores the relay copies between (a link whose two
    stores differ): a file:// root must exist (it is never created here: on a relay host
    it would be an empty directory, not the swarm's store) and be usable, an s3:// bucket
    answer. ConfigError (78) / StoreUnavailable (75) naming the file, the key and the fix."""
    from pathlib import Path

    from ccsq.common.storage.claimstore import open_store

    base = Path(cfg.config_path).parent if cfg.config_path else None
    for i, link in enumerate(cfg.links):
        if link.upstream_claim_store == link.downstream_claim_store or not (link.upstream_claim_store and
                                                                            link.downstream_claim_store):
            continue  # nothing is copied: the relay never opens them
        for key in ("upstream_claim_store", "downstream_claim_store"):
            where = f"{cfg.config_path}: links[{i}].{key}"
            store = open_store(getattr(link, key), base, create=False, where=where)
            try:
                store.check(where)
            except ConfigError as exc:
                raise ConfigError(f"{exc}. The relay copies by-reference payloads and results through this store: "
                                  "on a relay host of its own use the swarm's s3:// store, or mount that swarm's "
                                  "store at this path (docs/federation.md, Running it)") from None


def run(config_path: str) -> int:
    try:
        cfg = load_relay_config(config_path)
        notifier = Notifier.from_env()
        catch_early_stop()  # a stop before the loop serves is a clean exit, not death by signal
    except ConfigError as exc:
        return _die(exc, f"config error: {exc}")
    try:
        check_link_stores(cfg)
    except ConfigError as exc:
        return _die(exc, f"config error: {exc}")
    except StoreUnavailable as exc:
        return _die(exc, f"transient: {exc}")
    logsetup.configure(cfg.log_format)
    try:
        journal = RelayJournal.open(cfg.journal_dir)
    except JournalLocked as exc:
        return _die(exc)
    try:
        from ccsq.relayd.relay_metrics import start_relay_metrics
        from ccsq.relayd.relay import Relay, RelayRefused

        try:
            relay = Relay(cfg, journal)
            metrics = start_relay_metrics(relay, cfg.metrics_listen, where=f"{cfg.config_path}: metrics_listen")
        except ConfigError as exc:
            return _die(exc, f"config error: {exc}")
        except JournalCorrupt as exc:
            return _die(exc)
        except PortInUse as exc:  # the old instance still exiting: transient
            return _die(exc, f"transient: {exc}")
        try:
            asyncio.run(_serve(relay, notifier))
        except RelayRefused as exc:
            return _die(ExitCode.UNAUTHORIZED, f"every link was refused: {exc}")
        except ConfigError as exc:  # another live process holds a link's peer id (ID_IN_USE)
            return _die(exc, f"config error: {exc}")
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
