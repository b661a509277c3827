"""TOML configuration loaded into frozen dataclasses that refuse typos.

Unknown keys, wrong types and out-of-range values raise
:class:`~ccsq.common.wire.errors.ConfigError` naming the file and the key. Relative
paths are resolved against the config file's directory, so a swarm directory
written by ``ccsq init`` can be moved as a whole. Durations carry their unit
in the key name (``lease_ttl_s``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

from ccsq.common.wire.errors import ConfigError

T = TypeVar("T")


def opt(default: Any, *, min: float | None = None, max: float | None = None, path: bool = False, choices: tuple = (), doc: str = "",
        endpoint: str = "") -> Any:
    """A config field: default, inclusive range, whether it is a filesystem path, allowed values;
    ``endpoint``: "connect" or "bind" for a ZeroMQ endpoint, "connect-list" for one or a comma-separated
    list of connect endpoints (checked by :mod:`ccsq.common.wire.endpoints`)."""
    return dataclasses.field(default=default, metadata={"min": min, "max": max, "path": path, "choices": choices, "doc": doc,
                                                        "endpoint": endpoint})


def _check(cls_name: str, where: str, f: dataclasses.Field, tp: Any, value: Any) -> Any:
    key = f"{where}: {f.name}"
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        value = float(value)
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
    elif tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    elif tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
    elif typing.get_origin(tp) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        value = tuple(value)
    elif typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        value = tuple(value)
    md = f.metadata
    if md.get("min") is not None and value < md["min"]:
        raise ConfigError(f"{key} = {value!r} is below the minimum {md['min']}")
    if md.get("max") is not None and value > md["max"]:
        raise ConfigError(f"{key} = {value!r} is above the maximum {md['max']}")
    if md.get("choices") and value not in md["choices"]:
        raise ConfigError(f"{key} = {value!r} is not one of {list(md['choices'])}")
    if md.get("endpoint") == "connect-list":  # a peer's brokers: one endpoint, or a comma-separated list
        from ccsq.common.wire.endpoints import check_endpoint_list

        check_endpoint_list(value, where=key)
    elif md.get("endpoint") and (value or md["endpoint"] != "bind"):  # "" = unset, for an optional bind
        from ccsq.common.wire.endpoints import check_endpoint

        check_endpoint(value, bind=md["endpoint"] == "bind", where=key)
    if f.name in ("peer_id", "broker_id", "ha_node_id") and value:
        from ccsq.common.wire.keys import check_peer_id

        check_peer_id(value, where=key)
    return value


#: config class -> the file ``ccsq init`` writes for it (what a refusal names)
_FILE_OF = {"BrokerConfig": "brokerd.toml", "WorkerConfig": "workerd-N.toml", "ProducerConfig": "producer.toml",
            "CompletionConfig": "completion.toml", "AdminConfig": "admin.toml"}


def _other_kind_of_file(cls: type, data: dict[str, Any]) -> str:
    """The file (``_FILE_OF``) of the first other config class that knows every key of ``data``:
    a worker's file given to the broker, a producer's to ``ccsq status``; "" when none does."""
    for name, file in _FILE_OF.items():
        other = globals().get(name)
        if other is not None and other is not cls and set(data) <= {f.name for f in dataclasses.fields(other)}:
            return file
    return ""


def from_mapping(cls: type[T], data: dict[str, Any], *, base_dir: Path, where: str) -> T:
    """Build ``cls`` from a mapping, rejecting unknown keys and bad values."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(fields)
    if unknown:
        import difflib

        known = sorted(set(fields) - {"config_path"})
        other = _other_kind_of_file(cls, data)
        if other:  # a whole file of another kind: "did you mean" on each of its keys would mislead
            mine = _FILE_OF.get(cls.__name__, cls.__name__)
            raise ConfigError(f"{where}: unknown key(s) {', '.join(repr(k) for k in sorted(unknown))}: the file's keys are "
                              f"those of {other}, not of {mine}: give --config the {mine} (`ccsq init` writes each)")
        named = []
        for key in sorted(unknown):
            close = difflib.get_close_matches(key, known, n=1)
            named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(named)}; the keys are listed in the README (Configuration)")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            value = _check(cls.__name__, where, f, hints[name], data[name])
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            raise ConfigError(f"{where}: required key {name!r} is missing")
        if f.metadata.get("path") and isinstance(value, str) and value and "://" not in value:
            value = str((base_dir / value).resolve()) if not Path(value).is_absolute() else value
        kwargs[name] = value
    kwargs.setdefault("config_path", "") if "config_path" in fields else None
    obj = cls(**kwargs)
    problem = obj.cross_check() if hasattr(obj, "cross_check") else ""
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return obj


