"""Strangers are kept out before they cost memory: with ``curve = true`` the
broker's ZAP handler admits exactly the ``curve_public_key`` values of
authorized_keys.toml (reloaded on SIGHUP); a broker that would bind beyond
loopback without CURVE refuses to start (exit 78) unless
``allow_insecure_bind = true``; the receive high-water mark bounds what one
connection can make the broker queue. Real broker processes, real sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import tomli_w
import tomllib
import zmq
from zmq.utils.monitor import recv_monitor_message

from ccsq.brokerd.transport import FRAME_SLACK_BYTES, is_loopback_endpoint, rcvhwm_for
from ccsq.tools.init import init_swarm
from ccsq.common.wire.config import ProducerConfig, load
from ccsq.common.wire.errors import ConfigError, ExitCode
from ccsq.common.wire.keys import write_curve_keypair, write_keypair
from ccsq.common.link.peer import make_codec
from ccsq.tools.procs import bin_path, free_tcp_port, wait_until
from tests.swarm import Swarm

CURVE = {"curve": True}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS")


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def curve_dealer(ctx: zmq.Context, endpoint: str, server_pub: bytes, pub: bytes, sec: bytes) -> tuple[zmq.Socket, zmq.Socket]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.CURVE_SERVERKEY, server_pub)
    s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
    s.setsockopt(zmq.CURVE_SECRETKEY, sec)
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    s.connect(endpoint)
    return s, mon


def first_handshake_event(mon: zmq.Socket, timeout_s: float = 10.0) -> int:
    if not mon.poll(int(timeout_s * 1000)):
        raise AssertionError("no handshake event")
    return int(recv_monitor_message(mon)["event"])


@pytest.fixture
def curve_swarm(tmp_path):
    metrics_port = free_tcp_port()
    s = Swarm(tmp_path / "swarm", workers=1, broker={**CURVE, "metrics_listen": f"127.0.0.1:{metrics_port}"},
              worker=CURVE, producer=CURVE, completion=CURVE)
    s.metrics_port = metrics_port  # type: ignore[attr-defined]
    with s:
        yield s


def test_stranger_is_dropped_at_the_handshake_and_costs_no_memory(curve_swarm):
    """Case C09: a CURVE client whose key is not listed gets HANDSHAKE_FAILED_AUTH (ZAP 400);
    the 64 MiB it tries to send never reach the broker (RSS stays flat), the
    refusal is counted and logged; an authorized peer (the producer library)
    still submits."""
    s = curve_swarm
    broker = s.start_broker()
    server_pub = (s.root / "keys" / "broker.curve.pub").read_text().strip().encode()
    ctx = zmq.Context()
    try:
        pub, sec = zmq.curve_keypair()
        sock, mon = curve_dealer(ctx, s.endpoint, server_pub, pub, sec)
        assert first_handshake_event(mon) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        before = rss_mib(broker.popen.pid)
        junk = os.urandom(1 << 20)
        sent = 0
        for _ in range(64):
            try:
                sock.send_multipart([junk, b"s" * 64], flags=zmq.NOBLOCK, copy=False)
                sent += 1
            except zmq.Again:
                break
        time.sleep(1.0)  # give ZeroMQ's reconnects time to be refused again
        assert rss_mib(broker.popen.pid) - before < 16.0
        wait_until(lambda: scrape(s.metrics_port, "ccsq_zap_refused_total") >= 1, 10.0, "zap_refused_total")
        wait_until(lambda: broker.count("curve_peer_refused") >= 1, 10.0, "curve_peer_refused log line")
        assert broker.count("curve_peer_refused") <= 2  # rate-limited: once per key per minute
        sock.close(0)
        mon.close(0)
        with s.client() as client:
            assert client.submit(b"authorized peer", "echo").item_id
    finally:
        ctx.term()


def test_sighup_adds_and_removes_a_curve_key(curve_swarm, tmp_path):
    """A new peer's CURVE key is refused until it is in authorized_keys.toml and
    the broker got SIGHUP; removed again + SIGHUP, the next connection is refused."""
    s = curve_swarm
    s.start_broker()
    server_pub = (s.root / "keys" / "broker.curve.pub").read_text().strip().encode()
    sec_path, pub_path = write_curve_keypair(tmp_path / "newkeys", "producer-2")
    pub, sec = pub_path.read_text().strip().encode(), sec_path.read_text().strip().encode()
    ak_path = s.root / "authorized_keys.toml"
    original = ak_path.read_text()
    ctx = zmq.Context()

    def attempt() -> int:
        sock, mon = curve_dealer(ctx, s.endpoint, server_pub, pub, sec)
        try:
            return first_handshake_event(mon)
        finally:
            sock.close(0)
            mon.close(0)

    def reload_count() -> int:
        return s.procs.procs["broker"].count("authorized_keys_reloaded")

    try:
        assert attempt() == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        _, ed_pub = write_keypair(tmp_path / "newkeys", "producer-2")
        doc = tomllib.loads(original)
        doc["peers"]["producer-2"] = {"role": "producer", "public_key": ed_pub.read_text().strip(),
                                      "curve_public_key": pub.decode()}
        ak_path.write_text(tomli_w.dumps(doc))
        n = reload_count()
        s.procs.signal("broker", signal.SIGHUP)
        wait_until(lambda: reload_count() > n, 10.0, "authorized_keys_reloaded")
        assert attempt() == zmq.EVENT_HANDSHAKE_SUCCEEDED
        ak_path.write_text(original)
        n = reload_count()
        s.procs.signal("broker", signal.SIGHUP)
        wait_until(lambda: reload_count() > n, 10.0, "authorized_keys_reloaded")
        assert attempt() == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    finally:
        ctx.term()


def _run_broker(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([bin_path("ccsq-brokerd"), "--config", str(config)], capture_output=True, text=True, timeout=60)


def _edit(path: Path, **changes) -> None:
    doc = tomllib.loads(path.read_text())
    doc.update(changes)
    path.write_text(tomli_w.dumps(doc))


def test_beyond_loopback_without_curve_refuses_to_start(tmp_path):
    """endpoint tcp://0.0.0.0:PORT with curve = false: exit 78, one line naming
    curve and the opt-out; allow_insecure_bind = true starts it. curve = true
    with no curve_public_key listed: exit 78 too."""
    port = free_tcp_port()
    configs = init_swarm(tmp_path / "s", endpoint=f"tcp://127.0.0.1:{port}", workers=1, broker={"min_free_disk_bytes": 0})
    brokerd = configs["brokerd"]
    _edit(brokerd, endpoint=f"tcp://0.0.0.0:{port}")
    out = _run_broker(brokerd)
    assert out.returncode == ExitCode.CONFIG, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "curve = true" in lines[0] and "allow_insecure_bind" in lines[0] and str(brokerd) in lines[0]

    _edit(brokerd, allow_insecure_bind=True)
    proc = subprocess.Popen([bin_path("ccsq-brokerd"), "--config", str(brokerd)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "s" / "broker-data" / "endpoint").exists() or proc.poll() is not None, 30.0,
                   "broker bound")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.terminate()
        proc.wait(30)

    _edit(brokerd, allow_insecure_bind=False, curve=True)
    ak = tmp_path / "s" / "authorized_keys.toml"
    doc = tomllib.loads(ak.read_text())
    for entry in doc["peers"].values():
        entry.pop("curve_public_key")
    ak.write_text(tomli_w.dumps(doc))
    out = _run_broker(brokerd)
    assert out.returncode == ExitCode.CONFIG and "lists no curve_public_key" in out.stderr


def test_init_turns_curve_on_beyond_loopback(tmp_path):
    """`ccsq init` writes a CURVE key pair per peer and lists the public keys;
    curve = true in every config when the endpoint is not loopback, false on loopback."""
    remote = init_swarm(tmp_path / "remote", endpoint="tcp://0.0.0.0:5555", workers=2)
    local = init_swarm(tmp_path / "local", endpoint="tcp://127.0.0.1:5555", workers=1)
    for name, path in remote.items():
        doc = tomllib.loads(path.read_text())
        assert doc["curve"] is True, name
        assert Path(path.parent, doc["curve_secret_key"]).stat().st_mode & 0o077 == 0, name
    assert all(tomllib.loads(p.read_text())["curve"] is False for p in local.values())
    peers = tomllib.loads((tmp_path / "remote" / "authorized_keys.toml").read_text())["peers"]
    for peer_id, entry in peers.items():
        assert entry["curve_public_key"] == (tmp_path / "remote" / "keys" / f"{peer_id}.curve.pub").read_text().strip()


def test_peer_with_curve_needs_its_own_key(tmp_path):
    """curve = true without curve_secret_key is a config error naming the fix."""
    configs = init_swarm(tmp_path / "s", workers=1)
    _edit(configs["producer"], curve=True, curve_secret_key="")
    with pytest.raises(ConfigError, match="curve_secret_key"):
        make_codec(load(ProducerConfig, configs["producer"]))


def test_loopback_and_hwm_rules():
    assert is_loopback_endpoint("tcp://127.0.0.1:5555") and is_loopback_endpoint("tcp://[::1]:5555")
    assert is_loopback_endpoint("tcp://localhost:1") and is_loopback_endpoint("ipc:///run/ccsq.sock")
    for ep in ("tcp://*:5555", "tcp://0.0.0.0:5555", "tcp://10.0.0.5:5555", "tcp://eth0:5555", "tcp://gpu-broker:5555"):
        assert not is_loopback_endpoint(ep), ep
    # one connection queues at most ~16 MiB of full-size frames; never more than a turn's 256 frames
    assert rcvhwm_for(1 << 20) == (16 << 20) // ((1 << 20) + FRAME_SLACK_BYTES + 64) == 15
    assert rcvhwm_for(4096) == 256 and rcvhwm_for(1 << 30) == 4


def test_transport_socket_bounds_and_keygen_line(tmp_path):
    """The ROUTER gets the derived RCVHWM and MAXMSGSIZE; CURVE without an
    allow-list is a programming error; `ccsq keygen --curve` prints the
    curve_public_key line for authorized_keys.toml."""
    from ccsq.brokerd.transport import Transport

    t = Transport("tcp://127.0.0.1:0", None, sndhwm=10, max_frame_bytes=1 << 20)  # type: ignore[arg-type]
    try:
        assert t.sock.getsockopt(zmq.RCVHWM) == 15
        assert t.sock.getsockopt(zmq.MAXMSGSIZE) == (1 << 20) + FRAME_SLACK_BYTES
    finally:
        t.close()
    with pytest.raises(ValueError, match="curve_allow"):
        Transport("tcp://127.0.0.1:0", None, sndhwm=10, max_frame_bytes=1 << 20,  # type: ignore[arg-type]
                  curve_secret_key=zmq.curve_keypair()[1])
    out = subprocess.run([bin_path("ccsq"), "keygen", "--curve", "--out", str(tmp_path), "--id", "worker-9"],
                         capture_output=True, text=True, timeout=60)
    pub = (tmp_path / "worker-9.curve.pub").read_text().strip()
    assert out.returncode == 0 and f'curve_public_key = "{pub}"' in out.stdout
