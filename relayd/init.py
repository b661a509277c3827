"""``ccsq init-relay``: wire a relay between swarm directories written by ``ccsq init``.

For each link ``UP -> DOWN`` it:

* gives each swarm a ``swarm_id`` (its directory name unless set) and a
  ``trusted_swarms.toml`` holding the *other* swarm's broker public key (pinned), and
  points ``brokerd.toml``'s ``trusted_swarms`` at it;
* authorizes the relay's key in each swarm's ``authorized_keys.toml`` under its
  per-link peer id (``<relay>-<link>-up`` upstream, ``-down`` downstream, role ``relay``);
* writes ``OUT/relayd.toml`` and ``OUT/keys/<relay>.key`` (0600).

The brokers read ``trusted_swarms`` at start: restart them (authorized keys alone
would reload on SIGHUP).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import tomli_w

from ccsq.common.wire.errors import ConfigError
from ccsq.common.wire.keys import (load_private_key, parse_authorized_keys, public_key_b64, write_authorized_keys,
                              write_curve_keypair, write_keypair)


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: run `ccsq init` for that swarm first") from None


def _swarm(directory: Path) -> dict:
    directory = directory.resolve()
    broker = _read(directory / "brokerd.toml")
    swarm_id = broker.get("swarm_id") or directory.name
    pub = public_key_b64(load_private_key((directory / broker.get("private_key", "keys/broker.key")).resolve()))
    curve_pub = (directory / broker.get("curve_secret_key", "keys/broker.curve.key")).with_suffix(".pub")
    return {"dir": directory, "broker": broker, "swarm_id": swarm_id, "pub": pub,
            "curve": bool(broker.get("curve")), "broker_curve_pub": curve_pub.resolve(),
            "endpoint": broker.get("endpoint", "tcp://127.0.0.1:5555"),  # what peers connect to (bind may differ)
            "authorized": (directory / broker.get("authorized_keys", "authorized_keys.toml")).resolve()}


def _trust(swarm: dict, other: dict) -> None:
    path = swarm["dir"] / "trusted_swarms.toml"
    doc = _read(path) if path.exists() else {"swarms": {}}
    doc.setdefault("swarms", {})[other["swarm_id"]] = {"public_key": other["pub"]}
    path.write_text(tomli_w.dumps(doc))
    broker = dict(swarm["broker"], swarm_id=swarm["swarm_id"], trusted_swarms="trusted_swarms.toml")
    (swarm["dir"] / "brokerd.toml").write_text(tomli_w.dumps(broker))
    swarm["broker"] = broker


def _authorize(swarm: dict, peer_id: str, pub: str, curve_pub: str) -> None:
    entries = {pid: (k.role.value, public_key_b64(k.public_key), (k.curve_public_key or b"").decode())
               for pid, k in parse_authorized_keys(swarm["authorized"]).items()}
    entries[peer_id] = ("relay", pub, curve_pub if swarm["curve"] else "")
    write_authorized_keys(swarm["authorized"], entries)


def init_relay(out: Path, links: list[tuple[Path, Path]], *, kinds: list[str], relay_id: str = "relay",
               relay: dict | None = None, link: dict | None = None) -> Path:
    """Write ``OUT/relayd.toml`` for ``links`` = [(upstream swarm dir, downstream swarm dir)];
    returns its path. ``relay``/``link`` override keys of relayd.toml / every link table."""
    out = out.resolve()
    if (out / "relayd.toml").exists():
        raise ConfigError(f"{out} already holds a relay (relayd.toml exists); choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    priv, _ = write_keypair(out / "keys", relay_id)
    pub = public_key_b64(load_private_key(priv))
    tables = []
    curve_pub = ""
    swarms = [(_swarm(u), _swarm(d)) for u, d in links]
    if any(s["curve"] for pair in swarms for s in pair):  # CURVE toward a swarm: the relay needs its own pair
        _, curve_path = write_curve_keypair(out / "keys", relay_id)
        curve_pub = curve_path.read_text().strip()
    for up, down in swarms:
        if up["swarm_id"] == down["swarm_id"]:
            raise ConfigError(f"{up['dir']} and {down['dir']} have the same swarm_id {up['swarm_id']!r}")
        name = f"{up['swarm_id']}-to-{down['swarm_id']}"
        _trust(down, up)  # the downstream checks the upstream's origin signatures
        _trust(up, down)  # the upstream checks the downstream's result proofs
        _authorize(up, f"{relay_id}-{name}-up", pub, curve_pub)
        _authorize(down, f"{relay_id}-{name}-down", pub, curve_pub)
        sides = {}
        for pre, sw in (("upstream_", up), ("downstream_", down)):
            if sw["curve"]:
                sides.update({pre + "curve": True, pre + "broker_curve_public_key": str(sw["broker_curve_pub"])})
        tables.append({
            "name": name,
            "kinds": list(kinds),
            "upstream_endpoint": up["endpoint"],
            "upstream_authorized_keys": str(up["authorized"]),
            "upstream_claim_store": f"file://{up['dir'] / 'blobs'}",
            "downstream_endpoint": down["endpoint"],
            "downstream_authorized_keys": str(down["authorized"]),
            "downstream_claim_store": f"file://{down['dir'] / 'blobs'}",
            **sides,
            **(link or {}),
        })
    doc = {"peer_id": relay_id, "private_key": f"keys/{relay_id}.key", "journal_dir": "relay-journal",
           **({"curve_secret_key": f"keys/{relay_id}.curve.key"} if curve_pub else {}), **(relay or {}), "links": tables}
    path = out / "relayd.toml"
    path.write_text(tomli_w.dumps(doc))
    return path
