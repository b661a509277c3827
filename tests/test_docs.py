"""The README documents every config key that exists (generated block kept in sync)."""

from pathlib import Path

from ccsq.common.wire.config import README_BEGIN, README_END, markdown_reference

ROOT = Path(__file__).resolve().parent.parent


def test_readme_config_reference_is_current() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    assert block == markdown_reference().strip(), "run: python -m ccsq.common.wire.config --write README.md"


def test_readme_shows_the_two_commands_first() -> None:
    head = (ROOT / "README.md").read_text().split("## ", 1)[0]
    assert "make demo" in head and "make test" in head


def test_ci_calls_make_test() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_no_downloaded_packages_are_committed() -> None:
    """Third-party wheels and archives never go in the repository (`*.whl` is in .gitignore)."""
    import subprocess

    done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        import pytest

        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    packages = [p for p in done.stdout.splitlines() if p.endswith((".whl", ".egg"))]
    assert not packages, f"downloaded packages are committed: {packages} (git rm them)"
    assert "*.whl" in (ROOT / ".gitignore").read_text().split()


def test_no_reader_of_the_deprecated_gap_report_keys() -> None:
    """The demo, the tests and the box read ``counters`` and ``states`` of a gap report
    (``load_report``, ``gap-report --json``), never the deprecated flat copies at top level
    (where ``completed`` is a counter, not the state): one day those go."""
    import re

    from ccsq.brokerd.ledger.schema import COUNTERS

    keys = "|".join([*COUNTERS, "ready", "leased"])
    reports = (r"(?:\b(?:rep\w*|report\w*|books|final|restored|r)|\.report\(\)|\(\w+ := [\w.]+\.report\(\)\)|"
               r"load_report\([^)]*\))")
    flat = re.compile(rf"{reports}\[['\"]({keys})['\"]\]")
    hits = []
    for path in [ROOT / "examples" / "demo.py", ROOT / "tests" / "systemd_box" / "box.sh", ROOT / "tests" / "chaos" / "checks.py",
                 *sorted((ROOT / "tests").glob("*.py"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if flat.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "read report['counters'][KEY] / report['states'][KEY] instead:\n" + "\n".join(hits)


def test_make_dist_installs_only_the_build_tool() -> None:
    """``make dist`` needs ``build``, not the package, its extras or the test stack."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("make") is None:
        pytest.skip("make is missing (.ci/run installs it)")
    done = subprocess.run(["make", "-n", "-C", str(ROOT), "dist", "VENV=/nonexistent/venv"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert "-m build" in done.stdout and "pip install -q 'build" in done.stdout, done.stdout
    assert "test]" not in done.stdout and "-e " not in done.stdout, done.stdout


def test_readme_walk_through_commands_parse() -> None:
    """Every ``ccsq ...`` line of README's "Run your own swarm" is a command the CLI accepts."""
    import shlex

    from ccsq.tools.cli import build_parser

    section = (ROOT / "README.md").read_text().split("## Run your own swarm", 1)[1].split("\n## ", 1)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in section.splitlines() if ln.startswith("ccsq ")]
    assert len(lines) >= 5, section
    parser = build_parser()
    for line in lines:
        parser.parse_args(shlex.split(line)[1:])  # argparse exits 2 on a command it does not know
