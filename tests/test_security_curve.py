"""Optional transport encryption with ZeroMQ CURVE, with real processes: the
broker is a CURVE server (``curve = true``), peers pin its public key; a plain
peer cannot talk to it; a peer with a wrong pinned key gets a clear
``curve_handshake_failed`` within seconds instead of hanging."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import tomli_w
import tomllib

from tests.broker_harness import ScriptedPeer
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import ConfigError, ExitCode
from ccsq.common.wire.keys import load_curve_public, load_curve_secret, write_curve_keypair
from ccsq.tools.procs import bin_path
from tests.swarm import Swarm

CURVE = {"curve": True}


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path / "swarm", workers=1, broker=CURVE, worker=CURVE, producer=CURVE, completion=CURVE)
    with s:
        yield s


def test_curve_swarm_works_and_plain_peer_is_shut_out(swarm):
    """curve = true on both sides: the producer library (BrokerLink, as every
    daemon uses) connects through CURVE, submits and reads the status back; a
    peer without CURVE (right Ed25519 key, no CURVE) never gets a WELCOME."""
    swarm.start_broker()
    with swarm.client() as client:
        receipt = client.submit(b"hello over curve", "echo")
        assert receipt.item_id and client.status([receipt.item_id])[receipt.item_id].state == "ready"
    plain = ScriptedPeer(swarm.root, "producer-1", swarm.endpoint)
    try:
        plain.send(protocol.Hello(role="producer"))
        assert plain.recv(1.0) is None
    finally:
        plain.close()


def test_wrong_pinned_key_fails_fast_with_a_clear_message(swarm, tmp_path):
    """A producer pinning the wrong broker key is told so within seconds (the link's
    monitor events, not the hello timeout) and never connects: ``ccsq submit`` prints one
    sentence naming ``broker_curve_public_key`` and exits 78 (config), with no JSON log
    line of the link beside it."""
    swarm.start_broker()
    _sec, wrong_pub = write_curve_keypair(tmp_path / "other", "impostor")
    cfg = tomllib.loads(swarm.configs["producer"].read_text())
    cfg.update(broker_curve_public_key=str(wrong_pub), hello_timeout_s=30.0, submit_timeout_s=30.0, log_format="json")
    bad = swarm.root / "producer-wrong-key.toml"
    bad.write_text(tomli_w.dumps(cfg))
    doc = swarm.root / "doc.txt"
    doc.write_text("x")
    t0 = time.monotonic()
    out = subprocess.run([bin_path("ccsq"), "submit", "--config", str(bad), "--kind", "echo", str(doc)],
                         capture_output=True, text=True, timeout=60)
    elapsed_s = time.monotonic() - t0
    said = out.stdout + out.stderr
    assert out.returncode == ExitCode.CONFIG, said
    assert elapsed_s < 5.0, f"took {elapsed_s:.1f}s: {said}"
    assert "broker_curve_public_key" in said and "curve_handshake_failed" not in said, said


@pytest.mark.parametrize("problem", ["missing", "mode"])
def test_broker_curve_key_problems_exit_config(swarm, problem):
    """curve = true with a missing or group-readable secret key: exit 78 and one line."""
    sec = swarm.root / "keys" / "broker.curve.key"
    if problem == "missing":
        sec.unlink()
    else:
        sec.chmod(0o640)
    out = subprocess.run([bin_path("ccsq-brokerd"), "--config", str(swarm.configs["brokerd"])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == ExitCode.CONFIG
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "CURVE secret key" in lines[0]


def test_curve_key_files(tmp_path: Path):
    """Secret written 0600, never overwritten; loaders validate Z85 and permissions."""
    sec, pub = write_curve_keypair(tmp_path, "b")
    assert (sec.stat().st_mode & 0o777) == 0o600
    assert len(load_curve_secret(sec)) == 40 and len(load_curve_public(pub)) == 40
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        write_curve_keypair(tmp_path, "b")
    pub.write_text("not-a-key\n")
    with pytest.raises(ConfigError, match="Z85"):
        load_curve_public(pub)
