"""One exception tree for ccsq, and the named exit codes of its daemons.

Every error a user can see names the cause and the fix. Whether an error is
worth retrying is a *type* (:class:`RetryableError` vs :class:`PermanentError`),
never a string to parse (after dramatiq's exception tree).
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes. systemd units list the non-transient ones in
    ``RestartPreventExitStatus`` so a config error does not restart-loop (case C11)."""

    OK = 0
    FAILURE = 1  # unexpected crash: systemd restarts it
    USAGE = 2  # bad command line
    CONFIG = 78  # EX_CONFIG: invalid config / keys / permissions; do not restart
    GPU_UNAVAILABLE = 79  # a GPU was required but the provider cannot load (case C10)
    # EX_TEMPFAIL: transient: a ledger/journal lock or port held by another process, a claim store down at start,
    # QUEUE_FULL at submit; restart or retry later
    TEMPFAIL = 75
    LEDGER_IO = 74  # EX_IOERR: a ledger write failed (disk full, I/O error); nothing unconfirmed was acknowledged
    UNBALANCED = 3  # gap-report: accounting does not balance
    INCOMPLETE = 4  # demo / submit --wait: not every item was acknowledged in time
    REFUSED = 65  # EX_DATAERR: the broker refused a CLI request (unknown item or worker, item not dead...)
    UNAVAILABLE = 69  # EX_UNAVAILABLE: a CLI command needs the running broker and got no answer
    UNAUTHORIZED = 77  # EX_NOPERM: the broker refused this peer (unknown id, wrong key, wrong role); do not restart
    NOINPUT = 66  # EX_NOINPUT: an input file named on the command line does not exist or cannot be read
    DEAD = 5  # submit --wait: some item ended dead or expired (it will not complete without `ccsq dlq replay`)
    LEDGER_CORRUPT = 80  # the ledger file is corrupt, not LMDB, or of another LMDB version: restore a backup; do not restart
    CANTCREAT = 73  # EX_CANTCREAT: an output file or directory named on the command line cannot be created


class CcsqError(Exception):
    """Root of every error ccsq raises on purpose."""

    code: str = "ERROR"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)
        if code is not None:
            self.code = code


class RetryableError(CcsqError):
    """The operation may succeed if retried later (back off first). A command stopped by
    one exits 75 (TEMPFAIL: a claim store or disk that is down now, a lock held), as
    QUEUE_FULL does; BrokerUnavailable has its own 69."""

    exit_code = ExitCode.TEMPFAIL


class PermanentError(CcsqError):
    """Retrying the same operation will fail the same way."""


class ConfigError(PermanentError):
    """Configuration is invalid; the message names the key and the fix."""

    code = "CONFIG"


class NoInput(PermanentError):
    """An input file named on the command line does not exist or cannot be read (exit 66)."""

    code = "NOINPUT"


class DecodeError(PermanentError):
    """Bytes from the wire could not be turned into a valid message.

    ``code`` is one of the ``REJECT_*`` reasons in :mod:`ccsq.common.wire.protocol`.
    """

    code = "MALFORMED"
    #: the sender id the frame claims, when it was read (for refusals and rate limits)
    sender: str | None = None
    #: an unauthenticated frame that looks like a real peer's HELLO (the broker may answer it)
    answerable: bool = False


class AuthError(DecodeError):
    """The frame decoded but fails authentication or authorization."""

    code = "BAD_SIGNATURE"


class QueueFull(RetryableError):
    """The broker's ledger is over its configured size: retry with backoff or spool to an outbox."""

    code = "QUEUE_FULL"


class DiskFull(RetryableError):
    """The broker's disk is nearly full: retry with backoff or spool to an outbox; an operator must free space."""

    code = "DISK_FULL"


class AdminFailed(PermanentError):
    """The broker refused an admin command (unknown item or worker, bad argument);
    the message is the broker's reason. One class on both sides: the broker's commands
    and the offline ledger reads raise it,
    the admin client raises it for a refused reply. The CLI exits with ExitCode.REFUSED."""

    code = "ADMIN"


