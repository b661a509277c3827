"""``ccsq init-relay``: wire a relay between swarm directories written by ``ccsq init``.

For each link ``UP -> DOWN`` it:

* gives each swarm a ``swarm_id`` (``brokerd.toml``'s, which ``ccsq init`` writes;
  the directory name for an older swarm without one) and a ``trusted_swarms.toml``
  holding the *other* swarm's broker public key (pinned), and points ``brokerd.toml``'s
  ``trusted_swarms`` at it;
* authorizes the relay's key in each swarm's ``authorized_keys.toml`` under its
  per-link peer id (``<relay>-<link>-up`` upstream, ``-down`` downstream, role ``relay``);
* writes ``OUT/relayd.toml`` and ``OUT/keys/<relay>.key`` (0600), with absolute paths
  into the swarm directories (a relay on the machine that holds them);
* with ``hosts``: ``OUT/hosts/relay/``, the relay host's ``/etc/ccsq`` (relayd-<relay>.toml,
  its keys, per swarm the broker's public keys, a MANIFEST), and refreshes each swarm's
  ``hosts/broker/`` (from ``ccsq init --hosts``) with the files the broker host needs now.

Every check runs before anything is written. The brokers read ``trusted_swarms`` at
start: restart them (authorized keys alone would reload on SIGHUP).
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

import tomli_w

from ccsq.common.storage.manifest import write_manifest
from ccsq.common.wire.errors import ConfigError
from ccsq.common.wire.keys import (load_private_key, parse_authorized_keys, public_key_b64, write_authorized_keys,
                              write_curve_keypair, write_keypair)

#: where the relay's bundle is installed (``ccsq-relayd@<relay>`` reads /etc/ccsq/relayd-<relay>.toml)
ETC = "/etc/ccsq"
STATE = "/var/lib/ccsq"


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: run `ccsq init` for that swarm first") from None


def _store_of(directory: Path) -> tuple[str, str]:
    """The swarm's claim store as its peers name it (``producer.toml``, else a worker's
    config): ``(URI with a relative file:// path made absolute, s3_endpoint_url)``."""
    for name in ["producer.toml", "completion.toml", *sorted(p.name for p in directory.glob("workerd-*.toml"))]:
        if (directory / name).exists():
            doc = _read(directory / name)
            uri = doc.get("claim_store", "")
            if uri.startswith("file://") and not Path(uri[len("file://"):]).is_absolute():
                uri = f"file://{(directory / uri[len('file://'):]).resolve()}"
            return uri, doc.get("s3_endpoint_url", "")
    return f"file://{directory / 'blobs'}", ""


def _swarm(directory: Path) -> dict:
    directory = directory.resolve()
    broker = _read(directory / "brokerd.toml")
    swarm_id = broker.get("swarm_id") or directory.name
    pub = public_key_b64(load_private_key((directory / broker.get("private_key", "keys/broker.key")).resolve()))
    curve_pub = (directory / broker.get("curve_secret_key", "keys/broker.curve.key")).with_suffix(".pub")
    store, s3_endpoint = _store_of(directory)
    return {"dir": directory, "broker": broker, "swarm_id": swarm_id, "pub": pub, "broker_id": broker.get("peer_id", "broker"),
            "named": bool(broker.get("swarm_id")),
            "curve": bool(broker.get("curve")), "broker_curve_pub": curve_pub.resolve(),
            "endpoint": broker.get("endpoint", "tcp://127.0.0.1:5555"),  # what peers connect to (bind may differ)
            "store": store, "s3_endpoint_url": s3_endpoint,
            "authorized": (directory / broker.get("authorized_keys", "authorized_keys.toml")).resolve()}


def _id_sources(a: dict, b: dict) -> str:
    """Where two swarms' one id came from, in words (for the same-id error): said once when
    both got it the same way."""
    how = ["swarm_id in brokerd.toml" if sw["named"] else "no swarm_id in brokerd.toml: the directory's name"
           for sw in (a, b)]
    return how[0] if how[0] == how[1] else "; ".join(how)


def _check_ids(pairs: list[tuple[dict, dict]]) -> None:
    """Two different swarm directories with one swarm_id (two sites each set up in a
    directory of the same name): ConfigError naming both and the fix."""
    seen: dict[str, dict] = {}
    for sw in (s for pair in pairs for s in pair):
        other = seen.setdefault(sw["swarm_id"], sw)
        if other["dir"] != sw["dir"]:
            raise ConfigError(
                f"{other['dir']} and {sw['dir']} have the same swarm_id {sw['swarm_id']!r} ({_id_sources(other, sw)}); "
                f"a swarm id names one swarm in the other's trust file: set swarm_id = \"<unique name>\" in "
                f"{sw['dir'] / 'brokerd.toml'} (e.g. \"site-b\"; `ccsq init --swarm-id` does it for a new swarm), "
                "then run ccsq init-relay again")
    for up, down in pairs:
        if up["dir"] == down["dir"]:
            raise ConfigError(f"--upstream and --downstream are the same swarm directory {up['dir']}")


def _host_store(sw: dict, stores: dict[str, str]) -> str:
    """The claim store of swarm ``sw`` as the relay's own host reaches it: ``stores[swarm_id]``
    (``--store``), else the swarm's own URI when that is S3; a file:// directory of the
    swarm's hosts is refused (ConfigError with the fix)."""
    if sw["swarm_id"] in stores:
        return stores[sw["swarm_id"]]
    if sw["store"].startswith("file://"):
        raise ConfigError(
            f"{sw['dir']}: the claim store of swarm {sw['swarm_id']!r} is {sw['store']} (a directory of that swarm's hosts, "
            "file:///var/lib/ccsq/blobs there): a relay on its own host cannot reach it, and every payload or result over "
            "inline_max_bytes goes by reference through it. Use a store both the relay and the swarm reach: "
            "claim_store = \"s3://bucket/prefix\" in that swarm's workerd-*.toml, producer.toml and completion.toml "
            f"(docs/deployment.md), or mount it on the relay host and pass --store {sw['swarm_id']}=file:///PATH/OF/THE/MOUNT")
    return sw["store"]


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


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, src.stat().st_mode & 0o777)
    return dst


