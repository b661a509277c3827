"""Junk flood: how much memory can a peer make the broker hold?

Starts a real ``ccsq-brokerd`` (``ccsq init`` layout, loopback), opens
``--connections`` ZeroMQ DEALER connections that send junk 2-frame messages
(``--frame-bytes`` of junk + 64 bytes) as fast as the broker takes them for
``--duration-s``, and prints the broker's RSS (``/proc/PID/status`` VmRSS)
before, at its peak during the flood, and ``--settle-s`` after it stopped.

Who floods (``--who``):

- ``stranger``: no keys. Against a broker with ``curve = true`` it offers a
  fresh CURVE key pair that is not in ``authorized_keys.toml`` (the ZAP
  allow-list must drop it at the handshake); against a plain broker it just
  connects.
- ``authorized``: the CURVE keys of the swarm's authorized peers (``--curve``
  needed): the handshake succeeds, the junk is refused after the frame is read.
  This measures the receive high-water mark and frame-size bound.

Usage::

    .venv/bin/python -m bench.junk_flood --connections 32 --frame-bytes 1048576 --duration-s 10
    .venv/bin/python -m bench.junk_flood --curve --who stranger ...
    .venv/bin/python -m bench.junk_flood --curve --who authorized ...

Prints one JSON line (sizes in MiB, durations in seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import zmq


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (0.0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except FileNotFoundError:
        pass
    return 0.0


def flood(endpoint: str, connections: int, frame_bytes: int, duration_s: float, curve_keys: list[tuple[bytes, bytes]] | None,
          server_key: bytes | None) -> dict[str, int]:
    """Send junk on ``connections`` DEALERs for ``duration_s``; returns messages/bytes handed to ZeroMQ.

    ``curve_keys``: one (public, secret) Z85 pair per connection, cycled (None: plain)."""
    ctx = zmq.Context()
    junk = os.urandom(frame_bytes)
    sig = os.urandom(64)
    socks = []
    for i in range(connections):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        if server_key is not None and curve_keys:
            pub, sec = curve_keys[i % len(curve_keys)]
            s.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
            s.setsockopt(zmq.CURVE_SECRETKEY, sec)
        s.connect(endpoint)
        socks.append(s)
    sent = 0
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        progress = False
        for s in socks:
            try:
                s.send_multipart([junk, sig], flags=zmq.NOBLOCK, copy=False)
                sent += 1
                progress = True
            except zmq.Again:
                pass
        if not progress:
            time.sleep(0.001)
    for s in socks:
        s.close(linger=0)
    ctx.term()
    return {"messages_queued": sent, "bytes_queued": sent * (frame_bytes + 64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--frame-bytes", type=int, default=1 << 20, help="junk bytes per message (default 1 MiB = max_frame_bytes)")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--settle-s", type=float, default=10.0, help="RSS is read again this long after the flood")
    ap.add_argument("--curve", action="store_true", help="broker with curve = true (ZAP allow-list of authorized_keys.toml)")
    ap.add_argument("--who", choices=("stranger", "authorized"), default="stranger")
    ap.add_argument("--dir", default="", help="swarm directory (default: a fresh temporary one)")
    args = ap.parse_args()

    from ccsq.tools.init import init_swarm
    from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ccsq-flood-"))
    port = free_tcp_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    configs = init_swarm(root / "swarm", endpoint=endpoint, workers=args.connections, broker={"min_free_disk_bytes": 0})
    keys = root / "swarm" / "keys"
    if args.curve:
        text = configs["brokerd"].read_text().replace("curve = false", "curve = true")
        if "curve = true" not in text:
            text += "curve = true\n"
        configs["brokerd"].write_text(text)
    server_key = (keys / "broker.curve.pub").read_text().strip().encode() if args.curve else None
    if args.who == "authorized":
        if not args.curve:
            ap.error("--who authorized needs --curve")
        curve_keys = [((keys / f"worker-{i}.curve.pub").read_text().strip().encode(),
                       (keys / f"worker-{i}.curve.key").read_text().strip().encode()) for i in range(1, args.connections + 1)]
    else:
        curve_keys = [zmq.curve_keypair() for _ in range(args.connections)] if args.curve else None

    with ProcessGroup(root / "logs") as procs:
        broker = procs.start("broker", [bin_path("ccsq-brokerd"), "--config", str(configs["brokerd"])], ready_event="broker_started")
        pid = broker.popen.pid
        time.sleep(1.0)
        before = rss_mib(pid)
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], rss_mib(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        sent = flood(endpoint, args.connections, args.frame_bytes, args.duration_s, curve_keys, server_key)
        flood_s = time.monotonic() - t0
        at_end = rss_mib(pid)
        time.sleep(args.settle_s)
        stop.set()
        sampler.join()
        after = rss_mib(pid)
        alive = broker.running
    print(json.dumps({
        "curve": args.curve, "who": args.who, "connections": args.connections, "frame_bytes": args.frame_bytes,
        "duration_s": round(flood_s, 1), **sent,
        "rss_before_mib": round(before, 1), "rss_peak_mib": round(peak[0], 1), "rss_at_end_mib": round(at_end, 1),
        "rss_after_settle_mib": round(after, 1), "broker_alive": alive,
    }))


if __name__ == "__main__":
    main()