class BrokerUnavailable(RetryableError):
    """No reply from the broker in time: check that ccsq-brokerd runs and the endpoint is right."""

    code = "BROKER_UNAVAILABLE"
    exit_code = ExitCode.UNAVAILABLE


class Unauthorized(PermanentError):
    """The broker refused this peer: add its public key with the right role to authorized_keys."""

    code = "UNAUTHORIZED"


class PayloadTooLarge(PermanentError):
    """A payload or frame is over the configured limit: raise max_frame_bytes or use the claim store."""

    code = "PAYLOAD_TOO_LARGE"


class InvalidRequest(PermanentError):
    """An argument or request field is invalid (wrong type, out of range); the message names it."""

    code = "INVALID_REQUEST"


class DeadlineExceeded(PermanentError):
    """The item's deadline passed before it completed."""

    code = "DEADLINE_EXCEEDED"


class PayloadMissing(PermanentError):
    """A claim-check reference points at a blob the store does not hold (or whose digest does not match)."""

    code = "PAYLOAD_MISSING"


class GpuUnavailable(PermanentError):
    """A GPU execution provider was required but cannot be used; set allow_cpu_fallback = true to run on CPU."""

    code = "GPU_UNAVAILABLE"


class HandlerError(RetryableError):
    """A handler failed on an item; retried per the item's max_attempts."""

    code = "HANDLER_ERROR"


class PermanentHandlerError(PermanentError):
    """A handler says this item can never succeed (bad input): dead-letter it at once."""

    code = "HANDLER_FATAL"


#: An I/O error on a filesystem with less free space than this is a full disk: LMDB reports a
#: short write (what a full disk gives) as EIO.
FULL_DISK_MARGIN_BYTES = 8 << 20


def ledger_failure(exc: BaseException, path: object, doing: str = "ledger", *,
                   free_bytes: int | None = None) -> tuple[ExitCode, str]:
    """The exit code and one sentence (cause and fix) for an LMDB error ``exc`` that
    stopped ``doing`` on the ledger at ``path``. Classifies by the py-lmdb exception
    class name (no lmdb import here) and, for plain ``lmdb.Error``/``OSError``, by the
    errno text: ReadersFullError -> TEMPFAIL (75, transient), MapFullError ->
    CONFIG (78: raise max_map_size_bytes), ENOSPC -> LEDGER_IO (74: free space), EIO ->
    LEDGER_IO (74: check the disk), Corrupted/Invalid/VersionMismatch/BadChecksum/
    PageNotFound/Panic/Incompatible -> LEDGER_CORRUPT (80: restore a backup),
    LockError -> TEMPFAIL (75); EACCES -> CONFIG (78); anything else -> LEDGER_IO (74). ``free_bytes``: free
    space on the ledger's filesystem when known; an EIO there with less than
    :data:`FULL_DISK_MARGIN_BYTES` free is a full disk (LMDB turns the short write of a
    full disk into EIO)."""
    name = type(exc).__name__
    text = str(exc)
    where = f"{doing} on {path}"
    if name == "ReadersFullError":
        return ExitCode.TEMPFAIL, (
            f"{where}: the LMDB reader table is full (MDB_READERS_FULL): live processes hold every reader slot "
            "(stale slots of dead processes were cleared); stop the stray readers listed by `ccsq status` "
            "(readers) or raise max_readers, then retry. This is not a disk problem")
    if name == "MapFullError":
        return ExitCode.CONFIG, (
            f"{where}: the ledger reached its map size limit (MDB_MAP_FULL): raise max_map_size_bytes in brokerd.toml, "
            "or take back space held by history with `ccsq backup` and the swap in docs/ledger.md")
    eio = "Input/output error" in text or getattr(exc, "errno", None) == 5
    if eio and free_bytes is not None and free_bytes < FULL_DISK_MARGIN_BYTES:
        return ExitCode.LEDGER_IO, (
            f"{where}: the disk holding the ledger is full (ENOSPC: {free_bytes} bytes free; LMDB reports the short "
            "write as EIO); nothing unconfirmed was acknowledged: free disk space there, then restart")
    if name == "DiskError" or "No space left" in text or getattr(exc, "errno", None) == 28:
        return ExitCode.LEDGER_IO, (
            f"{where}: the disk holding the ledger is full (ENOSPC); nothing unconfirmed was acknowledged: "
            "free disk space there, then restart")
    if eio:
        return ExitCode.LEDGER_IO, (
            f"{where}: the disk or filesystem returned an I/O error (EIO); nothing unconfirmed was acknowledged: "
            "check the device (dmesg, smartctl), restart once it is healthy, or restore the latest backup on a healthy disk")
    if name in ("CorruptedError", "PageNotFoundError", "BadChecksumError", "PanicError"):
        return ExitCode.LEDGER_CORRUPT, (
            f"{where}: the ledger file is corrupt ({name}); do not restart: stop the broker, keep the file for analysis, "
            "restore the latest `ccsq backup` (docs/ledger.md, Backups), then start")
    if name in ("InvalidError", "VersionMismatchError", "IncompatibleError"):
        return ExitCode.LEDGER_CORRUPT, (
            f"{where}: data.mdb is not a ledger this LMDB can read ({name}: not an LMDB file, or written by another "
            "LMDB version); do not restart: point data_dir at the right directory, use the LMDB version that wrote it, "
            "or restore a `ccsq backup`")
    if "Permission denied" in text or getattr(exc, "errno", None) == 13:
        return ExitCode.CONFIG, (
            f"{where}: permission denied (EACCES): this user cannot open the ledger files; fix their owner and mode "
            "(the broker's user owns data_dir), or run as that user")
    if name == "LockError":
        return ExitCode.TEMPFAIL, (
            f"{where}: the ledger's lock file is locked by another process (EAGAIN): transient, retry later")
    return ExitCode.LEDGER_IO, f"{where}: ledger error ({name}: {text}); nothing unconfirmed was acknowledged: restart"