def _relay_bundle(out: Path, doc: dict, swarms: dict[str, dict], relay_id: str, host_stores: dict[str, str]) -> Path:
    """``OUT/hosts/relay/``: the relay host's /etc/ccsq. Paths are relative to it (the config's
    directory), state under /var/lib/ccsq/relay-<relay>. Returns the folder."""
    d = out / "hosts" / "relay"
    for key in ("private_key", "curve_secret_key"):
        if doc.get(key):
            _copy(out / doc[key], d / doc[key])
    for sid, sw in swarms.items():
        fed = d / "federation" / sid
        fed.mkdir(parents=True, exist_ok=True)
        peers = tomllib.loads(sw["authorized"].read_text()).get("peers", {})
        (fed / "authorized_keys.toml").write_text(tomli_w.dumps({"peers": {sw["broker_id"]: peers[sw["broker_id"]]}}))
        if sw["curve"]:
            _copy(sw["broker_curve_pub"], fed / "broker.curve.pub")
    links = []
    for table, (up, down) in zip(doc["links"], doc["_pairs"]):
        t = dict(table)
        for pre, sw in (("upstream_", up), ("downstream_", down)):
            t[pre + "authorized_keys"] = f"federation/{sw['swarm_id']}/authorized_keys.toml"
            t[pre + "claim_store"] = host_stores[sw["swarm_id"]]
            if sw["curve"]:
                t[pre + "broker_curve_public_key"] = f"federation/{sw['swarm_id']}/broker.curve.pub"
        links.append(t)
    host_doc = {k: v for k, v in doc.items() if k not in ("links", "_pairs")}
    host_doc.update(journal_dir=f"{STATE}/relay-{relay_id}", links=links)
    (d / f"relayd-{relay_id}.toml").write_text(tomli_w.dumps(host_doc))
    os.chmod(out / "hosts", 0o700)
    write_manifest(d)
    return d


