"""Federation without processes: docs/federation.md lists every relayd.toml key and says
what every counter of both swarms' gap reports and of the federation report means, the gap
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


def test_every_counter_is_explained() -> None:
    """Each counter of ``ccsq gap-report`` (both swarms) and of ``ccsq federation report``
    has its row in docs/federation.md's "What each counter means" (issue 22)."""
    from ccsq.brokerd.ledger.schema import COUNTERS as SWARM
    from ccsq.relayd.relay_journal import COUNTERS as LINK

    text = (ROOT / "docs" / "federation.md").read_text()
    section = text.split("What each counter means.", 1)[1].split("\n### ", 1)[0]
    swarm, link = section.split("The link's (`ccsq federation report`", 1)

    def rows(part: str) -> set[str]:  # the names in a table's first column ("`a` / `b`": both)
        return {c for line in part.splitlines() if line.startswith("| `")
                for c in line.split(" | ", 1)[0].strip("| ").replace("`", "").split(" / ")}

    assert set(SWARM) | {"rejects", "reconnect_noise"} <= rows(swarm), set(SWARM) - rows(swarm)
    assert set(LINK) <= rows(link), set(LINK) - rows(link)


# --- small unit checks of federation pieces (no processes) ---------------------------
import dataclasses  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from ccsq.brokerd.relaying import capacity, deadline_pressure  # noqa: E402
from ccsq.common.wire import federation as fed  # noqa: E402
from ccsq.common.wire import protocol  # noqa: E402
from ccsq.common.wire.errors import ConfigError  # noqa: E402
from ccsq.relayd.config import load_relay_config  # noqa: E402


def test_new_protocol_fields_are_omitted_when_empty() -> None:
    """Version-1 peers reject unknown fields: the federation fields travel only to relays."""
    task = protocol.Task("i", 1, "ocr", protocol.Blob("0" * 64, 0, b""), {}, 1)
    assert "origin" not in protocol.encode_body(task) and "origin_sig" not in protocol.encode_body(task)
    res = protocol.TaskResult("i", 1, protocol.Blob("0" * 64, 0, b""), "h", "1")
    assert "proof" not in protocol.encode_body(res)
    signed = dataclasses.replace(task, origin=b"x", origin_sig=b"y")
    assert protocol.decode_body(protocol.MsgType.DISPATCH, protocol.encode_body(protocol.Dispatch([signed]))).tasks[0] == signed


@dataclasses.dataclass
class _W:
    peer_id: str
    credit: int
    kinds: tuple = ()
    healthy: bool = True  # only the fields a broker Session has: no method that could stand in for a missing one


def test_capacity_is_free_worker_credit_minus_own_backlog() -> None:
    workers = [_W("w1", 2, ("ocr",)), _W("w2", 3), _W("w3", 5, ("ocr",), healthy=False), _W("w4", 4, ("ocr",))]
    states = {"ocr": {"ready": 3}, "echo": {"ready": 10}}
    # w3 unhealthy, w4 draining: 2 + 3 free for ocr, 3 of b's own ocr items wait -> 2
    assert capacity(workers, {"w4"}, states, ("ocr", "echo")) == {"cap:ocr": 2, "cap:echo": 0,
                                                                  "workers:ocr": 2, "workers:echo": 1}
    assert capacity([_W("w1", 0)], set(), {}, ("ocr",))["cap:ocr"] == 0  # all busy: nothing moves


