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
