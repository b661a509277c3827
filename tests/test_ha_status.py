"""The status document's ``"ha"`` section (HA-CONTRACT: role, epoch, node, mode, confirming,
held replies, each standby's lag in turns/bytes/seconds) in ``ccsq status``, the console's
overview and ``ccsq gap-report``; nothing when it is absent or the broker is single (the
one-broker screens unchanged). ``ccsq failover`` against a single broker says it needs a pair.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import tomli_w

from ccsq.common.wire.config import AdminConfig, load
from ccsq.common.wire.errors import ExitCode
from ccsq.tools import cli
from ccsq.tools.admin_cmds import ha_lines, render_status

#: A primary's ``ha`` section as the contract specifies it (haprim's admin + harepl's server.status()).
PRIMARY = {
    "role": "primary", "epoch": 7, "node": "broker-1", "mode": "sync", "sync_standbys": 1, "confirming": True,
    "etcd": "http://10.0.0.5:2379,http://10.0.0.6:2379", "held_replies": 3,
    "standbys": [
        {"node": "broker-2", "seq": 1200, "lag_turns": 4, "lag_bytes": 3 << 20, "lag_s": 0.25, "in_sync": True, "copying": False},
        {"node": "broker-3", "seq": 10, "lag_turns": 1194, "lag_bytes": 900, "lag_s": 41.0, "in_sync": False, "copying": True},
    ],
    "durable_seq": 1200, "last_seq": 1204, "waiting": "", "sync_members": ["broker-2"], "degraded_count": 0, "failover": "",
}

STATUS = {"source": "broker", "ledger_id": "L1", "epoch": 7, "balanced": True, "oldest_ready_age_s": None, "dead": 0,
          "peers": [], "states": {"ready": 0}, "backlog": {}}


def test_ha_lines_name_primary_epoch_mode_and_each_standbys_lag() -> None:
    lines = ha_lines(PRIMARY)
    text = "\n".join(lines)
    assert lines[0].startswith("ha: primary broker-1, epoch 7, sync (1 standby must acknowledge each turn), confirming")
    assert "held replies 3" in lines[0] and "etcd http://10.0.0.5:2379,http://10.0.0.6:2379" in lines[0]
    assert "ha: standby broker-2: seq 1200, lag 4 turns / 3.0 MiB / 0.2 s, in sync" in text
    assert "ha: standby broker-3: seq 10, lag 1194 turns / 900 B / 41.0 s, copying" in text
    assert "ha: last turn 1204, durable (acknowledged) 1200" in text
    assert "ha: sync set in etcd: broker-2 (only these may take over)" in text and "planned failover" not in text
    stopped = ha_lines({**PRIMARY, "confirming": False, "standbys": [], "waiting": "etcd lease not renewed within the margin"})
    assert "NOT CONFIRMING (replies are held: etcd lease not renewed within the margin)" in stopped[0]
    assert any("no standby connected (sync mode: nothing is confirmed until one acknowledges)" in ln for ln in stopped)
    assert "async (turns not yet shipped are lost on failover)" in ha_lines({**PRIMARY, "mode": "async"})[0]
    degraded = ha_lines({**PRIMARY, "mode": "degraded", "sync_members": [], "degraded_count": 2, "failover": "in progress"})
    assert "DEGRADED: sync, confirming without a standby" in degraded[0]
    assert "ha: planned failover in progress" in degraded
    assert "ha: sync set in etcd: none (only these may take over); degraded 2 time(s)" in degraded


@pytest.mark.parametrize("ha", [None, {}, {"role": "single", "epoch": 3}])
def test_no_ha_section_or_a_single_broker_shows_nothing(ha) -> None:
    assert ha_lines(ha) == []
    doc = dict(STATUS) if ha is None else {**STATUS, "ha": ha}
    assert render_status(doc) == render_status(STATUS)
    assert "ha:" not in render_status(doc)


def test_status_screen_shows_the_ha_lines_before_the_peers() -> None:
    screen = render_status({**STATUS, "ha": PRIMARY})
    assert "ha: primary broker-1, epoch 7" in screen and "ha: standby broker-2" in screen
    assert screen.index("ha: primary") < screen.index("peers")


def test_console_overview_shows_the_ha_section_only_when_present(tmp_path: Path) -> None:
    from ccsq.console.app import Auth, Console, Viewer
    from ccsq.console.data import Source

    (tmp_path / "admin.toml").write_text('peer_id = "admin"\nprivate_key = "k"\n')
    console = Console(Source(load(AdminConfig, tmp_path / "admin.toml")), Auth([]))
    viewer = Viewer("local", "admin", csrf="c")
    states = dict.fromkeys(("ready", "leased", "completed", "acknowledged", "dead", "expired"), 0)
    status = {**STATUS, "counters": {"received": 0}, "states": states,
              "dead_listed": 0}

    def render(**ctx) -> str:
        return console.env.get_template("overview.html").render(viewer=viewer, flash=[], path="/", refresh_s=0, now="", status=status,
                                                                queues=[], more={}, **ctx)

    try:
        assert 'id="ha"' not in render(ha_lines=[])
        page = render(ha_lines=ha_lines(PRIMARY))
        assert 'id="ha"' in page and "High availability" in page and "ha: standby broker-2: seq 1200" in page
    finally:
        console.source.close()


def _ledger_dir(tmp_path: Path, ha: bool) -> Path:
    """A swarm directory with an empty ledger; brokerd.toml of a pair member when ``ha``."""
    from ccsq.brokerd.ledger.store import Ledger, data_paths
    from ccsq.tools.init import init_swarm

    d = tmp_path / ("pair" if ha else "single")
    kw = {"standbys": ["127.0.0.1:1"], "etcd": "http://127.0.0.1:1"} if ha else {}
    # endpoints where nothing listens (port 9: discard): the admin gets no answer quickly
    init_swarm(d, endpoint="tcp://127.0.0.1:9", swarm_id="s1", **kw)
    admin = tomllib.loads((d / "admin.toml").read_text())
    admin.update({"connect_timeout_s": 0.3, "hello_timeout_s": 0.3})
    (d / "admin.toml").write_text(tomli_w.dumps(admin))
    Ledger(data_paths(d / "broker-data")[0]).close()
    return d


def test_gap_report_of_a_pair_says_whether_a_primary_answered_and_a_single_broker_is_unchanged(tmp_path: Path, capsys) -> None:
    single = _ledger_dir(tmp_path, ha=False)
    assert cli.main(["gap-report", "--config", str(single / "brokerd.toml"), "--json"]) == ExitCode.OK
    assert "ha" not in json.loads(capsys.readouterr().out)
    assert cli.main(["gap-report", "--config", str(single / "brokerd.toml")]) == ExitCode.OK
    assert "ha:" not in capsys.readouterr().out
    pair = _ledger_dir(tmp_path, ha=True)
    assert cli.main(["gap-report", "--config", str(pair / "brokerd.toml"), "--json"]) == ExitCode.OK
    rep = json.loads(capsys.readouterr().out)
    assert "no broker answered as primary" in rep["ha"]["unavailable"]
    assert cli.main(["gap-report", "--config", str(pair / "brokerd.toml")]) == ExitCode.OK
    assert capsys.readouterr().out.startswith("ha: no broker answered as primary")


def test_gap_report_renders_the_primarys_ha_section(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The text report leads with the same lines as ``ccsq status`` (the section as the broker answers it)."""
    from ccsq.tools import ledger_cmds

    pair = _ledger_dir(tmp_path, ha=True)
    monkeypatch.setattr(ledger_cmds, "_ha_status", lambda admin_path: PRIMARY)
    assert cli.main(["gap-report", "--config", str(pair / "brokerd.toml")]) == ExitCode.OK
    out = capsys.readouterr().out
    assert out.startswith("ha: primary broker-1, epoch 7") and "ha: standby broker-3" in out


