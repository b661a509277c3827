"""A command line (and library) that helps: refused peers learn why within seconds,
a down broker is named at once, exit codes and messages say what happened
(issue 16, "A command line that helps"). Real broker, real worker processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import msgpack
import pytest
import zmq

from ccsq.tools import admin_cmds, cli
from ccsq.common.wire import protocol
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import ExitCode, Unauthorized
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, write_keypair
from ccsq.tools.procs import bin_path
from tests.swarm import Swarm, wait_until

pytestmark = pytest.mark.timeout(120)

REFUSAL_S = 5.0  # the bound: a refused peer gets a distinct error within this


def run_ccsq(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def peer_config(swarm: Swarm, base: str, name: str, **changes) -> Path:
    """A copy of ``base``.toml with some keys changed (a peer the broker should refuse)."""
    text = swarm.configs[base].read_text()
    lines = [ln for ln in text.splitlines() if ln.split("=")[0].strip() not in changes]
    lines += [f"{k} = {json.dumps(v)}" for k, v in changes.items()]
    path = swarm.root / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_refused_peers_learn_why_and_the_broker_counts_them(tmp_path: Path, capsys) -> None:
    """Unknown id, wrong key and wrong role: workers exit 77 (not restarted by systemd),
    the library raises Unauthorized and the CLI exits 77 naming the fix, each within
    5 s; the broker counts and logs every kind."""
    with Swarm(tmp_path, workers=1, producer={"hello_timeout_s": 5.0}) as swarm:
        swarm.start_broker()
        keys = tmp_path / "keys"
        write_keypair(keys, "stranger")  # a key pair the broker's authorized_keys does not list
        write_keypair(keys, "impostor")
        unknown_worker = peer_config(swarm, "workerd-0", "w-unknown", peer_id="stranger", private_key="keys/stranger.key",
                                     journal_dir="j-unknown")
        wrong_key = peer_config(swarm, "workerd-0", "w-badkey", private_key="keys/impostor.key", journal_dir="j-badkey")
        wrong_role = peer_config(swarm, "workerd-0", "w-role", peer_id="producer-1", private_key="keys/producer-1.key",
                                 journal_dir="j-role")
        stranger_completion = peer_config(swarm, "completion", "c-unknown", peer_id="stranger-c",
                                          private_key="keys/stranger.key", database="sqlite:///stranger.db")
        workers = {}
        for name, path in (("unknown", unknown_worker), ("badkey", wrong_key), ("role", wrong_role)):
            workers[name] = subprocess.Popen([bin_path("ccsq-workerd"), "--config", str(path)], stdout=subprocess.DEVNULL,
                                             stderr=subprocess.PIPE, text=True)
        workers["completion"] = subprocess.Popen([bin_path("ccsq"), "completion", "--config", str(stranger_completion)],
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        # the library: Unauthorized (not BrokerUnavailable after 60 s), within 5 s
        from ccsq.producer.client import Client

        stranger_producer = peer_config(swarm, "producer", "p-unknown", peer_id="stranger-p", private_key="keys/stranger.key")
        with Client.from_config_file(stranger_producer) as client:
            t0 = time.monotonic()
            with pytest.raises(Unauthorized) as err:
                client.submit(b"x", "echo")
            assert time.monotonic() - t0 < REFUSAL_S
        assert err.value.code == protocol.REJECT_UNKNOWN_SENDER and "authorized_keys" in str(err.value)

        # the CLI: its own exit code and a sentence naming the fix
        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        wrong_role_producer = peer_config(swarm, "producer", "p-role", peer_id="worker-1", private_key="keys/worker-1.key")
        t0 = time.monotonic()
        rc, _out, errtext = run_ccsq(capsys, "submit", "--config", wrong_role_producer, "--kind", "echo", doc)
        assert rc == ExitCode.UNAUTHORIZED and time.monotonic() - t0 < REFUSAL_S
        assert "ROLE" in errtext and "use the id and key of a peer with role 'producer'" in errtext
        admin_as_worker = peer_config(swarm, "admin", "a-role", peer_id="worker-1", private_key="keys/worker-1.key")
        rc, _out, errtext = run_ccsq(capsys, "status", "--config", admin_as_worker)
        assert rc == ExitCode.UNAUTHORIZED and "peer with role 'admin'" in errtext
        assert "authorized for another role than 'admin'" in errtext  # not a silent offline fallback

        for name, proc in workers.items():
            try:
                _, stderr = proc.communicate(timeout=30)  # process start and handler import included
            finally:
                proc.kill()
            assert proc.returncode == ExitCode.UNAUTHORIZED, (name, stderr[-2000:])
            assert "authorized_keys" in stderr or "peer with role 'worker'" in stderr, stderr[-2000:]
            if name != "completion":  # from ready to connect to stopped, by the worker's own log
                events = {e["event"]: e["timestamp"] for e in (json.loads(ln) for ln in stderr.splitlines() if ln.startswith("{"))
                          if isinstance(e, dict) and "event" in e}
                took = (datetime.fromisoformat(events["worker_stopped"].replace("Z", "+00:00"))
                        - datetime.fromisoformat(events["handler_ready"].replace("Z", "+00:00"))).total_seconds()
                assert took < REFUSAL_S, (name, took)

        # the broker counted and logged each kind of refusal
        rc, out, _ = run_ccsq(capsys, "status", "--config", swarm.configs["admin"], "--json")
        rejects = json.loads(out)["rejects"]
        assert rejects.get(protocol.REJECT_UNKNOWN_SENDER, 0) >= 2 and rejects.get(protocol.REJECT_BAD_SIGNATURE, 0) >= 1
        assert rejects.get(protocol.REJECT_ROLE, 0) >= 2
        log = [json.loads(ln) for ln in (tmp_path / "logs" / "broker.log").read_text().splitlines() if ln.startswith("{")]
        refused = {(e.get("peer"), e["code"]) for e in log if e["event"] == "frame_rejected"}
        assert {("stranger", "UNKNOWN_SENDER"), ("worker-1", "BAD_SIGNATURE"), ("producer-1", "ROLE")} <= refused


def test_broker_answers_strangers_rate_limited_and_never_unsigned_junk(tmp_path: Path) -> None:
    """A flood of HELLOs from an unknown id gets one answer per interval; junk gets none."""
    with Swarm(tmp_path, workers=0) as swarm:
        swarm.start_broker()
        priv, _ = write_keypair(tmp_path / "keys", "flooder")
        codec = EnvelopeCodec("flooder", load_private_key(priv), AuthorizedKeys(tmp_path / "authorized_keys.toml"),
                              require_hello=False)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(swarm.endpoint)
        try:
            for _ in range(50):
                sock.send_multipart(codec.encode(protocol.Hello(role="worker")))
            for _ in range(50):
                sock.send_multipart([msgpack.packb([1, int(protocol.MsgType.HELLO), "junk", 1, 1, 0, {}]), b"\0" * 64])  # stale junk
                sock.send_multipart([b"\xc1garbage"])
            answers = []
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                if sock.poll(100):
                    answers.append(codec.decode(sock.recv_multipart(), bound_sender="broker").message)
            assert len(answers) == 1, answers
            assert isinstance(answers[0], protocol.Error) and answers[0].code == protocol.REJECT_UNKNOWN_SENDER
            assert "'flooder'" in answers[0].message and "public" not in answers[0].message

            # made-up ids: at most the token bucket's burst is answered, the log stays bounded
            key = load_private_key(priv)
            for i in range(300):
                sock.send_multipart(EnvelopeCodec(f"made-up-{i}", key, codec.authorized).encode(protocol.Hello(role="worker")))
            answers = []
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                if sock.poll(100):
                    answers.append(codec.decode(sock.recv_multipart(), bound_sender="broker").message)
            assert 15 <= len(answers) <= 60, len(answers)  # a burst of 20, then 20/s: far fewer than 300
            log = (tmp_path / "logs" / "broker.log").read_text()
            assert log.count('"frame_rejected"') <= 100
        finally:
            sock.close()


def test_submit_names_a_down_broker_within_seconds(tmp_path: Path, capsys) -> None:
    with Swarm(tmp_path, workers=0) as swarm:  # no broker started
        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        t0 = time.monotonic()
        rc, _out, err = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--kind", "echo", doc)
        # the default --connect-timeout-s is 10 s (a loaded host), but a refused connect is known at once
        assert rc == ExitCode.UNAVAILABLE and time.monotonic() - t0 < 5.0
        assert "refused (nothing listens there)" in err and "start ccsq-brokerd" in err
        rc, _out, err = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--connect-timeout-s", "1",
                                 "--kind", "echo", doc)
        assert rc == ExitCode.UNAVAILABLE and "start ccsq-brokerd" in err


def test_cli_messages_exit_codes_and_defaults(tmp_path: Path, capsys, monkeypatch) -> None:
    """--version, CCSQ_CONFIG, completion script, missing input (66), unknown config key
    suggestion, state column without --wait, unserved-kind warning, kinds in status,
    ISO dates in items show, dlq purge of an unknown id, dead items exit 5."""
    with Swarm(tmp_path, workers=1, handler="fail", broker={"max_attempts": 1}) as swarm:
        swarm.start_broker()
        swarm.start_worker(1)
        monkeypatch.setenv("CCSQ_CONFIG", str(tmp_path))  # no --config from here on
        with pytest.raises(SystemExit):
            cli.main(["--version"])
        assert capsys.readouterr().out.startswith("ccsq ")
        rc, out, _ = run_ccsq(capsys, "completion-script", "bash")
        assert rc == 0 and "submit" in out and "--deadline-s" in out and "_shtab_compgen_files" in out
        import shtab

        assert all(shtab.FILE[k] == v for k, v in cli.FILE_COMPLETION.items())

        rc, _, err = run_ccsq(capsys, "submit", "--kind", "fail", tmp_path / "missing.png")
        assert rc == ExitCode.NOINPUT and "missing.png" in err

        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        # the broker says "unserved" only after 2 liveness windows (2 s here): workers reconnect first
        wait_until(lambda: json.loads(run_ccsq(capsys, "status", "--json")[1])["broker"]["uptime_s"] > 2.5, 30, "uptime")
        rc, out, err = run_ccsq(capsys, "submit", "--kind", "classify", "--param", "top_k=5", "--priority", "7",
                                "--deadline-s", "3600", doc)
        assert rc == 0 and "submitted" in out
        rc, shown, _ = run_ccsq(capsys, "items", "show", out.split()[0], "--json")
        rec = json.loads(shown)["item"]
        assert rec["params"] == {"name": "doc.txt", "top_k": 5} and rec["priority"] == 7
        assert 3500_000 < rec["deadline_ms"] - time.time() * 1000 <= 3600_000
        assert "no worker seen by the broker recently (since it started, or in the day before) serves kind 'classify'" in err
        rc, shown, _ = run_ccsq(capsys, "items", "show", out.split()[0])
        rows = dict(ln.strip().split("  ", 1) for ln in shown.splitlines() if "  " in ln.strip())
        rows = {k.strip(): v.strip() for k, v in rows.items()}
        assert "lease expires" not in rows and rows["max attempts"].startswith("broker default ("), shown
        assert "nb_ms" not in shown and "ready not before" in rows and "submitted" in rows, shown

        rc, out, _ = run_ccsq(capsys, "status")
        assert rc == 0 and "fail" in out and "no connected worker serves kind 'classify'" in out
        rc, out, _ = run_ccsq(capsys, "gap-report", "--json")
        assert rc == 0 and {q["kind"]: q["verdict"] for q in json.loads(out)["queues"]}["classify"] == (
            "stalled: no worker serves kind 'classify'")

        rc, out, err = run_ccsq(capsys, "submit", "--kind", "fail", "--wait", "--timeout-s", "60", doc)
        assert rc == ExitCode.DEAD and " dead" in out and "dlq list" in err
        item_id = out.split()[0]
        rc, out, _ = run_ccsq(capsys, "items", "show", item_id)
        assert rc == 0 and "Z" in out and f"{time.gmtime().tm_year}-" in out
        assert "last error" not in out and re.search(r"^ +error  \S", out, re.M), out  # a dead item's own error

        rc, out, _ = run_ccsq(capsys, "dlq", "purge", "bogus-id")
        assert rc == ExitCode.REFUSED and "unknown (no such item in the ledger): bogus-id" in out

        bad = peer_config(swarm, "admin", "typo", conect_timeout_s=1.0)
        rc, _, err = run_ccsq(capsys, "status", "--config", bad)
        assert rc == ExitCode.CONFIG and "did you mean 'connect_timeout_s'" in err and "known keys" not in err


LIBRARY_APP = """
import logging, sys
from ccsq.producer.client import Client
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="APP %(name)s %(message)s")
logging.getLogger("ccsq").setLevel(sys.argv[2])
with Client.from_config_file(sys.argv[1]) as c:
    print(c.submit(b"doc", "echo").item_id)
