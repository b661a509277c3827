"""Claim stores: where payloads and large results live, addressed by SHA-256.

The broker only ever holds a reference (:class:`~ccsq.common.wire.protocol.Blob`).
``file://PATH`` is the default (local disk or a shared mount); ``s3://bucket/prefix``
is provided by :mod:`ccsq.common.storage.s3store` (extra ``s3``).

Writes are atomic (temporary name, fsync, rename, fsync of the directory) and
idempotent (same content, same name); reads verify the digest, so a torn or
tampered blob is reported as :class:`~ccsq.common.wire.errors.PayloadMissing`.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path

from ccsq.common.wire.errors import ConfigError, PayloadMissing, StoreUnavailable
from ccsq.common.wire.protocol import Blob, FailReason, trusted_constructor


#: Inline blobs up to this size are digest-checked on the caller's event loop (tens of µs);
#: larger ones go to the executor so a heartbeat never waits behind a hash.
HASH_ON_LOOP_MAX_BYTES = 65536


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: ``Blob(sha256, size, inline)`` without ``__init__`` or its check: for :func:`inline_blob`, whose
#: digest comes from ``hexdigest()`` and size from ``len``, so the check passes by construction
_trusted_blob = trusted_constructor(Blob, ("sha256", "size", "inline"))


def inline_blob(data: bytes) -> Blob:
    """The inline :class:`Blob` of ``data``: its SHA-256 hex, its length in bytes, the bytes
    themselves. What :meth:`ClaimStore.put_blob` makes for data up to ``inline_max_bytes``
    (no I/O), and what the producer's and the worker's loops make for it when
    :meth:`ClaimStore.inline_without_io` says so: the one rule for an inline blob."""
    return _trusted_blob(hashlib.sha256(data).hexdigest(), len(data), data)


def store_failure(exc: BaseException, blob: Blob | None = None) -> FailReason:
    """The one rule for what a claim-store error means for the item, used by every reader
    and writer of blobs (worker, relay):

    * :class:`PayloadMissing` for bytes that came inline with the item (``blob.inline``)
      -> ``PAYLOAD_MISSING``: the item itself is bad (dead-lettered at once).
    * :class:`PayloadMissing` for a stored blob -> ``STORE_UNAVAILABLE``: absent or corrupt
      in THIS reader's view of the store (a missing mount, a lagging replica) is the
      store's problem, not the item's, until ``ccsq reconcile`` confirms the blob gone (G7).
    * anything else (:class:`StoreUnavailable`, an ``OSError``, a backend's error while
      writing a result) -> ``STORE_UNAVAILABLE``: try again later, no attempt counted."""
    if isinstance(exc, PayloadMissing) and blob is not None and blob.inline is not None:
        return FailReason.PAYLOAD_MISSING
    return FailReason.STORE_UNAVAILABLE


class ClaimStore(abc.ABC):
    """Content-addressed blob store. Implementations are safe to share between
    processes; one instance is used from one thread at a time."""

    uri: str

    @abc.abstractmethod
    def put(self, data: bytes) -> str:
        """Store ``data`` durably; return its SHA-256 hex. Idempotent."""

    @abc.abstractmethod
    def get(self, sha256: str) -> bytes:
        """Return the content; raises PayloadMissing if absent or corrupt."""

    @abc.abstractmethod
    def exists(self, sha256: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, sha256: str) -> None:
        """Delete a blob (no error if absent)."""

    @abc.abstractmethod
    def list(self) -> Iterator[tuple[str, float]]:
        """Yield ``(sha256, mtime_unix_s)`` of every blob (for reconcile)."""

    def check(self, where: str = "") -> None:
        """Start-up check that this store is usable (root / bucket present and
        accessible). Raises ConfigError (exit 78: wrong root, bucket, credentials,
        permissions) or StoreUnavailable (exit 75: unreachable right now); ``where``
        (``"FILE: claim_store"``) is named in the message."""

    def inline_without_io(self, size_bytes: int, inline_max_bytes: int) -> bool:
        """True when a blob of ``size_bytes`` travels inline and this store's
        :meth:`put_blob` / :meth:`get_blob` are the base class's, which then do no
        I/O (one SHA-256 over at most ``inline_max_bytes``): callers may run them on
        their event loop instead of hopping to an I/O thread."""
        cls = type(self)
        return size_bytes <= inline_max_bytes and cls.put_blob is ClaimStore.put_blob and cls.get_blob is ClaimStore.get_blob

    async def aput_blob(self, data: bytes, inline_max_bytes: int, executor: Executor | None = None) -> Blob:
        """:meth:`put_blob` from an event loop: on the loop when it does no I/O (an inline
        blob, see :meth:`inline_without_io`), else in ``executor`` (None: the loop's default)."""
        if self.inline_without_io(len(data), inline_max_bytes):
            return self.put_blob(data, inline_max_bytes)
        return await asyncio.get_running_loop().run_in_executor(executor, self.put_blob, data, inline_max_bytes)

    async def aget_blob(self, blob: Blob, executor: Executor | None = None) -> bytes:
        """:meth:`get_blob` from an event loop: on the loop for an inline blob of at most
        ``HASH_ON_LOOP_MAX_BYTES`` of a store whose reads are the base class's (a digest
        check, no I/O), else in ``executor``. Errors as :meth:`get_blob` (what they mean for
        the item: :func:`store_failure`)."""
        if blob.inline is not None and self.inline_without_io(len(blob.inline), HASH_ON_LOOP_MAX_BYTES):
            return self.get_blob(blob)
        return await asyncio.get_running_loop().run_in_executor(executor, self.get_blob, blob)

    def put_blob(self, data: bytes, inline_max_bytes: int) -> Blob:
        """Make a Blob: inline when ``len(data) <= inline_max_bytes`` (:func:`inline_blob`), else stored here."""
        if len(data) <= inline_max_bytes:
            return inline_blob(data)
        digest = sha256_hex(data)
        self.put(data)
        return Blob(digest, len(data), None)

    def get_blob(self, blob: Blob) -> bytes:
        """Resolve a Blob to bytes, verifying its digest either way."""
        if blob.inline is not None:
            if sha256_hex(blob.inline) != blob.sha256:
                raise PayloadMissing(f"inline payload does not match its sha256 {blob.sha256}")
            return blob.inline
        data = self.get(blob.sha256)
        if len(data) != blob.size:
            raise PayloadMissing(f"blob {blob.sha256} has {len(data)} bytes, reference says {blob.size}")
        return data


class FileStore(ClaimStore):
    """``file://PATH``: blobs at ``PATH/ab/cd/<sha256>``."""

    def __init__(self, root: Path, *, create: bool = True) -> None:
        """``create``: make the root if absent (``ccsq init``, the broker host's
        reconcile); workers, producers and the completion service pass False and
        call :meth:`check`, so a wrong root is refused at start instead of becoming
        an empty store that reports every payload missing."""
        self.root = root
        self.uri = f"file://{root}"
        self._create = create
        if not create:
            return
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            # unreachable right now (a network mount down, a path replaced): every operation
            # fails with OSError and is retried by its caller, as during a later outage;
            # a daemon must not crash-loop at start over it
            pass

    def check(self, where: str = "") -> None:
        prefix = f"{where} = {self.uri!r}" if where else f"claim store {self.uri}"
        try:
            st = self.root.stat()
        except FileNotFoundError:
            raise ConfigError(
                f"{prefix}: directory {self.root} does not exist; fix the path, mount the shared store there, "
                "or create it on purpose (ccsq init does; a worker, producer or completion service never creates it)"
            ) from None
        except PermissionError as exc:
            raise ConfigError(f"{prefix}: {exc.strerror}; give this service's user access to {self.root}") from None
        except OSError as exc:  # EIO, ESTALE, ETIMEDOUT on a network mount: transient
            raise StoreUnavailable(f"{prefix}: {self.root} cannot be read right now ({exc.strerror}); retry later") from None
        import stat as stat_mod

        if not stat_mod.S_ISDIR(st.st_mode):  # there but unusable, as during an outage of a mount: transient
            raise StoreUnavailable(f"{prefix}: {self.root} exists but is not a directory; retry later, or point "
                                   "claim_store at the blobs directory")
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise ConfigError(f"{prefix}: {self.root} is not readable and writable by this user (uid {os.getuid()}); "
                              "fix its owner or mode")

    def _path(self, sha256: str) -> Path:
        if len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
            raise PayloadMissing(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256[:2] / sha256[2:4] / sha256

    def put(self, data: bytes) -> str:
        digest = sha256_hex(data)
        path = self._path(digest)
        if path.exists():
            # refresh mtime: reconcile's grace period must protect a blob about to be referenced again
            try:
                os.utime(path)
                return digest
            except FileNotFoundError:
                pass  # collected meanwhile: write it again
        if self._create:
            path.parent.mkdir(parents=True, exist_ok=True)
        else:  # the root itself is never created here (a vanished mount must not become an empty local store)
            path.parent.parent.mkdir(exist_ok=True)
            path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return digest

    def get(self, sha256: str) -> bytes:
        try:
            data = self._path(sha256).read_bytes()
        except FileNotFoundError:
            raise PayloadMissing(f"blob {sha256} is not in {self.uri}") from None
        if sha256_hex(data) != sha256:
            raise PayloadMissing(f"blob {sha256} in {self.uri} is corrupt (digest mismatch)")
        return data

    def exists(self, sha256: str) -> bool:
        return self._path(sha256).exists()

    def delete(self, sha256: str) -> None:
        try:
            self._path(sha256).unlink()
        except FileNotFoundError:
            pass

    def list(self) -> Iterator[tuple[str, float]]:
        for path in self.root.glob("??/??/*"):
            if path.name.startswith(".tmp-") or len(path.name) != 64:
                continue
            try:
                yield path.name, path.stat().st_mtime
            except FileNotFoundError:
                continue


def open_store(uri: str, base_dir: str | Path | None = None, *, create: bool = True, s3: dict | None = None,
               where: str = "") -> ClaimStore:
    """Open a claim store by URI. A relative ``file://`` path is resolved against
    ``base_dir`` (the config file's directory). ``create``: make a missing file://
    root (False: leave it to :meth:`ClaimStore.check`). ``s3``: ``endpoint_url``,
    ``region``, ``profile`` for s3:// (empty values: the AWS defaults). Raises
    ConfigError for unknown schemes."""
    if uri.startswith("file://"):
        path = Path(uri[len("file://"):])
        if not path.is_absolute():
            path = Path(base_dir or ".").resolve() / path
        return FileStore(path, create=create)
    if uri.startswith("s3://"):
        try:
            from ccsq.common.storage.s3store import S3Store
        except ImportError as exc:
            raise ConfigError(f"claim store {uri}: install the s3 extra (pip install 'ccsq[s3]'): {exc}") from None
        opts = {k: v for k, v in (s3 or {}).items() if v}
        return S3Store.from_uri(uri, where=where, **opts)
    raise ConfigError(f"{where + ' = ' if where else 'claim store '}{uri!r}: scheme must be file:// or s3://")


def open_configured_store(cfg: object, *, check: bool = True) -> ClaimStore:
    """The claim store of a worker, producer or completion config (``claim_store``
    and the ``s3_*`` keys), never creating a file:// root; with ``check``, the
    start-up check runs (ConfigError / StoreUnavailable naming the file and key)."""
    config_path = getattr(cfg, "config_path", "")
    where = f"{config_path}: claim_store" if config_path else "claim_store"
    s3 = {k: getattr(cfg, f"s3_{k}", "") for k in ("endpoint_url", "region", "profile")}
    store = open_store(getattr(cfg, "claim_store"), Path(config_path).parent if config_path else None, create=False, s3=s3,
                       where=where)
    if check:
        store.check(where)
    return store

