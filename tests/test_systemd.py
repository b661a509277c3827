"""The systemd units in ``systemd/``: valid, sandboxed, consistent with the code, and runnable as written.

- ``systemd-analyze verify`` passes with no output at all (warnings fail too);
- ``systemd-analyze security --offline=yes`` rates every service below 5.0;
- ``RestartPreventExitStatus`` is exactly ``ExitCode.UNAUTHORIZED``, ``ExitCode.CONFIG`` and ``ExitCode.GPU_UNAVAILABLE``;
- the recovery unit restarts a unit that is still failed, unless its main process exited 77/78/79/80 (case C11);
- ``install.sh --venv`` refuses a venv the sandbox hides (or whose base Python it hides);
- each daemon started with its unit's ExecStart, Environment, UMask, SystemCallFilter and
  (where the unit sets it) MemoryDenyWriteExecute (seccomp, see test_systemd_sandbox.py) sends
  READY=1 and WATCHDOG=1 from its main process on
  ``$NOTIFY_SOCKET``, and on SIGTERM sends STOPPING=1 and exits 0 within the unit's TimeoutStopSec.

What only a real systemd shows (address families, the start limit, the recover timer firing,
KillMode, the watchdog) is tested in test_systemd_real.py, which boots one.

Without ``systemd-analyze`` the verify/security tests skip, except under CI (``$CI`` set),
where they fail: CI must install the ``systemd`` Debian package.
"""

from __future__ import annotations

import configparser
import functools
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ccsq.tools.init import init_swarm
from ccsq.common.wire.errors import ExitCode
from ccsq.tools.procs import ProcessGroup, free_tcp_port, wait_until

REPO = Path(__file__).resolve().parent.parent
UNIT_DIR = REPO / "systemd"
SANDBOX = Path(__file__).resolve().with_name("test_systemd_sandbox.py")
VENV_BIN = Path(sys.executable).parent

DAEMON_UNITS = ["ccsq-brokerd.service", "ccsq-workerd@.service", "ccsq-completion.service", "ccsq-relayd@.service"]
SERVICE_UNITS = [*DAEMON_UNITS, "ccsq-recover@.service"]
ALL_UNITS = [*SERVICE_UNITS, "ccsq-recover@.timer"]
# instance names used to verify templates
INSTANCES = {
    "ccsq-brokerd.service": "ccsq-brokerd.service",
    "ccsq-workerd@.service": "ccsq-workerd@0.service",
    "ccsq-completion.service": "ccsq-completion.service",
    "ccsq-relayd@.service": "ccsq-relayd@site-a.service",
    "ccsq-recover@.service": "ccsq-recover@ccsq-workerd@0.service.service",
    "ccsq-recover@.timer": "ccsq-recover@ccsq-brokerd.service.timer",
}
MAX_EXPOSURE = 5.0


# --- reading unit files ---------------------------------------------------------------
def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """``{section: [(key, value), ...]}`` in file order (keys may repeat, as systemd allows)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None and "=" in line, f"{path.name}: unparsable line {raw!r}"
        key, value = line.split("=", 1)
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit: dict, section: str, key: str) -> str | None:
    found = values(unit, section, key)
    return found[-1] if found else None


def seconds(text: str) -> float:
    """A systemd time span with one unit (``30``, ``30s``, ``5min``) in seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|sec|min|m|h)?", text.strip())
    assert m, f"unsupported time span {text!r}"
    return float(m.group(1)) * {"ms": 0.001, None: 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}[m.group(2)]


def unit(name: str) -> dict:
    return parse_unit(UNIT_DIR / name)


# --- systemd-analyze ------------------------------------------------------------------
@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing: CI must install the Debian package 'systemd'")
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return path


@pytest.fixture(scope="module")
def unit_copies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All units with ExecStart's /usr/local/bin/ pointed at this venv (whose scripts exist)."""
    out = tmp_path_factory.mktemp("units")
    for name in ALL_UNITS:
        text = (UNIT_DIR / name).read_text().replace("/usr/local/bin/", f"{VENV_BIN}/")
        (out / name).write_text(text)
    return out


