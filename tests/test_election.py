"""Primary election on a real etcd (brokerd/election.py, docs/ha.md): started in tmp_path on
loopback ports; the holder that stops renewing (SIGSTOP, a real process) loses the key to a
standby with a higher epoch, and stops confirming before etcd can have expired its lease."""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from ccsq.brokerd.election import ENDPOINTS_KEY, Election
from ccsq.common.wire.errors import ConfigError

pytest.importorskip("etcd3gw")
ETCD = shutil.which("etcd")
TTL_S = 2  # etcd 3.4's shortest with its default timing (1.5 s, rounded up)
MARGIN_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd_server(tmp_path):
    """A one-member etcd in tmp_path; yields (client URL, process); stopped (SIGTERM, then SIGKILL)."""
    if ETCD is None:
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed (.ci/run installs Debian's etcd-server)")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = open(tmp_path / "etcd.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [ETCD, "--name", "t", "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", client,
         "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"t={peer}", "--initial-cluster-state", "new", "--logger", "zap",
         "--log-outputs", "stderr"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                if b'"true"' in r.read():
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"etcd did not become healthy: {(tmp_path / 'etcd.log').read_text()[-2000:]}")
        time.sleep(0.05)
    yield client, proc
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture
def etcd(etcd_server):
    return etcd_server[0]


def election(url: str, me: str, **kw) -> Election:
    return Election([url], "s1", me, ttl_s=TTL_S, margin_s=MARGIN_S, **kw)


def test_take_renew_and_epochs_only_grow(etcd):
    a, b = election(etcd, "tcp://a:5555"), election(etcd, "tcp://b:5555")
    a.check()
    e1 = a.campaign()
    assert e1 == 1 and a.may_confirm(time.monotonic())
    h = b.holder()
    assert (h.epoch, h.endpoint, h.lease) == (1, "tcp://a:5555", a.lease_id)
    assert b.campaign() is None and not b.may_confirm(time.monotonic())  # held: b stays standby
    before = a.renewed_at
    assert a.renew() and a.renewed_at > before
    a.resign()
    assert not a.may_confirm(time.monotonic()) and b.wait_vacant(5)
    assert b.campaign(min_epoch=0) == 2  # the counter survives the key
    b.resign()
    assert a.campaign(min_epoch=41) == 42  # above the ledger's epoch too
    assert b.holder().epoch == 42
    a.resign()


def test_may_confirm_ends_margin_before_the_ttl():
    now = [100.0]
    e = Election(["http://127.0.0.1:2379"], "s1", "tcp://a:1", ttl_s=3, margin_s=1.0, clock=lambda: now[0])
    assert not e.may_confirm(now[0])  # holds nothing
    e.renewed_at = 100.0  # as renew() sets it: the clock before the keep-alive was sent
    assert e.may_confirm(101.99) and not e.may_confirm(102.0) and e.confirm_deadline() == 102.0


def test_may_confirm_is_false_before_etcd_expires_the_lease(etcd):
    a = election(etcd, "tcp://a:5555")
    watcher = election(etcd, "tcp://w:5555")
    assert a.campaign()
    deadline = a.confirm_deadline()
    checks = []
    end = time.monotonic() + TTL_S * 4
    while time.monotonic() < end:  # nobody renews
        t = time.monotonic()
        present = watcher.holder() is not None
        checks.append((t, present, a.may_confirm(t)))
        if not present:
            break
        time.sleep(0.02)
    assert not checks[-1][1], "the lease never expired"
    gone_at = checks[-1][0]
    assert deadline < gone_at - MARGIN_S / 2
    assert all(not may for _, present, may in checks if not present)
    assert any(may for _, _, may in checks) and not a.may_confirm(time.monotonic())
    assert a.renew() is False and a.renewed_at is None  # the lease is gone at etcd


HOLDER = """
import sys, time
from ccsq.brokerd.election import Election
e = Election([sys.argv[1]], "s1", "tcp://holder:5555", ttl_s=int(sys.argv[2]), margin_s=float(sys.argv[3]))
print("epoch", e.campaign(), flush=True)
while True:
    time.sleep(e.ttl_s / 3)
    if not e.renew():
        print("lost", flush=True)
        break
"""


def readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line of ``proc``'s stdout, or "" after ``timeout_s``."""
    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        return ""
    return proc.stdout.readline()


