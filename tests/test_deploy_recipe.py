"""Set-up as the docs tell it (issues 22 and 27): ``ccsq init``'s swarm ids, ``ccsq init-relay``
on same-named directories, a relay host's bundle and its claim stores, and the copy recipes of
docs/deployment.md and docs/federation.md followed literally.

The recipe tests take the shell block between the ``copy-recipe`` markers of the docs and
run it as written; only what cannot exist here is stood in for: ``ssh root@HOST 'CMD'``
runs CMD locally, ``/etc/ccsq`` is a directory per host, and there is no ``ccsq`` user
(``chown`` does nothing, ``install -o/-g`` is dropped). Each host then starts from only what
it copied, in its own network namespace (``tests/netns.py``): the configs' ``/var/lib/ccsq``
becomes a directory per host (the units' StateDirectory=), the one file:// store a shared
directory linked in as each host's ``blobs`` (the shared mount the docs ask for).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from ccsq.tools.procs import ProcessGroup, bin_path, wait_until
from ccsq.common.wire.errors import ExitCode
from tests.netns import netns  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

# ssh runs its command here; no ccsq user: chown is a no-op, install's owner/group options are dropped
PRELUDE = r"""
ssh() { shift; bash -c "$1"; }
chown() { :; }
install() { local a=(); while [ $# -gt 0 ]; do case "$1" in -o|-g) shift 2;; *) a+=("$1"); shift;; esac; done; command install "${a[@]}"; }
export -f chown install
"""


def _ccsq(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([bin_path("ccsq"), *argv], capture_output=True, text=True, timeout=timeout_s)


def _edit(path: Path, **changes: object) -> None:
    doc = tomllib.loads(path.read_text())
    doc.update(changes)
    path.write_text(tomli_w.dumps(doc))


def _recipe(doc: str, marker: str) -> str:
    """The ``sh`` block between ``<!-- MARKER:begin`` and ``<!-- MARKER:end -->`` of docs/DOC."""
    text = (REPO / "docs" / doc).read_text()
    assert f"<!-- {marker}:begin" in text, f"docs/{doc} has no {marker} block"
    block = text.split(f"<!-- {marker}:begin", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]
    return block.split("```sh\n", 1)[1].split("```", 1)[0]


def _follow(recipe: str, cwd: Path, etc: Path, folder: str | None = None) -> None:
    """Run ``recipe`` from ``cwd`` (where the operator ran ``ccsq init``) installing into ``etc``."""
    script = recipe.replace("/etc/ccsq", str(etc))
    if folder is not None:
        script, n = re.subn(r"^H=\S+", f"H={folder}", script, flags=re.M)
        assert n == 1, recipe
    res = subprocess.run(["bash", "-c", PRELUDE + script], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"the recipe failed for {folder or etc}:\n{script}\n{res.stdout}{res.stderr}"


def _as_state(etc: Path, state: Path, blobs: Path | None = None) -> None:
    """What the units' StateDirectory= does: /var/lib/ccsq is this host's ``state``; the
    shared store is mounted at its blobs/."""
    for toml in etc.glob("*.toml"):
        toml.write_text(toml.read_text().replace("/var/lib/ccsq", str(state)))
    for sub in ("broker", "worker-0", "worker-1", "completion", "relay-relay"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    if blobs is not None:
        (state / "blobs").symlink_to(blobs)


def _results(db: Path) -> list[str]:
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return [r[0] for r in con.execute("SELECT item_id FROM results")]
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()


# --- swarm ids ----------------------------------------------------------------------------------
def test_two_sites_set_up_in_same_named_directories(tmp_path: Path) -> None:
    """Issue 22.4: each site in a directory called ``ccsq``. They get different swarm ids by
    default and ``init-relay`` wires them; older swarms without a swarm_id are refused with
    both directories and the fix (was: NameError 'up_dir'), and nothing is written."""
    a, b = tmp_path / "site-a" / "ccsq", tmp_path / "site-b" / "ccsq"
    for d, port in ((a, 5601), (b, 5602)):
        res = _ccsq("init", str(d), "--endpoint", f"tcp://127.0.0.1:{port}", "--workers", "1")
        assert res.returncode == 0, res.stderr
    ids = [tomllib.loads((d / "brokerd.toml").read_text()).get("swarm_id", "") for d in (a, b)]
    assert all(i.startswith("ccsq-") for i in ids) and ids[0] != ids[1], ids
    res = _ccsq("init-relay", str(tmp_path / "relay"), "--upstream", str(a), "--downstream", str(b), "--kinds", "echo")
    assert res.returncode == 0, res.stderr
    link = tomllib.loads((tmp_path / "relay" / "relayd.toml").read_text())["links"][0]
    assert link["name"] == f"{ids[0]}-to-{ids[1]}"
    # --swarm-id names it; a bad one is refused at init
    res = _ccsq("init", str(tmp_path / "named"), "--swarm-id", "site-c", "--workers", "1")
    assert res.returncode == 0 and tomllib.loads((tmp_path / "named" / "brokerd.toml").read_text())["swarm_id"] == "site-c"
    res = _ccsq("init", str(tmp_path / "bad"), "--swarm-id", "site c/1", "--workers", "1")
    assert res.returncode == ExitCode.CONFIG and "--swarm-id" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "bad").exists()
    # two swarms written before swarm ids (no swarm_id: the directory's name, 'ccsq' for both)
    old_a, old_b = tmp_path / "old-a" / "ccsq", tmp_path / "old-b" / "ccsq"
    for d, port in ((old_a, 5603), (old_b, 5604)):
        assert _ccsq("init", str(d), "--endpoint", f"tcp://127.0.0.1:{port}", "--workers", "1").returncode == 0
        doc = tomllib.loads((d / "brokerd.toml").read_text())
        doc.pop("swarm_id")
        (d / "brokerd.toml").write_text(tomli_w.dumps(doc))
    before = {d: {f.name: f.read_bytes() for f in d.glob("*.toml")} for d in (old_a, old_b)}
    res = _ccsq("init-relay", str(tmp_path / "relay2"), "--upstream", str(old_a), "--downstream", str(old_b), "--kinds", "echo")
    assert res.returncode == ExitCode.CONFIG, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and "NameError" not in res.stderr, res.stderr
    assert str(old_a) in res.stderr and str(old_b) in res.stderr and "'ccsq'" in res.stderr, res.stderr
    assert "swarm_id = " in res.stderr and "--swarm-id" in res.stderr, res.stderr  # the fix
    assert not (tmp_path / "relay2").exists()  # refused before anything was written
    assert before == {d: {f.name: f.read_bytes() for f in d.glob("*.toml")} for d in (old_a, old_b)}


# --- the worker's advice for a missing broker key ----------------------------------------------
def test_a_peer_without_the_brokers_curve_key_is_told_to_copy_it(tmp_path: Path) -> None:
    """Issue 27.3: a GPU host's folder installed without keys/broker.curve.pub: exit 78 naming the
    file, the key, and the fix (copy it from the broker host), not 'create it with ccsq keygen'."""
    assert _ccsq("init", str(tmp_path / "swarm"), "--endpoint", "tcp://gpu-broker.internal:5555", "--workers", "1",
                 "--hosts").returncode == 0
    host = tmp_path / "swarm" / "hosts" / "gpu-1"
    (host / "keys" / "broker.curve.pub").unlink()
    conf = host / "workerd-0.toml"
    _edit(conf, journal_dir=str(tmp_path / "journal"), claim_store=f"file://{tmp_path / 'swarm' / 'blobs'}")
    res = subprocess.run([bin_path("ccsq-workerd"), "--config", str(conf)], capture_output=True, text=True, timeout=60)
    assert res.returncode == ExitCode.CONFIG, res.stderr
    assert f"{conf}: broker_curve_public_key" in res.stderr and "broker.curve.pub" in res.stderr, res.stderr
    assert "copy it from the broker host" in res.stderr and "create it with" not in res.stderr, res.stderr


# --- a relay host's claim stores ----------------------------------------------------------------
def test_a_relay_refuses_a_file_store_it_cannot_reach(tmp_path: Path) -> None:
    """Issue 22.6: ``init-relay --hosts`` refuses a swarm's file:// store (another host's
    directory) with the fix; the relay itself, given a file:// root that is not there (a
    store on another host, a mount missing), exits 78 at start naming the key, and does
    not create an empty directory in its place."""
    for name, port in (("site-a", 5611), ("site-b", 5612)):
        assert _ccsq("init", str(tmp_path / name), "--endpoint", f"tcp://127.0.0.1:{port}", "--workers", "1",
                     "--swarm-id", name).returncode == 0
    argv = ["init-relay", str(tmp_path / "relay"), "--upstream", str(tmp_path / "site-a"), "--downstream",
            str(tmp_path / "site-b"), "--kinds", "echo", "--hosts"]
    res = _ccsq(*argv)
    assert res.returncode == ExitCode.CONFIG and "Traceback" not in res.stderr, (res.returncode, res.stderr)
    assert "site-a" in res.stderr and "file://" in res.stderr and "s3://" in res.stderr and "--store site-a=" in res.stderr
    assert not (tmp_path / "relay").exists()
    # the relay on the machine of the swarm directories: its stores are there
    assert _ccsq(*argv[:-1]).returncode == 0
    conf = tmp_path / "relay" / "relayd.toml"
    doc = tomllib.loads(conf.read_text())
    assert doc["links"][0]["upstream_claim_store"] == f"file://{tmp_path / 'site-a' / 'blobs'}"
    gone = tmp_path / "not-mounted" / "site-a-blobs"
    doc["links"][0]["upstream_claim_store"] = f"file://{gone}"
    conf.write_text(tomli_w.dumps(doc))
    res = subprocess.run([bin_path("ccsq-relayd"), "--config", str(conf)], capture_output=True, text=True, timeout=30)
    assert res.returncode == ExitCode.CONFIG, (res.returncode, res.stderr)
    assert f"{conf}: links[0].upstream_claim_store" in res.stderr and "does not exist" in res.stderr, res.stderr
    assert "s3://" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not gone.exists() and not gone.parent.exists()


# --- the recipes, literally, onto separate hosts -----------------------------------------------
@pytest.mark.timeout(240)
def test_deployment_recipe_onto_separate_hosts(tmp_path: Path, netns) -> None:  # noqa: F811
    """Issue 27.3: docs/deployment.md's copy recipe for every folder of ``ccsq init --hosts``
    (two workers on gpu-1 both naming keys/broker.curve.pub), each host started from only
    what it copied: an item goes from the producer host to a result on the completion host."""
    net = netns(["broker", "gpu-1", "completion", "producer"])
    ops = tmp_path / "ops"  # the machine that ran ccsq init
    ops.mkdir()
    res = subprocess.run([bin_path("ccsq"), "init", "swarm", "--endpoint", "tcp://broker:5555", "--workers", "2",
                          "--handler", "echo", "--hosts", "--gpu-hosts", "1"], cwd=ops, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    recipe = _recipe("deployment.md", "copy-recipe")
    shared = tmp_path / "shared-blobs"  # the store every host mounts at /var/lib/ccsq/blobs
    shared.mkdir()
    etc = {h: tmp_path / h / "etc-ccsq" for h in ("broker", "gpu-1", "completion", "producer")}
    for host, d in etc.items():
        _follow(recipe, ops, d, folder=host)
        _as_state(d, tmp_path / host / "state", blobs=None if host == "broker" else shared)
    assert (etc["gpu-1"] / "keys" / "broker.curve.pub").exists()
    assert not any(p.name == "broker.curve.key" for h in ("gpu-1", "completion", "producer") for p in etc[h].rglob("*"))
    _edit(etc["broker"] / "brokerd.toml", heartbeat_interval_s=0.2, min_free_disk_bytes=0)
    procs = ProcessGroup(tmp_path / "logs")
    try:
        procs.start("broker", net["broker"].argv([bin_path("ccsq-brokerd"), "--config", str(etc["broker"] / "brokerd.toml")]),
                    ready_event="broker_started", ready_timeout_s=60)
        for k in (0, 1):
            procs.start(f"worker-{k}", net["gpu-1"].argv([bin_path("ccsq-workerd"), "--config",
                                                          str(etc["gpu-1"] / f"workerd-{k}.toml")]),
                        ready_event="broker_link_ready", ready_timeout_s=60)
        procs.start("completion", net["completion"].argv([bin_path("ccsq"), "completion", "--config",
                                                           str(etc["completion"] / "completion.toml")]),
                    ready_event="broker_link_ready", ready_timeout_s=60)
        page = tmp_path / "page.bin"
        page.write_bytes(os.urandom(200_000))  # over inline_max_bytes: by reference, through the shared store
        res = net["producer"].run([bin_path("ccsq"), "submit", "--kind", "echo", "--wait", "--timeout-s", "60", "--json",
                                   "--config", str(etc["producer"] / "producer.toml"), str(page)], timeout_s=90)
        assert res.returncode == 0, res.stdout + res.stderr
        out = json.loads(res.stdout)[0]
        assert out["state"] == "acknowledged", out
        db = tmp_path / "completion" / "state" / "completion" / "results.db"
        wait_until(lambda: out["item_id"] in _results(db), 30, "the result on the completion host")
        assert any(f.is_file() for f in shared.rglob("*")), "the payload went by reference through the shared store"
    finally:
        procs.stop_all()


MOTO = r"""
import sys
from moto.server import ThreadedMotoServer
ThreadedMotoServer(ip_address="0.0.0.0", port=int(sys.argv[1])).start()
import time
while True:
    time.sleep(3600)
