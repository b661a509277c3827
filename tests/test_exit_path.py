"""One exit path for every main (``common/runtime/daemon.py``): :func:`exit_code_for` maps
an error to its exit code, :func:`die` prints the one line and returns it; the mains print
no stop line of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ccsq.brokerd.ledger.store import LedgerError
from ccsq.brokerd.main import LedgerLocked
from ccsq.brokerd.transport import EndpointInUse
from ccsq.common.runtime.daemon import die, exit_code_for
from ccsq.common.wire import errors

ROOT = Path(__file__).resolve().parent.parent
X = errors.ExitCode

CASES = [
    (errors.ConfigError("bad key"), X.CONFIG),
    (errors.JournalCorrupt("row 3"), X.CONFIG),
    (errors.NoInput("no file"), X.NOINPUT),
    (errors.Unauthorized("who"), X.UNAUTHORIZED),
    (errors.GpuUnavailable("no cuda"), X.GPU_UNAVAILABLE),
    (errors.BrokerUnavailable("silent"), X.UNAVAILABLE),
    (errors.AdminFailed("no such item"), X.REFUSED),
    (errors.JournalLocked("held"), X.TEMPFAIL),
    (errors.PortInUse("taken"), X.TEMPFAIL),
    (errors.StoreUnavailable("down"), X.TEMPFAIL),
    (errors.CantCreate("cannot write"), X.CANTCREAT),
    (LedgerError("disk full", exit_code=X.LEDGER_IO), X.LEDGER_IO),
    (LedgerLocked("held by 12"), X.TEMPFAIL),
    (EndpointInUse("bound"), X.TEMPFAIL),
    (errors.QueueFull("full"), X.TEMPFAIL),  # every RetryableError is transient: 75, retry later
    (ValueError("bug"), X.FAILURE),
]


@pytest.mark.parametrize("exc,code", CASES, ids=[type(exc).__name__ for exc, _ in CASES])
def test_exit_code_for(exc: BaseException, code: errors.ExitCode) -> None:
    assert exit_code_for(exc) is code


def test_die_prints_one_line_and_returns_the_code(capsys) -> None:
    assert die("ccsq-x", errors.PortInUse("port 9 taken"), "transient: port 9 taken") == 75
    assert die("ccsq-x", X.CONFIG, "config error: y") == 78
    assert die("ccsq-x", errors.Unauthorized("not in authorized_keys")) == 77
    assert capsys.readouterr().err.splitlines() == ["ccsq-x: transient: port 9 taken", "ccsq-x: config error: y",
                                                    "ccsq-x: not in authorized_keys"]


MAINS = ["brokerd/main.py", "workerd/main.py", "relayd/main.py", "completiond/main.py", "completiond/completion.py",
         "tools/cli.py", "console/main.py"]


def _parse(path: Path) -> ast.Module:
    """``ast.parse`` of ``path``; in a fresh interpreter when this one's parser refuses with
    CPython 3.11's "AST constructor recursion depth mismatch" (a SystemError seen once in a
    pytest worker after other tests had changed the recursion limit: not about the file)."""
    try:
        return ast.parse(path.read_text(), str(path))
    except SystemError:
        import pickle
        import subprocess
        import sys

        code = "import ast, pickle, sys; sys.stdout.buffer.write(pickle.dumps(ast.parse(open(sys.argv[1]).read(), sys.argv[1])))"
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, check=True, timeout=60)
        return pickle.loads(done.stdout)


@pytest.mark.parametrize("rel", MAINS)
def test_the_mains_stop_through_die(rel: str) -> None:
    """No main prints its own stop line to stderr: each goes through die()."""
    tree = _parse(ROOT / rel)
    own = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in ("main", "run", "_serve", "_fail", "_die")):
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"):
            if any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in call.keywords):
                own.append(f"{rel}:{call.lineno} {fn.name}")
    assert not own, f"print to stderr outside die(): {own}"
