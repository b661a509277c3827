"""Federation's wire format (docs/federation.md): origin records and their signatures,
result proofs, the trust file, and the Hello/Heartbeat info keys. Shared by the broker
(``brokerd/relaying.py``: its signing key and the state it keeps) and the relay.

A relay (``ccsq-relayd``, role ``relay``) opens two kinds of sessions, told apart by
``Hello.info["relay_side"]``:

* ``upstream``: the relay holds leases here exactly like a worker (credit, fencing
  token, heartbeat extension, expiry). Every task DISPATCHed to it carries this
  broker's Ed25519 signature over the item's canonical record (:func:`origin_record`).
* ``downstream``: the relay SUBMITs relayed items here. Each must carry a valid origin
  signature by a swarm pinned in ``trusted_swarms`` (:func:`check_origin`), else the
  item is refused with ``ORIGIN_REJECTED`` (counted in ``rejects``, logged). The item
  records its origin and the relay as ``reply_to``; its result is delivered to that
  relay (never to this swarm's completion service) with this broker's signed proof
  (:func:`result_proof`), and heartbeats to the relay carry the free worker capacity
  per kind (``cap:<kind>`` in ``Heartbeat.info``).

Back upstream, a relay's COMPLETE is accepted only with a proof signed by a trusted
swarm for exactly this item and result (:func:`check_proof`); else ``rejected``.

Everything here is pure (no I/O but the trust file) and holds no runtime state.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ccsq.common.wire import protocol
from ccsq.common.wire.config import read_toml
from ccsq.common.wire.errors import ConfigError, DecodeError
from ccsq.common.wire.keys import _unb64

#: SubmitResult.error for a relayed item whose origin does not verify (also the reject counter's name).
ORIGIN_REJECTED = "ORIGIN_REJECTED"
#: SubmitResult.error when a relayed item's origin key is held by a non-relayed item (squatted).
ORIGIN_KEY_TAKEN = "ORIGIN_KEY_TAKEN"
#: reject counter of a relay COMPLETE whose downstream proof does not verify.
RESULT_REJECTED = "RESULT_REJECTED"
#: Hello.info key by which a relay says which side of a link this session is.
RELAY_SIDE = "relay_side"
UPSTREAM, DOWNSTREAM = "upstream", "downstream"
#: An item that arrived by relay is never relayed again (RabbitMQ's max-hops = 1).
MAX_HOPS = 1
#: Heartbeat.info key prefix of the free capacity per kind sent to downstream relay sessions.
CAP_PREFIX = "cap:"
#: ... and of the number of healthy workers that take the kind (a spill needs at least one).
WORKERS_PREFIX = "workers:"
#: Heartbeat.info key prefix sent to upstream relay sessions of policy ``deadline``: 1 when
#: this swarm's drain forecast for the kind misses its nearest deadline (or is stalled).
LATE_PREFIX = "late:"
#: Heartbeat.info keys sent to upstream relay sessions: the session's credit at the broker,
#: and how many CREDIT frames it applied (the relay's credit resync; a negative CREDIT from
#: a relay withdraws credit).
CREDIT_INFO, CREDIT_MSGS_INFO = "credit", "credit_msgs"
#: Heartbeat.info keys a relay's upstream session sends when its link has stopped for good
#: (refused by a swarm): why, since when (unix seconds), and the fix (``ccsq status`` shows them).
BROKEN_INFO, BROKEN_SINCE_INFO, BROKEN_FIX_INFO = "link_broken", "link_broken_since", "link_broken_fix"
#: Hello.info key by which a relay names its link's policy (``capacity`` | ``deadline``).
POLICY = "policy"
#: An origin record carries the item's params, which SUBMIT admits up to what fits a DISPATCH
#: to a relay (brokerd/outbound.py dispatch_refusal): so the record is bounded by the frame it
#: arrived in (max_frame_bytes, at most 1 GiB), not by a cap of its own: a smaller cap would
#: refuse as forged items the upstream accepted, and the relay would stop the whole link.
MAX_RECORD_BYTES = 1 << 30
RECORD_VERSION = 1


def origin_key(swarm: str, item_id: str) -> str:
    """The idempotency key of a relayed item: its origin, so a resubmission is a dedup hit."""
    return f"origin:{swarm}:{item_id}"


def relay_side(sess: Any) -> str:
    """``upstream``/``downstream`` for a relay session, "" for any other peer."""
    if sess.role is not protocol.Role.RELAY:
        return ""
    side = sess.info_hello.get(RELAY_SIDE)
    return side if side in (UPSTREAM, DOWNSTREAM) else ""


class TrustedSwarms:
    """``trusted_swarms.toml``: the pinned broker public key of each swarm we federate with::

        [swarms.site-a]
        public_key = "base64..."   # that swarm's broker key (keys/broker.pub)

    Raises ConfigError naming the file and key on any problem."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.keys: dict[str, Ed25519PublicKey] = {}
        self.reload()

    def reload(self) -> None:
        doc = read_toml(self.path, "trusted swarms file", "`ccsq init-relay`")
        unknown = set(doc) - {"swarms"}
        if unknown:
            raise ConfigError(f"{self.path}: unknown top-level key(s) {sorted(unknown)}; only [swarms.<id>] tables")
        keys = {}
        for swarm, entry in doc.get("swarms", {}).items():
            where = f"{self.path}: swarms.{swarm}"
            if not isinstance(entry, dict) or set(entry) != {"public_key"}:
                raise ConfigError(f"{where}: needs exactly the key public_key (the swarm's broker public key)")
            keys[swarm] = Ed25519PublicKey.from_public_bytes(_unb64(str(entry["public_key"]), f"{where}.public_key"))
        self.keys = keys

    def get(self, swarm: str) -> Ed25519PublicKey | None:
        return self.keys.get(swarm)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack_record(raw: bytes, what: str) -> dict:
    if not raw or len(raw) > MAX_RECORD_BYTES:
        raise DecodeError(f"{what} missing or over {MAX_RECORD_BYTES} bytes")
    try:
        rec = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_RECORD_BYTES,
                              max_str_len=MAX_RECORD_BYTES, max_array_len=1024, max_map_len=protocol.MAX_MAP_LEN + 32)
    except Exception as exc:  # msgpack raises several types for bad input
        raise DecodeError(f"{what} is not valid msgpack: {exc}") from None
    if type(rec) is not dict or rec.get("v") != RECORD_VERSION:
        raise DecodeError(f"{what} is not a version-{RECORD_VERSION} record")
    return rec


