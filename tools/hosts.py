"""``ccsq init --hosts``: split a swarm directory into one folder per host.

``DIR/hosts/<host>/`` holds exactly what that host's ``/etc/ccsq`` needs: its
config file(s) with state paths under ``/var/lib/ccsq`` (the units' state
directories), its own private key(s) (mode 0600) and an ``authorized_keys.toml``
with only the public keys it needs (a peer: the broker's; the broker: everyone's).
Files that a config names by a relative path (``private_key``,
``broker_curve_public_key``, ``curve_secret_key``, a model file ...) are copied
with their mode.

Hosts: ``broker`` (brokerd.toml + admin.toml; with a broker pair, ``ccsq init --standby``,
this is broker-1 and ``broker-N`` holds broker-N's ``brokerd-N.toml`` as its ``brokerd.toml``,
its node key and the shared service keys), ``gpu-1..H`` (workers, as
``workerd-0..K-1.toml`` for ``ccsq-workerd@0..K-1`` on that host, so the unit's
index is the local GPU index), ``completion``, ``producer``. Each folder also gets a
``MANIFEST`` (``sha256sum`` format: every file of the folder) that the copy recipe of
docs/deployment.md checks on the host (``sha256sum -c MANIFEST``), so a file left
behind is an error there, not a daemon that exits later.
"""

from __future__ import annotations

import os
import shutil
import stat
import tomllib
from pathlib import Path

import tomli_w

from ccsq.common.storage.manifest import write_manifest
from ccsq.common.wire.errors import ConfigError

ETC = "/etc/ccsq"
STATE = "/var/lib/ccsq"


def _store_uri(uri: str) -> str:
    """A relative ``file://`` store becomes the units' shared blobs directory."""
    if uri.startswith("file://") and not uri[len("file://"):].startswith("/"):
        return f"file://{STATE}/blobs"
    return uri


def _ship(src_dir: Path, dst_dir: Path, name: str, doc: dict, changes: dict) -> list[Path]:
    """Write ``doc`` (with ``changes``) as ``dst_dir/name`` and copy every file it names
    by a relative path (keys, CURVE keys, a model file; not ``authorized_keys``, which
    is written per host), keeping each file's mode (private keys stay 0600)."""
    out = dict(doc)
    out.update(changes)
    dst_dir.mkdir(parents=True, exist_ok=True)
    written = [dst_dir / name]
    for key, rel in out.items():
        if key == "authorized_keys" or not isinstance(rel, str) or not rel or "://" in rel or Path(rel).is_absolute():
            continue
        src = src_dir / rel
        if not src.is_file():
            continue
        dst = dst_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        os.chmod(dst, stat.S_IMODE(src.stat().st_mode))
        written.append(dst)
    (dst_dir / name).write_text(tomli_w.dumps(out))
    return written


def _authorized(src: Path, dst_dir: Path, only: set[str] | None) -> Path:
    doc = tomllib.loads(src.read_text())
    peers = doc.get("peers", {})
    if only is not None:
        peers = {pid: entry for pid, entry in peers.items() if pid in only}
    path = dst_dir / "authorized_keys.toml"
    path.write_text(tomli_w.dumps({"peers": peers}))
    return path


def write_host_layout(directory: Path, *, gpu_hosts: int = 0) -> dict[str, list[Path]]:
    """Write ``directory/hosts/<host>/`` from the swarm in ``directory``; returns
    ``{host: [files]}``. ``gpu_hosts``: spread the workers over this many GPU hosts
    (0: one host per worker). Raises ConfigError when ``hosts/`` exists already."""
    directory = directory.resolve()
    root = directory / "hosts"
    if root.exists():
        raise ConfigError(f"{root} exists; remove it to write the per-host layout again")

    def load(name: str) -> dict:
        return tomllib.loads((directory / name).read_text())

    worker_files = sorted(directory.glob("workerd-*.toml"), key=lambda p: (len(p.name), p.name))
    hosts: dict[str, list[Path]] = {}
    broker = load("brokerd.toml")
    broker_id = broker.get("peer_id", "broker")
    d = root / "broker"
    hosts["broker"] = _ship(directory, d, "brokerd.toml", broker, {"data_dir": f"{STATE}/broker"})
    hosts["broker"] += _ship(directory, d, "admin.toml", load("admin.toml"), {"data_dir": f"{STATE}/broker"})
    hosts["broker"].append(_authorized(directory / broker.get("authorized_keys", "authorized_keys.toml"), d, None))
    # a broker pair (ccsq init --standby, docs/ha.md): broker-N's brokerd-N.toml is brokerd.toml on its host
    for path in sorted(directory.glob("brokerd-*.toml"), key=lambda p: (len(p.name), p.name)):
        host = f"broker-{path.stem.split('-', 1)[1]}"
        d = root / host
        hosts[host] = _ship(directory, d, "brokerd.toml", load(path.name), {"data_dir": f"{STATE}/broker"})
        hosts[host] += _ship(directory, d, "admin.toml", load("admin.toml"), {"data_dir": f"{STATE}/broker"})
        hosts[host].append(_authorized(directory / broker.get("authorized_keys", "authorized_keys.toml"), d, None))
    n_hosts = gpu_hosts if gpu_hosts > 0 else len(worker_files)
    per_host = -(-len(worker_files) // max(n_hosts, 1)) if worker_files else 0
    for j in range(n_hosts):
        mine = worker_files[j * per_host:(j + 1) * per_host]
        if not mine:
            continue
        host = f"gpu-{j + 1}"
        d = root / host
        hosts[host] = []
        for k, path in enumerate(mine):
            doc = load(path.name)
            hosts[host] += _ship(directory, d, f"workerd-{k}.toml", doc, {
                "journal_dir": f"{STATE}/worker-{k}",
                "claim_store": _store_uri(doc.get("claim_store", "file://blobs")),
            })
        hosts[host].append(_authorized(directory / "authorized_keys.toml", d, {broker_id}))
    for host, name, changes in (
        ("completion", "completion.toml", {"database": f"sqlite:///{STATE}/completion/results.db"}),
        ("producer", "producer.toml", {}),
    ):
        if not (directory / name).exists():
            continue
        doc = load(name)
        d = root / host
        hosts[host] = _ship(directory, d, name, doc, {**changes, "claim_store": _store_uri(doc.get("claim_store", "file://blobs"))})
        hosts[host].append(_authorized(directory / "authorized_keys.toml", d, {broker_id}))
    os.chmod(root, 0o700)
    for host, files in hosts.items():  # a file several configs name (broker.curve.pub) is listed once
        hosts[host] = list(dict.fromkeys(files)) + [write_manifest(root / host)]
    return hosts


def render_layout(hosts: dict[str, list[Path]]) -> str:
    """The layout as text: per host, its files as they go under /etc/ccsq."""
    lines = [f"per-host layout (copy each folder's content to {ETC}/ on that host and check it with sha256sum -c MANIFEST "
             "there, docs/deployment.md; private keys stay 0600):"]
    for host, files in hosts.items():
        base = files[0].parent
        rel = sorted(str(f.relative_to(base)) for f in files)
        lines.append(f"  {host:11} {base}: {', '.join(rel)}")
    return "\n".join(lines)
