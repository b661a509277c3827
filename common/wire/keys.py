"""Ed25519 identities: key files and the authorized-keys file.

Private key file: the raw 32-byte Ed25519 seed, base64, one line, mode 0600.
Public key file: the raw 32-byte public key, base64, one line.
Authorized keys (TOML)::

    [peers.worker-1]
    role = "worker"            # broker | worker | producer | completion | admin
    public_key = "base64..."   # raw 32-byte Ed25519 public key
    curve_public_key = "Z85.." # optional: the peer's ZeroMQ CURVE public key (40 chars);
                               # a broker with curve = true admits exactly these (ZAP)

Errors: :class:`~ccsq.common.wire.errors.ConfigError` naming the file and the fix.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import tomli_w
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ccsq.common.wire.config import read_toml
from ccsq.common.wire.errors import ConfigError
from ccsq.common.wire.protocol import Role


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{what}: not valid base64") from None
    if len(raw) != 32:
        raise ConfigError(f"{what}: expected a 32-byte Ed25519 key, got {len(raw)} bytes")
    return raw


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    from cryptography.hazmat.primitives import serialization

    return _b64(pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def write_keypair(directory: Path, peer_id: str) -> tuple[Path, Path]:
    """Create ``DIR/<peer_id>.key`` (0600) and ``DIR/<peer_id>.pub``; returns both paths.

    Refuses to overwrite an existing private key, and a peer id that is not
    :data:`PEER_ID_RE` (it could name a path outside ``directory``) (ConfigError)."""
    from cryptography.hazmat.primitives import serialization

    check_peer_id(peer_id)

    directory.mkdir(parents=True, exist_ok=True)
    priv_path = directory / f"{peer_id}.key"
    pub_path = directory / f"{peer_id}.pub"
    if priv_path.exists():
        raise ConfigError(f"{priv_path} exists; refusing to overwrite a private key (delete it first)")
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(_b64(seed) + "\n")
    pub_path.write_text(public_key_b64(key) + "\n")
    return priv_path, pub_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load a private key file; refuses one that is group- or world-readable."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"private key {path} not found (create it with `ccsq keygen`)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"private key {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); run chmod 600 {path}"
        )
    return Ed25519PrivateKey.from_private_bytes(_unb64(path.read_text(), str(path)))


@dataclasses.dataclass(frozen=True, slots=True)
class PeerKey:
    peer_id: str
    role: Role
    public_key: Ed25519PublicKey
    curve_public_key: bytes | None = None  # Z85, when the entry lists one


class AuthorizedKeys:
    """Peer id -> (role, public key), loaded from a TOML file; :meth:`reload` re-reads it (SIGHUP)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._peers: dict[str, PeerKey] = {}
        #: Z85 CURVE public keys of every entry that lists one: the broker's ZAP
        #: allow-list (read from the ZAP thread; replaced whole on reload).
        self.curve_keys: frozenset[bytes] = frozenset()
        self.reload()

    def reload(self) -> None:
        """Re-read the file; on error the previous table stays in force and ConfigError is raised."""
        peers = parse_authorized_keys(self.path)
        self._peers = peers
        self.curve_keys = frozenset(k.curve_public_key for k in peers.values() if k.curve_public_key)

    def curve_allowed(self, z85_key: bytes) -> bool:
        """ZAP decision: is this CURVE client key listed for some authorized peer?"""
        return z85_key in self.curve_keys

    def get(self, peer_id: str) -> PeerKey | None:
        return self._peers.get(peer_id)

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def ids(self) -> list[str]:
        """Every authorized peer id."""
        return list(self._peers)

    def __len__(self) -> int:
        return len(self._peers)


#: A peer id: a letter or digit, then up to 63 letters, digits, '.', '_' or '-'. It names
#: key files (``keys/<id>.key``) and TOML tables (``[peers.<id>]``), so nothing else is allowed.
PEER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_peer_id(peer_id: str, *, where: str = "peer id") -> str:
    """Return ``peer_id`` when it is a safe peer id (:data:`PEER_ID_RE`), else raise
    ConfigError naming ``where`` and the allowed characters."""
    if not isinstance(peer_id, str) or not PEER_ID_RE.fullmatch(peer_id):
        raise ConfigError(f"{where}: {peer_id!r} is not a valid peer id: use 1-64 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit (it names key files and [peers.<id>] tables)")
    return peer_id


def parse_authorized_keys(path: Path) -> dict[str, PeerKey]:
    doc = read_toml(path, "authorized keys file", "`ccsq init`")
    unknown = set(doc) - {"peers"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(unknown)}; only [peers.<id>] tables are allowed")
    peers: dict[str, PeerKey] = {}
    for peer_id, entry in doc.get("peers", {}).items():
        where = f"{path}: peers.{peer_id}"
        check_peer_id(peer_id, where=f"{path}: [peers]")
        if not isinstance(entry, dict) or not {"role", "public_key"} <= set(entry) <= {"role", "public_key", "curve_public_key"}:
            raise ConfigError(f"{where}: needs the keys role and public_key (and optionally curve_public_key)")
        try:
            role = Role(entry["role"])
        except ValueError:
            raise ConfigError(f"{where}.role: {entry['role']!r} is not one of {[r.value for r in Role]}") from None
        raw = _unb64(str(entry["public_key"]), f"{where}.public_key")
        curve = None
        if "curve_public_key" in entry:
            curve = _z85_key(str(entry["curve_public_key"]), f"{where}.curve_public_key")
        peers[peer_id] = PeerKey(peer_id, role, Ed25519PublicKey.from_public_bytes(raw), curve)
    return peers


