"""Untrusted input against the real ``ccsq-brokerd``: every rejection reason is
typed, counted (admin status and ``ccsq gap-report --json``), logged once per
peer per interval, and never half-applied; roles; authorized-keys reload on
SIGHUP; C09 at broker level with other peers watching; key-file permissions
for every daemon.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import msgpack
import pytest

from tests.broker_harness import BrokerProcess, ScriptedPeer, make_swarm, wait_for
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import ExitCode
from ccsq.common.wire.keys import write_keypair
from ccsq.tools.procs import bin_path

PEERS = {"prod": "producer", "prod2": "producer", "wA": "worker", "adm": "admin"}
LIMIT = 65536  # max_frame_bytes of these brokers


def blob(data: bytes) -> protocol.Blob:
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def item(key: str) -> protocol.SubmitItem:
    return protocol.SubmitItem(key, "echo", blob(key.encode()))


class Env:
    """One broker (max_frame_bytes = LIMIT) and scripted peers on it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = make_swarm(root, PEERS, max_frame_bytes=LIMIT)
        write_keypair(root / "keys", "intruder")  # a key pair that is NOT in authorized_keys
        self.broker = BrokerProcess(self.config).start()
        self.peers: list[ScriptedPeer] = []
        self.adm = self.peer("adm")
        self.adm.hello("admin")

    def peer(self, peer_id: str) -> ScriptedPeer:
        sp = ScriptedPeer(self.root, peer_id, self.broker.endpoint)
        self.peers.append(sp)
        return sp

    def rejects(self) -> dict[str, int]:
        """Refusals and reconnect noise (NO_SESSION, counted apart: issue 22, defect 8)."""
        st = self.adm.admin_status()
        return {**st["rejects"], **st["reconnect_noise"]}

    def expect_rejects(self, expected: dict[str, int]) -> dict[str, int]:
        return wait_for(lambda: (r := self.rejects()) == expected and r, 10, what=f"rejects == {expected}")

    def gap_report(self) -> dict:
        out = subprocess.run([bin_path("ccsq"), "gap-report", "--config", str(self.config), "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode in (0, 3), out.stderr
        return json.loads(out.stdout)

    def close(self) -> None:
        for sp in self.peers:
            sp.close()
        self.broker.kill()


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.close()


def signed(sp: ScriptedPeer, mtype: int, body: object, *, version: int = protocol.PROTOCOL_VERSION, seq: int = 1_000_000,
           ts_ms: int | None = None, sender: str | None = None) -> list[bytes]:
    """A frame with an arbitrary header, correctly signed by ``sp``'s key."""
    ts = int(time.time() * 1000) if ts_ms is None else ts_ms
    payload = msgpack.packb([version, mtype, sender or sp.peer_id, sp.codec.session, seq, ts, body], use_bin_type=True)
    return [payload, sp.codec._key.sign(payload)]


def submit_of_size(sp: ScriptedPeer, size: int) -> list[bytes]:
    """A properly signed SUBMIT whose frame 0 is exactly ``size`` bytes."""
    # padded over 8 items: each fits a DISPATCH (an item that fills a whole frame alone never
    # could, and is refused at SUBMIT: common/wire/frames.py)
    share = size // 8
    pad = share - 300
    for _ in range(10):
        items = [protocol.SubmitItem(f"pad{i}", "echo", blob(b"x"), params={"pad": "p" * (share - 300)}) for i in range(7)]
        frames = sp.codec.encode(protocol.Submit(1, [*items, protocol.SubmitItem("pad", "echo", blob(b"x"), params={"pad": "p" * pad})]))
        if len(frames[0]) == size:
            return frames
        pad += size - len(frames[0])
    raise AssertionError("could not hit the exact size")


def test_every_reject_reason_is_typed_counted_and_not_applied(env):
    """Each rejection reason against the real broker: counted per reason in admin
    status and in ``ccsq gap-report --json`` (``rejects``); an authenticated
    sender gets a typed ERROR, a stranger gets silence; a bound session that sends
    an invalid envelope is ended (the one disconnect rule); nothing is applied;
    20 bad frames from one peer log one line."""
    prod, wa = env.peer("prod"), env.peer("wA")
    stranger = env.peer("prod")  # prod's key, but this connection never opens a session
    prod.hello("producer")
    wa.hello("worker", slots=1, credit=0)
    expected: dict[str, int] = {}

    def bump(code: str, n: int = 1) -> None:
        expected[code] = expected.get(code, 0) + n
        env.expect_rejects(expected)

    # --- authenticated senders: typed ERROR, the bound session ends ---
    prod.send(protocol.Complete([protocol.TaskResult("x", 1, blob(b"r"), "echo", "1")]))  # a producer may not COMPLETE
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_ROLE
    bump(protocol.REJECT_ROLE)
    prod.send(protocol.Status(1, []))
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_NO_SESSION  # its session is gone (not a codec reject)
    wa.send(protocol.Submit(1, [item("from-a-worker")]))  # a worker may not SUBMIT
    assert wa.recv_type(protocol.Error).code == protocol.REJECT_ROLE
    bump(protocol.REJECT_ROLE)

    prod.connect()
    prod.hello("producer")
    prod.send_raw(submit_of_size(prod, LIMIT + 1))
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_OVERSIZE
    bump(protocol.REJECT_OVERSIZE)

    prod.connect()
    prod.hello("producer")
    prod.send_raw(wa.codec.encode(protocol.Heartbeat()))  # properly signed by wA, on prod's connection
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_FORGED_ORIGIN
    bump(protocol.REJECT_FORGED_ORIGIN)

    # --- authenticated but not acceptable, on an unbound connection: typed ERROR ---
    stranger.send_raw(signed(prod, 99, {}))
    assert stranger.recv_type(protocol.Error).code == protocol.REJECT_UNKNOWN_TYPE
    bump(protocol.REJECT_UNKNOWN_TYPE)
    stranger.send_raw(signed(prod, int(protocol.MsgType.STATUS), {"req": 1, "item_ids": []}, ts_ms=int(time.time() * 1000) - 600_000))
    assert stranger.recv_type(protocol.Error).code == protocol.REJECT_STALE
    bump(protocol.REJECT_STALE)
    prod.connect()
    hello = prod.codec.encode(protocol.Hello(role="producer"))
    prod.send_raw(hello)
    prod.recv_type(protocol.Welcome)
    stranger.send_raw(hello)  # a captured HELLO replayed from another connection
    assert stranger.recv_type(protocol.Error).code == protocol.REJECT_REPLAY
    bump(protocol.REJECT_REPLAY)
    prod.codec.new_session()
    prod.send(protocol.Status(1, []))  # a new session that does not open with HELLO
    assert prod.recv_type(protocol.Error).code == protocol.REJECT_NO_SESSION
    bump(protocol.REJECT_NO_SESSION)

    # --- unauthenticated: silence (no reflection), counted; a fresh HELLO from an unknown id
    # or with a bad signature gets one fixed refusal per id and interval (docs/security.md) ---
    stranger.send_raw([b"a", b"b", b"c"])
    bump(protocol.REJECT_FRAMING)
    stranger.send_raw([b"\xc1" * 10, b"s" * 64])  # 0xc1 is never valid msgpack
    bump(protocol.REJECT_MALFORMED)
    stranger.send_raw(signed(prod, int(protocol.MsgType.HELLO), {"role": "producer"}, version=2))
    bump(protocol.REJECT_VERSION)
    intruder = env.peer("intruder")
    intruder.send(protocol.Hello(role="producer"))
    bump(protocol.REJECT_UNKNOWN_SENDER)
    for i in range(20):
        payload, sig = signed(prod, int(protocol.MsgType.HELLO), {"role": "producer"}, seq=i + 1)
        stranger.send_raw([payload, bytes([sig[0] ^ 1]) + sig[1:]])
    bump(protocol.REJECT_BAD_SIGNATURE, 20)
    assert intruder.recv_type(protocol.Error).code == protocol.REJECT_UNKNOWN_SENDER
    assert stranger.recv_type(protocol.Error).code == protocol.REJECT_BAD_SIGNATURE  # one answer for 20 frames
    assert stranger.recv(0.2) is None and intruder.recv(0.01) is None

    assert set(expected) == set(protocol.ALL_REJECT_REASONS)
    st = env.adm.admin_status()
    assert st["counters"]["received"] == 0 and st["balanced"]  # nothing half-applied
    rep = wait_for(lambda: {**(r := env.gap_report())["rejects"], **r["reconnect_noise"]} == expected and r, 10,
                   what="rejects (and reconnect noise) in gap-report")
    assert protocol.REJECT_NO_SESSION not in rep["rejects"] and rep["reconnect_noise"][protocol.REJECT_NO_SESSION] >= 1
    assert rep["counters"]["received"] == 0
    lines = [e for e in env.broker.events("frame_rejected") if e["code"] == protocol.REJECT_BAD_SIGNATURE]
    assert len(lines) == 1  # one line per peer per interval, not 20
    reasons = [e["reason"] for e in env.broker.events("peer_disconnected")]
    for code in (protocol.REJECT_ROLE, protocol.REJECT_OVERSIZE, protocol.REJECT_FORGED_ORIGIN):
        assert f"invalid envelope: {code}" in reasons
    # the broker still serves the same peer on a fresh session
    prod.connect()
    prod.hello("producer")
    (r,) = prod.submit([item("after")])
    assert r.item_id and not r.error


def test_sighup_adds_and_removes_a_producer_key(env):
    """Authorized keys reload on SIGHUP without a restart: a new producer key can
    submit after SIGHUP; once removed and SIGHUPed, its next message is refused
    (UNKNOWN_SENDER, session ended) and a new HELLO is ignored; a broken file
    keeps the previous table in force."""
    ak = env.root / "authorized_keys.toml"
    original = ak.read_text()
    _priv, pub = write_keypair(env.root / "keys", "late")
    late = env.peer("late")
    late.send(protocol.Hello(role="producer"))
    env.expect_rejects({protocol.REJECT_UNKNOWN_SENDER: 1})
    ak.write_text(original + f'\n[peers.late]\nrole = "producer"\npublic_key = "{pub.read_text().strip()}"\n')
    env.broker.signal(signal.SIGHUP)
    wait_for(lambda: env.broker.events("authorized_keys_reloaded"), 5, what="reload")
    late.connect()
    late.hello("producer")
    (r,) = late.submit([item("late-1")])
    assert r.item_id and not r.error

    ak.write_text(original)
    env.broker.signal(signal.SIGHUP)
    wait_for(lambda: len(env.broker.events("authorized_keys_reloaded")) == 2, 5, what="second reload")
    late.send(protocol.Submit(2, [item("late-2")]))
    err = late.recv_type(protocol.Error)
    assert err.code == protocol.REJECT_UNKNOWN_SENDER
    late.connect()
    late.send(protocol.Hello(role="producer"))
    reply = late.recv(0.3)  # a removed peer is told once per 2 s at most (docs/security.md, Rejections)
    assert reply is None or (isinstance(reply.message, protocol.Error) and reply.message.code == protocol.REJECT_UNKNOWN_SENDER)
    env.expect_rejects({protocol.REJECT_UNKNOWN_SENDER: 3})

    prod = env.peer("prod")
    ak.write_text("this is = = not toml")
    env.broker.signal(signal.SIGHUP)
    wait_for(lambda: env.broker.events("authorized_keys_reload_failed"), 5, what="reload failure logged")
    prod.hello("producer")
    (r2,) = prod.submit([item("still-served")])
    assert r2.item_id and env.adm.admin_status()["counters"]["received"] == 2
    assert env.broker.proc.poll() is None


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_c09_hostile_flood_leaves_other_peers_unaffected(env):
    """C09 at broker level, beyond tests/test_broker.py (which checks one frame of
    each kind): 200 headers that claim a 4 GiB binary, 200 signed frames one byte
    over the limit and 10 frames of 4 MiB (dropped by ZeroMQ's MAXMSGSIZE, the
    connection is cut) from one authorized peer. Meanwhile a worker keeps getting
    the broker's heartbeats; afterwards another producer submits at once; RSS
    grows by at most a few MiB; every rejected frame is counted."""
    wa = env.peer("wA")
    wa.hello("worker", slots=1, credit=0)
    hostile = env.peer("prod")  # authorized, no session on this connection
    over = submit_of_size(hostile, LIMIT + 1)
    rss0 = _rss_kib(env.broker.proc.pid)
    t0 = time.monotonic()
    for i in range(200):
        hostile.send_raw([b"\x97\x01\x0a\xc6\xff\xff\xff\xff" + os.urandom(8), b"\0" * 64])
        hostile.send_raw(over)
    beats = 0
    for _ in range(10):
        hostile.send_raw([os.urandom(4 << 20), b"\0" * 64])
    while time.monotonic() - t0 < 2.0:  # the broker heartbeats every 0.25 s throughout
        env_ = wa.recv(1.0)  # (slack for a loaded 2-core CI machine; the silence window is 5 s)
        assert env_ is not None, "worker got no heartbeat for 1 s during the flood"
        beats += isinstance(env_.message, protocol.Heartbeat)
    assert beats >= 4
    prod2 = env.peer("prod2")
    t1 = time.monotonic()
    prod2.hello("producer")
    (r,) = prod2.submit([item("unaffected")])
    assert r.item_id and not r.error and time.monotonic() - t1 < 3.0
    got = env.expect_rejects({protocol.REJECT_MALFORMED: 200, protocol.REJECT_OVERSIZE: 200})
    assert got == {protocol.REJECT_MALFORMED: 200, protocol.REJECT_OVERSIZE: 200}
    assert _rss_kib(env.broker.proc.pid) - rss0 < 8 * 1024
    assert env.broker.proc.poll() is None


@pytest.mark.parametrize("daemon", ["workerd", "completion"])
def test_daemon_refuses_group_readable_key(tmp_path, daemon):
    """Every daemon refuses to start with a group/world-readable private key:
    exit 78 (CONFIG) and one line naming the file and the fix (the broker's case
    is in tests/test_broker.py::test_bad_config_exits_config)."""
    from ccsq.tools.init import init_swarm

    configs = init_swarm(tmp_path / "swarm", endpoint="tcp://127.0.0.1:9", workers=1)
    key = tmp_path / "swarm" / "keys" / ("worker-1.key" if daemon == "workerd" else "completion-1.key")
    assert (key.stat().st_mode & 0o777) == 0o600
    key.chmod(0o640)
    cmd = ([bin_path("ccsq-workerd"), "--config", str(configs["workerd-0"])] if daemon == "workerd"
           else [bin_path("ccsq"), "completion", "--config", str(configs["completion"])])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == ExitCode.CONFIG
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(key) in lines[0] and "chmod 600" in lines[0], out.stderr


def test_private_keys_are_written_0600_whatever_the_umask(tmp_path):
    """write_keypair creates the private key 0600 even under umask 000."""
    old = os.umask(0)
    try:
        priv, pub = write_keypair(tmp_path, "p")
    finally:
        os.umask(old)
    assert (priv.stat().st_mode & 0o777) == 0o600 and pub.exists()