"""


def test_library_logs_through_standard_logging(tmp_path: Path) -> None:
    """Inside an application the library's log lines obey logging levels and handlers."""
    with Swarm(tmp_path, workers=0) as swarm:
        swarm.start_broker()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        quiet = subprocess.run([sys.executable, "-c", LIBRARY_APP, str(swarm.configs["producer"]), "ERROR"],
                               capture_output=True, text=True, timeout=60, env=env)
        assert quiet.returncode == 0 and quiet.stdout.strip(), quiet.stderr
        assert "broker_link_ready" not in quiet.stderr and "broker_link_ready" not in quiet.stdout
        chatty = subprocess.run([sys.executable, "-c", LIBRARY_APP, str(swarm.configs["producer"]), "INFO"],
                                capture_output=True, text=True, timeout=60, env=env)
        assert chatty.returncode == 0
        assert "APP ccsq.peer broker_link_ready" in chatty.stderr  # through the application's own handler


def test_curve_peer_outside_the_allow_list_is_refused_with_the_line_to_add(tmp_path: Path, capsys) -> None:
    """With CURVE, a peer whose CURVE key the broker's allow-list lacks (ZAP 400) stops
    at once too: Unauthorized / exit 77 with the curve_public_key line to add."""
    from ccsq.common.wire.keys import write_curve_keypair
    from ccsq.producer.client import Client

    curve = {"curve": True}
    with Swarm(tmp_path, workers=0, broker=curve, producer=curve, completion=curve, worker=curve) as swarm:
        swarm.start_broker()
        secret, public = write_curve_keypair(tmp_path / "keys", "stray")
        stray = peer_config(swarm, "producer", "p-stray", curve_secret_key=str(secret))
        with Client.from_config_file(stray) as client:
            t0 = time.monotonic()
            with pytest.raises(Unauthorized) as err:
                client.submit(b"x", "echo")
            assert time.monotonic() - t0 < REFUSAL_S
        assert err.value.code == "CURVE_REFUSED"
        assert f'curve_public_key = "{public.read_text().strip()}"' in str(err.value)
        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        rc, _out, errtext = run_ccsq(capsys, "submit", "--config", stray, "--kind", "echo", doc)
        assert rc == ExitCode.UNAUTHORIZED and "CURVE" in errtext
        with swarm.client() as client:  # the listed producer still gets in
            assert client.submit(b"y", "echo").item_id