@pytest.mark.parametrize("name", ALL_UNITS)
def test_unit_verifies_without_any_warning(systemd_analyze: str, unit_copies: Path, name: str) -> None:
    for line in values(parse_unit(unit_copies / name), "Service", "ExecStart"):
        binary = Path(shlex.split(line.replace("$$", "$"))[0])
        assert binary.is_file() and os.access(binary, os.X_OK), f"{name}: ExecStart binary {binary} does not exist here"
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_copies}:", "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    done = subprocess.run(
        [systemd_analyze, "verify", "--man=no", INSTANCES[name]],
        cwd=unit_copies, env=env, capture_output=True, text=True, timeout=30,
    )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 0 and output == "", f"systemd-analyze verify {name} (rc {done.returncode}):\n{output}"


@pytest.mark.parametrize("name", SERVICE_UNITS)
def test_unit_exposure_is_below_five(systemd_analyze: str, unit_copies: Path, name: str) -> None:
    done = subprocess.run(
        [systemd_analyze, "security", "--offline=yes", "--no-pager", str(unit_copies / name)],
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_COLORS": "0"}, capture_output=True, text=True, timeout=30,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", done.stdout)
    assert m, f"no exposure line in systemd-analyze security output (rc {done.returncode}):\n{done.stdout}\n{done.stderr}"
    exposure = float(m.group(1))
    assert exposure < MAX_EXPOSURE, f"{name}: exposure {exposure}:\n{done.stdout}"


# --- what the units promise -------------------------------------------------------------
@pytest.mark.parametrize("name", DAEMON_UNITS)
def test_restart_prevent_exit_status_is_the_permanent_exit_codes(name: str) -> None:
    u = unit(name)
    codes = {int(c) for v in values(u, "Service", "RestartPreventExitStatus") for c in v.split()}
    ledger = {ExitCode.LEDGER_CORRUPT} if name == "ccsq-brokerd.service" else set()  # only the broker has the ledger
    assert codes == {ExitCode.UNAUTHORIZED, ExitCode.CONFIG, ExitCode.GPU_UNAVAILABLE} | ledger
    assert ExitCode.TEMPFAIL not in codes  # transient: must restart
    assert value(u, "Service", "Restart") == "on-failure"
    assert value(u, "Service", "RestartSec") == "2"


@pytest.mark.parametrize("name", DAEMON_UNITS)
def test_daemon_unit_settings(name: str) -> None:
    u = unit(name)
    svc = dict(u["Service"])
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert seconds(svc["WatchdogSec"]) > 0 and seconds(svc["TimeoutStopSec"]) > 0
    assert svc["KillMode"] == "mixed"
    assert svc["User"] == "ccsq" and "DynamicUser" not in svc
    assert svc["ConfigurationDirectory"] == "ccsq"
    assert all(d.startswith("ccsq/") for d in svc["StateDirectory"].split())
    assert svc["UMask"] == "0077" and svc["ProtectSystem"] == "strict" and svc["NoNewPrivileges"] == "yes"
    assert svc["CapabilityBoundingSet"] == ""
    # AF_NETLINK: libzmq's bind/connect call getifaddrs() (without it: SIGABRT in ip_resolver.cpp)
    assert svc["RestrictAddressFamilies"].split() == ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
    assert values(u, "Service", "EnvironmentFile") == ["-/etc/ccsq/ccsq.env"]  # optional: S3 credentials etc.
    assert value(u, "Unit", "StartLimitIntervalSec") == "60" and value(u, "Unit", "StartLimitBurst") == "5"
    assert value(u, "Unit", "OnFailure") == "ccsq-recover@%n.timer"
    # peers wait for each other at run time: ordering on the network only, no hard dependencies
    assert "network-online.target" in " ".join(values(u, "Unit", "After"))
    for key in ("Requires", "BindsTo", "Requisite", "PartOf"):
        assert not values(u, "Unit", key), f"{name}: {key}= couples units; peers must wait at run time"
    assert not any("ccsq" in v for v in values(u, "Unit", "Wants") + values(u, "Unit", "After"))
    argv = shlex.split(svc["ExecStart"])
    assert argv[0].startswith("/usr/local/bin/") and argv[-2] == "--config" and argv[-1].startswith("/etc/ccsq/")


