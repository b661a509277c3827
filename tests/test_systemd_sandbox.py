"""Two seccomp settings of the ccsq units, applied by hand where systemd does not run the tests.

``MemoryDenyWriteExecute=yes`` (broker and completion units): systemd implements
it as a seccomp filter (src/shared/seccomp-util.c,
``seccomp_memory_deny_write_execute``) that makes these calls fail with EPERM:

- ``mmap`` with both PROT_WRITE and PROT_EXEC;
- ``mprotect`` / ``pkey_mprotect`` adding PROT_EXEC;
- ``shmat`` with SHM_EXEC.

``SystemCallFilter=`` (every unit): an allow-list of syscall names; with
``SystemCallErrorNumber=EPERM`` any other call fails with EPERM. The names come
from ``systemd-analyze syscall-filter`` (the groups of the installed systemd)
and the numbers from the kernel headers.

A library that needs what these forbid (a JIT, an old libffi, an exotic
syscall) would fail only in production; the tests run the real daemons under
the same rules. x86-64 only. As a script (``--umask`` applies ``UMask=`` too)::

    python tests/test_systemd_sandbox.py [--umask 0077] [--deny-write-execute] [--syscalls FILE] -- COMMAND [ARG...]

``FILE`` holds the allowed syscall numbers, one per line.

Only these two: the rest of the sandbox (``RestrictAddressFamilies=``, which once aborted the broker
because libzmq needs AF_NETLINK, ``ProtectHome=``, ``PrivateTmp=``, the users, the start limit) shows
only under a real systemd, which ``tests/test_systemd_real.py`` boots.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path

# --- seccomp plumbing -----------------------------------------------------------------
_AUDIT_ARCH_X86_64 = 0xC000003E
_NR = {"mmap": 9, "mprotect": 10, "shmat": 30, "pkey_mprotect": 329}  # x86-64 syscall numbers
_PROT_WRITE, _PROT_EXEC, _SHM_EXEC = 0x2, 0x4, 0o100000
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
_LD_ABS_W, _JEQ_K, _JSET_K, _AND_K, _RET_K = 0x20, 0x15, 0x45, 0x54, 0x06
_OFF_NR, _OFF_ARCH, _OFF_ARG2 = 0, 4, 16 + 2 * 8  # struct seccomp_data, low 32 bits of args[2]
UNISTD_64_H = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _assemble(prog: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Resolve labels: an instruction may start with a label; jt/jf may name one."""
    labels = {ins[0]: i for i, ins in enumerate(prog) if isinstance(ins[0], str)}
    out = []
    for i, ins in enumerate(prog):
        code, jt, jf, k = ins[1:] if isinstance(ins[0], str) else ins
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out.append((code, jt, jf, k))
    return out


def _write_execute_program() -> list[tuple[int, int, int, int]]:
    """MemoryDenyWriteExecute=yes as BPF (code, jt, jf, k)."""
    allow, deny = "allow", "deny"
    return _assemble([
        (_LD_ABS_W, 0, 0, _OFF_ARCH),
        (_JEQ_K, 0, allow, _AUDIT_ARCH_X86_64),
        (_LD_ABS_W, 0, 0, _OFF_NR),
        (_JEQ_K, "mmap", 0, _NR["mmap"]),
        (_JEQ_K, "exec", 0, _NR["mprotect"]),
        (_JEQ_K, "exec", 0, _NR["pkey_mprotect"]),
        (_JEQ_K, "shm", allow, _NR["shmat"]),
        ("mmap", _LD_ABS_W, 0, 0, _OFF_ARG2),
        (_AND_K, 0, 0, _PROT_WRITE | _PROT_EXEC),
        (_JEQ_K, deny, allow, _PROT_WRITE | _PROT_EXEC),
        ("exec", _LD_ABS_W, 0, 0, _OFF_ARG2),
        (_JSET_K, deny, allow, _PROT_EXEC),
        ("shm", _LD_ABS_W, 0, 0, _OFF_ARG2),
        (_JSET_K, deny, allow, _SHM_EXEC),
        ("allow", _RET_K, 0, 0, _RET_ALLOW),
        ("deny", _RET_K, 0, 0, _RET_EPERM),
    ])


def _allow_list_program(numbers: set[int]) -> list[tuple[int, int, int, int]]:
    """SystemCallFilter= allow-list + SystemCallErrorNumber=EPERM as BPF (two insns per syscall)."""
    prog: list[tuple] = [(_LD_ABS_W, 0, 0, _OFF_ARCH), (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64), (_RET_K, 0, 0, _RET_EPERM),
                         (_LD_ABS_W, 0, 0, _OFF_NR)]
    for nr in sorted(numbers):
        prog += [(_JEQ_K, 0, 1, nr), (_RET_K, 0, 0, _RET_ALLOW)]
    prog.append((_RET_K, 0, 0, _RET_EPERM))
    return _assemble(prog)