def test_submit_on_queue_full_lists_what_was_accepted_and_exits_75(tmp_path: Path, capsys) -> None:
    """Tester #7: QUEUE_FULL is retryable: ``ccsq submit`` prints the files it did get
    accepted, a sentence, and exits 75 (TEMPFAIL), not 1. A real broker with max_ready_items=2."""
    with Swarm(tmp_path, workers=0, broker={"max_ready_items": 2}) as swarm:
        swarm.start_broker()
        docs = []
        for i in range(4):
            docs.append(tmp_path / f"d{i}.txt")
            docs[-1].write_text(f"document {i}")
        rc, out, err = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--kind", "echo",
                                "--submit-timeout-s", "1", "--json", *docs)
        assert rc == ExitCode.TEMPFAIL == 75, err
        rows = json.loads(out)
        assert [r["file"] for r in rows] == [str(d) for d in docs[:2]] and all(r["item_id"] for r in rows)
        assert "accepted 2 of 4" in err and "QUEUE_FULL" in err


def test_unwritable_outputs_exit_73_and_status_without_broker_or_ledger_exits_69(tmp_path: Path, capsys) -> None:
    """Tester #6: ``ccsq init`` into a directory that cannot be created and ``gap-report
    --html`` into a missing directory give a sentence and 73 (CANTCREAT), no traceback.
    Tester #9: ``ccsq status`` with the broker down and no ledger yet: a sentence and 69."""
    rc, _out, err = run_ccsq(capsys, "init", "/proc/nope")
    assert rc == ExitCode.CANTCREAT == 73 and "cannot write the swarm directory /proc/nope" in err and "Traceback" not in err
    with Swarm(tmp_path, workers=0) as swarm:  # the broker never started: no ledger
        admin = swarm.configs["admin"]
        admin.write_text(admin.read_text() + "connect_timeout_s = 0.5\nhello_timeout_s = 0.5\n")
        rc, _out, err = run_ccsq(capsys, "status", "--config", admin)
        assert rc == ExitCode.UNAVAILABLE == 69 and "no ledger at" in err and "start" in err, err
        swarm.start_broker()
        swarm.procs.stop("broker")
        rc, _out, err = run_ccsq(capsys, "gap-report", "--config", swarm.configs["brokerd"], "--html",
                                 tmp_path / "nonexistent" / "r.html")
        assert rc == 73 and "cannot write the HTML report" in err and "Traceback" not in err, err


