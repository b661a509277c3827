"""``s3://bucket/prefix`` claim store on any S3-compatible object storage (boto3).

Blobs live at ``<prefix>/<ab>/<sha256>`` (content-addressed, so a put is
idempotent). A put is conditional (``If-None-Match: *``): an object that is
already there answers 412 PreconditionFailed, which counts as success, and the
object's LastModified is refreshed (copy onto itself) so that ``reconcile``'s
grace period protects a blob that a producer is about to reference again.
Reads verify the SHA-256, so a torn or tampered object is
:class:`~ccsq.common.wire.errors.PayloadMissing`.

The endpoint comes from the config key ``s3_endpoint_url``, else
``CCSQ_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL`` (default: AWS); the region from
``s3_region`` (else ``AWS_REGION``/``AWS_DEFAULT_REGION``/the profile); credentials
always from the AWS credential chain (environment, e.g. the unit's
``EnvironmentFile=``; the ``s3_profile`` profile of ``~/.aws/credentials``; an
instance role), never from ccsq's TOML. :meth:`S3Store.check` (run at start-up)
turns missing credentials, a missing bucket and access denied into ConfigError
(exit 78) and an unreachable endpoint into StoreUnavailable (exit 75).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config as BotoConfig

from ccsq.common.storage.claimstore import ClaimStore, sha256_hex
from ccsq.common.wire.errors import ConfigError, PayloadMissing, StoreUnavailable
from ccsq.common.runtime.log import get_logger

log = get_logger("ccsq.s3store")

_HEX = frozenset("0123456789abcdef")
_PRECONDITION_FAILED = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_PUT_CONFLICT_RETRIES = 5
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
           "AllAccessDisabled", "AuthorizationHeaderMalformed"}
_NO_BUCKET = {"NoSuchBucket", "404", "NotFound"}
_CREDENTIALS_FIX = ("give the service AWS credentials through the credential chain: AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY in the unit's EnvironmentFile=, a profile (s3_profile) in "
                    "~/.aws/credentials of the service user, or an instance role; never in the TOML")
_UNREACHABLE = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
)


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Store(ClaimStore):
    """Content-addressed blobs in one bucket under ``prefix``.

    ``client`` is a boto3 S3 client; one instance is used from one thread at a time.
    """

    def __init__(self, client: Any, bucket: str, prefix: str = "", *, probe_client: Any | None = None,
                 endpoint_url: str = "") -> None:
        if not bucket:
            raise ConfigError("s3 claim store: the URI needs a bucket (s3://bucket/prefix)")
        self._s3 = client
        self._probe = probe_client or client  # start-up check: few retries, short timeouts
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url

    @classmethod
    def from_uri(cls, uri: str, *, endpoint_url: str | None = None, region: str | None = None,
                 profile: str | None = None, where: str = "") -> S3Store:
        """Open ``s3://bucket[/prefix]``. ``endpoint_url`` defaults to the env
        ``CCSQ_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL``; ``region``/``profile``: the
        AWS region and named profile (None: boto3's defaults). Raises ConfigError on a
        bad URI or an unknown profile."""
        if not uri.startswith("s3://"):
            raise ConfigError(f"claim store {uri!r} is not an s3:// URI")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        endpoint = endpoint_url or os.environ.get("CCSQ_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None
        try:
            session = boto3.session.Session(profile_name=profile or None, region_name=region or None)
        except botocore.exceptions.ProfileNotFound as exc:
            raise ConfigError(f"{where or 'claim store ' + uri}: s3_profile: {exc}; add the profile to the service "
                              "user's ~/.aws/config (or AWS_CONFIG_FILE) or remove s3_profile") from None
        try:
            client = session.client(
                "s3",
                endpoint_url=endpoint,
                config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=60),
            )
            probe = session.client(
                "s3",
                endpoint_url=endpoint,
                config=BotoConfig(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=3, read_timeout=10),
            )
        except ValueError as exc:  # e.g. an endpoint URL that is not a URL
            raise ConfigError(f"{where or 'claim store ' + uri}: s3_endpoint_url {endpoint!r}: {exc}") from None
        except botocore.exceptions.NoRegionError:
            raise ConfigError(f"{where or 'claim store ' + uri}: no AWS region; set s3_region (or AWS_REGION)") from None
        return cls(client, bucket, prefix, probe_client=probe, endpoint_url=endpoint or "")

    def check(self, where: str = "") -> None:
        """HEAD the bucket with the configured credentials: ConfigError for missing
        credentials, a missing bucket or access denied (exit 78), StoreUnavailable
        for an endpoint that does not answer (exit 75)."""
        prefix = f"{where} = {self.uri!r}" if where else f"claim store {self.uri}"
        at = f" at {self.endpoint_url}" if self.endpoint_url else ""
        try:
            self._probe.head_bucket(Bucket=self.bucket)
        except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as exc:
            raise ConfigError(f"{prefix}: {exc}; {_CREDENTIALS_FIX}") from None
        except _UNREACHABLE as exc:
            raise StoreUnavailable(f"{prefix}: the S3 endpoint{at} does not answer ({exc}); retry later, "
                                   "or fix s3_endpoint_url") from None
        except botocore.exceptions.ClientError as exc:
            code = _code(exc)
            if code in _NO_BUCKET:
                raise ConfigError(f"{prefix}: bucket {self.bucket!r} does not exist{at}; create it or fix the URI") from None
            if code in _DENIED:
                raise ConfigError(f"{prefix}: access to bucket {self.bucket!r}{at} denied ({code}); check the "
                                  "credentials and the bucket policy (s3:ListBucket, GetObject, PutObject)") from None
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status >= 500:
                raise StoreUnavailable(f"{prefix}: the S3 endpoint{at} answered {status} ({code}); retry later") from None
            raise ConfigError(f"{prefix}: bucket check failed ({code}: {exc})") from None
        except botocore.exceptions.BotoCoreError as exc:
            raise ConfigError(f"{prefix}: {exc}") from None

    def _runtime(self, exc: Exception) -> Exception:
        """What an S3 error met while serving means (one rule for get, put, exists, delete,
        list): missing credentials are a ConfigError with the fix (not a raw traceback);
        everything else the store answers or fails with (an endpoint that does not
        answer, a 5xx or SlowDown, a broken response stream, access denied after a
        policy change) is :class:`StoreUnavailable`: try again later, the item and its
        result wait in the broker (never dead-lettered, never ACKed without it)."""
        if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
            return ConfigError(f"claim store {self.uri}: {exc}; {_CREDENTIALS_FIX}")
        if isinstance(exc, _UNREACHABLE):
            return StoreUnavailable(f"claim store {self.uri}: the S3 endpoint does not answer ({exc})")
        if isinstance(exc, botocore.exceptions.ClientError):
            code = _code(exc)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            hint = ("; check the credentials and the bucket policy (s3:GetObject, PutObject, ListBucket)"
                    if code in _DENIED else "; retrying")
            return StoreUnavailable(f"claim store {self.uri}: S3 answered {status or '?'} {code or type(exc).__name__}{hint}")
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return StoreUnavailable(f"claim store {self.uri}: {type(exc).__name__}: {exc}")
        return exc

    def _key(self, sha256: str) -> str:
        if len(sha256) != 64 or not set(sha256) <= _HEX:
            raise PayloadMissing(f"not a sha256 hex digest: {sha256!r}")
        tail = f"{sha256[:2]}/{sha256}"
        return f"{self.prefix}/{tail}" if self.prefix else tail

    def put(self, data: bytes) -> str:
        """Store ``data`` unless present (conditional put); return its SHA-256 hex."""
        try:
            return self._put(data)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._runtime(exc) from None

    def _put(self, data: bytes) -> str:
        digest = sha256_hex(data)
        key = self._key(digest)
        for attempt in range(_PUT_CONFLICT_RETRIES):
            try:
                self._s3.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
                return digest
            except botocore.exceptions.ClientError as exc:
                code = _code(exc)
                if code in _PRECONDITION_FAILED:
                    self._touch(key)
                    return digest
                if code not in _CONFLICT:
                    raise
                # a concurrent conditional put of the same key is in progress: same content, wait and re-check
                log.info("s3_put_conflict", key=key, attempt=attempt)
                time.sleep(0.05 * (attempt + 1))
        if self.exists(digest):
            return digest
        raise PayloadMissing(f"blob {digest}: conditional put kept conflicting in {self.uri}")

    def _touch(self, key: str) -> None:
        """Refresh LastModified of an existing object (copy onto itself)."""
        self._s3.copy_object(
            Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": key}, MetadataDirective="REPLACE"
        )

    def get(self, sha256: str) -> bytes:
        key = self._key(sha256)
        try:
            obj = self._s3.get_object(Bucket=self.bucket, Key=key)
            data = obj["Body"].read()
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                raise PayloadMissing(f"blob {sha256} is not in {self.uri}") from None
            raise self._runtime(exc) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise self._runtime(exc) from None
        if sha256_hex(data) != sha256:
            raise PayloadMissing(f"blob {sha256} in {self.uri} is corrupt (digest mismatch)")
        return data

    def exists(self, sha256: str) -> bool:
        key = self._key(sha256)
        try:
            self._s3.head_object(Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return False
            raise self._runtime(exc) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise self._runtime(exc) from None
        return True

    def delete(self, sha256: str) -> None:
        key = self._key(sha256)
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._runtime(exc) from None

    def list(self) -> Iterator[tuple[str, float]]:
        """Yield ``(sha256, last_modified_unix_s)`` of every blob under the prefix."""
        paginator = self._s3.get_paginator("list_objects_v2")
        prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"].rsplit("/", 1)[-1]
                    if len(name) == 64 and set(name) <= _HEX:
                        yield name, obj["LastModified"].timestamp()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._runtime(exc) from None