def origin_record(swarm: str, rec: dict, payload: protocol.Blob, max_attempts: int, hops: int = 1) -> bytes:
    """The canonical record of a ledger item that the origin broker signs (msgpack map):
    id, kind, params (sorted), payload digest/size/reference, deadline (ms), priority,
    attempt budget, per-attempt runtime cap, hops."""
    return _pack({
        "v": RECORD_VERSION,
        "swarm": swarm,
        "item_id": rec["id"],
        "kind": rec["kind"],
        "params": dict(sorted(rec["params"].items())),
        "payload_sha256": payload.sha256,
        "payload_size": payload.size,
        "payload_ref": payload.inline is None,
        "deadline_ms": rec["deadline_ms"],
        "priority": rec["priority"],
        "max_attempts": max_attempts,
        "max_runtime_s": float(rec["max_runtime_s"]),
        "hops": hops,
    })


def check_origin(item: protocol.SubmitItem, trust: TrustedSwarms | None, own_swarm: str) -> tuple[dict | None, str]:
    """Verify a relayed item against its signed origin record.

    Returns ``({"swarm", "item_id", "hops"}, "")`` or ``(None, reason)``: no trust file,
    unknown swarm, bad signature (forged origin, rogue key), a field that differs from
    the signed record (tampered params, swapped payload, changed deadline...), an item
    from this very swarm (a loop) or more than :data:`MAX_HOPS` hops."""
    if trust is None:
        return None, "this broker accepts no relayed items (trusted_swarms is not set)"
    if not item.origin or not item.origin_sig:
        return None, "relayed item without an origin record and signature"
    try:
        rec = _unpack_record(item.origin, "origin record")
    except DecodeError as exc:
        return None, str(exc)
    swarm = rec.get("swarm")
    key = trust.get(swarm) if isinstance(swarm, str) else None
    if key is None or not isinstance(swarm, str):
        return None, f"origin swarm {str(swarm)[:64]!r} is not in {trust.path.name}"
    try:
        key.verify(item.origin_sig, item.origin)
    except InvalidSignature:
        return None, f"origin signature of swarm {swarm!r} does not verify (forged origin or rogue key)"
    if swarm == own_swarm:
        return None, "item originates in this swarm (relay loop)"
    hops = rec.get("hops")
    if type(hops) is not int or not 1 <= hops <= MAX_HOPS:
        return None, f"hops {hops!r} outside 1..{MAX_HOPS} (max_hops)"
    deadline_ms = round(item.deadline_ts * 1000) if item.deadline_ts is not None and math.isfinite(item.deadline_ts) else None
    expect = {
        "item_id": rec.get("item_id"),
        "kind": item.kind,
        "params": dict(sorted(item.params.items())),
        "payload_sha256": item.payload.sha256,
        "payload_size": item.payload.size,
        "payload_ref": item.payload.inline is None,
        "deadline_ms": deadline_ms,
        "priority": item.priority,
        "max_attempts": item.max_attempts,
        "max_runtime_s": float(item.max_runtime_s),
    }
    for field, value in expect.items():
        if rec.get(field) != value or type(rec.get(field)) is not type(value):
            return None, f"{field} differs from the signed origin record (tampered)"
    if not isinstance(rec["item_id"], str) or item.key != origin_key(swarm, rec["item_id"]):
        return None, "key is not the origin key origin:<swarm>:<item id>"
    if item.payload.inline is not None and hashlib.sha256(item.payload.inline).hexdigest() != item.payload.sha256:
        return None, "inline payload does not match its signed digest (swapped payload)"
    return {"swarm": swarm, "item_id": rec["item_id"], "hops": hops}, ""