#: Map from wire error code to exception type (policy.refusal_error raises the one a refusal names).
ERRORS_BY_CODE: dict[str, type[CcsqError]] = {
    cls.code: cls
    for cls in (
        QueueFull,
        DiskFull,
        BrokerUnavailable,
        Unauthorized,
        PayloadTooLarge,
        InvalidRequest,
        DeadlineExceeded,
        PayloadMissing,
        ConfigError,
        DecodeError,
    )
}


class StoreUnavailable(RetryableError):
    """The claim store cannot be reached right now (S3 endpoint down, I/O error on a
    mount): transient, a daemon exits 75 at start-up and is restarted."""

    code = "STORE_UNAVAILABLE"


class PortInUse(RetryableError):
    """A listen address (``metrics_listen``) is taken by another process, e.g. the old
    instance still exiting after a restart: transient, a daemon exits 75 (TEMPFAIL) and is restarted."""

    code = "PORT_IN_USE"


class CantCreate(PermanentError):
    """An output file or directory named on the command line cannot be created or
    written (no such parent directory, read-only, no permission): exit 73."""

    code = "CANT_CREATE"
    exit_code = ExitCode.CANTCREAT

    @classmethod
    def of(cls, what: str, path: object, exc: OSError) -> CantCreate:
        return cls(f"cannot write {what} {path}: {exc.strerror or exc}; choose a writable path "
                   "(an existing directory this user may write)")


class JournalLocked(RetryableError):
    """Another process holds this journal_dir (a worker's or a relay's journal): give each its
    own journal_dir, or wait for the old process to exit."""

    code = "JOURNAL_LOCKED"


class JournalCorrupt(PermanentError):
    """A journal row could not be decoded; the message names the row. Permanent: a restart
    reads the same row (the daemon exits 78, CONFIG, and is not restarted); move the journal
    aside to start clean."""

    code = "JOURNAL_CORRUPT"