def supported() -> bool:
    """True where this emulation works (Linux on x86-64)."""
    return sys.platform == "linux" and platform.machine() == "x86_64"


def _install(insns: list[tuple[int, int, int, int]]) -> None:
    if not supported():
        raise RuntimeError("the seccomp emulation supports Linux on x86-64 only")
    libc = ctypes.CDLL(None, use_errno=True)
    array = (_SockFilter * len(insns))(*[_SockFilter(*ins) for ins in insns])
    prog = _SockFprog(len(insns), array)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def deny_write_execute() -> None:
    """Install the MemoryDenyWriteExecute filter on this process (inherited by children and execs).
    Raises OSError when the kernel refuses and RuntimeError off x86-64."""
    _install(_write_execute_program())


def allow_only_syscalls(numbers: set[int]) -> None:
    """Install a SystemCallFilter= allow-list (others fail with EPERM) on this process."""
    _install(_allow_list_program(numbers))


# --- SystemCallFilter= names -> numbers -------------------------------------------------
def syscall_groups(systemd_analyze: str) -> dict[str, list[str]]:
    """``{"@group": [member, ...]}`` as the installed systemd defines them (members may be groups)."""
    text = subprocess.run([systemd_analyze, "syscall-filter", "--no-pager"], capture_output=True, text=True,
                          check=True, timeout=30).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith("    ") and current is not None and not line.strip().startswith("#") and line.strip():
            current.append(line.strip())
        elif not line.strip():
            current = None
    return groups


def expand(entries: list[str], groups: dict[str, list[str]]) -> set[str]:
    """Syscall names of a list of names and @groups (recursively)."""
    out: set[str] = set()
    for entry in entries:
        out |= expand(groups[entry], groups) if entry.startswith("@") else {entry}
    return out


def unit_syscall_names(filter_lines: list[str], groups: dict[str, list[str]]) -> set[str]:
    """The names a unit's ``SystemCallFilter=`` lines (in order) allow; it must start with an allow-list."""
    allowed: set[str] | None = None
    for line in filter_lines:
        deny = line.startswith("~")
        names = expand(line.lstrip("~").split(), groups)
        if allowed is None:
            if deny:
                raise ValueError("emulated only: a SystemCallFilter= that starts with an allow-list")
            allowed = set()
        allowed = allowed - names if deny else allowed | names
    return allowed or set()


def syscall_numbers(names: set[str], header: Path = UNISTD_64_H) -> set[int]:
    """x86-64 numbers of ``names`` (names this architecture lacks are skipped)."""
    table = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", header.read_text())}
    return {table[n] for n in names if n in table}


def wrap(argv: list[str], *, deny_write_execute: bool = True, umask: int | None = None,
         syscalls_file: Path | None = None) -> list[str]:
    """``argv`` run under the filters and/or a umask (through this file as a script)."""
    opts = (["--deny-write-execute"] if deny_write_execute else []) + (["--umask", f"{umask:04o}"] if umask is not None else [])
    opts += ["--syscalls", str(syscalls_file)] if syscalls_file else []
    return [sys.executable, os.path.abspath(__file__), *opts, "--", *argv]


