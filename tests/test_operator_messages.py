"""What an operator is told when something is down or wrong (issue 27's friction list):
the endpoint and the cause are named, it is a warning, and the fix is given; a transient
outage exits 75 (TEMPFAIL), not 1. Real broker, real worker process, real files."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from ccsq.tools import cli
from ccsq.tools.procs import bin_path, free_tcp_port
from ccsq.common.wire.errors import ExitCode
from tests.swarm import Swarm, wait_until

pytestmark = pytest.mark.timeout(120)


def run_ccsq(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _set(path: Path, **changes) -> Path:
    """Rewrite keys of a TOML config in place (top-level keys only)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.split("=")[0].strip() not in changes]
    path.write_text("\n".join(lines + [f"{k} = {json.dumps(v)}" for k, v in changes.items()]) + "\n")
    return path


def test_status_and_dlq_with_the_broker_down_or_a_wrong_endpoint_name_endpoint_cause_and_fix(tmp_path: Path,
                                                                                              capsys) -> None:
    """Broker stopped: ``ccsq status`` still shows the ledger but warns with the endpoint,
    the cause (nothing listens) and the fix, and exits 69 (not 0); ``dlq replay`` says the
    same. Broker running but admin.toml pointing elsewhere: the fix says a broker holds the
    ledger on this host and names the endpoint in its brokerd.toml. ``--offline`` is 0."""
    with Swarm(tmp_path, workers=0) as swarm:
        admin = _set(swarm.configs["admin"], connect_timeout_s=1.0, hello_timeout_s=1.0)
        swarm.start_broker()
        rc, _out, err = run_ccsq(capsys, "status", "--config", admin)
        assert rc == ExitCode.OK and "warning" not in err, err

        wrong = f"tcp://127.0.0.1:{free_tcp_port()}"
        _set(admin, broker_endpoint=wrong)
        rc, out, err = run_ccsq(capsys, "status", "--config", admin, "--json")
        assert rc == ExitCode.UNAVAILABLE, (rc, err)
        assert json.loads(out)["source"] == "ledger (offline)"
        assert f"the broker at {wrong} did not answer" in err and "refused (nothing listens there)" in err, err
        assert "warning" in err and re.search(r"a broker \(pid \d+\) holds the ledger", err), err
        assert swarm.endpoint in err and str(swarm.configs["brokerd"]) in err, err  # the endpoint to set instead

        _set(admin, broker_endpoint=swarm.endpoint)
        swarm.procs.stop("broker")
        rc, out, err = run_ccsq(capsys, "status", "--config", admin)
        assert rc == ExitCode.UNAVAILABLE and "backlog per queue" in out, (rc, err)
        assert f"the broker at {swarm.endpoint} did not answer" in err and "refused (nothing listens there)" in err, err
        assert "systemctl start ccsq-brokerd" in err and f"broker_endpoint in {admin}" in err, err
        assert "holds the ledger" not in err, err
        rc, _out, err = run_ccsq(capsys, "status", "--config", admin, "--offline")
        assert rc == ExitCode.OK and "warning" not in err, err

        rc, _out, err = run_ccsq(capsys, "dlq", "replay", "--all", "--config", admin)
        assert rc == ExitCode.UNAVAILABLE, (rc, err)
        assert swarm.endpoint in err and "refused (nothing listens there)" in err and "systemctl start ccsq-brokerd" in err, err