def read_toml(path: Path, what: str = "config file", writer: str = "`ccsq init DIR`") -> dict[str, Any]:
    """The parsed TOML document at ``path``; ConfigError naming the file when it is missing
    ("<what> <path> not found (<writer> writes one)"; no hint when ``writer`` is "") or
    not valid TOML."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found" + (f" ({writer} writes one)" if writer else "")) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load(cls: type[T], path: str | Path) -> T:
    """Load a TOML file into ``cls``; raises ConfigError with the file name on any problem."""
    path = Path(path)
    data = read_toml(path)
    if "config_path" in {f.name for f in dataclasses.fields(cls)}:  # type: ignore[arg-type]
        data = dict(data)
        if "config_path" in data:
            raise ConfigError(f"{path}: unknown key(s) ['config_path']")
        data["config_path"] = str(path.resolve())
    return from_mapping(cls, data, base_dir=path.resolve().parent, where=str(path))


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every key of a config class (used by docs and --help)."""
    hints = typing.get_type_hints(cls)
    return [
        (f.name, getattr(hints[f.name], "__name__", str(hints[f.name])), f.default, f.metadata.get("doc", ""))
        for f in dataclasses.fields(cls)
        if f.name != "config_path"
    ]


# --- the config of each process --------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PeerSettings:
    """What every peer of the broker needs: identity, keys, where the broker is."""

    peer_id: str = opt("", doc="this peer's id, as listed in authorized_keys")
    private_key: str = opt("", path=True, doc="path of this peer's Ed25519 private key (mode 0600)")
    authorized_keys: str = opt("authorized_keys.toml", path=True, doc="peer id -> role -> public key")
    broker_endpoint: str = opt("tcp://127.0.0.1:5555", endpoint="connect-list",
                               doc="ZeroMQ endpoint of ccsq-brokerd (tcp://HOST:PORT or ipc://PATH); for a broker pair a comma-separated "
                                   "list (tcp://b1:5555,tcp://b2:5555): tried first to last, the standby's NOT_PRIMARY answer leads to "
                                   "the primary (docs/ha.md)")
    broker_id: str = opt("broker", doc="the broker's peer id in authorized_keys")
    max_frame_bytes: int = opt(1 << 20, min=4096, max=1 << 30, doc="largest frame sent or accepted")
    max_clock_skew_s: float = opt(60.0, min=1.0, max=3600.0, doc="largest accepted |now - message timestamp|")
    reconnect_backoff_max_s: float = opt(5.0, min=0.05, max=300.0, doc="cap of the reconnect backoff")
    hello_timeout_s: float = opt(5.0, min=0.1, max=300.0, doc="how long to wait for WELCOME before reconnecting")
    log_format: str = opt("auto", choices=("auto", "json", "console"), doc="json in daemons, console on a terminal")
    curve: bool = opt(False, doc="encrypt the link with ZeroMQ CURVE (the broker must have curve = true)")
    broker_curve_public_key: str = opt("keys/broker.curve.pub", path=True,
                                       doc="the broker's CURVE public key (Z85), pinned; used when curve = true")
    curve_secret_key: str = opt("", path=True,
                                doc="this peer's CURVE secret key (Z85, mode 0600; needed when curve = true): the broker admits only the "
                                    "curve_public_key values in authorized_keys.toml")
    config_path: str = ""


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    """``brokerd.toml``."""

    peer_id: str = opt("broker", doc="the broker's peer id")
    private_key: str = opt("keys/broker.key", path=True, doc="broker's Ed25519 private key (mode 0600)")
    authorized_keys: str = opt("authorized_keys.toml", path=True, doc="peer id -> role -> public key; reloaded on SIGHUP")
    endpoint: str = opt("tcp://127.0.0.1:5555", endpoint="bind",
                        doc="endpoint peers connect to (their broker_endpoint); the ROUTER binds it too unless bind is set")
    bind: str = opt("", endpoint="bind",
                    doc="endpoint the ROUTER binds when it differs from endpoint, e.g. tcp://0.0.0.0:5555 ('' = endpoint)")
    data_dir: str = opt("broker-data", path=True, doc="directory of the LMDB ledger")
    heartbeat_interval_s: float = opt(1.0, min=0.05, max=60.0, doc="idle peers send HEARTBEAT this often")
    liveness: int = opt(5, min=2, max=100, doc="a peer silent for heartbeat_interval_s x liveness is gone")
    lease_ttl_s: float = opt(30.0, min=0.1, max=86400.0,
                             doc="a lease not extended by heartbeats expires after this (at least heartbeat_interval_s, else refused at "
                                 "start; keep it >= 3 heartbeats)")
    max_attempts: int = opt(5, min=1, max=1000, doc="default attempts before an item is dead-lettered")
    retry_backoff_base_s: float = opt(0.5, min=0.0, max=3600.0, doc="first retry delay (doubles per attempt, jittered)")
    retry_backoff_max_s: float = opt(60.0, min=0.0, max=86400.0, doc="cap of the retry delay")
    dedup_window_s: float = opt(7 * 86400.0, min=0.0, max=365 * 86400.0, doc="how long an idempotency key is remembered")
    retention_s: float = opt(3600.0, min=0.0, max=365 * 86400.0, doc="acknowledged items are purged after this")
    map_size_bytes: int = opt(1 << 30, min=1 << 20, max=1 << 44, doc="initial LMDB map size")
    max_map_size_bytes: int = opt(64 << 30, min=1 << 20, max=1 << 46, doc="the map grows up to this, then SUBMIT gets QUEUE_FULL")
    result_reserve_bytes: int = opt(24576, min=0, max=1 << 30,
                                    doc="ledger room kept per accepted, not yet completed item for its result (admission control, "
                                        "docs/ledger.md); default = the worker's 16 KiB inline result limit + 8 KiB overhead; lower it "
                                        "for deep queues of small results")
    max_readers: int = opt(126, min=8, max=65536,
                           doc="LMDB reader slots (processes reading the ledger at once); set when the broker creates lock.mdb")
    reader_warn_age_s: float = opt(300.0, min=0.1, max=86400.0,
                                   doc="warn (log, status) when a ledger reader's snapshot is this old: it pins pages freed since")
    min_free_disk_bytes: int = opt(256 << 20, min=0, max=1 << 46, doc="below this free disk, SUBMIT gets DISK_FULL")
    max_ready_items: int = opt(0, min=0, max=1 << 40, doc="0 = unlimited; above it SUBMIT gets QUEUE_FULL")
    max_frame_bytes: int = opt(1 << 20, min=4096, max=1 << 30, doc="largest accepted frame")
    max_clock_skew_s: float = opt(60.0, min=1.0, max=3600.0, doc="largest accepted |now - message timestamp|")
    slice_budget_ms: float = opt(5.0, min=0.1, max=1000.0, doc="time budget of one dispatch/expiry/purge slice")
    max_batch_items: int = opt(256, min=1, max=65536, doc="most items in one DISPATCH or RESULT frame")
    sndhwm: int = opt(1000, min=1, max=1 << 20, doc="ROUTER send high-water mark per peer")
    metrics_port: int = opt(0, min=0, max=65535, doc="Prometheus metrics port on 127.0.0.1 (0 = off)")
    accounting_sample_interval_s: float = opt(
        30.0, min=0.05, max=86400.0, doc="the ledger keeps an accounting sample this often while counters change (gap-report --html chart)"
    )
    log_format: str = opt("auto", choices=("auto", "json", "console"), doc="log rendering")
    curve: bool = opt(False, doc="encrypt every link with ZeroMQ CURVE (peers need curve = true and the public key)")
    curve_secret_key: str = opt("keys/broker.curve.key", path=True,
                                doc="the broker's CURVE secret key (Z85, mode 0600); used when curve = true")
    allow_insecure_bind: bool = opt(False,
                                    doc="true: allow an endpoint beyond loopback without curve (anyone reaching the port can connect and "
                                        "make the broker queue frames; docs/security.md)")
    metrics_listen: str = opt("",
                              doc="HOST:PORT of the Prometheus /metrics server ('' = 127.0.0.1:metrics_port; 0.0.0.0:9464 = every "
                                  "interface)")
    swarm_id: str = opt("", doc="this swarm's name in federation trust files ('' = the ledger id); signs relayed items and results")
    trusted_swarms: str = opt("", path=True,
                              doc="federation trust file: swarm id -> pinned broker public key ('' = accept no relayed items or results)")
    ha_etcd_endpoints: str = opt("",
                                 doc="high availability (docs/ha.md): comma-separated etcd client URLs, e.g. http://10.0.0.5:2379 ('' = a "
                                     "single broker: no etcd, no standby)")
    ha_etcd_ca_cert: str = opt("", path=True,
                               doc="HA: PEM file of the CA that signed etcd's server certificates; https:// endpoints are verified "
                                   "against it ('' = the system CA store)")
    ha_etcd_cert: str = opt("", path=True, doc="HA: PEM client certificate for etcd --client-cert-auth ('' = none; with ha_etcd_key)")
    ha_etcd_key: str = opt("", path=True, doc="HA: the private key of ha_etcd_cert (PEM, mode 0600; '' = none)")
    ha_etcd_user: str = opt("", doc="HA: etcd v3 authentication user name ('' = none; with ha_etcd_password_file)")
    ha_etcd_password_file: str = opt("", path=True,
                                     doc="HA: file holding ha_etcd_user's password (one line, mode 0600; '' = none)")
    ha_node_id: str = opt("broker-1",
                          doc="HA: this broker host's node id (its peer id on the replication link; listed with role standby in every "
                              "broker's authorized_keys)")
    ha_node_key: str = opt("keys/broker-1.key", path=True, doc="HA: the node id's Ed25519 private key (mode 0600)")
    ha_repl_endpoint: str = opt("tcp://127.0.0.1:5556", endpoint="bind",
                                doc="HA: where this broker, while primary, serves its standbys (advertised in etcd)")
    ha_mode: str = opt("sync", choices=("sync", "async"),
                       doc="HA: sync = no confirm before ha_sync_standbys standbys acknowledged the turn (nothing confirmed is lost); "
                           "async = confirm at once (a failover loses the turns not yet shipped)")
    ha_sync_standbys: int = opt(1, min=1, max=16, doc="HA, sync mode: standbys that must acknowledge a turn before its confirms leave")
    ha_on_standby_loss: str = opt("wait", choices=("wait", "degrade"),
                                  doc="HA, sync mode with too few standbys: wait = confirm nothing until one is back; degrade = after "
                                      "ha_degrade_after_s confirm alone (removes the standbys from the sync set in etcd first)")
    ha_degrade_after_s: float = opt(10.0, min=0.0, max=86400.0,
                                    doc="HA: how long a sync primary waits for a standby before ha_on_standby_loss = degrade confirms "
                                        "alone")
    ha_lease_ttl_s: int = opt(3, min=2, max=300, doc="HA: TTL of the primary's etcd lease (a dead primary's key goes after this)")
    ha_lease_margin_s: float = opt(1.0, min=0.01, max=299.0,
                                   doc="HA: the primary stops confirming this long before its lease could expire at etcd (below "
                                       "ha_lease_ttl_s)")
    ha_swarm_id: str = opt("", doc="HA: the etcd key namespace /ccsq/<id>/ ('' = swarm_id; a pair must set one of the two)")
    config_path: str = ""

    def ha(self) -> bool:
        """True when this broker runs as one of a replicated pair (``ha_etcd_endpoints`` set)."""
        return bool(self.ha_etcd_endpoints)

    def ha_namespace(self) -> str:
        """The etcd namespace of the pair (``ha_swarm_id``, else ``swarm_id``; "" = unset)."""
        return self.ha_swarm_id or self.swarm_id

    def cross_check(self) -> str:
        """A problem between keys (checked when the file is loaded), or ""."""
        if self.ha_etcd_endpoints:
            if self.ha_lease_margin_s >= self.ha_lease_ttl_s:
                return (f"ha_lease_margin_s = {self.ha_lease_margin_s} is not below ha_lease_ttl_s = {self.ha_lease_ttl_s}: "
                        "the primary could never confirm; set ha_lease_margin_s below the TTL (default 1.0 of 3)")
            if not self.ha_namespace():
                return ("ha_etcd_endpoints is set but neither ha_swarm_id nor swarm_id is: both brokers of a pair must name "
                        "the same etcd namespace (a ledger id differs per copy); set ha_swarm_id (or swarm_id) to the swarm's name")
            if self.ha_node_id == self.peer_id:
                return (f"ha_node_id = {self.ha_node_id!r} is the service peer id (peer_id): each broker host needs a node "
                        "id of its own for the replication link, e.g. broker-1 and broker-2")
            if self.ha_repl_endpoint in (self.endpoint, self.bind):
                return (f"ha_repl_endpoint = {self.ha_repl_endpoint!r} is the peer endpoint too: the replication link "
                        "needs its own port, e.g. tcp://HOST:5556")
        if self.lease_ttl_s < self.heartbeat_interval_s:
            return (f"lease_ttl_s = {self.lease_ttl_s} is shorter than heartbeat_interval_s = {self.heartbeat_interval_s}: "
                    "every lease would expire before the heartbeat that extends it, and every job would be run again "
                    f"and dead-lettered as worker_lost; set lease_ttl_s to at least {3 * self.heartbeat_interval_s:g} "
                    "(3 heartbeats; the default is 30) or lower heartbeat_interval_s")
        return ""