def _refresh_broker_bundle(sw: dict) -> Path | None:
    """A swarm split by ``ccsq init --hosts``: its ``hosts/broker/`` gets the broker's new
    swarm_id / trusted_swarms, trusted_swarms.toml and the authorized keys with the relay."""
    d = sw["dir"] / "hosts" / "broker"
    if not (d / "brokerd.toml").exists():
        return None
    broker = dict(_read(d / "brokerd.toml"), swarm_id=sw["swarm_id"], trusted_swarms="trusted_swarms.toml")
    (d / "brokerd.toml").write_text(tomli_w.dumps(broker))
    _copy(sw["dir"] / "trusted_swarms.toml", d / "trusted_swarms.toml")
    _copy(sw["authorized"], d / "authorized_keys.toml")
    write_manifest(d)
    return d


def init_relay(out: Path, links: list[tuple[Path, Path]], *, kinds: list[str], relay_id: str = "relay",
               relay: dict | None = None, link: dict | None = None, hosts: bool = False,
               stores: dict[str, str] | None = None) -> Path:
    """Write ``OUT/relayd.toml`` for ``links`` = [(upstream swarm dir, downstream swarm dir)];
    returns its path. ``relay``/``link`` override keys of relayd.toml / every link table.

    ``hosts``: also the relay host's bundle ``OUT/hosts/relay/`` (see the module doc);
    ``stores`` = {swarm_id: URI} names a swarm's claim store as the relay host reaches it
    (default: the swarm's own when it is ``s3://``; a ``file://`` one is refused).
    ConfigError (nothing written) for two swarms with one swarm_id, an existing relay,
    a store the relay host cannot reach."""
    out = out.resolve()
    if (out / "relayd.toml").exists():
        raise ConfigError(f"{out} already holds a relay (relayd.toml exists); choose another directory")
    pairs = [(_swarm(u), _swarm(d)) for u, d in links]
    by_dir: dict[Path, dict] = {}
    pairs = [(by_dir.setdefault(u["dir"], u), by_dir.setdefault(d["dir"], d)) for u, d in pairs]  # one dict per swarm (a link back)
    _check_ids(pairs)
    swarms = {s["swarm_id"]: s for s in by_dir.values()}
    stores = dict(stores or {})
    unknown = set(stores) - set(swarms)
    if unknown:
        raise ConfigError(f"--store {sorted(unknown)[0]}=...: no such swarm_id among {sorted(swarms)}")
    host_stores = {sid: _host_store(sw, stores) for sid, sw in swarms.items()} if hosts else {}
    if hosts and len({sw["s3_endpoint_url"] for sw in swarms.values() if sw["s3_endpoint_url"]}) > 1:
        raise ConfigError("the swarms' S3 stores have different s3_endpoint_url; the relay reaches one S3 endpoint "
                          "(AWS_ENDPOINT_URL in its environment, /etc/ccsq/ccsq.env): use one S3 service for both")
    out.mkdir(parents=True, exist_ok=True)
    priv, _ = write_keypair(out / "keys", relay_id)
    pub = public_key_b64(load_private_key(priv))
    tables = []
    curve_pub = ""
    if any(s["curve"] for s in swarms.values()):  # CURVE toward a swarm: the relay needs its own pair
        _, curve_path = write_curve_keypair(out / "keys", relay_id)
        curve_pub = curve_path.read_text().strip()
    for up, down in pairs:
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
            **({"upstream_broker_id": up["broker_id"]} if up["broker_id"] != "broker" else {}),
            "upstream_authorized_keys": str(up["authorized"]),
            "upstream_claim_store": up["store"],
            "downstream_endpoint": down["endpoint"],
            **({"downstream_broker_id": down["broker_id"]} if down["broker_id"] != "broker" else {}),
            "downstream_authorized_keys": str(down["authorized"]),
            "downstream_claim_store": down["store"],
            **sides,
            **(link or {}),
        })
    doc = {"peer_id": relay_id, "private_key": f"keys/{relay_id}.key", "journal_dir": "relay-journal",
           **({"curve_secret_key": f"keys/{relay_id}.curve.key"} if curve_pub else {}), **(relay or {}), "links": tables}
    path = out / "relayd.toml"
    path.write_text(tomli_w.dumps(doc))
    if hosts:
        _relay_bundle(out, {**doc, "_pairs": pairs}, swarms, relay_id, host_stores)
        for sw in swarms.values():
            _refresh_broker_bundle(sw)
    return path