def test_workers_get_their_gpu_and_the_others_get_no_devices() -> None:
    worker = unit("ccsq-workerd@.service")
    env = dict(kv.split("=", 1) for line in values(worker, "Service", "Environment") for kv in shlex.split(line))
    assert env["CUDA_VISIBLE_DEVICES"] == "%i" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert value(worker, "Service", "PrivateDevices") in (None, "no")
    assert value(worker, "Service", "DevicePolicy") == "closed"
    assert any(v.startswith("char-nvidia") for v in values(worker, "Service", "DeviceAllow"))
    assert "/etc/ccsq/workerd-%i.toml" in value(worker, "Service", "ExecStart")
    for name in ("ccsq-brokerd.service", "ccsq-completion.service"):
        u = unit(name)
        assert value(u, "Service", "PrivateDevices") == "yes" and value(u, "Service", "MemoryDenyWriteExecute") == "yes"


def test_each_daemon_unit_runs_its_own_console_script() -> None:
    # `ccsq completion` stays an alias for people; the unit runs the daemon's own script
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(REPO / "setup.cfg")
    scripts = {line.split("=")[0].strip() for line in cfg["options.entry_points"]["console_scripts"].splitlines() if line}
    for name, script in (("ccsq-brokerd.service", "ccsq-brokerd"), ("ccsq-workerd@.service", "ccsq-workerd"),
                         ("ccsq-completion.service", "ccsq-completiond")):
        argv = shlex.split(value(unit(name), "Service", "ExecStart"))
        assert argv[:2] == [f"/usr/local/bin/{script}", "--config"], f"{name}: ExecStart {argv}"
        assert script in scripts, f"{script} is not a console script in setup.cfg"



def test_the_wheel_carries_every_unit_install_sh_installs() -> None:
    """setup.cfg's data_files ship every file of systemd/ in the wheel (VENV/share/ccsq/systemd):
    install.sh from the wheel installs each unit of its ``units=`` list from there, so a unit
    left out (ccsq-relayd@.service was) makes the documented install fail half-way, before
    it links /usr/local/bin/ccsq* (tester)."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(REPO / "setup.cfg")
    patterns = [line.strip() for line in cfg["options.data_files"]["share/ccsq/systemd"].splitlines() if line.strip()]
    shipped = {str(p.relative_to(REPO)) for pattern in patterns for p in REPO.glob(pattern)}  # setuptools expands globs
    assert shipped == {f"systemd/{p.name}" for p in (REPO / "systemd").iterdir() if p.is_file()}
    units = re.search(r'^units="([^"]*)"', (REPO / "systemd" / "install.sh").read_text(), re.M)
    assert units and {f"systemd/{u}" for u in units.group(1).split()} <= shipped

# --- C11: the recovery unit -------------------------------------------------------------
def _recover_argv(target: str) -> list[str]:
    """ccsq-recover@TARGET's ExecStart as systemd runs it (``$$`` -> ``$``, ``%i`` -> TARGET)."""
    line = value(unit("ccsq-recover@.service"), "Service", "ExecStart")
    return [target if a == "%i" else a for a in shlex.split(line.replace("$$", "$"))]


