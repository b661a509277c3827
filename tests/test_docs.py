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
