"""Claim stores (file:// and s3:// against a real S3-compatible server) and reconcile."""

from __future__ import annotations

import os
import time
from pathlib import Path

import boto3
import pytest

from ccsq.common.storage.claimstore import FileStore, inline_blob, open_store, sha256_hex
from ccsq.common.wire.errors import ConfigError, PayloadMissing
from ccsq.common.wire.protocol import Blob
from ccsq.tools.reconcile import reconcile

BUCKET = "ccsq-test"


# --- file store ---------------------------------------------------------------------
def test_file_store_roundtrip_is_content_addressed_and_idempotent(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "blobs")
    data = b"page one" * 1000
    digest = store.put(data)
    assert digest == sha256_hex(data)
    assert store.put(data) == digest
    assert store.get(digest) == data and store.exists(digest)
    assert [sha for sha, _ in store.list()] == [digest]
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "blobs").rglob("*"))
    store.delete(digest)
    store.delete(digest)  # absent: no error
    assert not store.exists(digest)
    with pytest.raises(PayloadMissing):
        store.get(digest)


def test_file_store_detects_corruption_and_ignores_torn_writes(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "blobs")
    digest = store.put(b"original content")
    path = tmp_path / "blobs" / digest[:2] / digest[2:4] / digest
    path.write_bytes(b"tampered content")
    with pytest.raises(PayloadMissing, match="corrupt"):
        store.get(digest)
    # a writer killed before its rename leaves only a temp file: never listed, never read
    (path.parent / ".tmp-abc123").write_bytes(b"half a blo")
    assert [sha for sha, _ in store.list()] == [digest]
    with pytest.raises(PayloadMissing):
        store.get("not-a-digest")


def test_file_store_reput_refreshes_mtime(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "blobs")
    digest = store.put(b"x" * 100)
    path = tmp_path / "blobs" / digest[:2] / digest[2:4] / digest
    os.utime(path, (1_000_000, 1_000_000))
    store.put(b"x" * 100)
    assert path.stat().st_mtime > time.time() - 60


def test_put_blob_inline_below_threshold_and_get_blob_verifies(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "blobs")
    small = store.put_blob(b"tiny", inline_max_bytes=16)
    assert small.inline == b"tiny" and not store.exists(small.sha256)
    big = store.put_blob(b"y" * 100, inline_max_bytes=16)
    assert big.inline is None and store.get_blob(big) == b"y" * 100
    with pytest.raises(PayloadMissing):
        store.get_blob(Blob(sha256_hex(b"tinx"), 4, b"tiny"))
    with pytest.raises(PayloadMissing):
        store.get_blob(Blob(big.sha256, 99, None))


def test_inline_blob_is_the_checked_blob_put_blob_made(tmp_path: Path) -> None:
    """``inline_blob`` (no ``__init__``, the check passed by construction) makes the Blob the
    checked constructor makes, for every size: equal, hashed alike, frozen; ``put_blob``'s
    inline branch is it."""
    import dataclasses
    import random

    rng = random.Random(26)
    store = FileStore(tmp_path / "blobs")
    for n in [0, 1, 2, 63, 64, 65, 255, 256, 4096, 16384, 16385, *(rng.randrange(70_000) for _ in range(60))]:
        data = rng.randbytes(n)
        checked = Blob(sha256_hex(data), n, data)
        made = inline_blob(data)
        assert made == checked and type(made) is Blob and hash(made) == hash(checked) and made.inline is data
        assert store.put_blob(data, n) == checked and store.put_blob(data, n + rng.randrange(3)) == checked
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.size = n + 1  # type: ignore[misc]
    assert list(store.list()) == []  # inline: nothing written


def test_open_store_resolves_relative_paths_and_rejects_unknown_schemes(tmp_path: Path) -> None:
    store = open_store("file://blobs", base_dir=tmp_path)
    assert isinstance(store, FileStore) and store.root == tmp_path / "blobs"
    with pytest.raises(ConfigError):
        open_store("ftp://x", base_dir=tmp_path)


