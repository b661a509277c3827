"""The static checks CI runs (docs/architecture.md, "Checks"): mypy and import-linter over
the package *as installed*, ruff over the tree.

ccsq's packages live in top-level folders mapped by setup.cfg's ``package_dir``
(``brokerd/`` is ``ccsq.brokerd``), so no ``ccsq/`` folder exists in the tree, and the
editable install only maps the names with an import hook that neither mypy nor
import-linter runs. Each test session therefore builds a real (non-editable) install with
pip into ``build/static-checks/<worker>/site`` (``--no-deps --no-build-isolation``: no
network; setuptools' build directories go to a temporary directory, so nothing stale and
nothing in the tree) and checks that: what a user installs is what is checked.

Each rule is shown to bite: a planted bad import breaks its contract, a planted type error
fails mypy, a planted unused import fails ruff.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"
BIN = Path(sys.executable).parent
CHECKS = ROOT / "build" / "static-checks" / os.environ.get("PYTEST_XDIST_WORKER", "main")


def _run(cmd: list[str], cwd: Path, timeout_s: float = 180, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(cwd), **env})


def _tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} is missing from the venv: pip install -e '.[test]' (setup.cfg's test extra)"
    return str(path)


@pytest.fixture(scope="module")
def site() -> Path:
    """A fresh non-editable install of this tree (``site/ccsq/...``), built once per module."""
    target = CHECKS / "site"
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ccsq-static-") as tmp:
        extra = Path(tmp) / "build.cfg"  # setuptools reads DIST_EXTRA_CONFIG: build dirs out of the tree
        extra.write_text(f"[build]\nbuild_base = {tmp}/build\n[egg_info]\negg_base = {tmp}\n")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                               "--no-compile", "--target", str(target), str(ROOT)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "DIST_EXTRA_CONFIG": str(extra)})
    assert proc.returncode == 0, f"pip install --target failed:\n{proc.stdout}\n{proc.stderr}"
    assert (target / "ccsq" / "common" / "wire" / "protocol.py").is_file()
    return target


@pytest.fixture
def plant(site: Path) -> Iterator[Callable[[str, str], None]]:
    """``plant("common/wire/x.py", "import ccsq.brokerd")``: a module written into the
    install (never into the tree), removed after the test."""
    made: list[Path] = []

    def write(rel: str, text: str) -> None:
        path = site / "ccsq" / rel
        for parent in reversed(path.relative_to(site).parents):
            if not (site / parent).exists():
                (site / parent).mkdir()
                made.append(site / parent)
        path.write_text(text)
        made.append(path)

    yield write
    for path in reversed(made):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _lint_imports(site: Path, *contracts: str) -> subprocess.CompletedProcess:
    cmd = [_tool("lint-imports"), "--no-logo", "--no-cache", str(CONFIG)]
    for c in contracts:
        cmd += ["--contract", c]
    return _run(cmd, cwd=site)


def _mypy(site: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "mypy", "--config-file", str(CONFIG), "--cache-dir", str(CHECKS / "mypy-cache"),
                 "--python-executable", sys.executable], cwd=site)


def test_the_install_carries_the_py_typed_markers(site: Path) -> None:
    """PEP 561: ``ccsq`` is a namespace package, so each top-level package carries ``py.typed``."""
    tops = sorted(p.name for p in (site / "ccsq").iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert tops and all((site / "ccsq" / top / "py.typed").is_file() for top in tops), tops


def test_mypy_is_clean_over_the_installed_package(site: Path) -> None:
    proc = _mypy(site)
    assert proc.returncode == 0, f"mypy (packages listed in pyproject.toml [tool.mypy]):\n{proc.stdout}{proc.stderr}"
    assert "Success" in proc.stdout


def test_mypy_fails_on_a_planted_type_error(site: Path) -> None:
    backoff = site / "ccsq" / "common" / "wire" / "backoff.py"
    original = backoff.read_text()
    backoff.write_text(original + "\n\nPLANTED: int = 'not an int'\n")
    try:
        proc = _mypy(site)
    finally:
        backoff.write_text(original)
    assert proc.returncode == 1 and "backoff.py" in proc.stdout and "[assignment]" in proc.stdout, proc.stdout


def test_the_import_contracts_are_kept(site: Path) -> None:
    proc = _lint_imports(site)
    assert proc.returncode == 0, f"lint-imports (contracts in pyproject.toml):\n{proc.stdout}{proc.stderr}"
    contracts = tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in proc.stdout, proc.stdout


#: (contract id, module planted into the install, its text): each must break its contract.
PLANTED = [
    ("layers", "common/wire/_planted.py", "import ccsq.common.runtime.log\n"),  # wire imports up
    ("layers", "common/link/_planted.py", "from ccsq.producer import client\n"),  # layer 2 imports layer 3
    ("layers", "brokerd/_planted.py", "import ccsq.tools.cli\n"),  # a daemon imports the tools
    ("layers", "newtop/__init__.py", ""),  # a top-level package in no layer
    ("common-layers", "common/newsub/__init__.py", ""),  # a common/ sub-package in no layer
    ("daemons-independent", "workerd/_planted.py", "from ccsq.brokerd.ledger import schema\n"),
    ("daemons-independent", "relayd/_planted.py", "import ccsq.completiond.resultsdb\n"),
    ("tools-read-the-broker", "tools/_planted.py", "from ccsq.brokerd import actor\n"),
    ("tools-read-the-broker", "console/_planted.py", "import ccsq.brokerd.transport\n"),
    ("no-test-code", "producer/_planted.py", "import tests.swarm\n"),
    ("protocol-facade", "workerd/_planted.py", "from ccsq.common.wire.messages import Blob\n"),  # past protocol.py
]


@pytest.mark.parametrize("contract,rel,text", PLANTED, ids=[f"{c}:{r}" for c, r, _ in PLANTED])
def test_a_planted_import_breaks_its_contract(site: Path, plant, contract: str, rel: str, text: str) -> None:
    plant(rel, text)
    proc = _lint_imports(site, contract)
    assert proc.returncode == 1 and "BROKEN" in proc.stdout and "0 kept, 1 broken" in proc.stdout, proc.stdout + proc.stderr
    planted = "ccsq." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    assert planted in proc.stdout, proc.stdout


def test_an_exception_no_longer_needed_fails(site: Path, tmp_path: Path) -> None:
    """An ``ignore_imports`` rule that matches no import is an error: a stale exception
    would hide the next break."""
    text = CONFIG.read_text()
    anchor = '    "ccsq.console.* -> ccsq.brokerd.gaps",'
    assert anchor in text
    config = tmp_path / "pyproject.toml"
    config.write_text(text.replace(anchor, anchor + '\n    "ccsq.console.app -> ccsq.brokerd.actor",'))
    proc = _run([_tool("lint-imports"), "--no-logo", "--no-cache", str(config), "--contract", "tools-read-the-broker"],
                cwd=site)
    assert proc.returncode == 1 and "No matches for ignored import ccsq.console.app -> ccsq.brokerd.actor" in proc.stdout + proc.stderr


def test_ruff_is_clean() -> None:
    proc = subprocess.run([_tool("ruff"), "check", "--no-cache", "--config", str(CONFIG), str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check (rules in pyproject.toml [tool.ruff.lint]):\n{proc.stdout}{proc.stderr}"


def test_ruff_fails_on_a_planted_unused_import(tmp_path: Path) -> None:
    bad = tmp_path / "planted.py"
    bad.write_text("import os\n")
    proc = subprocess.run([_tool("ruff"), "check", "--no-cache", "--config", str(CONFIG), str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "F401" in proc.stdout, proc.stdout


# --- house rules no linter has (docs/architecture.md, "Checks") ---
SOURCE_DIRS = ("common", "brokerd", "workerd", "completiond", "relayd", "producer", "console", "tools", "bench", "examples", "tests")
#: short aliases every reader knows (``import numpy as np``, ``from hypothesis import strategies as st``)
CONVENTIONAL_ALIASES = {("numpy", "np"), ("hypothesis.strategies", "st")}
#: files other sessions were rewriting when the rule came in, with the aliases they still use: rename them there
#: (``from ccsq.common.wire import protocol``) and drop the entry (an entry no longer needed fails)
SHORT_ALIASES_LEFT: dict[str, set[str]] = {}


def _sources() -> Iterator[tuple[str, str]]:
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/out/" not in rel:
                yield rel, path.read_text(encoding="utf-8")


def _short_aliases(source: str) -> set[tuple[str, str]]:
    """``(module, alias)`` for every ``import M as A`` / ``from P import M as A`` whose alias
    has at most two characters."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            prefix = f"{node.module}." if isinstance(node, ast.ImportFrom) and node.module else ""
            out |= {(prefix + a.name, a.asname) for a in node.names if a.asname and len(a.asname) <= 2}
    return out