# --- tests of the emulation itself and of the libraries the daemons load --------------
if __name__ != "__main__":
    import pytest

    pytestmark = pytest.mark.skipif(not supported(), reason="the seccomp emulation is x86-64 Linux only")

    _PROBE = textwrap.dedent(
        """
        import ctypes, mmap
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        def try_mmap(prot):
            addr = libc.mmap(None, 4096, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            return "denied" if addr in (None, ctypes.c_void_p(-1).value) else "allowed"
        print(try_mmap(mmap.PROT_READ | mmap.PROT_WRITE), try_mmap(mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC))
        """
    )

    def _run(code: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(wrap([sys.executable, "-c", code]), capture_output=True, text=True, timeout=timeout_s)

    def test_filter_denies_writable_executable_mappings_only() -> None:
        done = _run(_PROBE)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["allowed", "denied"]

    def test_syscall_allow_list_denies_what_the_units_remove(tmp_path: Path) -> None:
        """@system-service minus @privileged, as the units say: threads work, chown fails with EPERM."""
        import shutil

        analyze = shutil.which("systemd-analyze")
        if analyze is None or not UNISTD_64_H.exists():
            missing = "systemd-analyze (package systemd)" if analyze is None else f"{UNISTD_64_H} (package linux-libc-dev)"
            if os.environ.get("CI"):
                pytest.fail(f"{missing} is missing: CI must install it")
            pytest.skip(f"needs {missing}")
        names = unit_syscall_names(["@system-service", "~@privileged"], syscall_groups(analyze))
        assert {"read", "write", "clone", "futex", "epoll_wait", "fsync"} <= names and "chown" not in names
        numbers = tmp_path / "syscalls"
        numbers.write_text("\n".join(map(str, sorted(syscall_numbers(names)))))
        target = tmp_path / "f"
        target.touch()
        code = (f"import os, threading; t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
                f"try:\n    os.chown({str(target)!r}, os.getuid(), os.getgid())\nexcept PermissionError:\n    print('denied')")
        done = subprocess.run(wrap([sys.executable, "-c", code], deny_write_execute=False, syscalls_file=numbers),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["thread", "denied"]

    def test_broker_and_completion_libraries_work_without_write_execute() -> None:
        """What the broker/completion import and touch: msgpack, zmq, lmdb, Ed25519, uvloop,
        sqlite3, ctypes callbacks (libffi closures)."""
        code = textwrap.dedent(
            """
            import asyncio, ctypes, sqlite3, tempfile
            import lmdb, msgpack, uvloop, zmq
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
            key = Ed25519PrivateKey.generate()
            key.public_key().verify(key.sign(b"x"), b"x")
            assert msgpack.unpackb(msgpack.packb({"a": 1})) == {"a": 1}
            with tempfile.TemporaryDirectory() as d:
                env = lmdb.open(d, map_size=1 << 20)
                with env.begin(write=True) as txn:
                    txn.put(b"k", b"v")
                env.close()
                con = sqlite3.connect(d + "/r.db"); con.execute("create table t(x)"); con.commit(); con.close()
            ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind("tcp://127.0.0.1:*"); s.close(); ctx.term()
            uvloop.run(asyncio.sleep(0))
            CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
            arr = (ctypes.c_int * 3)(3, 1, 2)
            cmp = CB(lambda a, b: ctypes.cast(a, ctypes.POINTER(ctypes.c_int))[0] - ctypes.cast(b, ctypes.POINTER(ctypes.c_int))[0])
            ctypes.CDLL(None).qsort(arr, 3, ctypes.sizeof(ctypes.c_int), cmp)
            assert list(arr) == [1, 2, 3]
            print("ok")
            """
        )
        done = _run(code)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

    def test_cpu_inference_works_without_write_execute() -> None:
        """The worker unit leaves MemoryDenyWriteExecute off for the CUDA driver; this shows a
        CPU-only worker (numpy + onnxruntime CPU) could turn it on with a drop-in."""
        pytest.importorskip("onnxruntime")
        code = textwrap.dedent(
            """
            import numpy as np, onnxruntime as ort
            # a one-node Relu model, serialised by hand (no onnx package needed)
            def varint(n):
                out = b""
                while True:
                    b, n = n & 0x7F, n >> 7
                    out += bytes([b | (0x80 if n else 0)])
                    if not n: return out
            def field(num, wt, payload):
                key = varint((num << 3) | wt)
                return key + (varint(len(payload)) + payload if wt == 2 else varint(payload))
            def s(num, text): return field(num, 2, text.encode())
            dim = field(1, 2, field(1, 0, 4))                         # TensorShapeProto.dim {dim_value: 4}
            tensor_type = field(1, 0, 1) + field(2, 2, dim)          # elem_type FLOAT, shape
            vtype = field(1, 2, tensor_type)                          # TypeProto.tensor_type
            def value_info(name): return s(1, name) + field(2, 2, vtype)
            node = s(1, "x") + s(2, "y") + s(4, "Relu")
            graph = field(1, 2, node) + s(2, "g") + field(11, 2, value_info("x")) + field(12, 2, value_info("y"))
            model = field(1, 0, 8) + field(7, 2, graph) + field(8, 2, field(2, 0, 13))  # ir_version 8, opset 13
            sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
            y = sess.run(None, {"x": np.array([-1, 2, -3, 4], dtype=np.float32)})[0]
            assert y.tolist() == [0, 2, 0, 4], y
            print("ok")
            """
        )
        done = _run(code)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="exec COMMAND the way a ccsq unit would (a few settings)")
    parser.add_argument("--deny-write-execute", action="store_true", help="MemoryDenyWriteExecute=yes")
    parser.add_argument("--umask", type=lambda v: int(v, 8), help="UMask=, octal")
    parser.add_argument("--syscalls", type=Path, help="SystemCallFilter=: file of allowed syscall numbers")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    if args.umask is not None:
        os.umask(args.umask)
    if args.deny_write_execute:
        deny_write_execute()
    if args.syscalls:
        allow_only_syscalls({int(v) for v in args.syscalls.read_text().split()})
    os.execvp(args.command[0], args.command)


if __name__ == "__main__":
    _main(sys.argv[1:])
