"""CPU per job of ONE ccsq-brokerd, without the other daemons' noise: a real broker, and a
scripted producer, worker and completion service in this process (real ZeroMQ, real signed
envelopes). The producer submits ``n`` echo jobs in frames of ``frame`` (1 KiB inline claim
reference each, like benchmark 1), ``window`` frames in flight; the worker keeps ``credit``
and completes every DISPATCH frame with one COMPLETE; the completion service ACKs every
RESULT frame. The broker's CPU seconds are read from /proc around the run. Used to A/B broker
changes on a shared machine, where the whole pipeline's figures move with the
neighbours' load.

    python -m bench.broker_cpu [--n 20000] [--profile broker.txt] [--signed]

The scripted peers use session MACs as BrokerLink peers do (``--signed``: every frame signed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from bench.common import claim_ref, cpu_s

ROOT = Path(__file__).resolve().parent.parent


def run(n: int = 20000, frame: int = 100, window: int = 8, credit: int = 512, profile: Path | None = None,
        signed: bool = False, profile_rate_hz: int = 200) -> dict:
    sys.path.insert(0, str(ROOT))
    from bench.ccsq_pipeline import start_swarm
    from ccsq.tools.procs import bin_path
    from ccsq.common.wire import protocol
    from tests.broker_harness import ScriptedPeer

    def item(i: int) -> protocol.SubmitItem:
        ref = claim_ref(i)
        return protocol.SubmitItem(key=f"bench-{i}", kind="echo", payload=protocol.Blob(hashlib.sha256(ref).hexdigest(), len(ref), ref),
                            params={"t": 0.0})

    result = protocol.Blob(hashlib.sha256(b"ok").hexdigest(), 2, b"ok")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        procs, _configs = start_swarm(root, workers=1, start_workers=0, start_completion=False)
        try:
            endpoint = (root / "broker-data" / "endpoint").read_text().strip()
            prod = ScriptedPeer(root, "producer-1", endpoint, rcvhwm=0, session_macs=not signed)
            prod.hello("producer")
            work = ScriptedPeer(root, "worker-1", endpoint, rcvhwm=0, session_macs=not signed)
            work.hello("worker", slots=4, credit=credit, kinds=["echo"])
            comp = ScriptedPeer(root, "completion-1", endpoint, rcvhwm=0, session_macs=not signed)
            comp.hello("completion", credit=credit)
            pid = procs.procs["broker"].popen.pid
            spy = None
            if profile is not None:
                spy = subprocess.Popen([bin_path("py-spy"), "record", "-p", str(pid), "-r", str(profile_rate_hz), "--format", "raw",
                                        "-o", str(profile), "--nonblocking", "--gil"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            cpu0, t0 = cpu_s(pid), time.monotonic()
            nxt = acked = in_flight = 0
            poller = zmq.Poller()
            for peer in (prod, work, comp):
                poller.register(peer.sock, zmq.POLLIN)
            deadline = time.monotonic() + 600
            while acked < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{acked} of {n} acknowledged")
                while nxt < n and in_flight < window:
                    prod.send(protocol.Submit(prod.next_req(), [item(i) for i in range(nxt, min(n, nxt + frame))]))
                    nxt, in_flight = nxt + frame, in_flight + 1
                for sock, _ in poller.poll(1000):
                    peer = prod if sock is prod.sock else work if sock is work.sock else comp
                    env = peer.recv(0)
                    if env is None:
                        continue
                    msg = env.message
                    if isinstance(msg, protocol.SubmitAck):
                        in_flight -= 1
                    elif isinstance(msg, protocol.Dispatch):
                        work.send(protocol.Complete([protocol.TaskResult(t.item_id, t.token, result, "echo", "1") for t in msg.tasks]))
                        work.send(protocol.Credit(credit=len(msg.tasks)))
                    elif isinstance(msg, protocol.Result):
                        comp.send(protocol.Ack([d.item_id for d in msg.deliveries]))
                        comp.send(protocol.Credit(credit=len(msg.deliveries)))
                    elif isinstance(msg, protocol.AckOk):
                        acked += len(msg.item_ids)
            cpu, wall = cpu_s(pid) - cpu0, time.monotonic() - t0
            if spy is not None:
                spy.send_signal(2)
                spy.wait(timeout=30)
            for peer in (prod, work, comp):
                peer.close()
        finally:
            procs.stop_all()
    return {"n": n, "broker_cpu_s": round(cpu, 2), "broker_cpu_us_per_job": round(cpu / n * 1e6, 1),
            "wall_s": round(wall, 1), "jobs_per_s": round(n / wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--profile", type=Path, default=None, help="py-spy raw profile of the broker (--gil)")
    ap.add_argument("--profile-rate", type=int, default=200, help="py-spy samples per second (--profile)")
    ap.add_argument("--signed", action="store_true", help="peers sign every frame (no session MACs, like older peers)")
    args = ap.parse_args()
    print(json.dumps(run(args.n, profile=args.profile, signed=args.signed, profile_rate_hz=args.profile_rate)))


if __name__ == "__main__":
    main()