@pytest.mark.parametrize("side", ["broker", "peer"])
def test_curve_on_one_side_only_is_named_not_broker_down(tmp_path: Path, capsys, side: str) -> None:
    """A producer with curve = false against a CURVE broker (or the reverse) is told
    "CURVE mismatch" and which side to change, exit 78, within seconds (ZMTP mechanism
    mismatch seen on the monitor), not "start ccsq-brokerd" after the timeout."""
    curve = {"curve": True}
    with Swarm(tmp_path, workers=0, broker=curve if side == "broker" else None,
               producer=curve if side == "peer" else None) as swarm:
        swarm.start_broker()
        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        t0 = time.monotonic()
        rc, _out, err = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--kind", "echo", doc)
        assert rc == ExitCode.CONFIG and time.monotonic() - t0 < 8.0, (rc, err)
        assert "CURVE mismatch" in err and "start ccsq-brokerd" not in err
        assert ("requires CURVE" in err) if side == "broker" else ("runs without CURVE" in err)


def test_a_peer_using_another_peers_key_is_told_whose_key_it_is(tmp_path: Path, capsys) -> None:
    """producer-1 started with worker-1's private key: exit 77 and the fix leads with
    "this is worker-1's key; use keys/producer-1.key", never "list worker-1's public key
    for producer-1" (which would let worker-1's key act as producer-1)."""
    with Swarm(tmp_path, workers=1) as swarm:  # worker-1's key exists; no worker runs
        swarm.start_broker()
        stolen = peer_config(swarm, "producer", "p-stolen", private_key="keys/worker-1.key")
        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        rc, _out, errtext = run_ccsq(capsys, "submit", "--config", stolen, "--kind", "echo", doc)
        assert rc == ExitCode.UNAUTHORIZED, errtext
        assert "this is worker-1's key" in errtext, errtext
        assert "keys/producer-1.key: set private_key" in errtext and "set it in the broker's" not in errtext