def write_authorized_keys(path: Path, entries: Mapping[str, tuple[str, ...]]) -> None:
    """Write ``{peer_id: (role, public_key_b64[, curve_public_key_z85])}`` as an authorized-keys TOML file."""
    doc: dict = {"peers": {}}
    for pid, (role, pub, *curve) in entries.items():
        doc["peers"][pid] = {"role": role, "public_key": pub, **({"curve_public_key": curve[0]} if curve and curve[0] else {})}
    path.write_text(tomli_w.dumps(doc))


# --- ZeroMQ CURVE transport keys (optional encryption; see docs/security.md) ---------
# Files: the Z85 text of the 32-byte key (40 chars), one line. The secret key is
# written 0600 and refused when group/world readable, like the Ed25519 key.
# The broker's key pair is pinned by every peer. Each peer has its own pair too
# (``curve_secret_key``); its public key is listed as ``curve_public_key`` in
# authorized_keys.toml, and the broker's ZAP handler admits exactly those keys,
# so an unknown peer is dropped at the handshake, before it can queue a byte.

CURVE_KEY_CHARS = 40


def write_curve_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Create ``DIR/<name>.curve.key`` (Z85 secret, 0600) and ``DIR/<name>.curve.pub``
    (Z85 public) with ``zmq.curve_keypair()``; returns both paths.
    Raises ConfigError if the secret exists or libzmq lacks CURVE."""
    import zmq

    check_peer_id(name, where="CURVE key name")
    if not zmq.has("curve"):
        raise ConfigError("this libzmq has no CURVE support; install pyzmq wheels (bundled libsodium)")
    directory.mkdir(parents=True, exist_ok=True)
    sec_path = directory / f"{name}.curve.key"
    pub_path = directory / f"{name}.curve.pub"
    if sec_path.exists():
        raise ConfigError(f"{sec_path} exists; refusing to overwrite a secret key (delete it first)")
    public, secret = zmq.curve_keypair()
    fd = os.open(sec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret.decode("ascii") + "\n")
    pub_path.write_text(public.decode("ascii") + "\n")
    return sec_path, pub_path


def _z85_key(text: str, what: str) -> bytes:
    """Validate a Z85 CURVE key given as text; ConfigError naming ``what``."""
    from zmq.utils import z85

    raw = text.strip().encode("ascii", "replace")
    try:
        if len(raw) != CURVE_KEY_CHARS or len(z85.decode(raw)) != 32:
            raise ValueError
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"{what}: expected a {CURVE_KEY_CHARS}-character Z85 CURVE key") from None
    return raw


def _read_z85(path: Path, what: str, missing: str = "create it with `ccsq keygen --curve`") -> bytes:
    import zmq

    try:
        text = path.read_text().strip()
        text.encode("ascii")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found ({missing})") from None
    except (UnicodeError, OSError) as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None
    key = _z85_key(text, f"{what} {path}")
    if not zmq.has("curve"):
        raise ConfigError("curve = true but this libzmq has no CURVE support")
    return key


def load_curve_secret(path: Path) -> bytes:
    """A Z85 CURVE secret key (the broker's, or a peer's ``curve_secret_key``);
    refuses a group/world-readable file (ConfigError)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"CURVE secret key {path} not found (create it with `ccsq keygen --curve`)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"CURVE secret key {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); run chmod 600 {path}"
        )
    return _read_z85(path, "CURVE secret key")


def load_curve_public(path: Path) -> bytes:
    """The broker's Z85 CURVE public key, as pinned by peers (ConfigError if missing or invalid;
    a missing one must come from the broker host: a new key made here would not be the broker's)."""
    return _read_z85(path, "broker CURVE public key",
                     "copy it from the broker host: keys/broker.curve.pub next to its brokerd.toml, which `ccsq init` "
                     "wrote and `ccsq init --hosts` puts in every host's folder (docs/deployment.md); a key made here "
                     "with `ccsq keygen` would not be the broker's")


def curve_server_setup(sock, secret_z85: bytes) -> None:
    """Make ``sock`` (the broker's ROUTER) a CURVE server with this secret key."""
    import zmq

    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret_z85)


def curve_client_setup(sock, server_public_z85: bytes, secret_z85: bytes | None = None) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is pinned,
    with the peer's own key pair (``secret_z85``; its public key is derived),
    or a fresh ephemeral pair when None (which a ZAP allow-list refuses)."""
    import zmq

    if secret_z85 is None:
        public, secret = zmq.curve_keypair()
    else:
        public, secret = zmq.curve_public(secret_z85), secret_z85
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_z85)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
