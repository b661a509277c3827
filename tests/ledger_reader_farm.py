"""A farm of real LMDB reader processes for tests (``python tests/ledger_reader_farm.py LEDGER_DIR``).

The parent never opens the ledger (py-lmdb allows one open per process, and a
forked child must open its own): it forks children that each open the ledger
read-only with LMDB's lock table, begin a read transaction (a reader slot and a
snapshot) and sleep holding it, as an operator's ``lmdb`` session or a tool
would. The children never run LMDB's reader check themselves: slots their death
leaves behind are the broker's to clear.

Commands on stdin, one answer line each on stdout:

- ``open N WAIT_S``: fork N readers; a reader that finds the table full retries
  for up to WAIT_S seconds. Answer ``opened OK FULL TXNIDS`` (comma-separated).
- ``kill``: SIGKILL every reader (mid-transaction) and reap it. Answer ``killed N``.
- ``pids``: answer ``pids P,P,...``.
- ``quit``: kill, then exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _reader(path: str, wait_s: float, w: int) -> None:
    import lmdb

    deadline = time.monotonic() + wait_s
    env = None
    while True:
        try:
            if env is None:  # py-lmdb's open begins a read transaction too
                env = lmdb.open(path, readonly=True, lock=True, subdir=True, max_dbs=16)
            txn = env.begin()
            os.write(w, b"ok %d\n" % txn.id())
            break
        except lmdb.ReadersFullError:
            if time.monotonic() > deadline:
                os.write(w, b"full 0\n")
                break
            time.sleep(0.02)
    os.close(w)
    parent = os.getppid()
    while os.getppid() == parent:  # holds its snapshot until killed, or until the farm is gone
        time.sleep(0.2)


def main() -> None:
    path = sys.argv[1]
    import lmdb  # noqa: F401 - imported before forking so each child starts fast

    children: list[int] = []

    def kill() -> int:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for pid in children:
            os.waitpid(pid, 0)
        n = len(children)
        children.clear()
        return n

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "open":
            n, wait_s = int(cmd[1]), float(cmd[2])
            pipes = []
            for _ in range(n):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(r)
                    try:
                        _reader(path, wait_s, w)
                    except BaseException as exc:  # noqa: BLE001 - said on stderr, then this reader is gone
                        print(f"reader {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                    finally:
                        os._exit(0)
                os.close(w)
                children.append(pid)
                pipes.append(r)
            ok, full, ids = 0, 0, []
            for r in pipes:
                with os.fdopen(r, "rb") as f:
                    ans = f.readline().split()
                if ans and ans[0] == b"ok":
                    ok += 1
                    ids.append(ans[1].decode())
                else:
                    full += 1
            print(f"opened {ok} {full} {','.join(ids) or '-'}", flush=True)
        elif cmd[0] == "kill":
            print(f"killed {kill()}", flush=True)
        elif cmd[0] == "pids":
            print("pids " + (",".join(map(str, children)) or "-"), flush=True)
        elif cmd[0] == "quit":
            break
    kill()  # quit, or stdin closed (the test is gone)


if __name__ == "__main__":
    main()
