"""Reconnect noise apart from refusals, and failed ZeroMQ handshakes seen, with a real
broker (issue 22, defect 8; docs/security.md).

* A broker restart makes every connected peer send frames of a session the new broker
  does not have (NO_SESSION) before it says HELLO again: counted as ``reconnect_noise``
  (gap report, ``ccsq_reconnect_noise_frames``), logged at info, never in ``rejects``
  with warnings (those are refusals: what an attack looks like).
* A plain (non-CURVE) client at a CURVE broker fails the ZeroMQ handshake before any
  frame reaches the broker: counted (``ccsq_handshake_failed{reason="plain_client"}``) and
  logged once per interval (``handshake_failed``), not silently dropped.

Both fail on a broker that counted NO_SESSION in ``rejects`` and had no handshake monitor.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import zmq

from ccsq.tools.procs import free_tcp_port
from tests.swarm import Swarm, wait_until

pytestmark = pytest.mark.timeout(120)


def _metrics(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_reconnects_after_a_broker_restart_are_noise_not_refusals(tmp_path: Path) -> None:
    # liveness 20 x 0.2 s: the peers still hold their sessions when the new broker is up
    with Swarm(tmp_path, broker={"liveness": 20}) as swarm:
        broker = swarm.start_broker()
        worker = swarm.start_worker(1)
        swarm.start_completion()
        with swarm.client() as client:
            client.submit(b"before", "echo")
        swarm.wait_acknowledged(1)
        for restart in range(2):
            swarm.procs.kill("broker")
            swarm.start_broker()
            wait_until(lambda: worker.count("broker_link_ready") >= 2 + restart, 30, "the worker reconnected")
        with swarm.client() as client:
            client.submit(b"after", "echo")
        rep = swarm.wait_acknowledged(2)
        wait_until(lambda: swarm.report()["reconnect_noise"].get("NO_SESSION", 0) >= 1, 30,
                   "the stale-session frames counted as reconnect noise")
        rep = swarm.report()
        assert "NO_SESSION" not in rep["rejects"], rep["rejects"]
        warned = [e for e in broker.events() if e.get("event") == "frame_rejected" and e.get("code") == "NO_SESSION"]
        assert not warned, warned
        assert broker.count("stale_session_frame") >= 1


def test_plain_client_at_a_curve_broker_is_counted_and_logged(tmp_path: Path) -> None:
    port = free_tcp_port()
    with Swarm(tmp_path, broker={"curve": True, "metrics_listen": f"127.0.0.1:{port}"}) as swarm:
        broker = swarm.start_broker()
        def failed() -> dict:
            return {dict(labels)["reason"]: v for (name, labels), v in _metrics(port).items()
                    if name == "ccsq_handshake_failed_total"}

        ctx = zmq.Context()
        try:
            for i in range(5):  # five plain strangers, one after another
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(swarm.endpoint)
                sock.send(b"hello?")
                # each stays connected until the broker has counted its failed handshake (on a
                # loaded box a fixed 0.2 s let the plain side close first: all five NO_DETAIL)
                wait_until(lambda: sum(failed().values()) >= i + 1, 30, f"failed handshake {i + 1} counted")
                sock.close()
        finally:
            ctx.term()

        # (libzmq names a mechanism mismatch as such, or, when the plain side closes first, NO_DETAIL)
        counted = wait_until(lambda: f if sum((f := failed()).values()) >= 5 else None, 30, "five failed handshakes counted")
        assert counted.get("plain_client", 0) >= 1, counted
        lines = [e for e in broker.events() if e.get("event") == "handshake_failed"]
        assert any(e["reason"] == "plain_client" for e in lines) and all(e["level"] == "warning" for e in lines), lines
        assert len(lines) == len({e["reason"] for e in lines}), lines  # rate-limited: one line per reason, not five
