"""docs/federation.md lists every relayd.toml key (generated block), and the gap
register documents every federation window the code counts."""

from pathlib import Path

from ccsq.brokerd import gaps
from ccsq.relayd.docs import BEGIN, END, markdown_reference

ROOT = Path(__file__).resolve().parent.parent


def test_relay_config_reference_is_current() -> None:
    text = (ROOT / "docs" / "federation.md").read_text()
    assert text.split(BEGIN, 1)[1].split(END, 1)[0].strip() == markdown_reference()


def test_federation_windows_are_documented() -> None:
    register = (ROOT / "docs" / "gap-register.md").read_text()
    for w in gaps.WINDOWS:
        if w.id.startswith("F"):
            assert f"| {w.id} |" in register, w.id