@pytest.mark.parametrize(
    ("state", "code", "status", "restarted"),
    [
        ("failed", "2", "9", True),  # crash loop of SIGKILLs: Result=signal on systemd 252
        ("failed", "1", "1", True),  # crash loop of exit 1: Result=exit-code
        ("failed", "1", "75", True),  # ledger locked / port busy: transient
        ("failed", "1", "0", True),  # start-limit-hit after manual restarts of a healthy unit
        ("failed", "1", "77", False),  # UNAUTHORIZED: the key must be added first
        ("failed", "1", "78", False),  # CONFIG: a restart cannot fix it
        ("failed", "1", "79", False),  # GPU_UNAVAILABLE
        ("failed", "1", "80", False),  # LEDGER_CORRUPT: restore from a backup first
        ("active", "1", "1", False),  # already running again
        ("inactive", "1", "1", False),  # the operator ran reset-failed: keep it down
    ],
)
def test_recover_restarts_a_failed_unit_unless_it_exited_78_or_79(
    tmp_path: Path, state: str, code: str, status: str, restarted: bool
) -> None:
    fake = tmp_path / "systemctl"
    calls = tmp_path / "calls"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'if [ "$1" = show ]; then case "$2" in\n'
        f"  --property=ActiveState) echo {state} ;;\n"
        "  --property=Result) echo signal ;;\n"
        f"  --property=ExecMainCode) echo {code} ;;\n"
        f"  --property=ExecMainStatus) echo {status} ;;\n"
        "esac; fi\n"
    )
    fake.chmod(0o755)
    target = "ccsq-workerd@0.service"
    done = subprocess.run(_recover_argv(target), env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    assert all(line.startswith("show ") for line in lines[:4]) and lines[0] == f"show --property=ActiveState --value {target}"
    expected = [f"reset-failed {target}", f"start --no-block {target}"] if restarted else []
    assert lines[4:] == expected, done.stdout
    if status in ("77", "78", "79", "80") and state == "failed":
        assert f"exited {status}" in done.stdout and "not restarted" in done.stdout


def test_recover_timer_fires_once_and_rearms() -> None:
    timer = unit("ccsq-recover@.timer")
    assert seconds(value(timer, "Timer", "OnActiveSec")) >= 60
    assert value(timer, "Timer", "RemainAfterElapse") == "no"


def _visible_root() -> Path:
    """A fresh directory where the units could see a venv: not under /home, /root, /run/user,
    /tmp or /var/tmp (install.sh refuses those), wherever this checkout happens to live
    (CI clones it under /tmp). Skipped only where no such place is writable."""
    hidden = ("/home/", "/root/", "/run/user/", "/tmp/", "/var/tmp/")
    for base in ("/opt", "/srv", "/var/lib", str(REPO)):
        real = os.path.realpath(base) + "/"
        if real.startswith(hidden) or not os.access(base, os.W_OK):
            continue
        return Path(tempfile.mkdtemp(prefix=".ccsq-test-venv-", dir=base))
    pytest.skip("no writable directory the units could see (/opt, /srv, /var/lib, the checkout): run as root")


# --- install.sh -----------------------------------------------------------------------
def test_install_dry_run_changes_nothing() -> None:
    root = _visible_root()
    try:
        venv = _fake_venv(root, "/usr/bin")
        done = subprocess.run(["sh", str(UNIT_DIR / "install.sh"), "--dry-run", "--venv", str(venv)],
                              capture_output=True, text=True, timeout=20)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for name in ALL_UNITS:
        assert f"install -m 0644 {UNIT_DIR / name} /etc/systemd/system/{name}" in out
    assert "useradd --system" in out or "# user ccsq exists" in out
    for name in ("ccsq", "ccsq-brokerd", "ccsq-workerd", "ccsq-completiond", "ccsq-console", "ccsq-relayd"):
        assert f"ln -sfn {venv}/bin/{name} /usr/local/bin/{name}" in out


def test_install_into_a_staging_root(tmp_path: Path) -> None:
    done = subprocess.run(["sh", str(UNIT_DIR / "install.sh"), "--root", str(tmp_path)], capture_output=True, text=True,
                          timeout=20)
    assert done.returncode == 0, done.stderr
    for name in ALL_UNITS:
        installed = tmp_path / "etc/systemd/system" / name
        assert installed.read_bytes() == (UNIT_DIR / name).read_bytes()
        assert stat.S_IMODE(installed.stat().st_mode) == 0o644


def test_install_refuses_an_incomplete_copy_before_any_step(tmp_path: Path) -> None:
    """A copy of the units lacking one (the wheel once left ccsq-relayd@.service out) fails before
    the first step, and ``--dry-run`` fails the same way instead of printing steps that would fail."""
    copy = tmp_path / "systemd"
    shutil.copytree(UNIT_DIR, copy)
    (copy / "ccsq-relayd@.service").unlink()
    for args in (["--dry-run"], ["--root", str(tmp_path / "stage")]):
        done = subprocess.run(["sh", str(copy / "install.sh"), *args], capture_output=True, text=True, timeout=20)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert "ccsq-relayd@.service" in done.stderr and "missing" in done.stderr, (args, done.stderr)
        assert "+ " not in done.stdout, (args, done.stdout)
    assert not (tmp_path / "stage").exists()


@pytest.mark.parametrize(("venv", "why"), [
    ("/home/someone/venv", "ProtectHome"), ("/root/venv", "ProtectHome"), ("/run/user/0/venv", "ProtectHome"),
    ("/tmp/venv", "PrivateTmp"), ("/var/tmp/ccsq-venv", "PrivateTmp"),
])
def test_install_refuses_a_venv_the_units_cannot_see(venv: str, why: str) -> None:
    done = subprocess.run(["sh", str(UNIT_DIR / "install.sh"), "--dry-run", "--venv", venv],
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and why in done.stderr and "/usr/bin/python3 -m venv /opt/ccsq/venv" in done.stderr, done.stderr
    assert "ln -sfn" not in done.stdout


def _fake_venv(root: Path, base_home: str) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("ccsq", "ccsq-brokerd", "ccsq-workerd", "ccsq-completiond", "ccsq-console", "ccsq-relayd"):
        (venv / "bin" / name).write_text("#!/bin/sh\n")
        (venv / "bin" / name).chmod(0o755)
    (venv / "bin" / "python3").symlink_to(f"{base_home}/python3")
    (venv / "pyvenv.cfg").write_text(f"home = {base_home}\ninclude-system-site-packages = false\nversion = 3.11.7\n")
    return venv


@pytest.mark.parametrize("base_home", ["/root/.pyenv/versions/3.11.7/bin", "/home/dev/.local/python/bin", "/tmp/py/bin"])
def test_install_refuses_a_venv_whose_base_python_the_units_cannot_see(base_home: str) -> None:
    # the venv itself must lie where the units can see it (not under tmp_path, which is in /tmp)
    root = _visible_root()
    try:
        venv = _fake_venv(root, base_home)
        done = subprocess.run(["sh", str(UNIT_DIR / "install.sh"), "--dry-run", "--venv", str(venv)],
                              capture_output=True, text=True, timeout=20)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert f"its base Python is {base_home}" in done.stderr and "203/EXEC" in done.stderr, done.stderr
        # the same venv made from a Python the units can see is accepted
        shutil.rmtree(venv)
        venv = _fake_venv(root, "/usr/bin")
        done = subprocess.run(["sh", str(UNIT_DIR / "install.sh"), "--dry-run", "--venv", str(venv)],
                              capture_output=True, text=True, timeout=20)
        assert done.returncode == 0 and f"ln -sfn {venv}/bin/ccsq-brokerd" in done.stdout, done.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- the daemons, started as the units start them ---------------------------------------
class NotifyListener:
    """A ``$NOTIFY_SOCKET`` datagram socket that records (sender pid, {KEY: VALUE}) per message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.setblocking(False)
        self.messages: list[tuple[int, dict[str, str]]] = []

    def drain(self) -> list[tuple[int, dict[str, str]]]:
        while True:
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except BlockingIOError:
                return self.messages
            pid = -1
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", cdata[:12])[0]
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((pid, fields))

    def seen(self, key: str, value: str, pid: int) -> bool:
        return any(p == pid and f.get(key) == value for p, f in self.drain())

    def close(self) -> None:
        self.sock.close()


def _as_written(name: str, instance: str, paths: dict[str, str]) -> tuple[list[str], dict[str, str], dict]:
    """(argv, environment, parsed unit) of a unit's ExecStart with specifiers and paths substituted."""
    u = unit(name)

    def subst(text: str) -> str:
        text = text.replace("%i", instance)
        for old, new in paths.items():
            text = text.replace(old, new)
        return text

    argv = shlex.split(subst(value(u, "Service", "ExecStart")))
    env = dict(kv.split("=", 1) for line in values(u, "Service", "Environment") for kv in shlex.split(subst(line)))
    return argv, env, u


_DAEMONS = [  # (process name, unit, instance, readiness log event), in start order
    ("broker", "ccsq-brokerd.service", "", "broker_started"),
    ("worker-1", "ccsq-workerd@.service", "0", "broker_link_ready"),  # GPU 0: workerd-0.toml (peer worker-1)
    ("completion", "ccsq-completion.service", "", "broker_link_ready"),
]


@functools.cache
def _load_sandbox():
    """tests/test_systemd_sandbox.py as a module (its seccomp helpers)."""
    spec = importlib.util.spec_from_file_location("ccsq_test_systemd_sandbox", SANDBOX)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sandbox_options(u: dict, tmp_path: Path, proc_name: str) -> list[str]:
    """Launcher options that apply the unit's UMask=, MemoryDenyWriteExecute= and SystemCallFilter=
    (the seccomp parts where the emulation works: x86-64 with systemd-analyze and kernel headers)."""
    sandbox = _load_sandbox()
    opts: list[str] = []
    umask = value(u, "Service", "UMask")
    if umask:
        opts += ["--umask", umask]
    if not sandbox.supported():
        return opts
    if value(u, "Service", "MemoryDenyWriteExecute") == "yes":
        opts.append("--deny-write-execute")
    filters = values(u, "Service", "SystemCallFilter")
    analyze = shutil.which("systemd-analyze")
    if filters and analyze and sandbox.UNISTD_64_H.exists():
        assert value(u, "Service", "SystemCallErrorNumber") == "EPERM"  # what the emulation does
        names = sandbox.unit_syscall_names(filters, sandbox.syscall_groups(analyze))
        numbers_file = tmp_path / f"{proc_name}.syscalls"
        numbers_file.write_text("\n".join(map(str, sorted(sandbox.syscall_numbers(names)))))
        opts += ["--syscalls", str(numbers_file)]
    return opts


def _daemons_missing() -> list[str]:
    return [m for m in ("ccsq.brokerd.main", "ccsq.workerd.main", "ccsq.completiond.main")
            if importlib.util.find_spec(m) is None]


@pytest.mark.timeout(90)
@pytest.mark.skipif(bool(_daemons_missing()), reason=f"daemons not written yet: {_daemons_missing()}")
def test_units_start_notify_and_stop_cleanly_as_written(tmp_path: Path) -> None:
    etc = tmp_path / "etc-ccsq"
    init_swarm(
        etc, endpoint=f"tcp://127.0.0.1:{free_tcp_port()}", workers=1, handler="echo",
        broker={"min_free_disk_bytes": 0, "heartbeat_interval_s": 0.2},
        worker={"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0},
        completion={"reconnect_backoff_max_s": 0.5, "hello_timeout_s": 2.0},
    )
    paths = {"/usr/local/bin/": f"{VENV_BIN}/", "/etc/ccsq/": f"{etc}/",
             "/var/lib/ccsq/": f"{tmp_path}/state/", "/var/cache/ccsq/": f"{tmp_path}/cache/"}
    watchdog_usec = 400_000  # the units say 20-30 s; a short one makes the test fast
    listeners: dict[str, NotifyListener] = {}
    stop_timeouts_s: dict[str, float] = {}
    with ProcessGroup(tmp_path / "logs") as group:
        try:
            for proc_name, unit_name, instance, ready_event in _DAEMONS:
                argv, env, u = _as_written(unit_name, instance, paths)
                wrapped = [sys.executable, str(SANDBOX), *_sandbox_options(u, tmp_path, proc_name), "--", *argv]
                listener = listeners[proc_name] = NotifyListener(tmp_path / f"{proc_name}.notify")
                env.update(NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC=str(watchdog_usec))
                stop_timeouts_s[proc_name] = seconds(value(u, "Service", "TimeoutStopSec"))
                proc = group.start(proc_name, wrapped, env=env, ready_event=ready_event, ready_timeout_s=60.0)
                pid = proc.popen.pid  # the wrapper execs the daemon: same pid, the unit's main process
                try:
                    wait_until(lambda: listener.seen("READY", "1", pid), 5.0, f"{proc_name}: READY=1")
                except TimeoutError:
                    pytest.fail(f"{unit_name}: the main process never sent READY=1 on $NOTIFY_SOCKET (Type=notify "
                                f"needs it; see ccsq.common.runtime.systemd). Got {listener.drain()}; log:\n{group.tail(proc_name)}")
            for proc_name, unit_name, _, _ in _DAEMONS:
                pid = group.procs[proc_name].popen.pid
                listener = listeners[proc_name]
                try:
                    wait_until(lambda: listener.seen("WATCHDOG", "1", pid), 5.0, f"{proc_name}: WATCHDOG=1")
                except TimeoutError:
                    pytest.fail(f"{unit_name}: no WATCHDOG=1 from the main process (WatchdogSec= would kill it; "
                                f"run ccsq.common.runtime.systemd.watchdog_task). Got {listener.drain()}")
            # stop in reverse order (peers first, broker last), as systemctl stop would
            for proc_name, unit_name, _, _ in reversed(_DAEMONS):
                group.signal(proc_name, signal.SIGTERM)
                try:
                    code = group.wait_exit(proc_name, timeout_s=stop_timeouts_s[proc_name])
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{unit_name}: still running {stop_timeouts_s[proc_name]} s (TimeoutStopSec) after "
                                f"SIGTERM; log:\n{group.tail(proc_name)}")
                assert code == 0, f"{unit_name}: exit {code} after SIGTERM; log:\n{group.tail(proc_name)}"
                pid = group.procs[proc_name].popen.pid
                assert listeners[proc_name].seen("STOPPING", "1", pid), f"{unit_name}: no STOPPING=1 on SIGTERM"
        finally:
            for listener in listeners.values():
                listener.close()