def result_proof(swarm: str, origin: dict, down_item_id: str, result: protocol.Blob) -> bytes:
    """The record a downstream broker signs for a relayed item's result."""
    return _pack({
        "v": RECORD_VERSION,
        "swarm": swarm,
        "origin_swarm": origin["swarm"],
        "origin_item": origin["item_id"],
        "down_item": down_item_id,
        "result_sha256": result.sha256,
        "result_size": result.size,
    })


def check_proof(res: protocol.TaskResult, trust: TrustedSwarms | None, own_swarm: str) -> str:
    """"" if ``res`` (a relay's COMPLETE) carries a downstream proof, signed by a trusted
    swarm, for exactly this item of this swarm and this result; else the reason."""
    if trust is None:
        return "this broker accepts no relayed results (trusted_swarms is not set)"
    if not res.proof or not res.proof_sig:
        return "relayed result without a proof"
    try:
        rec = _unpack_record(res.proof, "result proof")
    except DecodeError as exc:
        return str(exc)
    swarm = rec.get("swarm")
    key = trust.get(swarm) if isinstance(swarm, str) else None
    if key is None:
        return f"result swarm {str(swarm)[:64]!r} is not trusted"
    try:
        key.verify(res.proof_sig, res.proof)
    except InvalidSignature:
        return f"result proof of swarm {swarm!r} does not verify (forged)"
    if rec.get("origin_swarm") != own_swarm or rec.get("origin_item") != res.item_id:
        return "result proof is for another item (replayed or swapped)"
    if rec.get("result_sha256") != res.result.sha256 or rec.get("result_size") != res.result.size:
        return "result differs from the signed proof (tampered)"
    if res.result.inline is not None and hashlib.sha256(res.result.inline).hexdigest() != res.result.sha256:
        return "inline result does not match its signed digest"
    return ""
