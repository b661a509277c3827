"""Ledger bytes per queued item: submit N items the way benchmark 4 does
(frames of 500 in one transaction each, 1 KiB inline claim reference, key
``bench-<i>``, kind ``echo``) straight into a :class:`~ccsq.brokerd.ledger.store.Ledger`
and print the pages in use per sub-database and in all, per item.

``--payload random`` uses 1 KiB of random (incompressible) bytes instead of the
benchmark's padded s3 URI, ``--payload claim`` a claim-check reference (no inline
bytes). No broker process: this is the ledger's own layout, measured in seconds.

    python -m bench.ledger_bytes [--n 20000] [--payload ref|random|claim]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from bench.common import claim_ref
from ccsq.brokerd.ledger import schema
from ccsq.brokerd.ledger.store import Ledger
from ccsq.common.wire import protocol

FRAME_ITEMS = 500


def _payload(kind: str, i: int) -> protocol.Blob:
    if kind == "claim":
        digest = hashlib.sha256(str(i).encode()).hexdigest()
        return protocol.Blob(digest, 1 << 20, None)
    data = os.urandom(1024) if kind == "random" else claim_ref(i)
    return protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)


def measure(n: int, payload: str, root: Path) -> dict:
    ledger = Ledger(root / "ledger")
    now_ms = int(time.time() * 1000)
    try:
        for start in range(0, n, FRAME_ITEMS):
            txn = ledger.begin()
            for i in range(start, min(n, start + FRAME_ITEMS)):
                item = protocol.SubmitItem(key=f"bench-{i}", kind="echo", payload=_payload(payload, i), params={"t": 0.0})
                res = txn.submit(item, now_ms)
                assert not res.error, res
            txn.commit()
            now_ms += 5
        out: dict = {"n": n, "payload": payload, "page_bytes": 0, "per_db": {}}
        with ledger.env.begin() as t:
            for name in schema.DB_NAMES:
                st = ledger.env.stat() if False else t.stat(ledger.db[name])
                pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
                out["per_db"][name] = {"entries": st["entries"], "pages": pages,
                                       "bytes_per_item": round(pages * st["psize"] / n, 1)}
            out["page_bytes"] = st["psize"]
            out["used_bytes"] = ledger.used_bytes(t)
        out["bytes_per_item"] = round(out["used_bytes"] / n)
        out["file_bytes_per_item"] = round((root / "ledger" / "data.mdb").stat().st_blocks * 512 / n)
        return out
    finally:
        ledger.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--payload", choices=("ref", "random", "claim"), default="ref")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(measure(args.n, args.payload, Path(d)), indent=1))


if __name__ == "__main__":
    main()