# --- S3 against a real S3-compatible server (moto) ----------------------------------------
@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_store(s3_endpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("CCSQ_S3_ENDPOINT_URL", s3_endpoint)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    prefix = f"t{time.monotonic_ns()}"
    return open_store(f"s3://{BUCKET}/{prefix}", base_dir=tmp_path), client, prefix


def test_s3_roundtrip_exists_delete_list(s3_store) -> None:
    store, _, prefix = s3_store
    assert store.uri == f"s3://{BUCKET}/{prefix}"
    data = os.urandom(50_000)
    digest = store.put(data)
    assert digest == sha256_hex(data)
    assert store.exists(digest) and store.get(digest) == data
    listed = dict(store.list())
    assert list(listed) == [digest] and abs(listed[digest] - time.time()) < 120
    store.delete(digest)
    assert not store.exists(digest) and dict(store.list()) == {}
    with pytest.raises(PayloadMissing):
        store.get(digest)


def test_s3_conditional_put_never_overwrites(s3_store) -> None:
    """The server honours If-None-Match: a second conditional put of the same key
    is refused with 412, which the store treats as "already there"."""
    store, client, prefix = s3_store
    digest = store.put(b"first")
    key = f"{prefix}/{digest[:2]}/{digest}"
    with pytest.raises(client.exceptions.ClientError) as err:
        client.put_object(Bucket=BUCKET, Key=key, Body=b"other", IfNoneMatch="*")
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert store.put(b"first") == digest  # 412 -> success, content unchanged
    assert store.get(digest) == b"first"


def test_s3_get_verifies_digest(s3_store) -> None:
    store, client, prefix = s3_store
    digest = sha256_hex(b"expected")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{digest[:2]}/{digest}", Body=b"tampered")
    with pytest.raises(PayloadMissing, match="corrupt"):
        store.get(digest)


def test_reconcile_on_s3_deletes_old_orphans_only(s3_store) -> None:
    store, _, _ = s3_store
    kept = store.put(b"referenced")
    orphan = store.put(b"orphan")
    report = reconcile([("i1", "ready", kept)], store, grace_s=3600, dry_run=False)
    assert (report.orphans, report.orphans_young, report.orphans_deleted) == (1, 1, 0)
    report = reconcile([("i1", "ready", kept)], store, grace_s=3600, dry_run=False, now_s=time.time() + 7200)
    assert report.orphans_deleted == 1 and not store.exists(orphan) and store.exists(kept)


# --- reconcile ---------------------------------------------------------------------------
def test_reconcile_reports_orphans_and_missing_payloads(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "blobs")
    live = store.put(b"live payload")
    done_result = store.put(b"a stored result")
    orphan = store.put(b"left behind by a crashed producer")
    gone = sha256_hex(b"never stored")
    refs = [("i1", "ready", live), ("i2", "acknowledged", done_result), ("i3", "ready", gone),
            ("i4", "completed", sha256_hex(b"collected result"))]
    future = time.time() + 3600
    dry = reconcile(refs, store, grace_s=60, dry_run=True, now_s=future)
    assert (dry.referenced, dry.stored, dry.orphans, dry.orphans_deleted) == (4, 3, 1, 0)
    assert [(m.item_id, m.sha256) for m in dry.missing] == [("i3", gone)]  # i4 no longer needs its payload
    assert store.exists(orphan)
    young = reconcile(refs, store, grace_s=60, dry_run=False)
    assert (young.orphans_young, young.orphans_deleted) == (1, 0) and store.exists(orphan)
    real = reconcile(refs, store, grace_s=60, dry_run=False, now_s=future)
    assert real.orphans_deleted == 1 and not store.exists(orphan)
    assert store.exists(live) and store.exists(done_result)
    assert real.as_dict()["missing"] == [{"item_id": "i3", "state": "ready", "sha256": gone}]


def test_file_store_down_at_start_fails_per_operation_not_at_construction(tmp_path: Path) -> None:
    """A daemon that starts while its file:// store is unreachable (here: the path is
    under a regular file) must not crash-loop: the store is made, and each operation
    raises OSError, which the worker and the completion service retry (chaos found the
    crash loop)."""
    blocker = tmp_path / "mount"
    blocker.write_bytes(b"not a directory")
    store = FileStore(blocker / "blobs")
    with pytest.raises(OSError):
        store.put(b"payload")
    blocker.unlink()  # the store comes back
    digest = store.put(b"payload")
    assert store.get(digest) == b"payload"


def test_one_rule_for_store_errors_and_async_get_put(tmp_path) -> None:
    """store_failure: bad inline bytes are PAYLOAD_MISSING, a stored blob missing in our
    view or an unreachable store STORE_UNAVAILABLE; aput_blob/aget_blob round-trip
    inline and stored blobs from an event loop (stored ones through the executor)."""
    import asyncio

    from ccsq.common.storage.claimstore import FileStore, store_failure
    from ccsq.common.wire.errors import PayloadMissing, StoreUnavailable
    from ccsq.common.wire.protocol import Blob, FailReason

    assert store_failure(PayloadMissing("x"), Blob("0" * 64, 1, b"y")) is FailReason.PAYLOAD_MISSING  # inline: the item's
    assert store_failure(PayloadMissing("x"), Blob("0" * 64, 1, None)) is FailReason.STORE_UNAVAILABLE  # our view (G7)
    assert store_failure(StoreUnavailable("x")) is FailReason.STORE_UNAVAILABLE
    assert store_failure(PermissionError(13, "denied")) is FailReason.STORE_UNAVAILABLE

    store = FileStore(tmp_path / "blobs")

    async def run() -> None:
        small = await store.aput_blob(b"tiny", 64)
        big = await store.aput_blob(b"b" * 1000, 64)
        assert small.inline == b"tiny" and big.inline is None
        assert await store.aget_blob(small) == b"tiny" and await store.aget_blob(big) == b"b" * 1000
        with pytest.raises(PayloadMissing):
            await store.aget_blob(Blob("0" * 64, 3, None))

    asyncio.run(run())


# --- S3 that misbehaves: a scripted endpoint (real HTTP, real botocore) ------------------
class _BadS3:
    """An S3 endpoint that answers every request with ``status`` and an S3 error body, or
    (``truncate``) a 200 whose body ends early (a broken response stream)."""

    def __init__(self, status: int = 503, code: str = "SlowDown", truncate: bool = False) -> None:
        import http.server
        import threading

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if truncate and self.command == "GET":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b"short")
                    self.wfile.flush()
                    self.close_connection = True
                    return
                body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                        f"<Message>scripted</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _answer

            def log_message(self, *args) -> None:  # quiet
                pass

        self.requests = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def store(self):
        from botocore.config import Config as BotoConfig

        from ccsq.common.storage.s3store import S3Store

        client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="k",
                              aws_secret_access_key="s", config=BotoConfig(retries={"total_max_attempts": 1, "mode": "standard"}))
        return S3Store(client, BUCKET, "p", endpoint_url=self.url)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status,code,truncate", [(503, "SlowDown", False), (500, "InternalError", False),
                                                  (403, "AccessDenied", False), (200, "", True)])
