"""Cost of the envelope: encode and decode rates of ``EnvelopeCodec`` (frames per CPU second
of one process, no sockets) for a HEARTBEAT, a SUBMIT of 1 item and a SUBMIT of 100 items, each Ed25519-
signed (an older peer, or HELLO/WELCOME) and with a session MAC (HMAC-SHA256 tag, after a
HELLO/WELCOME that agreed on it). Decoding is the broker's full check: header, sender,
signature or tag, role, staleness, replay, body and schema (docs/security.md, "Cost of
signatures").

    python -m bench.envelope [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path


def _codecs(root: Path, macs: bool):
    from ccsq.common.wire import protocol
    from ccsq.common.wire.envelope import EnvelopeCodec
    from ccsq.common.wire.keys import AuthorizedKeys, load_private_key, public_key_b64, write_authorized_keys, write_keypair

    d = root / ("mac" if macs else "signed")
    keys = {}
    for pid in ("broker", "producer-1"):
        priv, _ = write_keypair(d / "keys", pid)
        keys[pid] = load_private_key(priv)
    write_authorized_keys(d / "ak.toml", {"broker": ("broker", public_key_b64(keys["broker"])),
                                          "producer-1": ("producer", public_key_b64(keys["producer-1"]))})
    broker = EnvelopeCodec("broker", keys["broker"], AuthorizedKeys(d / "ak.toml"), session_macs=macs)
    peer = EnvelopeCodec("producer-1", keys["producer-1"], AuthorizedKeys(d / "ak.toml"), require_hello=False,
                         session_macs=macs)
    hello = broker.decode(peer.encode(protocol.Hello(role="producer")))
    mac = broker.open_session_mac(hello, b"rid")
    peer.decode(broker.encode(protocol.Welcome(1.0, 5, 1, mac_x25519=mac), channel=b"rid"), bound_sender="broker")
    assert peer.mac_active is macs
    return broker, peer


def _items(n: int):
    from ccsq.common.wire import protocol

    out = []
    for i in range(n):
        ref = f"s3://bench-bucket/payloads/{i:012d}.png".encode()
        out.append(protocol.SubmitItem(key=f"doc-{i:08d}", kind="ocr", payload=protocol.Blob(hashlib.sha256(ref).hexdigest(), 150_000),
                                params={"lang": "en", "dpi": 300}))
    return out


def _encode_rate(peer, msg, seconds: float) -> float:
    """Encodes per CPU second of this process (best of 3 slices: a shared machine)."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.process_time()
        while (el := time.process_time() - t0) < seconds / 3:
            for _ in range(20):
                peer.encode(msg)
            n += 20
        best = max(best, n / el)
    return best


def _decode_rate(broker, peer, msg, seconds: float) -> float:
    """Decodes per CPU second (frames encoded beforehand, outside the clock; best of 3)."""
    best = 0.0
    batch = 200
    for _ in range(3):
        n, el = 0, 0.0
        while el < seconds / 3:
            frames = [peer.encode(msg) for _ in range(batch)]
            t0 = time.process_time()
            for f in frames:
                broker.decode(f)
            el += time.process_time() - t0
            n += batch
        best = max(best, n / el)
    return best


def run(seconds: float = 1.0) -> list[dict]:
    from ccsq.common.wire import protocol

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pairs = {macs: _codecs(Path(tmp), macs) for macs in (False, True)}
        for name, msg, items in (("HEARTBEAT", protocol.Heartbeat(), 1), ("SUBMIT, 1 item", protocol.Submit(1, _items(1)), 1),
                                 ("SUBMIT, 100 items", protocol.Submit(1, _items(100)), 100)):
            row = {"frame": name, "items": items}
            for macs, (broker, peer) in pairs.items():
                what = "mac" if macs else "signed"
                frames = peer.encode(msg)
                row["bytes"] = len(frames[0])
                row[f"{what}_tag_bytes"] = len(frames[1])
                row[f"{what}_encode_per_s"] = round(_encode_rate(peer, msg, seconds))
                row[f"{what}_decode_per_s"] = round(_decode_rate(broker, peer, msg, seconds))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.envelope", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per measured figure")
    args = ap.parse_args(argv)
    rows = run(args.seconds)
    print("| frame | bytes | encode, Ed25519 | encode, MAC | decode, Ed25519 | decode, MAC |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        def f(v: int) -> str:
            return f"{v:,} /s" + (f" ({v * r['items']:,} items/s)" if r["items"] > 1 else "")
        print(f"| {r['frame']} | {r['bytes']:,} | {f(r['signed_encode_per_s'])} | {f(r['mac_encode_per_s'])} | "
              f"{f(r['signed_decode_per_s'])} | {f(r['mac_decode_per_s'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
