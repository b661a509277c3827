"""The command line every ccsq daemon shares: ``ccsq-<name> --config FILE``, and the one
exit path of every main (:func:`die`, :func:`exit_code_for`)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

from ccsq.common.wire.errors import (AdminFailed, BrokerUnavailable, ConfigError, ExitCode, GpuUnavailable, JournalCorrupt,
                                     JournalLocked, NoInput, PortInUse, StoreUnavailable, Unauthorized)

#: The config file each command reads when --config is not given.
CONFIG_ENV = "CCSQ_CONFIG"
CONFIG_DIR = Path("/etc/ccsq")


def default_config(name: str) -> str:
    """The config file for a command that reads ``<name>.toml`` when --config is left out:
    ``$CCSQ_CONFIG/<name>.toml`` (a directory, e.g. the one ``ccsq init`` wrote),
    ``$CCSQ_CONFIG`` (a file), else ``/etc/ccsq/<name>.toml``."""
    env = os.environ.get(CONFIG_ENV)
    if env:
        path = Path(env)
        return str(path / f"{name}.toml") if path.is_dir() else str(path)
    return str(CONFIG_DIR / f"{name}.toml")


def config_path_from_argv(prog: str, description: str, config_help: str, argv: list[str] | None = None, *,
                          default_name: str | None = None) -> str:
    """Parse ``--config FILE`` from ``argv`` (``sys.argv[1:]`` when None) and return FILE.
    argparse prints usage and exits 2 when it is missing or unknown arguments are given;
    ``--help`` prints ``description``. With ``default_name``, --config may be left out:
    FILE is then :func:`default_config` of that name, and ConfigError
    (:func:`missing_default_config`) when it does not exist."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=default_name is None, default=None, help=config_help)
    parser.add_argument("--version", action="version", version=version_string(prog))
    config = parser.parse_args(argv).config
    if config is None and default_name is not None:
        config = default_config(default_name)
        if not Path(config).exists():
            raise missing_default_config(config)
    return config


def missing_default_config(path: str) -> ConfigError:
    """The error of a command whose --config was left out and whose default file is missing."""
    return ConfigError(f"no --config given and {path} does not exist: pass --config FILE, or set {CONFIG_ENV} to "
                       "the directory `ccsq init` wrote")


#: Error type -> exit code, first match wins; an error with an ``exit_code`` of its own
#: (``LedgerError``: :func:`~ccsq.common.wire.errors.ledger_failure`, ``CantCreate``) says it itself.
EXIT_CODES: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (ConfigError, ExitCode.CONFIG),
    (JournalCorrupt, ExitCode.CONFIG),  # permanent: a restart reads the same row
    (NoInput, ExitCode.NOINPUT),
    (Unauthorized, ExitCode.UNAUTHORIZED),
    (GpuUnavailable, ExitCode.GPU_UNAVAILABLE),
    (BrokerUnavailable, ExitCode.UNAVAILABLE),
    (AdminFailed, ExitCode.REFUSED),
    (JournalLocked, ExitCode.TEMPFAIL),  # another process holds it: restart later
    (PortInUse, ExitCode.TEMPFAIL),  # the old instance still exiting
    (StoreUnavailable, ExitCode.TEMPFAIL),  # the claim store down at start
)


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code of a main that stops on ``exc``: its own ``exit_code`` when it has one,
    else the first row of :data:`EXIT_CODES` it is an instance of, else ``FAILURE`` (1)."""
    own = getattr(exc, "exit_code", None)
    if own is not None:
        return ExitCode(own)
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return ExitCode.FAILURE


def die(prog: str, code: int | BaseException, reason: str | None = None) -> int:
    """How every ccsq main stops on an error: one line ``prog: reason`` on stderr (flushed:
    the journal gets it before the exit), and the exit code to return. ``code`` is an
    :class:`~ccsq.common.wire.errors.ExitCode`, or the error itself (its code is
    :func:`exit_code_for` it; ``reason`` defaults to its text)."""
    if isinstance(code, BaseException):
        reason = str(code) if reason is None else reason
        code = exit_code_for(code)
    print(f"{prog}: {reason}", file=sys.stderr, flush=True)
    return int(code)


def version_string(prog: str) -> str:
    """``PROG VERSION`` of the installed ccsq distribution (``--version`` of every command)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{prog} {version('ccsq')}"
    except PackageNotFoundError:
        return f"{prog} unknown"


#: Net container allocations between young collections after :func:`settle_gc` (CPython's
#: default is 700).
GC_YOUNG_THRESHOLD = 10_000


def settle_gc(young_threshold: int | None = GC_YOUNG_THRESHOLD) -> None:
    """Call once start-up is over (imports, config, keys, ledger or model), just before
    serving: collect, then freeze what is left out of the cyclic collector's scans
    (``gc.freeze``: it lives as long as the process), and with ``young_threshold`` collect
    the young generation after that many net container allocations instead of 700 (older
    generations keep their ratios). A daemon's per-frame work makes thousands of
    short-lived objects and little cyclic garbage: with the defaults the broker ran ~25
    young collections per thousand jobs (~15 µs of CPU per job), the worker's echo bench
    ~110 and a full one re-walking ~48,000 start-up objects, the completion service 65 ms
    of collections per 20,000 results (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    if young_threshold:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(young_threshold, gen1, gen2)