@dataclasses.dataclass(frozen=True)
class WorkerConfig(PeerSettings):
    """``workerd-N.toml``."""

    handler: str = opt("echo", doc="handler name (entry point group ccsq.handlers)")
    kinds: tuple[str, ...] = opt((), doc="item kinds to accept (default: the handler's name)")
    slots: int = opt(1, min=1, max=1024, doc="concurrent inferences on this GPU (the semaphore)")
    prefetch: int = opt(1, min=0, max=1024, doc="extra items held beyond free slots")
    claim_store: str = opt("file://blobs", doc="claim store URI: file://PATH or s3://bucket/prefix")
    journal_dir: str = opt("worker-journal", path=True, doc="the worker's local journal")
    provider: str = opt("cpu", choices=("cpu", "cuda", "tensorrt"), doc="ONNX Runtime execution provider to require")
    allow_cpu_fallback: bool = opt(False, doc="start on CPU (and say so in HELLO) when the GPU provider cannot load")
    handler_threads: int = opt(0, min=0, max=256, doc="intra-op threads for the model (0 = library default)")
    max_runtime_s: float = opt(0.0, min=0.0, max=86400.0, doc="default per-item runtime cap (0 = none)")
    drain_timeout_s: float = opt(30.0, min=0.0, max=86400.0,
                                 doc="on SIGTERM, running items get this long to finish before they are given back")
    max_batch: int = opt(0, min=0, max=4096,
                         doc="most items in one handler call (0 = the handler's default; credit = slots x max_batch + prefetch)")
    max_wait_ms: float = opt(-1.0, min=-1.0, max=60000.0, doc="how long a partial batch waits for more items (-1 = the handler's default)")
    model_path: str = opt("", path=True,
                          doc="model file of model handlers such as onnx; params['model'] may name another .onnx file in its directory")
    metrics_listen: str = opt("", doc="HOST:PORT (or PORT = 127.0.0.1:PORT) of the Prometheus /metrics server ('' = off)")
    log_each_job: bool = opt(True,
                             doc="log job_started/job_completed per item (false: one batch_started line naming the batch's items and one "
                                 "results_reported per report frame; ~40 µs CPU less per item)")
    s3_endpoint_url: str = opt("",
                               doc="s3:// claim store: endpoint URL of an S3-compatible server ('' = CCSQ_S3_ENDPOINT_URL, "
                                   "AWS_ENDPOINT_URL or AWS)")
    s3_region: str = opt("", doc="s3:// claim store: region ('' = AWS_REGION / the profile's)")
    s3_profile: str = opt("",
                          doc="s3:// claim store: named profile of the AWS credential chain ('' = default chain; secrets never go in this "
                              "file)")


