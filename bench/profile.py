"""Summaries of py-spy ``--format raw`` profiles (collapsed stacks: ``frame;frame;... count``).

``top(path)`` gives the functions with the most *self* samples and the most
*inclusive* samples (a function counted once per stack), as shares of all samples.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

_LINE = re.compile(r"^(.*) (\d+)$")


def _short(frame: str) -> str:
    # py-spy raw frames look like "func (path/to/file.py:123)"; keep func (file:line)
    m = re.match(r"^(.*?) \((.*?):(\d+)\)$", frame.strip())
    if not m:
        return frame.strip()
    func, path, line = m.groups()
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{func} ({short}:{line})"


def _func(frame: str) -> str:
    s = _short(frame)
    return re.sub(r":\d+\)$", ")", s)


def top(path: Path, limit: int = 15) -> dict[str, list[tuple[str, float]]]:
    """``{"self": [(function, share %)...], "inclusive": [...], "samples": [("total", n)]}``."""
    self_c: collections.Counter = collections.Counter()
    incl_c: collections.Counter = collections.Counter()
    total = 0
    for line in Path(path).read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        stack, n = m.group(1), int(m.group(2))
        frames = [f for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        self_c[_func(frames[-1])] += n
        for f in {_func(f) for f in frames}:
            incl_c[f] += n
    if total == 0:
        return {"self": [], "inclusive": [], "samples": [("total", 0)]}
    return {
        "self": [(f, round(100.0 * c / total, 1)) for f, c in self_c.most_common(limit)],
        "inclusive": [(f, round(100.0 * c / total, 1)) for f, c in incl_c.most_common(limit)],
        "samples": [("total", total)],
    }


def print_top(path, n: int = 30) -> None:
    """Print the ``n`` hottest functions of a py-spy raw profile, self and inclusive (%)."""
    t = top(path, n)
    for kind in ("self", "inclusive"):
        print(kind)
        for f, pct in t[kind]:
            print(f"  {pct:5.1f} {f}")
