"""The s3:// claim store against a real S3 server installable from Debian: radosgw on
a throwaway single-node Ceph (one monitor, one OSD on a file; tests/ceph/single_node.sh).

Marked ``soak`` (outside CI: it needs ``apt-get install ceph-mon ceph-osd radosgw
ceph-common``, ~300 MB, and ~1 min to bootstrap); skipped where those are missing.
Run: ``.venv/bin/pytest -m soak tests/test_deploy_radosgw.py``. What happened when it
was tried is in docs/deployment.md ("radosgw on a single-node Ceph").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import tomli_w
import tomllib

from ccsq.common.storage.claimstore import open_store
from ccsq.tools.cli import main as ccsq_main
from ccsq.common.wire.errors import ConfigError
from ccsq.tools.procs import bin_path, free_tcp_port

pytestmark = [
    pytest.mark.soak,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not all(shutil.which(b) for b in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "curl")),
                       reason="needs Debian's ceph-mon ceph-osd radosgw ceph-common and curl"),
]
SCRIPT = Path(__file__).parent / "ceph" / "single_node.sh"
ACCESS, SECRET = "ccsqaccess", "ccsqsecret"


@pytest.fixture(scope="module")
def rgw(tmp_path_factory):
    d = tmp_path_factory.mktemp("ceph")
    port = free_tcp_port()
    try:
        subprocess.run(["sh", str(SCRIPT), str(d), str(free_tcp_port()), str(port), ACCESS, SECRET], check=True,
                       timeout=400, capture_output=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        for pid_file in sorted((d / "asok").glob("*.pid"), reverse=True):  # rgw, osd, then the monitor
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


def test_radosgw_as_the_claim_store_of_a_swarm(tmp_path: Path, rgw: str, monkeypatch) -> None:
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    boto3.client("s3", endpoint_url=rgw, region_name="us-east-1").create_bucket(Bucket="pages")
    s3 = {"endpoint_url": rgw, "region": "us-east-1"}
    store = open_store("s3://pages/ocr", s3=s3)
    store.check()
    digest = store.put(b"page" * 5000)
    assert store.put(b"page" * 5000) == digest and store.get(digest) == b"page" * 5000  # conditional put: 412 honoured
    with pytest.raises(ConfigError, match="does not exist"):
        open_store("s3://no-such-bucket/x", s3=s3).check()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ConfigError, match="denied"):
        open_store("s3://pages/ocr", s3=s3).check()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)

    root = tmp_path / "s"
    assert ccsq_main(["init", str(root), "--workers", "1", "--endpoint", f"tcp://127.0.0.1:{free_tcp_port()}"]) == 0
    for name in ("workerd-0.toml", "producer.toml", "completion.toml"):
        doc = tomllib.loads((root / name).read_text())
        doc.update(claim_store="s3://pages/swarm", s3_endpoint_url=rgw, s3_region="us-east-1")
        if name == "producer.toml":
            doc["inline_max_bytes"] = 0  # every payload through radosgw
        (root / name).write_text(tomli_w.dumps(doc))
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for argv in (
        [bin_path("ccsq-brokerd"), "--config", str(root / "brokerd.toml")],
        [bin_path("ccsq-workerd"), "--config", str(root / "workerd-0.toml")],
        [bin_path("ccsq"), "completion", "--config", str(root / "completion.toml")],
    )]
    try:
        pages = []
        for i in range(3):
            page = tmp_path / f"page-{i}.bin"
            page.write_bytes(os.urandom(30_000))
            pages.append(str(page))
        res = subprocess.run([bin_path("ccsq"), "submit", "--kind", "echo", "--wait", "--timeout-s", "120", "--json",
                              "--config", str(root / "producer.toml"), *pages], capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stderr
        assert [row["state"] for row in json.loads(res.stdout)] == ["acknowledged"] * 3
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