@dataclasses.dataclass(frozen=True)
class ProducerConfig(PeerSettings):
    """``producer.toml``."""

    claim_store: str = opt("file://blobs", doc="claim store URI: file://PATH or s3://bucket/prefix")
    inline_max_bytes: int = opt(16384, min=0, max=1 << 20, doc="payloads up to this size travel inline")
    outbox_dir: str = opt("", path=True, doc="local spool for submissions while the broker is down ('' = off)")
    submit_timeout_s: float = opt(10.0, min=0.1, max=3600.0, doc="wait this long for SUBMIT_ACK before retrying")
    s3_endpoint_url: str = opt("",
                               doc="s3:// claim store: endpoint URL of an S3-compatible server ('' = CCSQ_S3_ENDPOINT_URL, "
                                   "AWS_ENDPOINT_URL or AWS)")
    s3_region: str = opt("", doc="s3:// claim store: region ('' = AWS_REGION / the profile's)")
    s3_profile: str = opt("",
                          doc="s3:// claim store: named profile of the AWS credential chain ('' = default chain; secrets never go in this "
                              "file)")
    default_kind: str = opt("", doc="item kind of `ccsq submit` without --kind ('' = ocr; `ccsq init` writes its --handler)")


@dataclasses.dataclass(frozen=True)
class CompletionConfig(PeerSettings):
    """``completion.toml``."""

    claim_store: str = opt("file://blobs", doc="claim store URI for results stored by reference")
    database: str = opt("sqlite:///results.db", doc="sqlite:///PATH or postgresql://... DSN")
    credit: int = opt(64, min=1, max=65536, doc="results in flight from the broker")
    batch_max: int = opt(256, min=1, max=2048, doc="most results in one database transaction (and one ACK)")
    batch_wait_ms: float = opt(0.0, min=0.0, max=10000.0,
                               doc="how long to wait for more results once one arrived (0 = land what has arrived: results arriving "
                                   "during a transaction form the next batch; raise it for fewer, larger transactions at the cost of "
                                   "latency)")
    db_slow_s: float = opt(5.0, min=0.01, max=3600.0, doc="a write slower than this counts as unhealthy")
    backoff_max_s: float = opt(30.0, min=0.01, max=3600.0, doc="cap of the database backoff")
    metrics_listen: str = opt("", doc="HOST:PORT (or PORT = 127.0.0.1:PORT) of the Prometheus /metrics server ('' = off)")
    s3_endpoint_url: str = opt("",
                               doc="s3:// claim store: endpoint URL of an S3-compatible server ('' = CCSQ_S3_ENDPOINT_URL, "
                                   "AWS_ENDPOINT_URL or AWS)")
    s3_region: str = opt("", doc="s3:// claim store: region ('' = AWS_REGION / the profile's)")
    s3_profile: str = opt("",
                          doc="s3:// claim store: named profile of the AWS credential chain ('' = default chain; secrets never go in this "
                              "file)")


