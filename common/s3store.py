"""``s3://bucket/prefix`` claim store on any S3-compatible object storage (boto3).

Blobs live at ``<prefix>/<ab>/<sha256>`` (content-addressed, so a put is
idempotent). A put is conditional (``If-None-Match: *``): an object that is
already there answers 412 PreconditionFailed, which counts as success, and the
object's LastModified is refreshed (copy onto itself) so that ``reconcile``'s
grace period protects a blob that a producer is about to reference again.
Reads verify the SHA-256, so a torn or tampered object is
:class:`~ccsq.common.errors.PayloadMissing`.

The endpoint comes from ``CCSQ_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL``
(default: AWS); credentials and region from the usual boto3 chain.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import boto3
import botocore.exceptions
from botocore.config import Config as BotoConfig

from ccsq.common.claimstore import ClaimStore, sha256_hex
from ccsq.common.errors import ConfigError, PayloadMissing
from ccsq.common.log import get_logger

log = get_logger("ccsq.s3store")

_HEX = frozenset("0123456789abcdef")
_PRECONDITION_FAILED = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_PUT_CONFLICT_RETRIES = 5


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Store(ClaimStore):
    """Content-addressed blobs in one bucket under ``prefix``.

    ``client`` is a boto3 S3 client; one instance is used from one thread at a time.
    """

    def __init__(self, client: object, bucket: str, prefix: str = "") -> None:
        if not bucket:
            raise ConfigError("s3 claim store: the URI needs a bucket (s3://bucket/prefix)")
        self._s3 = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    @classmethod
    def from_uri(cls, uri: str, *, endpoint_url: str | None = None) -> S3Store:
        """Open ``s3://bucket[/prefix]``. ``endpoint_url`` defaults to the env
        ``CCSQ_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL``. Raises ConfigError on a bad URI."""
        if not uri.startswith("s3://"):
            raise ConfigError(f"claim store {uri!r} is not an s3:// URI")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        endpoint = endpoint_url or os.environ.get("CCSQ_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            config=BotoConfig(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=60),
        )
        return cls(client, bucket, prefix)

    def _key(self, sha256: str) -> str:
        if len(sha256) != 64 or not set(sha256) <= _HEX:
            raise PayloadMissing(f"not a sha256 hex digest: {sha256!r}")
        tail = f"{sha256[:2]}/{sha256}"
        return f"{self.prefix}/{tail}" if self.prefix else tail

    def put(self, data: bytes) -> str:
        """Store ``data`` unless present (conditional put); return its SHA-256 hex."""
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
        try:
            obj = self._s3.get_object(Bucket=self.bucket, Key=self._key(sha256))
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                raise PayloadMissing(f"blob {sha256} is not in {self.uri}") from None
            raise
        data = obj["Body"].read()
        if sha256_hex(data) != sha256:
            raise PayloadMissing(f"blob {sha256} in {self.uri} is corrupt (digest mismatch)")
        return data

    def exists(self, sha256: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._key(sha256))
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return False
            raise
        return True

    def delete(self, sha256: str) -> None:
        self._s3.delete_object(Bucket=self.bucket, Key=self._key(sha256))

    def list(self) -> Iterator[tuple[str, float]]:
        """Yield ``(sha256, last_modified_unix_s)`` of every blob under the prefix."""
        paginator = self._s3.get_paginator("list_objects_v2")
        prefix = f"{self.prefix}/" if self.prefix else ""
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"].rsplit("/", 1)[-1]
                if len(name) == 64 and set(name) <= _HEX:
                    yield name, obj["LastModified"].timestamp()