def test_holder_stopped_longer_than_ttl_loses_to_standby_with_higher_epoch(etcd, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, etcd, str(TTL_S), str(MARGIN_S)],
                              stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        first = readline(holder, 30).split()
        assert first[0] == "epoch" and first[1] != "None", first
        standby = election(etcd, "tcp://standby:5555")
        assert standby.campaign() is None
        assert not standby.wait_vacant(TTL_S * 1.5)  # renewed: the key stays
        assert standby.holder().endpoint == "tcp://holder:5555"
        holder.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert standby.wait_vacant(TTL_S * 5)
        assert time.monotonic() - t0 > TTL_S - 1.0  # etcd waited out (most of) the TTL
        epoch = standby.campaign()
        assert epoch is not None and epoch > int(first[1])
        h = standby.holder()
        assert (h.epoch, h.endpoint) == (epoch, "tcp://standby:5555")
        standby.start_keepalive()
        holder.send_signal(signal.SIGCONT)
        assert readline(holder, TTL_S * 5).strip() == "lost"  # its next keep-alive finds no lease
        assert holder.wait(10) == 0
        assert standby.holder().endpoint == "tcp://standby:5555" and standby.may_confirm(time.monotonic())
        standby.resign()
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
            holder.wait()


def test_wrong_endpoints_are_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=f"{ENDPOINTS_KEY}.*not an etcd client URL.*/ccsq/s1/primary"):
        Election(["127.0.0.1:2379"], "s1", "tcp://a:1")
    with pytest.raises(ConfigError, match=f"{ENDPOINTS_KEY} is empty"):
        Election("", "s1", "tcp://a:1")
    dead = election(f"http://127.0.0.1:{free_port()}", "tcp://a:1")
    with pytest.raises(ConfigError, match=f"{ENDPOINTS_KEY}: no etcd answers for the election key /ccsq/s1/primary"):
        dead.check()
    with pytest.raises(ConfigError, match="lease_margin_s"):
        Election(["http://127.0.0.1:2379"], "s1", "tcp://a:1", ttl_s=3, margin_s=3)


def test_a_dead_endpoint_is_passed_over(etcd):
    e = Election([f"http://127.0.0.1:{free_port()}", etcd], "s1", "tcp://a:1", ttl_s=TTL_S, margin_s=MARGIN_S)
    e.check()
    assert e.campaign() == 1 and e.renew()
    e.resign()


def test_a_primary_that_cannot_renew_stops_confirming_in_time(etcd_server):
    url, proc = etcd_server
    a = election(url, "tcp://a:5555", request_timeout_s=0.3)
    assert a.campaign()
    lost: list[str] = []
    a.start_keepalive(lost.append)
    try:
        granted_at, deadline = a.renewed_at, time.monotonic() + 5
        while a.renewed_at == granted_at and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.renewed_at > granted_at  # a keep-alive went through
        proc.send_signal(signal.SIGSTOP)  # etcd stops answering: no renewal can succeed
        stopped = time.monotonic()
        last_ok = a.renewed_at
        assert last_ok is not None and last_ok <= stopped
        while not lost and time.monotonic() < stopped + TTL_S * 3:
            time.sleep(0.02)
        assert lost and lost[0].startswith("cannot renew"), lost
        assert not a.may_confirm(time.monotonic())
        assert a.confirm_deadline() == last_ok + TTL_S - MARGIN_S  # at most ttl - margin after the last renewal
        time.sleep(TTL_S / 3 * 2)
        assert len(lost) == 1  # told once per outage
    finally:
        proc.send_signal(signal.SIGCONT)
        a._stop.set()


def test_wait_vacant_passes_over_a_dead_endpoint(etcd):
    a = election(etcd, "tcp://a:1")
    assert a.campaign()
    b = Election([f"http://127.0.0.1:{free_port()}", etcd], "s1", "tcp://b:1", ttl_s=TTL_S, margin_s=MARGIN_S)
    assert not b.wait_vacant(0.5)
    a.resign()
    assert b.wait_vacant(5)


def test_resign_after_the_lease_expired_is_quiet(etcd):
    """A primary that lost its lease (a stall longer than the TTL) and then steps down:
    etcd answers the revoke 404 (lease not found); resign logs it and returns, it never
    kills the broker (seen: exit 1 after a 3.5 s stall, where the role loop should have
    gone on as standby)."""
    a = election(etcd, "tcp://a:5555")
    assert a.campaign() == 1
    lease_id = a.lease_id
    a._stop.set()  # no keep-alives from now on: as if the process had stalled
    if a._keepalive is not None:
        a._keepalive.join(TTL_S)
    a._post("/kv/lease/revoke", {"ID": lease_id})  # etcd expires it (what a stall past the TTL does)
    a.lease_id = lease_id
    a.resign()  # must not raise
    assert a.lease_id == 0 and not a.may_confirm(time.monotonic())