@dataclasses.dataclass(frozen=True)
class AdminConfig(PeerSettings):
    """``admin.toml`` (the ``ccsq status/items/dlq/drain/reconcile`` commands)."""

    data_dir: str = opt("broker-data", path=True, doc="the broker's data_dir, read directly when the broker is stopped (--offline)")
    connect_timeout_s: float = opt(2.0, min=0.1, max=300.0, doc="no WELCOME within this: read the ledger offline (read-only commands)")
    console_listen: str = opt("127.0.0.1:8750", doc="`ccsq console` listens here (HOST:PORT; beyond loopback it needs a token)")
    console_tokens: str = opt("", path=True,
                              doc="`ccsq console` tokens: TOML file of [tokens.NAME] token, role = admin|viewer (mode 0600; '' = none)")


CONFIG_FILES: dict[str, type] = {
    "brokerd.toml": BrokerConfig,
    "workerd-N.toml": WorkerConfig,
    "producer.toml": ProducerConfig,
    "completion.toml": CompletionConfig,
    "admin.toml": AdminConfig,
}


def markdown_reference() -> str:
    """The config-key reference as Markdown (embedded in README.md; a test keeps them in sync)."""
    out: list[str] = []
    for fname, cls in CONFIG_FILES.items():
        out.append(f"**`{fname}`**\n\n| key | type | default | meaning |\n|---|---|---|---|")
        for key, typ, default, doc in describe(cls):
            out.append(f"| `{key}` | {typ} | `{default!r}` | {doc} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


README_BEGIN = "<!-- config-keys:begin (generated: python -m ccsq.common.wire.config --write README.md) -->"
README_END = "<!-- config-keys:end -->"


def write_reference(readme: Path) -> bool:
    """Replace the generated block in ``readme``; returns True if it changed."""
    text = readme.read_text()
    head, _, rest = text.partition(README_BEGIN)
    _, _, tail = rest.partition(README_END)
    new = f"{head}{README_BEGIN}\n{markdown_reference()}\n{README_END}{tail}"
    if new != text:
        readme.write_text(new)
    return new != text


if __name__ == "__main__":  # python -m ccsq.common.wire.config [--write README.md]
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        write_reference(Path(sys.argv[2]))
    else:
        print(markdown_reference())