"""

BUCKET = r"""
import sys, boto3
boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1", aws_access_key_id="test",
             aws_secret_access_key="test").create_bucket(Bucket="pages")
"""


@pytest.mark.timeout(300)
def test_relay_bundle_onto_its_own_host(tmp_path: Path, netns) -> None:  # noqa: F811
    """Issue 22.6: two sites and a relay on three hosts, their claim stores on an S3 service (a
    fourth host). ``init-relay --hosts`` writes the relay host's folder and refreshes each
    site's broker folder; docs/federation.md's recipe installs the relay's, docs/deployment.md's
    the sites'; every process starts from only what its host copied. An item over
    inline_max_bytes submitted at site-a (which runs no worker) crosses to site-b's GPU and
    its result lands in site-a's results database."""
    net = netns(["s3", "site-a", "site-b", "relay-host"])
    s3_port = 5000
    s3_url = f"http://s3:{s3_port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_CONFIG_FILE": "/nonexistent"}
    procs = ProcessGroup(tmp_path / "logs")
    try:
        procs.start("s3", net["s3"].argv([PY, "-c", MOTO, str(s3_port)]))

        def bucket() -> bool:
            return net["s3"].run([PY, "-c", BUCKET, f"http://127.0.0.1:{s3_port}"], timeout_s=30).returncode == 0

        wait_until(bucket, 60, "moto answering and the bucket made", interval_s=0.5)
        ops = tmp_path / "ops"
        ops.mkdir()
        for site, workers in (("site-a", 1), ("site-b", 1)):
            res = subprocess.run([bin_path("ccsq"), "init", site, "--endpoint", f"tcp://{site}:5555", "--workers", str(workers),
                                  "--swarm-id", site, "--hosts"], cwd=ops, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            for name in ["producer.toml", "completion.toml", *(p.name for p in (ops / site).glob("workerd-*.toml"))]:
                _edit(ops / site / name, claim_store=f"s3://pages/{site}", s3_endpoint_url=s3_url, s3_region="us-east-1",
                      **({"inline_max_bytes": 0} if name == "producer.toml" else {}))
            _edit(ops / site / "brokerd.toml", heartbeat_interval_s=0.2, min_free_disk_bytes=0)
            shutil.rmtree(ops / site / "hosts")  # as deployment.md says after editing the configs
            res = subprocess.run([bin_path("ccsq"), "init", site, "--hosts", "--gpu-hosts", "1"], cwd=ops,
                                 capture_output=True, text=True, timeout=60)  # split it again, with the store set
            assert res.returncode == 0 and "only its per-host layout" in res.stdout, res.stdout + res.stderr
        res = subprocess.run([bin_path("ccsq"), "init-relay", "relay", "--upstream", "site-a", "--downstream", "site-b",
                              "--kinds", "echo", "--hosts"], cwd=ops, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert "refreshed" in res.stdout, res.stdout
        bundle = ops / "relay" / "hosts" / "relay"
        relay_toml = tomllib.loads((bundle / "relayd-relay.toml").read_text())
        assert str(ops) not in (bundle / "relayd-relay.toml").read_text()  # nothing points into the ops machine
        assert relay_toml["links"][0]["upstream_claim_store"] == "s3://pages/site-a"
        # install: the relay's folder by federation.md's recipe, the sites' by deployment.md's
        relay_etc = tmp_path / "relay-host" / "etc-ccsq"
        _follow(_recipe("federation.md", "relay-copy-recipe"), ops, relay_etc)
        _as_state(relay_etc, tmp_path / "relay-host" / "state")
        recipe = _recipe("deployment.md", "copy-recipe")
        etc: dict[tuple[str, str], Path] = {}
        for site, folders in (("site-a", ("broker", "completion", "producer")), ("site-b", ("broker", "gpu-1"))):
            site_recipe = recipe.replace("swarm/hosts/", f"{site}/hosts/")  # this site's folders
            for folder in folders:
                d = etc[site, folder] = tmp_path / site / folder / "etc-ccsq"
                _follow(site_recipe, ops, d, folder=folder)
                _as_state(d, tmp_path / site / folder / "state")
        start = procs.start
        for site in ("site-a", "site-b"):
            start(f"{site}-broker", net[site].argv([bin_path("ccsq-brokerd"), "--config", str(etc[site, "broker"] / "brokerd.toml")]),
                  env=env, ready_event="broker_started", ready_timeout_s=60)
        start("a-completion", net["site-a"].argv([bin_path("ccsq"), "completion", "--config",
                                                  str(etc["site-a", "completion"] / "completion.toml")]),
              env=env, ready_event="broker_link_ready", ready_timeout_s=60)
        start("b-worker", net["site-b"].argv([bin_path("ccsq-workerd"), "--config", str(etc["site-b", "gpu-1"] / "workerd-0.toml")]),
              env=env, ready_event="broker_link_ready", ready_timeout_s=60)
        start("relay", net["relay-host"].argv([bin_path("ccsq-relayd"), "--config", str(relay_etc / "relayd-relay.toml")]),
              env={**env, "AWS_ENDPOINT_URL": s3_url}, ready_event="relay_started", ready_timeout_s=60)
        page = tmp_path / "page.bin"
        page.write_bytes(os.urandom(50_000))
        res = net["site-a"].run([bin_path("ccsq"), "submit", "--kind", "echo", "--wait", "--timeout-s", "90", "--json",
                                 "--config", str(etc["site-a", "producer"] / "producer.toml"), str(page)],
                                timeout_s=120, env={**os.environ, **env})
        assert res.returncode == 0, res.stdout + res.stderr + procs.tail("relay")
        out = json.loads(res.stdout)[0]
        assert out["state"] == "acknowledged", out
        db = tmp_path / "site-a" / "completion" / "state" / "completion" / "results.db"
        wait_until(lambda: out["item_id"] in _results(db), 30, "the result in site-a's results database")
        from ccsq.relayd.federation_report import load_federation_report

        counters = wait_until(lambda: c if (c := load_federation_report(relay_etc / "relayd-relay.toml")["links"][0]
                                            ["counters"])["returned"] >= 1 else None, 30, "the relay's books show the item returned")
        assert counters["blobs_copied"] >= 1, counters  # by reference: copied from site-a's store into site-b's
    finally:
        procs.stop_all()
