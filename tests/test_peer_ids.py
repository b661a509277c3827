"""One peer id, one live session (issue 27, defect 2), with real processes.

A HELLO for a peer id whose session is live (heard within its liveness window) from
another process is refused with ID_IN_USE: the live session keeps the id, the newcomer
retries until the holder's window would lapse and then exits 78 naming the id and the
holder. A crashed (here: frozen) holder's successor gets in as soon as the window lapses.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from ccsq.tools.procs import bin_path
from tests.swarm import Swarm, wait_until


def _events(proc, name: str) -> list[dict]:
    return [e for e in proc.events() if e.get("event") == name]


def test_a_second_completion_service_with_a_live_ones_id_exits_78_and_the_live_one_keeps_serving(tmp_path: Path) -> None:
    """The issue's case: ``ccsq-completiond --config completion.toml`` run by hand beside the
    service. It used to replace the service's session (the service logged REPLACED and
    exited 78, never restarted). Now the hand-run one is refused, exits 78 within about
    one liveness window (0.2 s x 5 here) naming the id and the live holder (host/pid),
    and the service keeps its session and stores every result."""
    with Swarm(tmp_path / "s") as swarm:
        swarm.start_broker()
        swarm.start_worker(1)
        service = swarm.start_completion()
        by_hand = swarm.procs.start("completion-by-hand",
                                    [bin_path("ccsq-completiond"), "--config", str(swarm.configs["completion"])])
        assert swarm.procs.wait_exit("completion-by-hand", timeout_s=30) == 78
        out = by_hand.log_path.read_text(errors="replace")
        assert "completion-1" in out and f"{socket.gethostname()}/{service.popen.pid}/" in out, out[-2000:]
        assert _events(by_hand, "peer_id_in_use_waiting") and _events(by_hand, "peer_id_in_use")
        assert not _events(by_hand, "broker_link_ready")
        assert service.running and service.count("peer_id_in_use") == 0
        refused = _events(swarm.procs.procs["broker"], "peer_id_in_use_refused")
        assert refused and refused[0]["peer"] == "completion-1"
        with swarm.client() as client:
            ids = [client.submit(f"doc {i}".encode(), "echo").item_id for i in range(5)]
            states = client.wait(ids, timeout_s=60)
        assert {s.state for s in states.values()} == {"acknowledged"}
        assert len(swarm.results()) == 5 and service.running
        assert service.count("broker_link_ready") == 1  # its one session was never displaced
        rep = swarm.report()
    assert rep["balanced"] and rep["counters"]["acknowledged"] == 5


def test_a_frozen_workers_successor_gets_in_when_the_liveness_window_lapses(tmp_path: Path) -> None:
    """A process restarted beside a dead (here: SIGSTOPped, socket still open) holder of its
    id: refused while the holder's session is inside its liveness window (0.2 s x 50 =
    10 s: a worker's start under a loaded CI machine takes a few seconds), admitted as soon as
    it lapses (not a window of backoff later), then it works.
    The holder, resumed, finds its id taken by a live session: it exits 78."""
    import tomli_w
    import tomllib

    window_s = 0.2 * 50
    with Swarm(tmp_path / "s", broker={"liveness": 50, "lease_ttl_s": 20.0}) as swarm:
        swarm.start_broker()
        swarm.start_completion()
        holder = swarm.start_worker(1)
        twin_cfg = tmp_path / "s" / "workerd-1-twin.toml"
        doc = tomllib.loads(swarm.configs["workerd-0"].read_text())  # worker-1
        doc["journal_dir"] = "worker-1-twin-journal"
        twin_cfg.write_text(tomli_w.dumps(doc))
        swarm.procs.signal("worker-1", signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            twin = swarm.procs.start("worker-1-twin", [bin_path("ccsq-workerd"), "--config", str(twin_cfg)])
            wait_until(lambda: _events(twin, "peer_id_in_use_waiting"), 30, "the twin to be refused ID_IN_USE")
            assert time.monotonic() - stopped < window_s - 0.5, "the twin started too slowly for this test"
            wait_until(lambda: _events(twin, "broker_link_ready"), 30, "the twin to get in")
            admitted_s = time.monotonic() - stopped
        finally:
            swarm.procs.signal("worker-1", signal.SIGCONT)
        # the holder's last heartbeat was at most one interval before the stop; the twin polls
        # (at most 1 s apart) until just after the window lapses
        assert window_s - 0.3 <= admitted_s <= window_s + 3.0, admitted_s
        assert not _events(twin, "peer_id_in_use")
        assert swarm.procs.wait_exit("worker-1", timeout_s=30) == 78
        assert holder.count("peer_id_in_use") == 1
        with swarm.client() as client:
            ids = [client.submit(f"job {i}".encode(), "echo").item_id for i in range(3)]
            states = client.wait(ids, timeout_s=60)
        assert {s.state for s in states.values()} == {"acknowledged"}
        assert twin.running


_HOLD_ADMIN = """
import asyncio, sys
from ccsq.tools.admin_client import with_broker
from ccsq.common.wire.config import AdminConfig, load

async def hold(session):
    print("HOLDING", flush=True)
    await asyncio.sleep(60)

with_broker(load(AdminConfig, sys.argv[1]), hold)
"""


def test_an_admin_command_beside_a_live_admin_session_of_its_id_exits_78_naming_the_holder(tmp_path: Path) -> None:
    """Admin peers follow the same rule: ``ccsq status`` run while another process holds a
    live session with the same admin id is refused ID_IN_USE, waits out one liveness
    window (not just connect_timeout_s) and exits 78 naming the id and the holder; the
    holder's session is untouched. Once the holder ends (BYE), the id is free again."""
    import subprocess
    import sys

    with Swarm(tmp_path / "s", workers=0) as swarm:
        swarm.start_broker()
        admin = str(swarm.configs["admin"])
        holder = swarm.procs.start("admin-holder", [sys.executable, "-c", _HOLD_ADMIN, admin])
        wait_until(lambda: "HOLDING" in holder.log_path.read_text(errors="replace"), 30, "the admin session to open")
        t0 = time.monotonic()
        run = subprocess.run([bin_path("ccsq"), "status", "--config", admin], capture_output=True, text=True, timeout=60)
        assert run.returncode == 78, (run.returncode, run.stdout[-500:], run.stderr[-1500:])
        assert "'admin'" in run.stderr and f"/{holder.popen.pid}/" in run.stderr, run.stderr[-1500:]
        assert time.monotonic() - t0 < 20
        assert holder.running
        assert swarm.procs.stop("admin-holder") is not None
        again = subprocess.run([bin_path("ccsq"), "status", "--config", admin, "--json"], capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 0, again.stderr[-1500:]
