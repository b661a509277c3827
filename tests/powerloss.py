"""A power loss for tests: what a disk holds when the power goes, every write not yet
made durable lost.

A SIGKILL keeps the page cache (the kernel still writes it back), so it cannot show a
missing fsync. Here a writer process runs with ``tests/powerloss_preload.c`` preloaded:
it logs, before each write to a file under ``root``, the bytes the write overwrites,
and marks each fsync/fdatasync (the file is durable) and each O_DSYNC write (that range
is durable). After the writer is SIGKILLed, :func:`lose_unsynced` puts back the old
bytes of every write after the file's last sync (newest first, sparing the ranges
written durably since): the files are then what the disk would hold after a power
loss at that moment, in the worst case the model allows (nothing unsynced survived;
directory entries are kept). Lock and shared-memory files (``lock.mdb``, ``-shm``,
written through mmap, rebuilt at open) are removed.

Needs a C compiler (``cc``); :func:`build` compiles the library into a directory.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("powerloss_preload.c")
_HEAD = struct.Struct("<qqq")  # offset, old size, data length


def build(directory: Path) -> Path | None:
    """Compile the preload library into ``directory``; None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = directory / "powerloss.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl", "-lpthread"], check=True,
                   capture_output=True)
    return out


def env(lib: Path, log: Path, root: Path) -> dict[str, str]:
    """Environment variables for a writer process under ``root``, logging to ``log``."""
    return {"LD_PRELOAD": str(lib), "CCSQ_POWERLOSS_LOG": str(log), "CCSQ_POWERLOSS_ROOT": str(root.resolve())}


def read_log(log: Path) -> list[tuple[str, str, int, int, bytes]]:
    """The records ``(kind, path, offset, old size, data)`` in write order."""
    raw = log.read_bytes() if log.exists() else b""
    out, i = [], 0
    while i < len(raw):
        kind = chr(raw[i])
        (plen,) = struct.unpack_from("<I", raw, i + 1)
        path = raw[i + 5:i + 5 + plen].decode()
        j = i + 5 + plen
        off, old_size, n = _HEAD.unpack_from(raw, j)
        j += _HEAD.size
        out.append((kind, path, off, old_size, raw[j:j + n]))
        i = j + n
    return out


def lose_unsynced(log: Path, root: Path) -> dict[str, int]:
    """Undo every write after each file's last sync (see the module doc); returns
    {path: writes undone}."""
    by_path: dict[str, list] = {}
    for rec in read_log(log):
        if rec[0] == "S":
            by_path[rec[1]] = []
        else:
            by_path.setdefault(rec[1], []).append(rec)
    undone = {}
    for path, pending in by_path.items():
        if not pending or not os.path.exists(path):
            continue
        durable: list[tuple[int, int]] = []  # ranges written O_DSYNC after the record being undone
        with open(path, "r+b") as f:
            for kind, _p, off, old_size, data in reversed(pending):
                if kind == "D":
                    durable.append((off, off + old_size))  # (a D record: old_size is the length written)
                    continue
                if kind == "W":
                    for start, chunk in _spare(off, data, durable):
                        f.seek(start)
                        f.write(chunk)
                    keep = max([old_size] + [end for _s, end in durable])
                    if os.fstat(f.fileno()).st_size > keep:
                        f.truncate(keep)
                elif kind == "T":  # a truncate: the file had old_size bytes, data from off
                    f.seek(off)
                    f.write(data)
        undone[path] = sum(1 for r in pending if r[0] in "WT")
    for p in list(root.rglob("lock.mdb")) + list(root.rglob("*-shm")):
        p.unlink()
    return undone


def _spare(off: int, data: bytes, durable: list[tuple[int, int]]):
    """The parts of ``data`` (at ``off``) outside the ``durable`` ranges: (offset, bytes)."""
    cuts = sorted((max(s, off), min(e, off + len(data))) for s, e in durable if s < off + len(data) and e > off)
    pos = off
    for s, e in cuts:
        if s > pos:
            yield pos, data[pos - off:s - off]
        pos = max(pos, e)
    if pos < off + len(data):
        yield pos, data[pos - off:]
