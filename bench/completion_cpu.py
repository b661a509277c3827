"""CPU per result of ONE ``ccsq completion`` service, without the broker's noise: the scripted
broker of the completion tests (``tests/scripted_broker.py``: real ZeroMQ, real signed
envelopes, RESULT frames as the credit allows, ACK_OK at once) delivers ``n`` echo results
(1 KiB inline result and ``params = {"t": ...}`` each, like benchmark 1) to a real
``ccsq completion`` process writing to SQLite (``synchronous=FULL``), waits until every
result is acknowledged, and reads the service's CPU seconds from /proc around the run.
Used to A/B completion changes on a shared machine, where the whole pipeline's figures
move with the neighbours' load.

    python -m bench.completion_cpu [--n 20000] [--database postgresql://...] [--profile FILE]
    python -m bench.completion_cpu --phases [--n 20000]

``--phases`` splits the same work in one process, without sockets or threads: CPU per
result (user / system, from ``getrusage``) of verifying and decoding the RESULT frames
(the envelope codec), of the service's ``_resolve`` (rows from deliveries) and of
``ResultsDB.land`` (SQLite, 256 rows per transaction), and of encoding the ACKs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import claim_ref, cpu_s

ROOT = Path(__file__).resolve().parent.parent


def _user_sys_s(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def run(n: int = 20_000, *, credit: int = 512, database: str = "sqlite:///results.db",
        profile: Path | None = None) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from ccsq.tools.procs import ProcessGroup, bin_path, free_tcp_port, wait_until
    from tests.scripted_broker import ScriptedBroker, make_pki, write_config

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_pki(root, {"broker": "broker", "completion-1": "completion"})
        endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
        config = write_config(root, "completion", "completion-1", endpoint, database=database, credit=credit)
        broker = ScriptedBroker(root, endpoint, heartbeat_interval_s=1.0).start()
        procs = ProcessGroup(root / "logs")
        spy = None
        try:
            proc = procs.start("completion", [bin_path("ccsq"), "completion", "--config", str(config)],
                               ready_event="broker_link_ready")
            pid = proc.popen.pid
            deliveries = _deliveries(n)
            if profile is not None:
                import subprocess

                spy = subprocess.Popen([bin_path("py-spy"), "record", "-p", str(pid), "-r", "500", "--format", "raw",
                                        "-o", str(profile), "--nonblocking", "--gil"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
                time.sleep(1.0)  # py-spy attaches asynchronously
            cpu0, t0, us0 = cpu_s(pid), time.monotonic(), _user_sys_s(pid)
            for d in deliveries:
                broker.add_completed(d)
            wait_until(lambda: len(broker.acked_ids()) >= n, 600, f"{n} acknowledged", interval_s=0.02)
            el = time.monotonic() - t0
            cpu = cpu_s(pid) - cpu0
            us1 = _user_sys_s(pid)
            acks = broker.ack_frames()
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
        finally:
            procs.stop_all()
            broker.close()
    return {"results": n, "cpu_s": round(cpu, 2), "cpu_us_per_result": round(1e6 * cpu / n, 1),
            "results_per_s": round(n / el, 1), "ack_frames": acks,
            "user_us_per_result": round(1e6 * (us1[0] - us0[0]) / n, 1),
            "sys_us_per_result": round(1e6 * (us1[1] - us0[1]) / n, 1)}


def _deliveries(n: int) -> list:
    from ccsq.common.storage.claimstore import sha256_hex
    from ccsq.common.wire import protocol

    now = time.time()
    out = []
    for i in range(n):
        data = claim_ref(i)
        out.append(protocol.Delivery(
            item_id=f"i{i:09d}", key=hashlib.sha256(b"k%d" % i).hexdigest(), kind="echo",
            result=protocol.Blob(sha256_hex(data), len(data), data), params={"t": now}, attempt=1,
            handler="echo", handler_version="1", completed_ts=now))
    return out


def phases(n: int = 20_000, batch: int = 256) -> dict[str, dict[str, float]]:
    """CPU µs per result of each step of the service's path, in this process (see the module doc)."""
    import asyncio
    import resource

    sys.path.insert(0, str(ROOT))
    from ccsq.common.wire import protocol
    from ccsq.common.wire.config import CompletionConfig, load
    from ccsq.common.wire.envelope import EnvelopeCodec
    from ccsq.common.wire.keys import AuthorizedKeys, load_private_key
    from ccsq.completiond.completion import CompletionService
    from tests.scripted_broker import make_pki, write_config

    def now() -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime, r.ru_stime

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_pki(root, {"broker": "broker", "completion-1": "completion"})
        keys = AuthorizedKeys(root / "authorized_keys.toml")
        broker = EnvelopeCodec("broker", load_private_key(root / "keys" / "broker.key"), keys)
        ds = _deliveries(n)
        frames = [broker.encode(protocol.Result(deliveries=ds[k:k + batch])) for k in range(0, n, batch)]
        config = load(CompletionConfig, write_config(root, "completion", "completion-1", "tcp://127.0.0.1:9"))
        svc = CompletionService(config)
        codec = EnvelopeCodec("completion-1", load_private_key(root / "keys" / "completion-1.key"), keys,
                              require_hello=False)
        try:
            t = [now()]
            msgs = [codec.decode(f, bound_sender="broker").message for f in frames]
            t.append(now())
            rows = [asyncio.run(svc._resolve([(0, m.deliveries)]))[0] for m in msgs]
            t.append(now())
            for r in rows:
                svc.db.land(r)
            t.append(now())
            for r in rows:
                codec.encode(protocol.Ack(item_ids=sorted({x[0] for x in r}), quarantined=[]))
            t.append(now())
        finally:
            svc.db.close()
            svc._db_exec.shutdown()
            svc._io_exec.shutdown()
    names = ["decode RESULT (verify + codec)", "_resolve (rows)", "land (SQLite)", "encode ACK"]
    return {name: {"user_us": round(1e6 * (t[i + 1][0] - t[i][0]) / n, 1),
                   "sys_us": round(1e6 * (t[i + 1][1] - t[i][1]) / n, 1)} for i, name in enumerate(names)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.completion_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--database", default="sqlite:///results.db", help="the service's database URL")
    ap.add_argument("--profile", type=Path, help="record the service with py-spy (raw) into this file")
    ap.add_argument("--phases", action="store_true", help="CPU per result of each step, in this process")
    args = ap.parse_args(argv)
    if args.phases:
        for name, cpu in phases(args.n).items():
            print(f"  {name:32} user {cpu['user_us']:6.1f}  sys {cpu['sys_us']:6.1f} µs per result")
        return 0
    print(run(args.n, database=args.database, profile=args.profile))
    if args.profile:
        from bench.profile import print_top

        print_top(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