def test_modules_are_imported_under_readable_names() -> None:
    """``protocol.Submit``, not ``p.Submit``: a reader of one line knows which module it calls."""
    found = {rel: {a for m, a in _short_aliases(src) if (m, a) not in CONVENTIONAL_ALIASES} for rel, src in _sources()}
    found = {rel: aliases for rel, aliases in found.items() if aliases}
    new = {rel: sorted(a - SHORT_ALIASES_LEFT.get(rel, set())) for rel, a in found.items() if a - SHORT_ALIASES_LEFT.get(rel, set())}
    assert not new, f"short module aliases (import the module under its own name): {new}"
    gone = {rel: sorted(a - found.get(rel, set())) for rel, a in SHORT_ALIASES_LEFT.items() if a - found.get(rel, set())}
    assert not gone, f"SHORT_ALIASES_LEFT entries no longer needed (drop them): {gone}"


def test_the_alias_check_bites() -> None:
    planted = "from ccsq.common.wire import protocol as p\nimport numpy as np\nfrom a import b as bb, c as ccc\n"
    assert _short_aliases(planted) - CONVENTIONAL_ALIASES == {("ccsq.common.wire.protocol", "p"), ("a.b", "bb")}


def test_package_comments_state_the_invariant_not_the_issue() -> None:
    """A comment or docstring of the package says what holds and why, not which issue changed
    it (that is the commit message's job); tests may name the defect they pin."""
    import re

    rx = re.compile(r"\b[Ii]ssues? ?#?\d+")
    hits = [f"{rel}:{n}: {line.strip()[:100]}" for rel, src in _sources() if not rel.startswith("tests/")
            for n, line in enumerate(src.splitlines(), 1) if rx.search(line)]
    assert not hits, "\n".join(hits)


def test_no_file_is_exempt_from_the_line_length() -> None:
    """No file is exempted from E501 (140 characters) in pyproject.toml: the rule holds everywhere."""
    with CONFIG.open("rb") as f:
        ignores = tomllib.load(f)["tool"]["ruff"]["lint"].get("per-file-ignores", {})
    exempt = sorted(rel for rel, codes in ignores.items() if "E501" in codes)
    assert not exempt, f"files exempted from the 140-character rule (wrap their lines instead): {exempt}"


def test_ruff_fails_on_a_planted_long_line(tmp_path: Path) -> None:
    bad = tmp_path / "planted.py"
    bad.write_text("X = " + repr("x" * 140) + "\n")
    proc = subprocess.run([_tool("ruff"), "check", "--no-cache", "--config", str(CONFIG), str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "E501" in proc.stdout, proc.stdout
