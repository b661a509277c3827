"""ccsq.common.runtime.systemd: sd_notify datagrams on real AF_UNIX sockets, and the event-loop watchdog."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from ccsq.common.wire.errors import ConfigError
from ccsq.common.runtime.systemd import Notifier, watchdog_task


def _listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    return sock


def _fields(sock: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())


def _drain(sock: socket.socket) -> list[dict[str, str]]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines()))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(2.0)


def test_noop_without_notify_socket() -> None:
    env: dict[str, str] = {}
    n = Notifier.from_env(env)
    assert not n.enabled and n.watchdog_interval_s is None
    assert n.ready() is False and n.stopping() is False and n.status("x") is False and n.watchdog() is False
    asyncio.run(asyncio.wait_for(watchdog_task(n), 1.0))  # returns at once


def test_messages_on_a_path_socket(tmp_path: Path) -> None:
    with _listen(tmp_path / "notify") as sock:
        env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
        n = Notifier.from_env(env)
        assert n.ready("serving on tcp://x:1") is True
        assert _fields(sock) == {"READY": "1", "STATUS": "serving on tcp://x:1"}
        n.status("two\nlines   here")
        assert _fields(sock) == {"STATUS": "two lines here"}
        n.watchdog()
        assert _fields(sock) == {"WATCHDOG": "1"}
        n.extend_timeout(2.5)
        assert _fields(sock) == {"EXTEND_TIMEOUT_USEC": "2500000"}
        n.stopping()
        assert _fields(sock) == {"STOPPING": "1"}
        n.close()


def test_messages_on_an_abstract_socket() -> None:
    name = f"ccsq-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2.0)
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready() is True
        assert _fields(sock) == {"READY": "1"}


def test_from_env_unsets_the_variables_for_children(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "s"), "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid()), "X": "1"}
    n = Notifier.from_env(env)
    assert env == {"X": "1"}
    assert n.watchdog_interval_s == pytest.approx(1.0)
    kept = {"NOTIFY_SOCKET": str(tmp_path / "s")}
    Notifier.from_env(kept, unset=False)
    assert "NOTIFY_SOCKET" in kept


def test_watchdog_for_another_pid_is_not_ours(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "s"), "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_env(env).watchdog_interval_s is None


@pytest.mark.parametrize("env", [{"NOTIFY_SOCKET": "relative/path"}, {"NOTIFY_SOCKET": "vsock:2:1"},
                                 {"NOTIFY_SOCKET": "@"}, {"NOTIFY_SOCKET": "/s", "WATCHDOG_USEC": "soon"},
                                 {"NOTIFY_SOCKET": "/s", "WATCHDOG_USEC": "0"}])
def test_bad_environment_is_a_config_error(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        Notifier.from_env(dict(env))


def test_send_failure_returns_false_and_does_not_raise(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert n.enabled and n.ready() is False


def test_watchdog_pings_from_the_loop_and_stops_when_the_loop_blocks(tmp_path: Path) -> None:
    with _listen(tmp_path / "notify") as sock:
        n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "100000"})  # ping every 50 ms

        async def scenario() -> tuple[int, int]:
            task = asyncio.create_task(watchdog_task(n))
            await asyncio.sleep(0.3)
            before_block = len(_drain(sock))
            time.sleep(0.4)  # a blocked event loop: no pings may arrive meanwhile
            during_block = len(_drain(sock))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return before_block, during_block

        before_block, during_block = asyncio.run(scenario())
        assert before_block >= 2
        assert during_block == 0  # the task cannot run while the loop is blocked


def test_watchdog_skips_pings_while_unhealthy(tmp_path: Path) -> None:
    with _listen(tmp_path / "notify") as sock:
        n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "100000"})
        healthy = {"ok": False}

        async def scenario() -> tuple[int, int]:
            task = asyncio.create_task(watchdog_task(n, healthy=lambda: healthy["ok"]))
            await asyncio.sleep(0.3)
            unhealthy = len(_drain(sock))
            healthy["ok"] = True
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return unhealthy, len(_drain(sock))

        unhealthy, recovered = asyncio.run(scenario())
        assert unhealthy == 0 and recovered >= 2


_EARLY_STOP_SCRIPT = """
import asyncio, os, signal, sys
from ccsq.common.runtime.systemd import Notifier, catch_early_stop, stop_signals_and_watchdog
assert catch_early_stop()
os.kill(os.getpid(), signal.SIGTERM)  # arrives while 'starting' (no loop yet)
print("still alive", flush=True)
stops = []
async def main():
    done = asyncio.Event()
    async with stop_signals_and_watchdog(Notifier(), lambda name: (stops.append(name), done.set())):
        await asyncio.wait_for(done.wait(), 10)
asyncio.run(main())
print("stopped by", stops, flush=True)
"""


def test_a_stop_signal_during_start_up_is_delivered_once_serving() -> None:
    """A SIGTERM between start and the loop's signal handlers (systemd stopping a unit
    that is still starting) used to end the daemon by the signal; now it is remembered and
    handed to ``on_stop`` once, as soon as the serving block is entered: a clean exit."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _EARLY_STOP_SCRIPT], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "stop_signal_during_startup" not in ln]  # the log line
    assert lines == ["still alive", "stopped by ['SIGTERM']"], res.stdout


def test_broker_stopped_while_starting_exits_cleanly(tmp_path: Path) -> None:
    """ccsq-brokerd writes its endpoint file before it serves: a SIGTERM right then (a stop
    during start-up) must end in exit 0, not death by the signal."""
    import subprocess

    from ccsq.tools.cli import main as ccsq_main
    from ccsq.tools.procs import bin_path

    root = tmp_path / "s"
    assert ccsq_main(["init", str(root)]) == 0
    endpoint = root / "broker-data" / "endpoint"
    proc = subprocess.Popen([bin_path("ccsq-brokerd"), "--config", str(root / "brokerd.toml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not endpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)  # poll tightly: the window after the file is written is short
        assert endpoint.exists(), "broker never wrote its endpoint file"
        proc.send_signal(15)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