@pytest.mark.parametrize("bad", ["../evil", "a/b", "-x", "", "a b", "x" * 65, "peers.x]"])
def test_peer_ids_are_validated_everywhere(tmp_path: Path, capsys, bad: str) -> None:
    """keygen --id (exit 2, nothing written anywhere), authorized_keys.toml and peer_id in
    a config (exit 78, a sentence naming the file and the allowed characters)."""
    import tomli_w

    from ccsq.common.wire.config import PeerSettings, load
    from ccsq.common.wire.errors import ConfigError
    from ccsq.common.wire.keys import parse_authorized_keys

    out = tmp_path / "out" / "keys"
    with pytest.raises(SystemExit) as exc:
        cli.main(["keygen", "--out", str(out), f"--id={bad}"])
    assert exc.value.code == ExitCode.USAGE and "not a valid peer id" in capsys.readouterr().err
    assert not any(tmp_path.rglob("*.key")) and not any(tmp_path.rglob("*.pub"))
    _priv, pub = write_keypair(tmp_path / "k", "good-1.x_y")
    ak = tmp_path / "authorized_keys.toml"
    ak.write_text(tomli_w.dumps({"peers": {bad: {"role": "worker", "public_key": pub.read_text().strip()}}}))
    with pytest.raises(ConfigError, match="not a valid peer id"):
        parse_authorized_keys(ak)
    cfg = tmp_path / "producer.toml"
    cfg.write_text(tomli_w.dumps({"peer_id": bad or "x", "broker_id": "broker" if bad else ""}))
    if bad:
        with pytest.raises(ConfigError, match=r"producer.toml: peer_id: .* not a valid peer id"):
            load(PeerSettings, cfg)


