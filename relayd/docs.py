"""The ``relayd.toml`` key reference embedded in docs/federation.md (kept in sync by a test)."""

from __future__ import annotations

from ccsq.common.wire.config import describe
from ccsq.relayd.config import LinkConfig, RelayConfig

BEGIN = "<!-- relay-keys:begin (generated from ccsq.relayd.config; tests/test_federation_units.py checks it) -->"
END = "<!-- relay-keys:end -->"


def markdown_reference() -> str:
    out: list[str] = []
    for cls, name in ((RelayConfig, "relayd.toml (top level)"), (LinkConfig, "relayd.toml [[links]]")):
        out.append(f"**`{name}`**\n\n| key | type | default | meaning |\n|---|---|---|---|")
        out += [f"| `{k}` | {t} | `{d!r}` | {doc} |" for k, t, d, doc in describe(cls) if k != "links"]
        out.append("")
    return "\n".join(out).strip()
