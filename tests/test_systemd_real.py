"""ccsq as an operator installs it: a wheel in a fresh venv, and the units under a real systemd.

- ``make dist``'s build (``python -m build``: sdist, then the wheel from the sdist) ships what an
  operator needs: every module, the console scripts and handlers, the units and their installer
  (``VENV/share/ccsq/systemd``), the docs (``VENV/share/doc/ccsq``);
- the wheel installed NOT editable into a fresh venv (Debian's ``/usr/bin/python3``, as
  docs/operations.md says) runs a swarm: ``ccsq init``, broker, two workers, completion service,
  ``ccsq submit --wait``, ``ccsq gap-report`` balanced;
- ``tests/systemd_box/box.sh`` boots the host's systemd (252 on Debian 12) as PID 1 of private
  namespaces, installs the units with the wheel's own ``VENV/share/ccsq/systemd/install.sh --venv``
  for real, as an operator does (every unit loaded, every /usr/local/bin link), and checks: all
  active; a worker SIGKILLed comes back alone while the others keep their
  PIDs; a SIGSTOPped broker is killed by the watchdog and comes back; no process of a unit
  survives its restart; a crash loop is recovered by the recover timer, exits 78/79 are not;
  stop leaves nothing; every item submitted across all of it is acknowledged and the books
  balance. It prints one PASS/FAIL line per check.

The box needs root, util-linux (unshare, nsenter, setpriv), overlayfs, a cgroup2 mount and
/lib/systemd/systemd; without them that test is skipped with the reason (under CI, a missing
package fails it: ``.ci/run`` installs them).
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from ccsq.tools.procs import ProcessGroup, free_tcp_port

REPO = Path(__file__).resolve().parent.parent
BOX = REPO / "tests" / "systemd_box" / "box.sh"
# every file of systemd/ (the units and install.sh): the wheel must carry exactly these
UNITS = sorted(p.name for p in (REPO / "systemd").iterdir() if p.is_file())
DEBIAN_PYTHON = Path("/usr/bin/python3")


def _missing(message: str) -> None:
    """A package the test needs is missing: fail under CI (``.ci/run`` installs it), else skip."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _base_python() -> str:
    """Debian's python3 when it is >= 3.11 with venv (what the units can run), else this one's base."""
    if DEBIAN_PYTHON.exists():
        done = subprocess.run([str(DEBIAN_PYTHON), "-c", "import sys, ensurepip, venv; assert sys.version_info >= (3, 11)"],
                              capture_output=True, timeout=30)
        if done.returncode == 0:
            return str(DEBIAN_PYTHON)
        if os.environ.get("CI"):
            pytest.fail("/usr/bin/python3 lacks venv/ensurepip or is older than 3.11: .ci/run installs python3-venv")
    return getattr(sys, "_base_executable", sys.executable)


