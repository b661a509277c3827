"""A folder's ``MANIFEST``: the SHA-256 of every file in it, in ``sha256sum`` format.

``ccsq init --hosts`` and ``ccsq init-relay --hosts`` write one into each host's folder;
the copy recipe (docs/deployment.md) checks the copy with ``sha256sum -c MANIFEST``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

MANIFEST = "MANIFEST"


def write_manifest(folder: Path) -> Path:
    """``folder/MANIFEST``: ``<sha256>  <path>`` for every other file under ``folder``
    (sorted, paths relative to it; mode 0644). Returns its path."""
    lines = []
    for f in sorted(folder.rglob("*")):
        if f.is_file() and f.relative_to(folder).as_posix() != MANIFEST:
            lines.append(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(folder).as_posix()}\n")
    path = folder / MANIFEST
    path.write_text("".join(lines))
    os.chmod(path, 0o644)
    return path