def test_s3_errors_while_serving_mean_store_unavailable_never_a_crash(status: int, code: str, truncate: bool) -> None:
    """A 5xx, SlowDown, access denied after start or a broken response stream used to
    escape as a raw botocore error (the completion service died on it; a worker could
    count it against the item). Every one is StoreUnavailable: the one rule then says
    STORE_UNAVAILABLE (retry later, no attempt counted) and the completion service
    retries the read with backoff."""
    from ccsq.common.storage.claimstore import store_failure
    from ccsq.common.wire.errors import StoreUnavailable
    from ccsq.common.wire.protocol import FailReason

    bad = _BadS3(status, code, truncate)
    try:
        store = bad.store()
        digest = sha256_hex(b"x")
        calls = [lambda: store.get(digest)]
        if not truncate:
            calls += [lambda: store.exists(digest), lambda: store.put(b"x"), lambda: store.delete(digest),
                      lambda: list(store.list())]
        for call in calls:
            with pytest.raises(StoreUnavailable) as err:
                call()
            assert store.uri in str(err.value)
            assert store_failure(err.value, Blob(digest, 1, None)) == FailReason.STORE_UNAVAILABLE
        if code == "AccessDenied":
            assert "bucket policy" in str(err.value)
        assert bad.requests >= len(calls)  # each call really reached the endpoint
    finally:
        bad.close()
