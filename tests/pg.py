"""A throwaway PostgreSQL server for tests (real ``postgres``, not a mock).

``pg_server`` (session scoped) runs ``initdb`` into a fresh temporary directory
and starts ``postgres`` on a free loopback port with its unix socket in that
directory; as root it runs the server as ``nobody`` (PostgreSQL refuses to
run as root). :meth:`PgServer.stop` / :meth:`PgServer.start` stop and restart
it mid-test (same port, same data) for outage tests. ``pg_dsn`` is the
server's DSN; ``pg_database`` a fresh empty database per test.

Binaries are looked up on PATH and in ``/usr/lib/postgresql/*/bin``. When they
are missing the fixtures fail if the ``CI`` environment variable is set (CI
must not silently skip the PostgreSQL tests) and skip otherwise.

Use in a test module::

    from tests.pg import pg_database, pg_dsn, pg_server  # noqa: F401 (fixtures)
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def find_pg_bin() -> Path | None:
    """Directory holding ``pg_ctl``, ``initdb`` and ``postgres``, or None."""
    on_path = shutil.which("pg_ctl")
    candidates = [Path(on_path).resolve().parent] if on_path else []
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                      key=lambda d: int(Path(d).parent.name) if Path(d).parent.name.isdigit() else 0)
    candidates += [Path(d) for d in reversed(versions)]
    for d in candidates:
        if all((d / exe).exists() for exe in ("pg_ctl", "initdb", "postgres")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """One PostgreSQL cluster in ``root`` (data, socket and log), listening on 127.0.0.1:``port``."""

    def __init__(self, bin_dir: Path, root: Path) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.data = root / "data"
        self.log = root / "postgres.log"
        self.port = _free_port()
        self.user = "postgres"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(root, nobody.pw_uid, nobody.pw_gid)
            self._as_user = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", "--"]
        self._run(["initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-sync",
                   "--no-instructions"])

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def dsn_for(self, dbname: str) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, argv: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        cmd = [*self._as_user, str(self.bin_dir / argv[0]), *argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=self.root,
                              env={**os.environ, "LC_ALL": "C", "LANG": "C"})
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n{self.tail()}")
        return proc

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def start(self) -> None:
        """Start the server and wait until it accepts connections (pg_ctl -w)."""
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=50")
        self._run(["pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start"])

    def stop(self) -> None:
        """Stop the server now (fast shutdown: open connections are terminated)."""
        self._run(["pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"])

    def running(self) -> bool:
        proc = subprocess.run([*self._as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "status"],
                              capture_output=True, text=True, cwd=self.root)
        return proc.returncode == 0

    def ensure_running(self) -> None:
        if not self.running():
            self.start()

    def create_database(self) -> str:
        """A fresh empty database; returns its DSN."""
        import psycopg

        name = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.dsn, autocommit=True) as con:
            con.execute(f'CREATE DATABASE "{name}"')
        return self.dsn_for(name)

    def destroy(self) -> None:
        if self.running():
            try:
                self._run(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"])
            except RuntimeError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bin_dir = find_pg_bin()
    if bin_dir is None:
        msg = "PostgreSQL binaries (pg_ctl, initdb, postgres) not found; install the postgresql package"
        if os.environ.get("CI"):
            pytest.fail(f"{msg} (CI is set: PostgreSQL tests must run, not skip)")
        pytest.skip(msg)
    root = Path(tempfile.mkdtemp(prefix="ccsq-pg-", dir="/tmp"))
    server = PgServer(bin_dir, root)
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def pg_dsn(pg_server: PgServer) -> str:
    """DSN of the session's PostgreSQL server (database ``postgres``)."""
    return pg_server.dsn


@pytest.fixture
def pg_database(pg_server: PgServer) -> Iterator[str]:
    """DSN of a fresh, empty database on the session's server (restarted if a test stopped it)."""
    pg_server.ensure_running()
    yield pg_server.create_database()
    pg_server.ensure_running()
