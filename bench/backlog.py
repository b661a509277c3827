"""Benchmarks 4, 2 and 3 on one growing backlog (one fill serves all three).

4. Memory and disk growth: a scripted producer fills the ledger (frames of
   ``FRAME_ITEMS`` jobs, ``WINDOW`` frames in flight, 1 KiB inline claim
   reference each); at each checkpoint (10k, 100k, 1M... queued) the broker's RSS
   and the ledger's bytes on disk (``data.mdb`` blocks) are recorded.
2. Heartbeat lag under backlog: with the full backlog queued, 2 real workers
   (echo) and the completion service connect and drain it. A probe peer (role
   worker, no kinds) sends a session message every ``PROBE_INTERVAL_S`` that the
   actor answers at the very point where it handles a HEARTBEAT (``CREDIT 0``,
   answered at once with ERROR in ``_on_session_message``, before the turn's
   transaction). Its round trip = time from arrival to handling + loopback
   (~0.1 ms). No broker change is needed for it.
3. Restart recovery: a scripted worker takes ``LEASED`` leases (credit), the
   broker is SIGKILLed and restarted; measured from the restart: the
   ``broker_started`` log, the first DISPATCH to a waiting worker, and the
   WELCOME that resumes all ``LEASED`` leases of the reconnecting holder.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import zmq

from bench.ccsq_pipeline import acknowledged, check_alive, start_swarm
from bench.common import claim_ref, disk_bytes, dist, hist_delta, hist_summary, rss_bytes, rss_split_bytes, scrape_histograms
from tests.broker_harness import ScriptedPeer
from ccsq.common.wire import protocol
from ccsq.tools.procs import bin_path, free_tcp_port

FRAME_ITEMS = 500  # 500 x ~1.1 KiB stays under max_frame_bytes (1 MiB)
WINDOW = 4
PROBE_INTERVAL_S = 0.02
LEASED = 1000


def _item(i: int) -> protocol.SubmitItem:
    ref = claim_ref(i)
    digest = hashlib.sha256(ref).hexdigest()
    return protocol.SubmitItem(key=f"bench-{i}", kind="echo", payload=protocol.Blob(digest, len(ref), ref), params={"t": 0.0})


def fill(peer: ScriptedPeer, start: int, stop: int) -> float:
    """Submit jobs ``start .. stop-1`` (durably confirmed); returns seconds taken."""
    t0 = time.monotonic()
    outstanding: set[int] = set()
    nxt = start
    while nxt < stop or outstanding:
        while nxt < stop and len(outstanding) < WINDOW:
            req = peer.next_req()
            peer.send(protocol.Submit(req, [_item(i) for i in range(nxt, min(stop, nxt + FRAME_ITEMS))]))
            outstanding.add(req)
            nxt += FRAME_ITEMS
        ack = peer.recv_type(protocol.SubmitAck, 60)
        bad = [r for r in ack.results if r.error]
        if bad:
            raise RuntimeError(f"broker refused items: {bad[0].error}: {bad[0].message}")
        outstanding.discard(ack.req)
    return time.monotonic() - t0


def probe_lag(peer: ScriptedPeer, duration_s: float) -> list[float]:
    """Round trips (ms) of CREDIT 0 -> ERROR for ``duration_s`` seconds."""
    out: list[float] = []
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        t = time.monotonic()
        peer.send(protocol.Credit(credit=0))
        peer.recv_type(protocol.Error, 30)
        out.append((time.monotonic() - t) * 1000)
        left = PROBE_INTERVAL_S - (time.monotonic() - t)
        if left > 0:
            peer.sock.poll(int(left * 1000))  # wait without a bare sleep (nothing else arrives for the probe)
    return out


def _fresh_peer(root: Path, peer_id: str, endpoint: str) -> ScriptedPeer:
    peer = ScriptedPeer(root, peer_id, endpoint)
    peer.sock.setsockopt(zmq.RECONNECT_IVL, 10)
    return peer


def run(root: Path, sizes: list[int], lag_s: float = 10.0) -> dict[str, Any]:
    """Fill to each of ``sizes`` (ascending), then measure lag and restart at the last size."""
    metrics_port = free_tcp_port()
    procs, configs = start_swarm(root, workers=4, start_workers=0, start_completion=False,
                                 broker={"log_format": "json", "metrics_port": metrics_port,
                                         "result_reserve_bytes": 2048})  # echo results are a few bytes: let millions queue
    hists = ("ccsq_turn_seconds", "ccsq_heartbeat_lag_seconds")
    endpoint = (root / "broker-data" / "endpoint").read_text().strip()
    out: dict[str, Any] = {"sizes": sizes}
    try:
        broker_pid = procs.procs["broker"].popen.pid
        producer = ScriptedPeer(root, "producer-1", endpoint)
        producer.hello("producer")
        growth = [{"queued": 0, "fill_s": 0.0, "broker_rss_bytes": rss_bytes(broker_pid), "rss_split": rss_split_bytes(broker_pid),
                   "ledger_disk_bytes": disk_bytes(root / "broker-data")}]
        done = 0
        for size in sizes:
            took = fill(producer, done, size)
            done = size
            growth.append({"queued": size, "fill_s": round(took, 2), "submit_per_s": round((size - growth[-1]["queued"]) / took),
                           "broker_rss_bytes": rss_bytes(broker_pid), "rss_split": rss_split_bytes(broker_pid),
                           "ledger_disk_bytes": disk_bytes(root / "broker-data")})
        producer.close()
        big = growth[-1]
        prev = growth[-2] if len(growth) > 2 else growth[1]
        out["growth"] = growth
        out["ledger_bytes_per_item"] = round(big["ledger_disk_bytes"] / big["queued"]) if big["queued"] else 0
        if big["queued"] != prev["queued"]:
            out["ledger_bytes_per_item_marginal"] = round(
                (big["ledger_disk_bytes"] - prev["ledger_disk_bytes"]) / (big["queued"] - prev["queued"]))

        # --- 2: heartbeat lag while 2 workers drain the backlog ---
        probe = ScriptedPeer(root, "worker-3", endpoint)
        probe.hello("worker", credit=0, kinds=["probe"], slots=1)
        idle = probe_lag(probe, 2.0)
        for n in (1, 2):
            procs.start(f"worker-{n}", [bin_path("ccsq-workerd"), "--config", str(configs[f"workerd-{n - 1}"])],
                        ready_event="broker_link_ready", ready_timeout_s=120)
        procs.start("completion", [bin_path("ccsq"), "completion", "--config", str(configs["completion"])],
                    ready_event="broker_link_ready")
        acked0, t0 = acknowledged(root), time.monotonic()
        before = scrape_histograms(metrics_port, hists)
        busy = probe_lag(probe, lag_s)
        during = {name: hist_delta(h, before[name]) for name, h in scrape_histograms(metrics_port, hists).items()}
        check_alive(procs)
        drained = acknowledged(root) - acked0
        out["heartbeat_lag_ms"] = {"idle_backlog": dist(idle, 2), "draining": dist(busy, 2),
                                   "drain_jobs_per_s": round(drained / (time.monotonic() - t0), 1),
                                   "broker_rss_bytes_draining": rss_bytes(broker_pid)}
        # the broker's own view of the same seconds: how long its turns took (a frame
        # arriving during a turn waits at most that long) and the workers' heartbeats'
        # sent -> handled delay
        out["broker_side_ms"] = {"turn": hist_summary(during["ccsq_turn_seconds"], 1000.0),
                                 "worker_heartbeat_lag": hist_summary(during["ccsq_heartbeat_lag_seconds"], 1000.0)}
        probe.close()
        for name in ("worker-1", "worker-2", "completion"):
            procs.stop(name)

        # --- 3: restart recovery with LEASED leases held ---
        holder = ScriptedPeer(root, "worker-4", endpoint)
        holder.hello("worker", credit=LEASED, kinds=["echo"], slots=LEASED)
        leases: list[protocol.LeaseRef] = []
        while len(leases) < LEASED:
            d = holder.recv_type(protocol.Dispatch, 30)
            leases.extend(protocol.LeaseRef(t.item_id, t.token) for t in d.tasks)
        holder.close()
        procs.kill("broker")
        holder = _fresh_peer(root, "worker-4", endpoint)
        taker = _fresh_peer(root, "worker-3", endpoint)
        holder.send(protocol.Hello(role="worker", credit=0, kinds=["echo"], slots=LEASED, leases=leases))
        taker.send(protocol.Hello(role="worker", credit=1, kinds=["echo"], slots=1))
        t0, t0_wall = time.monotonic(), time.time()
        procs.start("broker", [bin_path("ccsq-brokerd"), "--config", str(configs["brokerd"])])
        poller = zmq.Poller()
        poller.register(holder.sock, zmq.POLLIN)
        poller.register(taker.sock, zmq.POLLIN)
        first_dispatch_s = resumed_s = None
        resumed = 0
        deadline = t0 + 60
        while (first_dispatch_s is None or resumed_s is None) and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                peer = holder if sock is holder.sock else taker
                env = peer.codec.decode(sock.recv_multipart(), bound_sender="broker")
                msg = env.message
                if peer is taker and isinstance(msg, protocol.Dispatch) and first_dispatch_s is None:
                    first_dispatch_s = time.monotonic() - t0
                elif peer is holder and isinstance(msg, protocol.Welcome) and resumed_s is None:
                    resumed_s, resumed = time.monotonic() - t0, len(msg.resumed)
        started = [e for e in procs.procs["broker"].events() if e.get("event") == "broker_started"]
        recovered = [e for e in procs.procs["broker"].events() if e.get("event") == "ledger_recovered"]
        started_s = None
        if len(started) >= 2:
            ts = datetime.datetime.fromisoformat(started[-1]["timestamp"].replace("Z", "+00:00")).timestamp()
            started_s = round(ts - t0_wall, 3)
        out["restart"] = {
            "queued": done,
            "started_s": started_s,
            "leased": LEASED,
            "first_dispatch_s": None if first_dispatch_s is None else round(first_dispatch_s, 3),
            "all_leases_resumed_s": None if resumed_s is None else round(resumed_s, 3),
            "leases_resumed": resumed,
            "ledger_recovered_leases": recovered[-1].get("leases") if recovered else None,
            "broker_starts": len(started),
        }
        holder.close()
        taker.close()
    finally:
        procs.stop_all()
    return out


if __name__ == "__main__":  # quick manual run
    print(json.dumps(run(Path("/tmp/bench-backlog"), [1000, 5000], lag_s=2.0), indent=1))
