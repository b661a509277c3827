"""``relayd.toml``: the relay's identity and journal, and one ``[[links]]`` table per link.

Loaded like every other ccsq config (:mod:`ccsq.common.wire.config`): unknown keys, wrong
types and out-of-range values raise :class:`~ccsq.common.wire.errors.ConfigError` naming
the file and the key; relative paths are relative to the file. Example::

    peer_id = "relay-1"
    private_key = "keys/relay-1.key"
    journal_dir = "relay-journal"

    [[links]]
    name = "a-to-b"                      # upstream a lends work, downstream b lends GPUs
    kinds = ["ocr"]
    upstream_endpoint = "tcp://10.0.0.1:5555"
    upstream_authorized_keys = "a/authorized_keys.toml"   # holds a's broker public key
    upstream_claim_store = "file:///srv/a/blobs"
    downstream_endpoint = "tcp://10.0.1.1:5555"
    downstream_authorized_keys = "b/authorized_keys.toml"
    downstream_claim_store = "file:///srv/b/blobs"        # same URI as upstream: nothing is copied
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ccsq.common.wire.config import PeerSettings, from_mapping, opt, read_toml
from ccsq.common.wire.endpoints import split_endpoints
from ccsq.common.wire.errors import ConfigError
from ccsq.common.runtime.metrics_exporter import parse_listen


MAX_KINDS_PER_LINK = 100


@dataclasses.dataclass(frozen=True)
class LinkConfig:
    """One ``[[links]]`` table: an upstream swarm that lends work, a downstream swarm that lends GPUs."""

    name: str = opt("", doc="link name (unique; used in peer ids, the journal and the federation report)")
    kinds: tuple[str, ...] = opt((), doc="item kinds this link carries (required)")
    policy: str = opt("capacity", choices=("capacity", "deadline"), doc="capacity: pull only while the downstream has free worker"
                      " credit; deadline: also spill (up to max_in_flight) while the upstream forecasts a missed deadline")
    max_hops: int = opt(1, min=1, max=1, doc="an item is relayed at most this many times (only 1 is supported)")
    max_in_flight: int = opt(256, min=1, max=65536, doc="most items held by this link at once")
    upstream_endpoint: str = opt("", endpoint="connect-list",
                            doc="ZeroMQ endpoint of the upstream broker (a broker pair: a comma-separated list, "
                            "like a peer's broker_endpoint)")
    upstream_broker_id: str = opt("broker", doc="the upstream broker's peer id in upstream_authorized_keys")
    upstream_peer_id: str = opt("", doc="this relay's peer id at the upstream broker ('' = <peer_id>-<name>-up)")
    upstream_authorized_keys: str = opt("", path=True, doc="file with the upstream broker's public key")
    upstream_claim_store: str = opt("", doc="the upstream's claim store URI ('' = payloads are inline only)")
    upstream_curve: bool = opt(False, doc="CURVE toward the upstream broker")
    upstream_broker_curve_public_key: str = opt("", path=True, doc="the upstream broker's CURVE public key (curve = true)")
    downstream_endpoint: str = opt("", endpoint="connect-list",
                            doc="ZeroMQ endpoint of the downstream broker (a broker pair: a comma-separated list, "
                            "like a peer's broker_endpoint)")
    downstream_broker_id: str = opt("broker", doc="the downstream broker's peer id in downstream_authorized_keys")
    downstream_peer_id: str = opt("", doc="this relay's peer id at the downstream broker ('' = <peer_id>-<name>-down)")
    downstream_authorized_keys: str = opt("", path=True, doc="file with the downstream broker's public key")
    downstream_claim_store: str = opt("", doc="the downstream's claim store URI (same as upstream: nothing is copied)")
    downstream_curve: bool = opt(False, doc="CURVE toward the downstream broker")
    downstream_broker_curve_public_key: str = opt("", path=True, doc="the downstream broker's CURVE public key (curve = true)")


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    """``relayd.toml`` (top level; ``links`` holds the :class:`LinkConfig` tables)."""

    peer_id: str = opt("", doc="the relay's name; its peer ids are <peer_id>-<link>-up/-down")
    private_key: str = opt("", path=True, doc="the relay's Ed25519 private key (mode 0600)")
    journal_dir: str = opt("relay-journal", path=True, doc="the relay's local journal (SQLite)")
    curve_secret_key: str = opt("", path=True, doc="the relay's CURVE secret key (Z85, mode 0600) for links with "
                                "upstream_curve/downstream_curve; its public key is the relay's curve_public_key in both swarms' "
                                "authorized_keys.toml")
    result_credit: int = opt(64, min=1, max=65536, doc="results in flight from each downstream broker")
    resend_interval_s: float = opt(2.0, min=0.05, max=3600.0, doc="unconfirmed SUBMIT/COMPLETE/ACK are resent this often")
    status_interval_s: float = opt(5.0, min=0.1, max=3600.0, doc="ask the downstream about submitted items this often (dead/expired there)")
    downstream_hold_max_s: float = opt(30.0, min=0.0, max=86400.0,
                                       doc="downstream unreachable this long: items already submitted there are "
                                         "given back to the upstream (released, no attempt counted) so its own workers run them; "
                                         "their downstream copies are cancelled once it is reachable (0 = hold them for the whole "
                                         "partition)")
    max_frame_bytes: int = opt(1 << 20, min=4096, max=1 << 30, doc="largest frame sent or accepted")
    max_clock_skew_s: float = opt(60.0, min=1.0, max=3600.0, doc="largest accepted |now - message timestamp|")
    reconnect_backoff_max_s: float = opt(5.0, min=0.05, max=300.0, doc="cap of the reconnect backoff")
    hello_timeout_s: float = opt(5.0, min=0.1, max=300.0, doc="how long to wait for WELCOME before reconnecting")
    log_format: str = opt("auto", choices=("auto", "json", "console"), doc="json in daemons, console on a terminal")
    metrics_listen: str = opt("", doc="HOST:PORT (or PORT = 127.0.0.1:PORT) of the Prometheus /metrics server ('' = off)")
    links: tuple = ()
    config_path: str = ""

    def side(self, link: LinkConfig, upstream: bool) -> PeerSettings:
        """The :class:`PeerSettings` of one side of ``link`` (its own peer id and broker)."""
        pre = "upstream_" if upstream else "downstream_"
        pid = getattr(link, pre + "peer_id") or f"{self.peer_id}-{link.name}-{'up' if upstream else 'down'}"
        return PeerSettings(
            peer_id=pid,
            private_key=self.private_key,
            authorized_keys=getattr(link, pre + "authorized_keys"),
            broker_endpoint=getattr(link, pre + "endpoint"),
            broker_id=getattr(link, pre + "broker_id"),
            max_frame_bytes=self.max_frame_bytes,
            max_clock_skew_s=self.max_clock_skew_s,
            reconnect_backoff_max_s=self.reconnect_backoff_max_s,
            hello_timeout_s=self.hello_timeout_s,
            log_format=self.log_format,
            curve=getattr(link, pre + "curve"),
            broker_curve_public_key=getattr(link, pre + "broker_curve_public_key") or "keys/broker.curve.pub",
            curve_secret_key=self.curve_secret_key,
            config_path=self.config_path,
        )


def load_relay_config(path: str | Path) -> RelayConfig:
    """Load ``relayd.toml``; ConfigError (exit 78) naming the file and key on any problem."""
    path = Path(path)
    data = read_toml(path, writer="`ccsq init-relay`")
    base = path.resolve().parent
    raw_links = data.pop("links", None)
    if "config_path" in data:
        raise ConfigError(f"{path}: unknown key(s) ['config_path']")
    cfg = from_mapping(RelayConfig, {**data, "config_path": str(path.resolve())}, base_dir=base, where=str(path))
    if not cfg.peer_id or not cfg.private_key:
        raise ConfigError(f"{path}: peer_id and private_key are required")
    parse_listen(cfg.metrics_listen, where=f"{path}: metrics_listen")
    if not isinstance(raw_links, list) or not raw_links:
        raise ConfigError(f"{path}: needs at least one [[links]] table")
    links: list[LinkConfig] = []
    for i, raw in enumerate(raw_links):
        where = f"{path}: links[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a table")
        link = from_mapping(LinkConfig, raw, base_dir=base, where=where)
        for key in ("name", "upstream_endpoint", "downstream_endpoint", "upstream_authorized_keys",
                    "downstream_authorized_keys"):
            if not getattr(link, key):
                raise ConfigError(f"{where}: {key} is required")
        if not link.kinds:
            raise ConfigError(f"{where}: kinds is required (the item kinds this link carries)")
        if len(link.kinds) > MAX_KINDS_PER_LINK or not all(0 < len(k) <= 128 for k in link.kinds):
            # the brokers' heartbeats carry two entries per kind in a map of at most 256
            raise ConfigError(f"{where}: kinds must be 1..{MAX_KINDS_PER_LINK} names of 1..128 characters")
        if both := set(split_endpoints(link.upstream_endpoint)) & set(split_endpoints(link.downstream_endpoint)):
            raise ConfigError(f"{where}: upstream_endpoint and downstream_endpoint name the same broker ({', '.join(sorted(both))})")
        if any(c in link.name for c in " \t:/"):
            raise ConfigError(f"{where}: name {link.name!r} may not contain spaces, ':' or '/'")
        if link.name in {x.name for x in links}:
            raise ConfigError(f"{where}: link name {link.name!r} is used twice")
        links.append(link)
    return dataclasses.replace(cfg, links=tuple(links))
