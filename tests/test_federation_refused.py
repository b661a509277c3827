"""A relay refused by a broker, with real processes on loopback (docs/federation.md,
"Failure domains"): a refused link stops alone and loudly (error log, metric, the
federation report and its exit code, ``ccsq status`` on the other swarm), the relay's
other links keep moving work, and a relay whose every link is refused exits 77 (the
unit does not restart it; README exit codes).

Fails on a relay whose ``run`` returned when any one link's session ended (one refused
link stopped every link, and the process exited 0 after ``relay_stopped`` at info).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ccsq.tools.procs import bin_path, free_tcp_port
from tests.fedswarm import FedPair, deauthorize
from tests.swarm import wait_until

pytestmark = pytest.mark.timeout(180)


def _report_cli(pair: FedPair) -> tuple[int, dict, str]:
    js = subprocess.run([bin_path("ccsq"), "federation", "report", "--config", str(pair.relay_cfg), "--json"],
                        capture_output=True, text=True, timeout=60)
    text = subprocess.run([bin_path("ccsq"), "federation", "report", "--config", str(pair.relay_cfg)],
                          capture_output=True, text=True, timeout=60)
    return js.returncode, json.loads(js.stdout), text.stdout


def test_refused_link_stops_alone_beside_a_working_one(tmp_path: Path) -> None:
    """Two links (a -> b, b -> a); a does not list the relay's b -> a downstream peer id:
    that link is refused and says so; a -> b keeps draining a's backlog."""
    metrics_port = free_tcp_port()
    with FedPair(tmp_path, both_ways=True, relay={"metrics_listen": f"127.0.0.1:{metrics_port}"}) as pair:
        deauthorize(pair.a, "relay-b-to-a-down")
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        relay = pair.start_relay()
        wait_until(lambda: relay.count("link_refused") >= 1, 30, "the b -> a link refused")
        with pair.a.client() as client:
            for i in range(6):
                client.submit(f"after-refusal-{i}".encode(), "echo")
        pair.a.wait_acknowledged(6, timeout_s=60)  # through the a -> b link, after the other was refused
        assert relay.running
        assert pair.counters(0)["returned"] == 6
        rc, doc, text = _report_cli(pair)
        assert rc == 77, (rc, doc)  # balanced, but a link is broken
        assert doc["balanced"] is True and doc["healthy"] is False
        good, bad = doc["links"]
        assert good["name"] == "a-to-b" and good["broken"] is None
        assert bad["name"] == "b-to-a" and bad["broken"]["cause"] == "downstream_refused"
        assert "relay-b-to-a-down" in bad["broken"]["fix"] and "authorized_keys" in bad["broken"]["fix"]
        assert "LINK BROKEN: b-to-a" in text and "fix:" in text
        import urllib.request

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'ccsq_relay_link_broken{link="b-to-a"} 1.0' in metrics
        assert 'ccsq_relay_link_broken{link="a-to-b"} 0.0' in metrics
        # b, the upstream of the refused link, sees it in ccsq status (the relay's heartbeat)
        out = subprocess.run([bin_path("ccsq"), "status", "--config", str(pair.b.configs["admin"])],
                             capture_output=True, text=True, timeout=30).stdout
        assert "relay-b-to-a-up: federation link BROKEN" in out, out
        errors = [e for e in relay.events() if e.get("event") in ("link_refused", "link_broken")]
        assert errors and all(e.get("level") == "error" for e in errors), errors


def test_relay_whose_every_link_is_refused_exits_77(tmp_path: Path) -> None:
    with FedPair(tmp_path) as pair:
        deauthorize(pair.b, "relay-a-to-b-down")
        pair.a.start_broker()
        pair.b.start_broker()
        relay = pair.start_relay(wait=False)
        wait_until(lambda: not relay.running, 60, "the refused relay to exit")
        assert relay.popen.returncode == 77, relay.popen.returncode
        assert "every link was refused" in relay.log_path.read_text()  # the reason on stderr
        doc = pair.report()
        assert doc["links"][0]["broken"]["cause"] == "downstream_refused"


def test_refused_origins_break_the_link_in_report_and_status(tmp_path: Path) -> None:
    """b does not trust a's origin key: b refuses every relayed item (ORIGIN_REJECTED), the
    relay stops pulling and gives the leases back. The federation report says the link
    is broken, since when, why and the fix (exit 77, though its books balance), and a's
    ``ccsq status`` shows it on the relay's peer; a's own worker runs the items."""
    with FedPair(tmp_path) as pair:
        (tmp_path / "b" / "trusted_swarms.toml").write_text("[swarms]\n")  # a's key missing in b
        pair.a.start_broker()
        pair.a.start_completion()
        pair.b.start_broker()
        pair.b.start_completion()
        pair.b.start_worker(1)
        relay = pair.start_relay()
        pair.wait_connected()
        with pair.a.client() as client:
            for i in range(4):
                client.submit(f"untrusted-{i}".encode(), "echo")
        wait_until(lambda: relay.count("link_broken", cause="origin_rejected") >= 1, 30, "the link broken")
        pair.a.start_worker(1)
        pair.a.wait_acknowledged(4, timeout_s=60)
        wait_until(lambda: pair.report()["links"][0]["in_flight"] == 0, 30, "the link drained")
        rc, doc, text = _report_cli(pair)
        assert rc == 77 and doc["balanced"] is True, (rc, doc)
        broken = doc["links"][0]["broken"]
        assert broken["cause"] == "origin_rejected" and "trusted_swarms" in broken["fix"] and broken["since_ts"] > 0, broken
        assert "BROKEN since" in text and "fix:" in text, text
        out = subprocess.run([bin_path("ccsq"), "status", "--config", str(pair.a.configs["admin"])],
                             capture_output=True, text=True, timeout=30).stdout
        assert "relay-a-to-b-up: federation link BROKEN" in out and "trusted_swarms" in out, out
        assert relay.running
        assert pair.a.report()["counters"]["dead"] == 0