def test_items_show_labels_an_earlier_attempts_error() -> None:
    """A replayed then acknowledged item keeps the dead attempt's error in the ledger;
    ``items show`` labels it "last error (an earlier attempt ...)"; a dead item's error stays "error".
    A replayed item now ``ready`` shows no ``ended`` of its dead letter as its own (the tester's
    case: it did, and the message as ``last error msg`` where README says ``last error``)."""
    rec = {"id": "x", "state": "acknowledged", "attempt": 2, "error": "handler_failed", "error_message": "boom",
           "lease_expires_ms": 0, "max_attempts": 0, "created_ms": 1_700_000_000_000}
    rows = dict(admin_cmds._item_rows({"item": rec, "default_max_attempts": 5}))
    assert "error" not in rows and rows["last error"].startswith("handler_failed: boom (an earlier attempt; the item is acknowledged")
    assert "error message" not in rows and "last error msg" not in rows
    assert "lease expires" not in rows and rows["max attempts"] == "broker default (5)"
    # replayed (the ledger clears error, keeps error_message and ended_ms), now ready
    replayed = {**rec, "state": "ready", "attempt": 0, "error": "", "ended_ms": 1_700_000_050_000}
    shown = admin_cmds._item_rows({"item": replayed, "default_max_attempts": 5})
    labels = [k for k, _ in shown]
    assert "ended" not in labels and "error message" not in labels and "error" not in labels, shown
    assert labels.count("last error") == 1 and dict(shown)["last error"] == (
        "boom (an earlier attempt, ended 2023-11-14T22:14:10.000Z; the item is ready now)"), shown
    assert "last error" not in dict(admin_cmds._item_rows({"item": {**replayed, "error_message": ""}}))
    assert rows["submitted"].startswith("2023-11-14T")
    rows = dict(admin_cmds._item_rows({"item": {**rec, "state": "dead", "lease_expires_ms": 1_700_000_060_000,
                                                 "ended_ms": 1_700_000_050_000}}))
    assert rows["error"] == "handler_failed" and "last error" not in rows
    assert rows["error message"] == "boom" and rows["ended"].startswith("2023-11-14T")
    assert "lease expires" not in rows  # the lease ended with the dead letter: no (future) expiry shown
    assert rows["max attempts"] == "broker default (max_attempts in brokerd.toml)"
    rows = dict(admin_cmds._item_rows({"item": {**rec, "state": "leased", "lease_expires_ms": 1_700_000_060_000,
                                                 "nb_ms": 1_700_000_000_000, "cseq": 0, "seq": 3}}))
    assert rows["lease expires"].startswith("2023-11-14T") and rows["ready not before"].startswith("2023-11-14T")
    assert "nb_ms" not in rows and "cseq" not in rows and rows["arrival seq"] == 3


#: The ``ccsq`` command line: every subcommand (and the sub-subcommands), as users type them.
SUBCOMMANDS = ["init", "keygen", "submit", "outbox", "completion", "gap-report", "status", "items", "dlq", "drain", "failover",
               "reconcile", "init-relay", "federation", "backup", "console", "completion-script"]
NESTED = {"outbox": ["flush"], "items": ["show", "cancel"], "dlq": ["list", "replay", "purge"], "federation": ["report"]}


def test_every_subcommand_is_parsed_runs_a_command_and_completes(capsys) -> None:
    """The command line split over several modules (issue 13) stays whole: each subcommand
    and sub-subcommand is in the parser with a command function, and the bash completion
    script lists them all."""
    import argparse

    def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    top = subparsers(cli.build_parser())
    assert list(top) == SUBCOMMANDS
    for name, sub in top.items():
        if name in NESTED:
            assert list(subparsers(sub)) == NESTED[name]
            assert all(callable(leaf.get_default("func")) for leaf in subparsers(sub).values()), name
        else:
            assert callable(sub.get_default("func")), name
    rc, out, _ = run_ccsq(capsys, "completion-script", "bash")
    assert rc == 0
    assert f"_shtab_ccsq_subparsers=({' '.join(SUBCOMMANDS)})" in out
    for name, leaves in NESTED.items():
        assert f"_shtab_ccsq_{name}_subparsers=({' '.join(leaves)})" in out