def test_failover_against_a_single_broker_exits_78_saying_it_needs_a_pair(tmp_path: Path, capsys) -> None:
    from tests.swarm import Swarm

    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        rc = cli.main(["failover", "--config", str(swarm.configs["admin"]), "--timeout-s", "5"])
        err = capsys.readouterr().err
        assert rc == ExitCode.CONFIG, err
        assert "single broker" in err and "ccsq init --standby" in err


def test_failover_help_names_its_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["failover", "--help"])
    out = capsys.readouterr().out
    assert "--to NODE" in out and "--timeout-s" in out


def _scripted_pair(tmp_path: Path):
    """A scripted broker answering ``status`` and ``failover`` as a primary would (tests/scripted_broker.py)."""
    from ccsq.tools.procs import free_tcp_port
    from tests.scripted_broker import ScriptedBroker, make_pki, write_config

    make_pki(tmp_path, {"broker": "broker", "admin": "admin"})
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    admin = write_config(tmp_path, "admin", "admin", endpoint, connect_timeout_s=3.0)
    return ScriptedBroker(tmp_path, endpoint), admin


@pytest.mark.parametrize("outcome", ["done", "refused", "no_new_primary"])
def test_failover_sends_the_command_and_waits_for_a_primary_with_a_higher_epoch(tmp_path: Path, capsys, outcome: str) -> None:
    broker, admin = _scripted_pair(tmp_path)
    state = {"ha": {"role": "primary", "epoch": 7, "node": "broker-1", "mode": "sync", "confirming": True, "standbys": []}}

    def answer(command: str, args: dict):
        if command == "status":
            return True, {"source": "broker", "ha": state["ha"]}
        if command == "failover":
            if outcome == "refused":
                return False, "failover: no standby of the sync set ['broker-2'] acknowledged seq 10 in time: nothing changed"
            if outcome == "done":
                state["ha"] = {**state["ha"], "epoch": 8, "node": "broker-2"}  # the standby took over
            return True, {"ok": True, "epoch": 7, "standby": "broker-2", "seq": 10}
        return False, f"unknown command {command}"

    broker.admin = answer
    with broker:
        rc = cli.main(["failover", "--config", str(admin), "--to", "broker-2", "--timeout-s", "2"])
        out, err = capsys.readouterr()
        calls = list(broker.admin_calls)
    assert ("failover", {"timeout_s": 2.0, "to": "broker-2"}) in calls
    if outcome == "done":
        assert rc == ExitCode.OK, err
        assert "failover done: broker-2 is primary at epoch 8 (was broker-1 at epoch 7, now a standby; it handed over at seq 10)" in out
    elif outcome == "refused":
        assert rc == ExitCode.REFUSED, err
        assert "no standby of the sync set" in err and "nothing changed" in err
    else:
        assert rc == ExitCode.INCOMPLETE, err
        assert "no broker answered as primary with a higher epoch within 2 s" in out