def test_deadline_pressure_from_the_queue_forecast() -> None:
    forecast = [{"kind": "ocr", "verdict": "late", "nearest_deadline_ms": 5},
                {"kind": "echo", "verdict": "stalled", "nearest_deadline_ms": None},  # no deadline: no pressure
                {"kind": "asr", "verdict": "on track", "nearest_deadline_ms": 5}]
    assert deadline_pressure(forecast, ("ocr", "echo", "asr", "none")) == {
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

    from ccsq.common.wire.federation import TrustedSwarms
    from ccsq.tools.cli import main
    from ccsq.common.wire.keys import parse_authorized_keys

    assert main(["init", str(tmp_path / "site-a"), "--endpoint", "tcp://127.0.0.1:5601", "--workers", "1",
                 "--swarm-id", "site-a"]) == 0
    assert main(["init", str(tmp_path / "site-b"), "--endpoint", "tcp://127.0.0.1:5602", "--workers", "1",
                 "--swarm-id", "site-b"]) == 0
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
        assert peers[f"relay-{me}-to-{other}-up"].role is protocol.Role.RELAY
        assert peers[f"relay-{other}-to-{me}-down"].role is protocol.Role.RELAY
    assert (tmp_path / "relay" / "keys" / "relay.key").stat().st_mode & 0o077 == 0


def test_relayd_exits_78_on_a_journal_row_that_does_not_decode(tmp_path) -> None:
    """A corrupt relay journal is permanent, as the worker's is (errors.JournalCorrupt): exit 78,
    which the unit does not restart, naming the row (it exited 1 before, a restart loop)."""
    import sqlite3

    from ccsq.tools.cli import main
    from ccsq.relayd.relay_journal import RelayJournal

    for site, port in (("site-a", 5611), ("site-b", 5612)):
        assert main(["init", str(tmp_path / site), "--endpoint", f"tcp://127.0.0.1:{port}", "--workers", "1",
                     "--swarm-id", site]) == 0
    assert main(["init-relay", str(tmp_path / "relay"), "--upstream", str(tmp_path / "site-a"), "--downstream",
                 str(tmp_path / "site-b"), "--kinds", "echo"]) == 0
    cfg_path = tmp_path / "relay" / "relayd.toml"
    journal_dir = Path(load_relay_config(cfg_path).journal_dir)
    RelayJournal.open(journal_dir).close()  # the schema
    with sqlite3.connect(journal_dir / "relay.sqlite3") as db:
        db.execute("INSERT INTO relayed (link, up_item, token, kind, state, task, updated_ts) VALUES (?, ?, 1, ?, ?, ?, 0)",
                   ("site-a-to-site-b", "item-1", "echo", "leased", b"\xc1 not msgpack"))
    db.close()
    proc = subprocess.run([sys.executable, "-m", "ccsq.relayd.main", "--config", str(cfg_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 78, proc.stderr
    assert "row (site-a-to-site-b, item-1, 1) does not decode" in proc.stderr


def test_init_relay_refuses_a_link_from_a_swarm_to_itself(tmp_path, capsys) -> None:
    """A link whose two ends share a swarm_id is a config error (exit 78) naming both
    directories, not a crash of the check itself."""
    from ccsq.tools.cli import main

    assert main(["init", str(tmp_path / "site-a"), "--endpoint", "tcp://127.0.0.1:5601", "--workers", "1"]) == 0
    code = main(["init-relay", str(tmp_path / "relay"), "--upstream", str(tmp_path / "site-a"), "--downstream",
                 str(tmp_path / "site-a"), "--kinds", "echo"])
    err = capsys.readouterr().err
    assert code == 78 and "are the same swarm directory" in err and str((tmp_path / "site-a").resolve()) in err


def test_a_delayed_hello_does_not_replace_a_newer_session() -> None:
    """A HELLO from a socket its peer gave up on (hello timeout) that reaches the broker
    after the peer's next session opened must not replace that live session."""
    from ccsq.common.wire.envelope import ReplayGuard
    from ccsq.common.wire.errors import AuthError

    guard = ReplayGuard()
    guard.check("relay-x", 2, 1, True, 2_000)
    guard.accept("relay-x", 2, 1, 2_000)  # the newer session opened first
    with pytest.raises(AuthError) as exc:
        guard.check("relay-x", 1, 1, True, 1_000)  # ... then the older HELLO arrives
    assert exc.value.code == protocol.REJECT_REPLAY
    guard.check("relay-x", 3, 1, True, 3_000)  # a genuinely newer session still may


def test_relay_metrics_read_the_journal_books_at_scrape_time(tmp_path) -> None:
    """relayd.toml metrics_listen: a real Relay over a real journal serves the link's books
    over HTTP (the same figures as `ccsq federation report`), its credit and sessions,
    the journal commit histogram and ccsq_build_info{process="relayd"}; bad syntax is refused."""
    import hashlib
    import tomllib
    import urllib.request

    import tomli_w
    from prometheus_client.parser import text_string_to_metric_families

    from ccsq.tools.cli import main
    from ccsq.relayd.relay_journal import RelayJournal
    from ccsq.relayd.relay_metrics import start_relay_metrics
    from ccsq.relayd.relay import Relay
    from ccsq.relayd.federation_report import load_federation_report

    assert main(["init", str(tmp_path / "a"), "--endpoint", "tcp://127.0.0.1:5611", "--workers", "1"]) == 0
    assert main(["init", str(tmp_path / "b"), "--endpoint", "tcp://127.0.0.1:5612", "--workers", "1"]) == 0
    assert main(["init-relay", str(tmp_path / "relay"), "--upstream", str(tmp_path / "a"), "--downstream",
                 str(tmp_path / "b"), "--kinds", "ocr"]) == 0
    path = tmp_path / "relay" / "relayd.toml"
    raw = tomllib.loads(path.read_text())
    for bad in ("9464x", "0.0.0.0:", "0.0.0.0:70000"):
        path.write_text(tomli_w.dumps({**raw, "metrics_listen": bad}))
        with pytest.raises(ConfigError, match="metrics_listen"):
            load_relay_config(path)
    path.write_text(tomli_w.dumps({**raw, "metrics_listen": "127.0.0.1:0"}))
    cfg = load_relay_config(path)
    journal = RelayJournal.open(cfg.journal_dir)
    relay = Relay(cfg, journal)
    server = start_relay_metrics(relay, cfg.metrics_listen, where="relayd.toml: metrics_listen")
    try:
        link = cfg.links[0].name
        blob = protocol.Blob(sha256=hashlib.sha256(b"x").hexdigest(), size=1, inline=b"x")
        tasks = [protocol.Task(f"it-{i}", 1, "ocr", blob, {}, 1) for i in range(5)]
        journal.insert_leased(link, tasks)
        journal.mark_submitted(link, "it-0", "down-0", False)
        journal.mark_failing(link, [protocol.TaskFailure("it-1", 1, protocol.FailReason.RELEASED.value, True)], "forged_rejected")
        journal.end(link, [("it-1", 1)], "ended_failed")
        relay.links[0].granted, relay.links[0].received = 7, 5

        def scrape() -> dict[tuple[str, tuple], float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples}

        m = scrape()
        counters = load_federation_report(path)["links"][0]["counters"]
        assert counters["leased"] == 5 and counters["forged_rejected"] == 1
        for event, n in counters.items():
            assert m[("ccsq_relay_items_total", (("event", event), ("link", link)))] == n, event
        assert m[("ccsq_relay_in_flight", (("link", link), ("state", "leased")))] == 3
        assert m[("ccsq_relay_in_flight", (("link", link), ("state", "submitted")))] == 1
        assert m[("ccsq_relay_balanced", (("link", link),))] == 1
        assert m[("ccsq_relay_upstream_credit", (("link", link),))] == 2
        assert m[("ccsq_relay_connected", (("link", link), ("side", "upstream")))] == 0
        assert m[("ccsq_relay_journal_commit_seconds_count", ())] == 4  # one per transaction above
        assert any(k[0] == "ccsq_build_info" and ("process", "relayd") in k[1] for k in m)
    finally:
        server.shutdown()
        journal.close()


# --- the link's state machine, driven directly (real journal, scripted brokers) ---------
def _scripted_link(tmp_path: Path):
    """A LinkRunner over a real relay journal whose two broker sessions are READY and
    record what the relay sends (the scripted upstream and downstream brokers)."""
    from ccsq.common.link.peer import LinkState
    from ccsq.relayd.relay_journal import RelayJournal
    from ccsq.relayd.relay import LinkRunner
    from tests.fedswarm import FedPair

    pair = FedPair(tmp_path)
    rcfg = load_relay_config(pair.relay_cfg)
    journal = RelayJournal.open(tmp_path / "journal")
    runner = LinkRunner(rcfg, rcfg.links[0], journal)
    sent: dict[str, list] = {"up": [], "down": []}
    for side, link in (("up", runner.up), ("down", runner.down)):
        link.state = LinkState.READY
        link.send = lambda msg, side=side: sent[side].append(msg) or True
    return runner, journal, sent


def _task(token: int) -> protocol.Task:
    import msgpack

    origin = msgpack.packb({"swarm": "a", "item_id": "item-1", "priority": 0, "max_attempts": 3})
    return protocol.Task("item-1", token, "echo", protocol.Blob("0" * 64, 2, b"hi"), {}, 1, origin=origin, origin_sig=b"s" * 64)


def test_upstream_leases_again_while_the_result_waits_for_ack(tmp_path: Path) -> None:
    """The upstream leases an item again (its first lease expired) while the relay still
    holds the downstream's result under the first token: the downstream answers the new
    SUBMIT as a dedup hit and never delivers the result a second time, so the relay must
    report the result it has under the new token, not wait for it (and extend the lease)
    forever. Seen as a CI flake: an item stuck between two swarms."""
    import asyncio

    runner, journal, sent = _scripted_link(tmp_path)
    asyncio.run(runner._on_dispatch([_task(1)]))
    submit = sent["down"][-1]
    assert isinstance(submit, protocol.Submit) and len(submit.items) == 1
    key = submit.items[0].key
    runner._on_submit_ack([protocol.SubmitResult(key, "down-1")])
    result = protocol.Blob("1" * 64, 2, b"ok")
    asyncio.run(runner._on_result([protocol.Delivery("down-1", key, "echo", result, {}, 1, "echo", "1", 0.0,
                                              proof=b"proof", proof_sig=b"sig")]))
    first = [m for m in sent["up"] if isinstance(m, protocol.Complete)]
    assert first and first[-1].results[0].token == 1
    # the upstream re-leases (token 2) before the first COMPLETE is confirmed
    asyncio.run(runner._on_dispatch([_task(2)]))
    runner._on_submit_ack([protocol.SubmitResult(key, "down-1", duplicate=True)])
    completes = [r for m in sent["up"] if isinstance(m, protocol.Complete) for r in m.results]
    assert [r.token for r in completes] == [1, 2], completes
    assert completes[1].result == result and completes[1].proof == b"proof"
    # the upstream fences token 1 and accepts token 2: the downstream item is ACKed once
    runner._on_complete_ack([protocol.ItemOutcome("item-1", 1, protocol.Outcome.FENCED.value),
                             protocol.ItemOutcome("item-1", 2, protocol.Outcome.ACCEPTED.value)])
    acks = [m for m in sent["down"] if isinstance(m, protocol.Ack)]
    assert acks and acks[-1].item_ids == ["down-1"]
    runner._on_ack_ok({"down-1"})
    assert runner.rows == {}
    c = journal.counters(runner.name)
    assert c["leased"] == 2 and c["ended_acked"] == 2 and c["returned"] == 1 and c["fenced"] == 1, c
    journal.close()


def test_leases_arriving_after_the_link_broke_go_straight_back(tmp_path: Path) -> None:
    """Once the upstream has refused the downstream's proofs, leases still arriving on
    credit granted earlier are released at once (uncounted), never submitted downstream."""
    import asyncio

    runner, journal, sent = _scripted_link(tmp_path)
    runner.broken = "upstream rejected the downstream's result proofs"
    asyncio.run(runner._on_dispatch([_task(5)]))
    assert not any(isinstance(m, protocol.Submit) for m in sent["down"])
    fails = [f for m in sent["up"] if isinstance(m, protocol.Fail) for f in m.failures]
    assert [(f.token, f.reason) for f in fails] == [(5, protocol.FailReason.RELEASED.value)]
    journal.close()


def test_an_item_the_upstream_accepts_passes_the_downstreams_origin_check(tmp_path) -> None:
    """An item whose params the upstream's SUBMIT admits (it fits a DISPATCH to a relay,
    origin record included) must pass the downstream's origin check: a record cap below
    the frame budget made the downstream refuse it as forged (ORIGIN_REJECTED) and the
    relay then stop pulling on the whole link, stranding every item behind it (tester)."""
    import base64
    import hashlib

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ccsq.brokerd.outbound import dispatch_refusal
    from ccsq.common.wire.frames import FrameBudget

    key = Ed25519PrivateKey.generate()
    pub = base64.b64encode(key.public_key().public_bytes_raw()).decode()
    (tmp_path / "trusted_swarms.toml").write_text(f'[swarms.site-a]\npublic_key = "{pub}"\n')
    trust = fed.TrustedSwarms(tmp_path / "trusted_swarms.toml")
    inline = b"x" * 16384
    payload = protocol.Blob(hashlib.sha256(inline).hexdigest(), len(inline), inline)
    for n in (70_000, 300_000, 500_000):
        params = {"big": "p" * n}
        sub = protocol.SubmitItem(key="k", kind="echo", payload=payload, params=params)
        assert dispatch_refusal(sub, FrameBudget(1 << 20), id_len=20, swarm_id="site-a", relayed=False, federated=True) == ""
        item_id = "db05330d0000000000c9"
        rec = {"id": item_id, "kind": "echo", "params": params, "deadline_ms": None, "priority": 0, "max_runtime_s": 0.0}
        origin = fed.origin_record("site-a", rec, payload, 5)
        relayed = dataclasses.replace(sub, key=fed.origin_key("site-a", item_id), max_attempts=5,
                                      origin=origin, origin_sig=key.sign(origin))
        assert fed.check_origin(relayed, trust, "site-b") == ({"swarm": "site-a", "item_id": item_id, "hops": 1}, ""), n