def test_submit_without_kind_uses_the_swarms_default_kind(tmp_path: Path, capsys) -> None:
    """`ccsq init --handler sleep` writes default_kind = "sleep" in producer.toml; a plain
    `ccsq submit` (no --kind) queues items of that kind, not "ocr"."""
    import tomllib

    with Swarm(tmp_path, workers=0, handler="sleep") as swarm:
        assert tomllib.loads(swarm.configs["producer"].read_text())["default_kind"] == "sleep"
        swarm.start_broker()
        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        rc, out, _ = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--json", doc)
        assert rc == 0, out
        item_id = json.loads(out)[0]["item_id"]
        rc, shown, _ = run_ccsq(capsys, "items", "show", item_id, "--config", swarm.configs["admin"], "--json")
        assert json.loads(shown)["item"]["kind"] == "sleep"


def test_unserved_kind_warning_works_right_after_a_broker_restart(tmp_path: Path, capsys) -> None:
    """The broker keeps the kinds its workers served (HELLO) in the ledger (meta w:<kind>),
    so right after a restart, within what used to be a silent grace of two liveness
    windows, `ccsq submit` of a kind no recent worker served warns, naming the kinds that
    are served (and the near one, for a typo), and a served kind does not."""
    from tests.broker_harness import ScriptedPeer

    with Swarm(tmp_path, workers=1, broker={"liveness": 50}) as swarm:  # grace: 2 x 0.2 s x 50 = 20 s
        swarm.start_broker()
        worker = ScriptedPeer(swarm.root, "worker-1", swarm.endpoint)
        try:
            worker.send(protocol.Hello(role="worker", slots=1, credit=1, kinds=["echo"]))
            assert isinstance(worker.recv(10.0).message, protocol.Welcome)
            wait_until(lambda: any(w["peer_id"] == "worker-1" for w in json.loads(run_ccsq(
                capsys, "status", "--config", swarm.configs["admin"], "--json")[1])["peers"]), 30, "worker seen")
        finally:
            worker.close()
        swarm.procs.stop("broker")
        t0 = time.monotonic()
        swarm.start_broker()
        doc = tmp_path / "doc.txt"
        doc.write_text("hello")
        rc, _out, err = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--kind", "classify", doc)
        assert rc == 0 and "serves kind 'classify'" in err, err
        assert "kinds served: 'echo'" in err and "did you mean" not in err and "ccsq items cancel" in err, err
        rc, _out, err = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--kind", "ecko", doc)
        assert rc == 0 and "serves kind 'ecko'" in err and "kinds served: 'echo' (did you mean 'echo'?)" in err, err  # a typo
        rc, _out, err = run_ccsq(capsys, "submit", "--config", swarm.configs["producer"], "--kind", "echo", doc)
        assert rc == 0 and "serves kind" not in err, err
        assert time.monotonic() - t0 < 20.0  # both answered inside the old grace period


