"""Federation without processes: docs/federation.md lists every relayd.toml key, the gap
register documents every federation window the code counts."""

from pathlib import Path

from ccsq.brokerd import gaps
from ccsq.relayd.docs import BEGIN, END, markdown_reference

ROOT = Path(__file__).resolve().parent.parent


def test_relay_config_reference_is_current() -> None:
    text = (ROOT / "docs" / "federation.md").read_text()
    assert text.split(BEGIN, 1)[1].split(END, 1)[0].strip() == markdown_reference()


def test_federation_windows_are_documented() -> None:
    register = (ROOT / "docs" / "gap-register.md").read_text()
    for w in gaps.WINDOWS:
        if w.id.startswith("F"):
            assert f"| {w.id} |" in register, w.id


# --- small unit checks of federation pieces (no processes) ---------------------------
import dataclasses  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from ccsq.common import federation as fed  # noqa: E402
from ccsq.common import protocol as p  # noqa: E402
from ccsq.common.errors import ConfigError  # noqa: E402
from ccsq.relayd.config import load_relay_config  # noqa: E402


def test_new_protocol_fields_are_omitted_when_empty() -> None:
    """Version-1 peers reject unknown fields: the federation fields travel only to relays."""
    task = p.Task("i", 1, "ocr", p.Blob("0" * 64, 0, b""), {}, 1)
    assert "origin" not in p.encode_body(task) and "origin_sig" not in p.encode_body(task)
    res = p.TaskResult("i", 1, p.Blob("0" * 64, 0, b""), "h", "1")
    assert "proof" not in p.encode_body(res)
    signed = dataclasses.replace(task, origin=b"x", origin_sig=b"y")
    assert p.decode_body(p.MsgType.DISPATCH, p.encode_body(p.Dispatch([signed]))).tasks[0] == signed


@dataclasses.dataclass
class _W:
    peer_id: str
    credit: int
    kinds: tuple = ()
    healthy: bool = True  # the fields of brokerd.peers.Session that capacity() reads, nothing more


def test_capacity_is_free_worker_credit_minus_own_backlog() -> None:
    workers = [_W("w1", 2, ("ocr",)), _W("w2", 3), _W("w3", 5, ("ocr",), healthy=False), _W("w4", 4, ("ocr",))]
    states = {"ocr": {"ready": 3}, "echo": {"ready": 10}}
    # w3 unhealthy, w4 draining: 2 + 3 free for ocr, 3 of b's own ocr items wait -> 2
    assert fed.capacity(workers, {"w4"}, states, ("ocr", "echo")) == {"cap:ocr": 2, "cap:echo": 0,
                                                                      "workers:ocr": 2, "workers:echo": 1}
    assert fed.capacity([_W("w1", 0)], set(), {}, ("ocr",))["cap:ocr"] == 0  # all busy: nothing moves


def test_deadline_pressure_from_the_queue_forecast() -> None:
    forecast = [{"kind": "ocr", "verdict": "late", "nearest_deadline_ms": 5},
                {"kind": "echo", "verdict": "stalled", "nearest_deadline_ms": None},  # no deadline: no pressure
                {"kind": "asr", "verdict": "on track", "nearest_deadline_ms": 5}]
    assert fed.deadline_pressure(forecast, ("ocr", "echo", "asr", "none")) == {
        "late:ocr": 1, "late:echo": 0, "late:asr": 0, "late:none": 0}


def _relay_toml(tmp_path, **link) -> str:
    import tomli_w

    base = {"name": "a-to-b", "kinds": ["ocr"], "upstream_endpoint": "tcp://127.0.0.1:1",
            "downstream_endpoint": "tcp://127.0.0.1:2", "upstream_authorized_keys": "a.toml",
            "downstream_authorized_keys": "b.toml", **link}
    path = tmp_path / "relayd.toml"
    path.write_text(tomli_w.dumps({"peer_id": "relay", "private_key": "relay.key", "links": [base]}))
    return str(path)


@pytest.mark.parametrize("link,needle", [
    ({"kinds": []}, "kinds is required"),
    ({"kinds": [f"k{i}" for i in range(101)]}, "kinds must be"),
    ({"policy": "fastest"}, "policy"),
    ({"max_hops": 2}, "max_hops"),
    ({"downstream_endpoint": "tcp://127.0.0.1:1"}, "same broker"),
    ({"typo_key": 1}, "typo_key"),
])
def test_relay_config_refuses_bad_links(tmp_path, link, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_relay_config(_relay_toml(tmp_path, **link))


def test_relayd_exits_78_on_a_bad_config(tmp_path) -> None:
    cfg = _relay_toml(tmp_path, kinds=[])
    proc = subprocess.run([sys.executable, "-m", "ccsq.relayd.main", "--config", cfg], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 78 and "kinds is required" in proc.stderr


def test_init_relay_wires_two_swarms(tmp_path) -> None:
    """`ccsq init-relay --both-ways` on two `ccsq init` directories: trust files, swarm ids,
    relay peers authorized, and a relayd.toml that loads."""
    import tomllib

    from ccsq.common.federation import TrustedSwarms
    from ccsq.common.cli import main
    from ccsq.common.keys import parse_authorized_keys

    assert main(["init", str(tmp_path / "site-a"), "--endpoint", "tcp://127.0.0.1:5601", "--workers", "1"]) == 0
    assert main(["init", str(tmp_path / "site-b"), "--endpoint", "tcp://127.0.0.1:5602", "--workers", "1"]) == 0
    assert main(["init-relay", str(tmp_path / "relay"), "--upstream", str(tmp_path / "site-a"), "--downstream",
                 str(tmp_path / "site-b"), "--kinds", "ocr,echo", "--both-ways"]) == 0
    cfg = load_relay_config(tmp_path / "relay" / "relayd.toml")
    assert [(lk.name, lk.kinds) for lk in cfg.links] == [("site-a-to-site-b", ("ocr", "echo")),
                                                         ("site-b-to-site-a", ("ocr", "echo"))]
    for me, other in (("site-a", "site-b"), ("site-b", "site-a")):
        broker = tomllib.loads((tmp_path / me / "brokerd.toml").read_text())
        assert broker["swarm_id"] == me
        trust = TrustedSwarms(tmp_path / me / broker["trusted_swarms"])
        assert set(trust.keys) == {other}
        peers = parse_authorized_keys(tmp_path / me / "authorized_keys.toml")
        assert peers[f"relay-{me}-to-{other}-up"].role is p.Role.RELAY
        assert peers[f"relay-{other}-to-{me}-down"].role is p.Role.RELAY
    assert (tmp_path / "relay" / "keys" / "relay.key").stat().st_mode & 0o077 == 0


def test_a_delayed_hello_does_not_replace_a_newer_session() -> None:
    """A HELLO from a socket its peer gave up on (hello timeout) that reaches the broker
    after the peer's next session opened must not replace that live session."""
    from ccsq.common.envelope import ReplayGuard
    from ccsq.common.errors import AuthError

    guard = ReplayGuard()
    guard.check("relay-x", 2, 1, True, 2_000)
    guard.accept("relay-x", 2, 1, 2_000)  # the newer session opened first
    with pytest.raises(AuthError) as exc:
        guard.check("relay-x", 1, 1, True, 1_000)  # ... then the older HELLO arrives
    assert exc.value.code == p.REJECT_REPLAY
    guard.check("relay-x", 3, 1, True, 3_000)  # a genuinely newer session still may
