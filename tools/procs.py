"""Run ccsq daemons as local child processes (for ``make demo``, tests and benchmarks).

Production runs each daemon under systemd; this module is the small local
supervisor that starts the same console scripts with the same arguments,
waits for readiness on their structured logs (never on sleeps), and stops or
kills them. Each process logs JSON lines to ``<log_dir>/<name>.log``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_tcp_port() -> int:
    """An ephemeral loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bin_path(script: str) -> str:
    """Path of a console script installed next to this interpreter (``ccsq-brokerd``...)."""
    candidate = Path(sys.executable).parent / script
    return str(candidate) if candidate.exists() else script


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout_s``
    passes (TimeoutError naming ``what``). Backs off gently up to 0.2 s per poll."""
    deadline = time.monotonic() + timeout_s
    delay = interval_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, 0.2)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    starts: int = 0

    def events(self) -> list[dict]:
        """Parsed JSON log lines of this process so far (non-JSON lines are skipped)."""
        out: list[dict] = []
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out

    def count(self, event: str, **fields: Any) -> int:
        return sum(1 for e in self.events() if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()))

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class ProcessGroup:
    """Named child processes; :meth:`stop_all` on exit (also use as a context manager)."""

    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, ready_event: str | None = None,
              ready_timeout_s: float = 30.0) -> Proc:
        """Start (or restart) ``name``; with ``ready_event`` wait until its log shows
        that event (counting only events logged by this start)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = self.procs.get(name)
        if proc is None:
            proc = Proc(name, argv, self.log_dir / f"{name}.log", dict(env or {}))
            self.procs[name] = proc
        else:
            if proc.running:
                raise RuntimeError(f"{name} is already running")
            proc.argv, proc.env = argv, dict(env or {})
        before = proc.count(ready_event) if ready_event else 0
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **proc.env}
        with open(proc.log_path, "ab") as log:
            proc.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env)
        proc.starts += 1
        if ready_event:
            def ready() -> bool:
                if not proc.running:
                    assert proc.popen is not None  # set just above
                    raise RuntimeError(f"{name} exited with {proc.popen.returncode} before {ready_event}; log:\n{self.tail(name)}")
                return proc.count(ready_event) > before
            try:
                wait_until(ready, ready_timeout_s, f"{name} to log {ready_event}")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; log:\n{self.tail(name)}") from None
        return proc

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.procs[name].log_path.read_text(errors="replace").splitlines()[-lines:])
        except (KeyError, FileNotFoundError):
            return ""

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.running:
            assert proc.popen is not None  # running implies started
            proc.popen.send_signal(sig)

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` and reap it."""
        proc = self.procs[name]
        if proc.running:
            assert proc.popen is not None  # running implies started
            proc.popen.kill()
        if proc.popen is not None:
            proc.popen.wait(timeout=10)

    def wait_exit(self, name: str, timeout_s: float = 10.0) -> int:
        popen = self.procs[name].popen
        assert popen is not None, f"{name} was never started"  # a name is in procs only once start() ran it
        return popen.wait(timeout=timeout_s)

    def stop(self, name: str, timeout_s: float = 10.0) -> int | None:
        """SIGCONT + SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        proc = self.procs[name]
        if proc.popen is None:
            return None
        if proc.running:
            proc.popen.send_signal(signal.SIGCONT)
            proc.popen.terminate()
            try:
                proc.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)
        return proc.popen.returncode

    def stop_all(self, timeout_s: float = 10.0) -> dict[str, int | None]:
        # stop producers of work first so the broker sees clean BYEs
        order = sorted(self.procs, key=lambda n: (n == "broker", n))
        return {name: self.stop(name, timeout_s) for name in order}