def test_a_worker_with_a_wrong_endpoint_warns_with_the_endpoint_and_the_fix(tmp_path: Path) -> None:
    """A worker whose broker_endpoint reaches nothing logs ``broker_unreachable`` at warning
    level, naming the endpoint, the cause and its config file (before: ``broker not reachable
    (HELLO not sent)`` at info every 5 s, no endpoint)."""
    with Swarm(tmp_path, workers=1) as swarm:
        wrong = f"tcp://127.0.0.1:{free_tcp_port()}"
        config = _set(swarm.configs["workerd-0"], broker_endpoint=wrong)
        proc = subprocess.Popen([bin_path("ccsq-workerd"), "--config", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        try:
            import os
            import selectors

            os.set_blocking(proc.stderr.fileno(), False)
            sel = selectors.DefaultSelector()
            sel.register(proc.stderr, selectors.EVENT_READ)

            def warned() -> str | None:
                for _key, _ in sel.select(timeout=0.5):
                    chunk = proc.stderr.read()
                    if chunk:
                        lines.extend(chunk.splitlines())
                return next((ln for ln in lines if "broker_unreachable" in ln), None)

            line = wait_until(warned, 45.0, "a broker_unreachable warning")
        finally:
            proc.kill()
            proc.wait(timeout=10)
        event = json.loads(line)
        assert event["level"] == "warning" and event["endpoint"] == wrong, event
        assert "refused" in event["cause"] or wrong in event["cause"], event
        assert str(config) in event["fix"] and "ccsq-brokerd" in event["fix"], event
        lost = [json.loads(ln) for ln in lines if "broker_link_lost" in ln]
        assert lost and all("HELLO not sent" not in e["reason"] or wrong in e["reason"] for e in lost), lost[:3]


def test_submit_with_the_claim_store_down_exits_75(tmp_path: Path, capsys, monkeypatch) -> None:
    """The S3 endpoint is down: ``ccsq submit`` says STORE_UNAVAILABLE ... retry later and
    exits 75 (TEMPFAIL, as QUEUE_FULL), not 1 (an unexpected failure)."""
    pytest.importorskip("boto3")
    for k, v in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    with Swarm(tmp_path, workers=0) as swarm:
        swarm.start_broker()
        producer = _set(swarm.configs["producer"], claim_store="s3://ccsq-test/claims",
                        s3_endpoint_url=f"http://127.0.0.1:{free_tcp_port()}", inline_max_bytes=0)
        doc = tmp_path / "doc.txt"
        doc.write_text("a document bigger than nothing\n" * 10)
        rc, _out, err = run_ccsq(capsys, "submit", "--config", producer, "--kind", "echo", doc)
        assert rc == ExitCode.TEMPFAIL == 75, (rc, err)
        assert "STORE_UNAVAILABLE" in err, err


def test_dead_counts_say_how_many_are_purged(tmp_path: Path) -> None:
    """Purged dead items stay counted in state ``dead`` (the balance holds) but ``dlq list``
    shows only the others: gap-report (text, JSON, HTML) and the console's overview label the
    row ``dead (2 dead letters + 1 purged)`` instead of a bare ``dead 3``."""
    import hashlib
    import random

    from ccsq.brokerd.admin import ledger_status
    from ccsq.brokerd.ledger.store import Ledger, Policy
    from ccsq.brokerd.gap_report import load_report, render_html, render_text
    from ccsq.common.wire import protocol

    data_dir = tmp_path / "broker-data"
    ledger = Ledger(data_dir / "ledger", map_size_bytes=1 << 20, max_map_size_bytes=8 << 20, policy=Policy(),
                    rng=random.Random(7))
    try:
        txn = ledger.begin()
        ids = [txn.submit(protocol.SubmitItem(f"k{i}", "echo", protocol.Blob(hashlib.sha256(b"x").hexdigest(), 1, b"x")), 1_000).item_id
               for i in range(3)]
        for item_id in ids:
            assert txn.dead_letter_ready(item_id, "cancelled", "test", 2_000)
        assert txn.purge_dead(ids[0], 2_100)
        txn.commit()
        with ledger.read() as view:
            status = ledger_status(view)
    finally:
        ledger.close()
    report = load_report(data_dir)
    assert report["states"]["dead"] == 3 and report["dead_listed"] == 2 and report["balanced"]
    label = "dead (2 dead letters + 1 purged)"
    assert label in render_text(report)
    assert label in render_html(report) and "data-state='dead'>3<" in render_html(report)

    from ccsq.common.wire.config import AdminConfig, load
    from ccsq.console.app import Auth, Console, Viewer
    from ccsq.console.data import Source

    (tmp_path / "admin.toml").write_text('peer_id = "admin"\nprivate_key = "k"\n')
    console = Console(Source(load(AdminConfig, tmp_path / "admin.toml")), Auth([]))
    try:
        page = console.env.get_template("overview.html").render(
            viewer=Viewer("local", "admin", csrf="c"), flash=[], path="/", refresh_s=0, now="",
            status={"source": "broker", **status, "peers": []}, queues=[], rates=None, chart=None, more={})
    finally:
        console.source.close()
    assert "(2 dead letters + 1 purged)" in page and 'data-state="dead">3<' in page


def test_ccsq_config_naming_one_file_says_which_file_a_command_needs(tmp_path: Path, capsys, monkeypatch) -> None:
    """CCSQ_CONFIG=.../brokerd.toml: gap-report works; submit (and status) say they need
    producer.toml (admin.toml) and how to point CCSQ_CONFIG at the directory, exit 78, not
    a bare "unknown key(s) 'data_dir'"."""
    with Swarm(tmp_path, workers=0) as swarm:
        swarm.start_broker()
        swarm.procs.stop("broker")
        monkeypatch.setenv("CCSQ_CONFIG", str(swarm.configs["brokerd"]))
        rc, _out, err = run_ccsq(capsys, "gap-report")
        assert rc == ExitCode.OK, err
        doc = tmp_path / "doc.txt"
        doc.write_text("x")
        for argv, needs in ((["submit", "--kind", "echo", doc], "producer.toml"), (["status"], "admin.toml")):
            rc, _out, err = run_ccsq(capsys, *argv)
            assert rc == ExitCode.CONFIG, (argv, rc, err)
            assert f"needs {needs}" in err and "CCSQ_CONFIG" in err and "directory" in err, err
        monkeypatch.setenv("CCSQ_CONFIG", str(swarm.root))  # the directory: each command finds its file
        rc, _out, err = run_ccsq(capsys, "status", "--offline")
        assert rc == ExitCode.OK, err


def test_the_console_shows_a_lease_expiry_only_while_leased() -> None:
    """A dead item keeps lease_expires_ms in its record; the item page's history shows
    "lease expires" only for a leased item (before: a dead item showed a future expiry)."""
    from ccsq.console.app import item_times

    rec = {"id": "x", "state": "dead", "created_ms": 1_700_000_000_000, "lease_expires_ms": 1_700_000_300_000,
           "ended_ms": 1_700_000_100_000}
    assert "lease expires" not in item_times(rec) and item_times(rec)["ended (dead/expired)"] == 1_700_000_100_000
    assert item_times({**rec, "state": "leased"})["lease expires"] == 1_700_000_300_000


def test_shell_completion_for_bash_zsh_tcsh_and_fish_and_every_command_has_version(tmp_path: Path, capsys) -> None:
    """``ccsq completion bash`` prints the script (as kubectl/gh users type it; before, it was
    an argument error of the completion service); ``completion-script fish`` is a fish script
    fish accepts and that completes sub-commands and options; every console script answers
    ``--version`` (the daemons had none)."""
    import os
    import shutil

    rc, out, _err = run_ccsq(capsys, "completion", "bash")
    assert rc == 0 and "complete" in out and "_shtab_ccsq" in out, out[:300]
    rc, fish_script, _err = run_ccsq(capsys, "completion-script", "fish")
    assert rc == 0 and "complete -c ccsq" in fish_script
    fish = shutil.which("fish")
    if fish is None:
        if os.environ.get("CI"):
            pytest.fail("fish is missing (.ci/run installs it)")
    else:
        path = tmp_path / "ccsq.fish"
        path.write_text(fish_script)
        assert subprocess.run([fish, "-n", str(path)], capture_output=True, timeout=30).returncode == 0
        done = subprocess.run([fish, "--no-config", "-c", f"source {path}; complete -C 'ccsq dlq '; echo ---; "
                               "complete -C 'ccsq submit --ki'"], capture_output=True, text=True, timeout=30)
        before, after = done.stdout.split("---")
        assert {ln.split("\t")[0] for ln in before.splitlines()} >= {"list", "replay", "purge"}, done
        assert "--kind" in after, done
    from importlib.metadata import version

    for prog in ("ccsq", "ccsq-brokerd", "ccsq-workerd", "ccsq-completiond", "ccsq-relayd", "ccsq-console"):
        done = subprocess.run([bin_path(prog), "--version"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == f"{prog} {version('ccsq')}", (prog, done)


def test_outbox_flush_sends_what_was_spooled_while_the_broker_was_away(tmp_path: Path, capsys) -> None:
    """``ccsq submit`` with outbox_dir spools while the broker is down; ``ccsq outbox flush``
    says how many are still spooled and exits 69 while it stays down, then sends them all and
    exits 0 once it runs (before: no command did, only the next producer process)."""
    with Swarm(tmp_path, workers=0, producer={"outbox_dir": "outbox"}) as swarm:
        producer = swarm.configs["producer"]
        docs = []
        for i in range(3):
            docs.append(tmp_path / f"d{i}.txt")
            docs[-1].write_text(f"document {i}")
        rc, out, err = run_ccsq(capsys, "submit", "--config", producer, "--kind", "echo", *docs)
        assert rc == 0 and out.count("(spooled)  spooled") == 3, (out, err)
        rc, out, err = run_ccsq(capsys, "outbox", "flush", "--config", producer, "--timeout-s", "2")
        assert rc == ExitCode.UNAVAILABLE and "3 still spooled" in out and "run `ccsq outbox flush` again" in err, (out, err)
        swarm.start_broker()
        rc, out, err = run_ccsq(capsys, "outbox", "flush", "--config", producer, "--timeout-s", "60", "--json")
        assert rc == 0, (out, err)
        doc = json.loads(out)
        assert (doc["spooled_before"], doc["sent"], doc["left"], doc["rejected"]) == (3, 3, 0, []), doc
        assert swarm.report()["counters"]["received"] == 3
        rc, _out, err = run_ccsq(capsys, "outbox", "flush", "--config", swarm.configs["admin"])
        assert rc == ExitCode.CONFIG, err  # not a producer config (no outbox there)


def test_a_curve_mismatch_is_one_sentence_at_once_for_admin_commands_too(tmp_path: Path, capsys) -> None:
    """A CURVE broker and an admin.toml without curve: ``ccsq status`` exits 78 with the
    CURVE sentence long before its connect timeout (before: it waited the timeout, then read
    the ledger as if the broker were down, exit 0/69); neither status nor submit prints a JSON
    log line beside the sentence."""
    import time

    with Swarm(tmp_path, workers=0, broker={"curve": True}) as swarm:
        swarm.start_broker()
        admin = _set(swarm.configs["admin"], connect_timeout_s=20.0, hello_timeout_s=5.0)
        t0 = time.monotonic()
        rc, out, err = run_ccsq(capsys, "status", "--config", admin)
        took = time.monotonic() - t0
        assert rc == ExitCode.CONFIG and "CURVE mismatch" in err and took < 10.0, (rc, took, err)
        assert not any(ln.lstrip().startswith("{") for ln in err.splitlines()), err
        doc = tmp_path / "doc.txt"
        doc.write_text("x")
        done = subprocess.run([bin_path("ccsq"), "submit", "--config", str(swarm.configs["producer"]), "--kind", "echo",
                               str(doc)], capture_output=True, text=True, timeout=60)
        assert done.returncode == ExitCode.CONFIG and "CURVE mismatch" in done.stderr, done
        assert not any(ln.lstrip().startswith("{") for ln in done.stderr.splitlines()), done.stderr


def test_console_item_page_names_the_broker_default_and_the_start_log_a_url_to_open(tmp_path: Path) -> None:
    """The item page shows max_attempts 0 as ``broker default (N)`` (as ``ccsq items show``;
    before: a bare 0), and a console listening on 0.0.0.0 logs a URL with this host's name,
    not ``http://0.0.0.0:PORT/``."""
    import os
    import socket
    import urllib.request

    with Swarm(tmp_path, workers=0, broker={"max_attempts": 4}) as swarm:
        swarm.start_broker()
        with swarm.client() as client:
            item = client.submit(b"x", "nobody-serves-this").item_id
        port = free_tcp_port()
        token = "ops-console-token-0123456789"
        swarm.procs.start("console", [bin_path("ccsq"), "console", "--config", str(swarm.configs["admin"]),
                                      "--listen", f"0.0.0.0:{port}", "--refresh-s", "0"],
                          env={**os.environ, "CCSQ_CONSOLE_TOKEN": token}, ready_event="console_started")
        started = next(e for e in swarm.procs.procs["console"].events() if e.get("event") == "console_started")
        assert "0.0.0.0" not in started["url"] and started["url"] == f"http://{socket.getfqdn()}:{port}/", started
        req = urllib.request.Request(f"http://127.0.0.1:{port}/items/{item}", headers={"Authorization": f"Bearer {token}"})
        page = urllib.request.urlopen(req, timeout=30).read().decode()
        assert 'data-field="max_attempts">broker default (4)<' in page, page[:2000]
        assert "\"attempt\">0 of 4 " in page  # attempts so far of the broker default


def test_the_completion_peer_counts_what_it_acknowledged(tmp_path: Path, capsys) -> None:
    """``ccsq status`` (and the console's workers page, the same reply) shows the completion
    peer's done as the items its ACKs acknowledged (before: always 0)."""
    with Swarm(tmp_path, workers=1) as swarm:
        swarm.start_all(workers=1)
        with swarm.client() as client:
            ids = [client.submit(f"doc {i}".encode(), "echo").item_id for i in range(4)]
        swarm.wait_acknowledged(len(ids))
        admin = _set(swarm.configs["admin"], connect_timeout_s=15.0)

        def completion_done() -> int | None:
            rc, out, _err = run_ccsq(capsys, "status", "--config", admin, "--json")
            peers = {x["peer_id"]: x for x in json.loads(out)["peers"]} if rc == 0 else {}
            done = peers.get("completion-1", {}).get("done")
            return done if done == len(ids) else None

        assert wait_until(completion_done, 20.0, "the completion peer's done count") == len(ids)


def test_the_console_items_page_lists_recent_items_by_state_and_kind(tmp_path: Path) -> None:
    """/items without a search lists the newest items, filtered by state and kind (before: a
    search box only): a typo'd kind waiting in ready is found without knowing its id."""
    import urllib.request

    with Swarm(tmp_path, workers=0) as swarm:
        swarm.start_broker()
        with swarm.client() as client:
            typo = client.submit(b"a", "ocrr").item_id
            other = client.submit(b"b", "echo").item_id
            cancelled = client.submit(b"c", "echo").item_id
            client.cancel([cancelled])
        port = free_tcp_port()
        swarm.procs.start("console", [bin_path("ccsq"), "console", "--config", str(swarm.configs["admin"]),
                                      "--listen", f"127.0.0.1:{port}", "--refresh-s", "0"], ready_event="console_started")

        def listed(query: str) -> list[str]:
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/items{query}", timeout=30).read().decode()
            return re.findall(r'<tr data-item="([^"]+)">', page)

        assert listed("") == [cancelled, other, typo]  # newest first
        assert listed("?state=ready") == [other, typo]
        assert listed("?state=ready&kind=ocrr") == [typo]
        assert listed("?state=dead") == [cancelled]
        assert listed("?kind=nothing") == []


def test_a_missing_key_file_is_refused_naming_the_config_file_and_its_key(tmp_path: Path, capsys) -> None:
    """A private_key or authorized_keys path that names no file: the command and the broker
    refuse with exit 78 naming the config file and the key to fix (they used to name the
    missing file only, so an operator with several configs could not tell which one to edit)."""
    from ccsq.brokerd import main as brokerd_main
    from ccsq.tools.init import init_swarm

    configs = init_swarm(tmp_path / "s", workers=1, endpoint=f"tcp://127.0.0.1:{free_tcp_port()}")
    doc = tmp_path / "doc.txt"
    doc.write_text("x")
    for key in ("private_key", "authorized_keys"):
        producer = _set(Path(configs["producer"]), **{key: "keys/absent"})
        rc, _, err = run_ccsq(capsys, "submit", "--config", producer, "--kind", "echo", doc)
        assert rc == ExitCode.CONFIG and f"{producer}: {key}: " in err and "absent" in err, err
        broker = _set(Path(configs["brokerd"]), **{key: "keys/absent"})
        capsys.readouterr()
        assert brokerd_main.run(str(broker)) == ExitCode.CONFIG
        err = capsys.readouterr().err
        assert f"{broker}: {key}: " in err and "absent" in err, err
        _set(Path(configs["producer"]), **{key: "keys/producer-1.key" if key == "private_key" else "authorized_keys.toml"})
        _set(Path(configs["brokerd"]), **{key: "keys/broker.key" if key == "private_key" else "authorized_keys.toml"})
    assert not (tmp_path / "s" / "broker-data" / "data.mdb").exists()  # refused before the ledger was opened


def test_a_broker_endpoint_whose_host_does_not_resolve_is_named_as_such(tmp_path: Path, capsys) -> None:
    """A typo in broker_endpoint's host name (it does not resolve) is said as that, naming the
    host, not as "refused (nothing listens there)", which sent the operator to start a broker
    that was running; still exit 69 at once, nothing submitted."""
    from ccsq.tools.init import init_swarm

    configs = init_swarm(tmp_path / "s", workers=1, endpoint=f"tcp://127.0.0.1:{free_tcp_port()}")
    producer = _set(Path(configs["producer"]), broker_endpoint="tcp://no-such-broker.invalid:5555")
    doc = tmp_path / "doc.txt"
    doc.write_text("x")
    rc, _, err = run_ccsq(capsys, "submit", "--config", producer, "--kind", "echo", "--connect-timeout-s", "20", doc)
    assert rc == ExitCode.UNAVAILABLE, err
    assert "'no-such-broker.invalid'" in err and "does not resolve" in err and "nothing listens" not in err, err


def test_a_peer_id_in_use_message_gives_the_fix_once() -> None:
    """The broker's refusal of a second live session ends with its own short fix; the
    peer's sentence (exit 78) quotes the broker and then gives the full fix: once (it
    used to print "give each process its own peer id and key" twice in one line)."""
    from types import SimpleNamespace

    from ccsq.common.link.peer import id_in_use_message
    from ccsq.common.wire.config import WorkerConfig

    broker_said = ("peer id 'worker-1' is in use by a live session from vm/1/ab (heard 1.00s ago; liveness window 5s): "
                   "give each process its own peer id and key, or stop the other one")
    msg = id_in_use_message(WorkerConfig(peer_id="worker-1"), SimpleNamespace(in_use_by=broker_said))  # type: ignore[arg-type]
    assert msg.count("give each process its own peer id") == 1, msg
    assert "vm/1/ab (heard 1.00s ago" in msg and "ccsq keygen --id NAME" in msg, msg


def test_a_config_file_of_another_kind_is_named_as_that_kind(tmp_path: Path, capsys) -> None:
    """ccsq-brokerd given a workerd-0.toml, ccsq status given a producer.toml: exit 78 saying
    which kind of file it is and which the command needs (it said "unknown key(s)
    'broker_endpoint' (did you mean 'ha_repl_endpoint'?)", which sent the operator to rename
    keys of a good file); a typo in the right file keeps its "did you mean"."""
    from ccsq.brokerd import main as brokerd_main
    from ccsq.tools.init import init_swarm

    configs = init_swarm(tmp_path / "s", workers=1, endpoint=f"tcp://127.0.0.1:{free_tcp_port()}")
    capsys.readouterr()
    assert brokerd_main.run(str(configs["workerd-0"])) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "those of workerd-N.toml, not of brokerd.toml" in err and "did you mean" not in err, err
    rc, _, err = run_ccsq(capsys, "status", "--config", configs["producer"])
    assert rc == ExitCode.CONFIG and "those of producer.toml, not of admin.toml" in err and "did you mean" not in err, err
    broker = _set(Path(configs["brokerd"]), endpont="tcp://127.0.0.1:1")
    assert brokerd_main.run(str(broker)) == ExitCode.CONFIG
    assert "'endpont' (did you mean 'endpoint'?)" in capsys.readouterr().err