# --- the wheel ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``python -m build`` of this checkout, as ``make dist`` runs it (sdist, then the wheel from it).

    Without isolation (setuptools and wheel of this venv: no download); ``make dist`` isolates."""
    try:
        import build  # noqa: F401
    except ImportError:
        _missing("the 'build' package is missing (pip install -e '.[test]')")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"python -m build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (wheel,) = out.glob("ccsq-*-py3-none-any.whl")
    (sdist,) = out.glob("ccsq-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def wheel_venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A fresh venv with the wheel installed, not editable. As root under /opt (the units must see
    it and its base Python: not /tmp, /root, /home), else in a temporary directory."""
    if os.geteuid() == 0 and os.access("/opt", os.W_OK):
        root = Path(tempfile.mkdtemp(prefix="ccsq-test-venv-", dir="/opt"))
        root.chmod(0o755)  # mkdtemp's 0700 would keep the service user out (203/EXEC, Permission denied)
    else:
        root = tmp_path_factory.mktemp("wheel-venv")
    venv = root / "venv"
    try:
        done = subprocess.run([_base_python(), "-m", "venv", str(venv)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"venv: {done.stderr}"
        done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(dist["wheel"])],
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, f"pip install {dist['wheel'].name} (dependencies from PyPI):\n{done.stdout}\n{done.stderr}"
        yield venv
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_wheel_ships_modules_scripts_units_and_docs(dist: dict[str, Path]) -> None:
    cfg = _setup_cfg()
    package_dir = dict(line.replace(" ", "").split("=", 1) for line in _lines(cfg["options"]["package_dir"]))
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        data = next(n.split("/")[0] for n in names if ".data/" in n)
        unit_dir = f"{data}/data/share/ccsq/systemd/"
        shipped_units = sorted(n[len(unit_dir):] for n in names if n.startswith(unit_dir))
        assert shipped_units == UNITS, f"the wheel's share/ccsq/systemd/ {shipped_units} is not systemd/ {UNITS}"
        for unit in UNITS:
            shipped = whl.read(f"{unit_dir}{unit}")
            assert shipped == (REPO / "systemd" / unit).read_bytes(), f"{unit} in the wheel differs from systemd/{unit}"
        # every doc (docs/operations.md says the wheel carries them), and the console's screenshots
        docs = ["README.md", "grafana-dashboard.json", *(p.name for p in (REPO / "docs").glob("*.md")),
                *(f"console/{p.name}" for p in (REPO / "docs" / "console").glob("*.png"))]
        for doc in docs:
            assert f"{data}/data/share/doc/ccsq/{doc}" in names, f"{doc} is missing from the wheel's share/doc/ccsq/"
        for package, folder in package_dir.items():
            inside = package.replace(".", "/")
            # every file of the folder (modules, subpackages, templates...), not only what setup.cfg declares
            files = [p for p in (REPO / folder).rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")]
            assert files, f"{folder}/ is empty"
            for path in files:
                rel = path.relative_to(REPO / folder).as_posix()
                assert f"{inside}/{rel}" in names, f"{folder}/{rel} is missing from the wheel ({package})"
        entry_points = whl.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for script in _lines(cfg["options.entry_points"]["console_scripts"]):
        assert script.replace(" ", "") in entry_points.replace(" ", ""), f"console script {script} missing from the wheel"
    assert "echo = ccsq.workerd.handlers:EchoHandler" in entry_points
    import tarfile

    with tarfile.open(dist["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    for path in ("setup.cfg", "pyproject.toml", "Makefile", "MANIFEST.in", "systemd/install.sh",
                 "docs/operations.md", "tests/test_systemd_real.py", "tests/systemd_box/box.sh"):
        assert path in members, f"{path} missing from the sdist"


def test_the_wheels_installer_installs_every_unit(wheel_venv: Path, tmp_path: Path) -> None:
    """``sh VENV/share/ccsq/systemd/install.sh`` as an operator runs it, from the installed wheel:
    ``--root`` stages every unit of systemd/ for real, and ``--dry-run --venv`` passes too (it
    fails like the real run when a unit is missing; before, the wheel lacked ccsq-relayd@.service,
    the real run stopped at `install: cannot stat` and --dry-run said nothing)."""
    installer = wheel_venv / "share" / "ccsq" / "systemd" / "install.sh"
    assert installer.is_file(), f"the installed wheel has no {installer}"
    staged = tmp_path / "stage"
    done = subprocess.run(["sh", str(installer), "--root", str(staged)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"install.sh --root rc {done.returncode}:\n{done.stdout}\n{done.stderr}"
    units = [u for u in UNITS if u != "install.sh"]
    for unit in units:
        assert (staged / "etc/systemd/system" / unit).read_bytes() == (REPO / "systemd" / unit).read_bytes(), unit
    assert sorted(p.name for p in (staged / "etc/systemd/system").iterdir()) == units
    if str(wheel_venv).startswith(("/tmp/", "/home/", "/root/", "/var/tmp/")):
        return  # --venv refuses a venv the units cannot see (not root: no venv under /opt)
    done = subprocess.run(["sh", str(installer), "--dry-run", "--venv", str(wheel_venv)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, f"install.sh --dry-run rc {done.returncode}:\n{done.stdout}\n{done.stderr}"
    for unit in units:
        assert f"install -m 0644 {installer.parent}/{unit} /etc/systemd/system/{unit}" in done.stdout, done.stdout


@pytest.mark.timeout(600)
def test_the_wheel_runs_a_swarm(wheel_venv: Path, tmp_path: Path) -> None:
    bin_dir = wheel_venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"

    def run(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=timeout_s)

    where = run("python", "-c", "import ccsq.common, ccsq.workerd.handlers; print(ccsq.common.__file__)")
    assert where.returncode == 0 and where.stdout.startswith(str(wheel_venv)), f"not the wheel's copy: {where}"
    swarm = tmp_path / "swarm"
    done = run("ccsq", "init", str(swarm), "--workers", "2", "--handler", "echo",
               "--endpoint", f"tcp://127.0.0.1:{free_tcp_port()}")
    assert done.returncode == 0, done.stderr
    assert (swarm / "workerd-0.toml").exists() and (swarm / "workerd-1.toml").exists(), sorted(os.listdir(swarm))
    assert tomllib.loads((swarm / "workerd-0.toml").read_text())["peer_id"] == "worker-1"
    with open(swarm / "brokerd.toml", "a") as f:  # tmp may be small; the swarm is tiny
        f.write("min_free_disk_bytes = 0\n")
    tomllib.loads((swarm / "brokerd.toml").read_text())
    items = tmp_path / "items"
    items.mkdir()
    for i in range(20):
        (items / f"doc-{i}.txt").write_text(f"document {i}\n")
    with ProcessGroup(tmp_path / "logs") as group:
        group.start("broker", [str(bin_dir / "ccsq-brokerd"), "--config", str(swarm / "brokerd.toml")], env=env,
                    ready_event="broker_started", ready_timeout_s=60)
        for gpu in (0, 1):
            group.start(f"worker-{gpu + 1}", [str(bin_dir / "ccsq-workerd"), "--config", str(swarm / f"workerd-{gpu}.toml")],
                        env=env, ready_event="broker_link_ready", ready_timeout_s=60)
        # the wheel's ccsq-completiond, as ccsq-completion.service runs it (`ccsq completion` is the same command)
        group.start("completion", [str(bin_dir / "ccsq-completiond"), "--config", str(swarm / "completion.toml")], env=env,
                    ready_event="broker_link_ready", ready_timeout_s=60)
        done = run("ccsq", "submit", "--config", str(swarm / "producer.toml"), "--kind", "echo", "--wait",
                   "--timeout-s", "90", *sorted(str(p) for p in items.iterdir()), timeout_s=150)
        assert done.returncode == 0, f"submit --wait rc {done.returncode}:\n{done.stdout}\n{done.stderr}"
        assert done.stdout.count(" acknowledged") == 20, done.stdout
        report = run("ccsq", "gap-report", "--config", str(swarm / "brokerd.toml"), "--json")
        assert report.returncode == 0, report.stderr
        books = json.loads(report.stdout)
        assert books["balanced"] and books["counters"]["received"] == 20 and books["counters"]["acknowledged"] == 20, books
        for name in ("completion", "worker-2", "worker-1", "broker"):
            group.signal(name, signal.SIGTERM)
            assert group.wait_exit(name, timeout_s=30) == 0, group.tail(name)


# --- the units under a real systemd -------------------------------------------------------
def _why_no_box() -> str | None:
    """Why this machine cannot boot the box (None when it can); missing packages fail under CI."""
    if os.geteuid() != 0:
        return "needs root: it boots systemd as PID 1 of private namespaces"
    for tool in ("unshare", "nsenter", "setpriv", "findmnt", "setsid"):
        if shutil.which(tool) is None:
            _missing(f"util-linux's {tool} is missing (apt-get install util-linux)")
    if shutil.which("ps") is None:
        _missing("ps is missing (apt-get install procps)")
    if not os.access("/lib/systemd/systemd", os.X_OK):
        _missing("/lib/systemd/systemd is missing (apt-get install systemd)")
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs (the box is an overlay of /)"
    cg2 = subprocess.run(["findmnt", "-rn", "-t", "cgroup2", "-o", "TARGET"], capture_output=True, text=True).stdout.strip()
    if not cg2:
        return "no cgroup2 mount on this machine (systemd in the box needs one)"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--cgroup", "--net", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare of pid/mount/uts/ipc/cgroup/net namespaces is refused here: {probe.stderr.strip()}"
    return None


@pytest.mark.timeout(600)
def test_the_units_under_a_real_systemd(wheel_venv: Path, tmp_path: Path) -> None:
    """Case C11 (restart loop) and C02 (a SIGSTOPped broker) under the host's real systemd:
    the box's checks a-g and x (tests/systemd_box/box.sh) must all pass."""
    why = _why_no_box()
    if why:
        pytest.skip(why)
    logs = tmp_path / "box-logs"
    done = subprocess.run(["bash", str(BOX), str(wheel_venv)], capture_output=True, text=True, timeout=400,
                          env={**os.environ, "CCSQ_BOX_LOGS": str(logs)})
    out = done.stdout + done.stderr
    print(out)
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    journal = ""
    if done.returncode != 0 and (logs / "journal.txt").exists():
        journal = "\n".join(line for line in (logs / "journal.txt").read_text(errors="replace").splitlines()[-80:])
    assert done.returncode == 0 and not fails and "RESULT: " in out, f"box.sh rc {done.returncode}:\n{out}\n--- journal tail:\n{journal}"
    for check in ("boot", "install", "a", "b", "c", "d1", "d2", "d3", "d4", "g", "e", "x", "f1", "f2", "f3", "f4", "f5", "f6"):
        assert any(line.startswith(f"PASS {check}: ") for line in out.splitlines()), f"check {check} did not run:\n{out}"