def test_a_worker_pinning_another_broker_key_stops_and_loses_nothing(tmp_path: Path) -> None:
    """A worker whose authorized_keys holds another public key for the broker (another
    swarm's file, or a broker key rotated without this host) exits 77 within seconds,
    naming the file and the fix, instead of reconnecting forever while the broker leases
    it items that then die as worker_lost (a fresh-clone tester lost good work this way)."""
    with Swarm(tmp_path, workers=1, broker={"max_attempts": 2}) as swarm:
        swarm.start_broker()
        swarm.start_completion()
        keys = tmp_path / "keys"
        _, pub = write_keypair(keys, "other-broker")
        text = (swarm.root / "authorized_keys.toml").read_text()
        real = re.search(r'\[peers\.broker\]\s*role = "broker"\s*public_key = "([^"]+)"', text).group(1)
        other = (tmp_path / "other_authorized_keys.toml")
        other.write_text(text.replace(real, pub.read_text().strip()))
        cfg = peer_config(swarm, "workerd-0", "w-otherkeys", authorized_keys=str(other), journal_dir="j-other")
        with swarm.client() as client:
            ids = [client.submit(f"page {i}".encode(), "echo").item_id for i in range(5)]
        t0 = time.monotonic()
        proc = subprocess.run([bin_path("ccsq-workerd"), "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == ExitCode.UNAUTHORIZED, (proc.returncode, proc.stderr[-2000:])
        assert time.monotonic() - t0 < 15
        assert "other_authorized_keys.toml" in proc.stderr and "does not match" in proc.stderr, proc.stderr[-2000:]
        swarm.start_worker(1)  # the right worker runs them all
        rep = swarm.wait_acknowledged(5, timeout_s=60)
    assert rep["counters"]["dead"] == 0 and rep["balanced"], rep
    assert len(ids) == 5


def test_a_lease_shorter_than_the_heartbeat_is_refused_at_start(tmp_path: Path) -> None:
    """C03 (lease shorter than the job) from the configuration side: lease_ttl_s under
    heartbeat_interval_s would expire every lease before a heartbeat could extend it (a
    tester's jobs all ended dead as worker_lost): exit 78 naming both keys."""
    with Swarm(tmp_path, workers=0, broker={"lease_ttl_s": 1.0, "heartbeat_interval_s": 5.0}) as swarm:
        proc = subprocess.run([bin_path("ccsq-brokerd"), "--config", str(swarm.configs["brokerd"])],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.CONFIG, proc.stderr[-1500:]
    assert "lease_ttl_s = 1.0" in proc.stderr and "heartbeat_interval_s = 5.0" in proc.stderr and "brokerd.toml" in proc.stderr


def test_config_before_the_action_of_a_command_family(tmp_path: Path, capsys) -> None:
    """``ccsq dlq --config X list`` and ``ccsq items --config X show ID`` (as users type them)
    use X, like ``--config`` after the action; argparse used to refuse X as an action."""
    missing = tmp_path / "elsewhere" / "admin.toml"
    for argv in (("dlq", "--config", str(missing), "list"), ("items", "--config", str(missing), "show", "abc"),
                 ("dlq", "list", "--config", str(missing))):
        rc, _, err = run_ccsq(capsys, *argv)
        assert rc == ExitCode.CONFIG and str(missing) in err, (argv, err)


def test_init_prints_the_next_steps_with_this_swarms_paths(tmp_path: Path, capsys) -> None:
    """Issue 27: `ccsq init` says what to run next, as README's "Run your own swarm" does:
    the broker, each worker's config, the completion service, a submit of the workers'
    kind, `ccsq status`; every config it names exists."""
    import re

    root = tmp_path / "myswarm"
    rc, out, _ = run_ccsq(capsys, "init", root, "--workers", "3", "--handler", "sleep")
    assert rc == 0 and "next steps" in out
    steps = out[out.index("next steps"):]
    assert f"export CCSQ_CONFIG={root.resolve()}" in steps
    commands = [ln.split("#")[0].split() for ln in steps.splitlines()[1:] if ln.strip().startswith("ccsq")]
    assert [c[0] for c in commands] == ["ccsq-brokerd", "ccsq-workerd", "ccsq-workerd", "ccsq-workerd", "ccsq-completiond",
                                        "ccsq", "ccsq", "ccsq"]
    assert [c[2] for c in commands[:5]] == [f"{root}/{n}.toml" for n in
                                            ("brokerd", "workerd-0", "workerd-1", "workerd-2", "completion")]
    assert all(Path(c[2]).is_file() for c in commands[:5])
    assert commands[5][:4] == ["ccsq", "submit", "--kind", "sleep"] and commands[6] == ["ccsq", "status"]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    own_swarm = readme[readme.index("## Run your own swarm"):readme.index("## Using it from Python")]
    for daemon in ("ccsq-brokerd", "ccsq-workerd", "ccsq-completiond", "ccsq submit", "ccsq status"):
        assert re.search(re.escape(daemon), own_swarm), daemon  # the README shows the same steps


def test_init_refuses_an_empty_swarm_id(tmp_path, capsys) -> None:
    """`ccsq init --swarm-id ''` is refused (78, nothing written) like any other invalid id;
    it used to write a swarm with no swarm_id and print an empty name."""
    from ccsq.tools.cli import main

    assert main(["init", str(tmp_path / "s"), "--endpoint", "tcp://127.0.0.1:5998", "--swarm-id", ""]) == 78
    assert "--swarm-id: '' is not a valid swarm id" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
