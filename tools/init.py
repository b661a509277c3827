"""``ccsq init`` and ``ccsq keygen``: a ready-to-run swarm directory, and one peer's keys.

:func:`init_swarm` is also the tests', the benches' and the demo's way to a swarm. It is
cut into one function per file it writes: :func:`_write_keys` (every peer's Ed25519 and
CURVE key pairs, ``authorized_keys.toml``), then the configs (:func:`_broker_config`,
:func:`_worker_config`, :func:`_producer_config`, :func:`_completion_config`,
:func:`_admin_config`), each a dict that ``tomli_w`` writes in its key order.
"""

from __future__ import annotations

import argparse
import re
import secrets
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w

from ccsq.common.wire.errors import CantCreate, ConfigError, ExitCode
from ccsq.common.wire.keys import public_key_b64, load_private_key, write_authorized_keys, write_curve_keypair, write_keypair


def init_swarm(
    directory: Path,
    *,
    endpoint: str = "tcp://127.0.0.1:5555",
    workers: int = 2,
    handler: str = "echo",
    broker: dict | None = None,
    worker: dict | None = None,
    producer: dict | None = None,
    completion: dict | None = None,
    bind: str = "",
    swarm_id: str | None = None,
    standbys: Sequence[str] = (),
    etcd: str = "",
    etcd_security: dict[str, str] | None = None,
) -> dict[str, Path]:
    """Write a ready-to-run swarm directory; returns ``{name: config path}``.

    ``endpoint`` is what peers connect to; ``bind`` (optional) what the broker binds
    when that differs (``tcp://0.0.0.0:5555`` behind ``tcp://gpu-broker.internal:5555``).

    Layout (all state lives under ``directory``)::

        brokerd.toml  workerd-0.toml ... workerd-<N-1>.toml  producer.toml  completion.toml
        authorized_keys.toml  keys/<peer>.key (0600) keys/<peer>.pub
        keys/<peer>.curve.key (0600) keys/<peer>.curve.pub (CURVE; curve = true when the endpoint is not loopback)
        blobs/ (file claim store)  broker-data/ (ledger)  worker-N-journal/  results.db

    Worker numbering: ``workerd-G.toml`` is named after the GPU index G (0-based, ``nvidia-smi``
    order) that ``ccsq-workerd@G.service`` drives and reads as ``/etc/ccsq/workerd-G.toml``; the
    peer inside is ``worker-<G+1>`` (worker-1..N, unique in the swarm: on another GPU host the
    file for its GPU 0 holds another peer id). Keys ``workerd-0`` ... in the returned dict.

    ``swarm_id``: this swarm's name in federation (``brokerd.toml`` ``swarm_id``; it names
    ``ccsq init-relay``'s links and pins the broker's key in the other swarm's trust file);
    None: :func:`default_swarm_id` (the directory's name and a random suffix, so two sites
    that were each set up in ``/etc/ccsq`` still differ); ``""``: none written (the broker's
    ledger id). ConfigError for an invalid one.

    ``standbys`` (``ccsq init --standby HOST[:PORT]``, with ``etcd``, ``--etcd``: the etcd
    client URLs, comma-separated): a broker pair (or more) per docs/ha.md "Operations". The
    brokers share the service identity (``keys/broker.key``, ``keys/broker.curve.key``); each
    has a node key ``keys/broker-<N>.key`` (+ CURVE pair), listed with role ``standby`` in
    ``authorized_keys.toml``. ``brokerd.toml`` is broker-1 (on ``endpoint``'s host),
    ``brokerd-<N>.toml`` broker-N on the N-1th standby host (its ledger in
    ``broker-<N>-data/``, the same port as ``endpoint`` unless HOST:PORT); each serves its
    standbys on its port + 1 (``ha_repl_endpoint``). Every peer's ``broker_endpoint`` is
    the list of all brokers, broker-1 first. Empty (the default): nothing of this is
    written, the files are those of a single broker. ConfigError (exit 78) naming the
    flag: a standby without ``etcd`` (or ``etcd`` without a standby), a host given twice
    or equal to the endpoint's, an ``ipc://`` endpoint, a malformed etcd URL.
    ``etcd_security``: ``{"ca", "user", "password_file"}`` (``--etcd-ca``, ``--etcd-user``,
    ``--etcd-password-file``; each optional) written into every broker's config as
    ``ha_etcd_ca_cert``, ``ha_etcd_user``, ``ha_etcd_password_file`` (paths as given: the
    files are on the broker hosts; the broker checks them at start). ConfigError naming the
    flag: given without ``etcd``, a user without a password file or the reverse.

    ``broker``/``worker``/``producer``/``completion`` override config keys (``broker``:
    of every broker).
    Raises ConfigError if the directory already holds a swarm.
    """
    from ccsq.common.wire.endpoints import is_loopback_endpoint

    directory = directory.resolve()
    from ccsq.common.wire.endpoints import check_endpoint

    check_endpoint(endpoint, bind=not bind, where="--endpoint")
    if bind:
        check_endpoint(bind, bind=True, where="--bind")
    if (directory / "brokerd.toml").exists():
        raise ConfigError(f"{directory} already holds a swarm (brokerd.toml exists); choose another directory")
    pair = ha_pair(endpoint, bind, standbys, etcd) if (standbys or etcd) else []
    etcd_keys = etcd_security_keys(etcd_security or {}, etcd)
    swarm_id = default_swarm_id(directory) if swarm_id is None else check_swarm_id(swarm_id, where="--swarm-id")
    directory.mkdir(parents=True, exist_ok=True)
    _write_keys(directory, workers, nodes=len(pair))
    (directory / "blobs").mkdir(exist_ok=True)
    peer_endpoints = ",".join(b["endpoint"] for b in pair) if pair else endpoint
    common = {"authorized_keys": "authorized_keys.toml", "broker_endpoint": peer_endpoints, "broker_id": "broker"}
    # CURVE with the allow-list is on when the broker binds beyond loopback (it refuses to start without it)
    curve_on = not is_loopback_endpoint(bind or endpoint) or not is_loopback_endpoint(endpoint)
    curve_on = curve_on or any(not is_loopback_endpoint(b["endpoint"]) or not is_loopback_endpoint(b["bind"] or b["endpoint"])
                               for b in pair)
    written: dict[str, Path] = {}

    def write(name: str, doc: dict) -> None:
        path = directory / name
        path.write_text(tomli_w.dumps(doc))
        written[name.removesuffix(".toml")] = path

    swarm_keys = {"swarm_id": swarm_id} if swarm_id else {}
    ha_swarm_id = default_swarm_id(directory)
    if not pair:
        write("brokerd.toml", _broker_config(endpoint, bind, curve_on, {**swarm_keys, **(broker or {})}))
    for b in pair:  # broker-1 = brokerd.toml, broker-N = brokerd-N.toml
        n = b["n"]
        ha = {**_ha_keys(b, etcd, data_dir=("broker-data" if n == 1 else f"broker-{n}-data")), **etcd_keys}
        if not swarm_id:  # the pair's etcd namespace must be one name (the ledger id differs until the standby copied it)
            ha["ha_swarm_id"] = ha_swarm_id
        write("brokerd.toml" if n == 1 else f"brokerd-{n}.toml",
              _broker_config(b["endpoint"], b["bind"], curve_on, {**swarm_keys, **ha, **(broker or {})}))
    for i in range(1, workers + 1):  # peer worker-i drives GPU i-1: workerd-<GPU index>.toml
        write(f"workerd-{i - 1}.toml", _worker_config(i, common, handler, curve_on, worker))
    write("producer.toml", _producer_config(common, handler, curve_on, producer))
    write("completion.toml", _completion_config(common, curve_on, completion))
    write("admin.toml", _admin_config(common, curve_on, broker))
    return written


#: A swarm id names links (``<up>-to-<down>``) and the relay's peer ids
#: (``<relay>-<up>-to-<down>-down``, at most 64 characters), so it is a short peer id.
SWARM_ID_MAX = 24


def check_swarm_id(swarm_id: str, *, where: str = "swarm_id") -> str:
    """Return ``swarm_id`` when it is a peer id (:data:`~ccsq.common.wire.keys.PEER_ID_RE`) of
    at most :data:`SWARM_ID_MAX` characters, else raise ConfigError naming ``where``."""
    from ccsq.common.wire.keys import PEER_ID_RE

    if not isinstance(swarm_id, str) or not PEER_ID_RE.fullmatch(swarm_id) or len(swarm_id) > SWARM_ID_MAX:
        raise ConfigError(f"{where}: {swarm_id!r} is not a valid swarm id: use 1-{SWARM_ID_MAX} letters, digits, '.', '_' "
                          "or '-', starting with a letter or digit (it names links and the relay's peer ids), e.g. site-a")
    return swarm_id


def default_swarm_id(directory: Path) -> str:
    """``<directory name>-<6 random hex digits>`` (the name cut to what a peer id allows,
    16 characters): two sites set up in directories of the same name get different ids."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", directory.name).lstrip("._-")[:16].rstrip("._-") or "swarm"
    return f"{name}-{secrets.token_hex(3)}"


def _write_keys(directory: Path, workers: int, *, nodes: int = 0) -> None:
    """Every peer's Ed25519 and CURVE key pairs under ``keys/``, and ``authorized_keys.toml``
    listing them with their roles (the CURVE keys are the broker's ZAP allow-list).
    ``nodes``: a broker pair's node identities ``broker-1..N``, role ``standby`` (docs/ha.md)."""
    keys_dir = directory / "keys"
    peers = {"broker": "broker", "producer-1": "producer", "completion-1": "completion", "admin": "admin"}
    peers.update({f"worker-{i}": "worker" for i in range(1, workers + 1)})
    peers.update({f"broker-{n}": "standby" for n in range(1, nodes + 1)})
    authorized: dict[str, tuple[str, ...]] = {}
    for peer_id, role in peers.items():
        priv, _ = write_keypair(keys_dir, peer_id)
        _, curve_pub = write_curve_keypair(keys_dir, peer_id)  # CURVE: the broker's ZAP allow-list (docs/security.md)
        authorized[peer_id] = (role, public_key_b64(load_private_key(priv)), curve_pub.read_text().strip())
    write_authorized_keys(directory / "authorized_keys.toml", authorized)


#: etcd client URLs as ``ccsq init --etcd`` takes them (the broker checks them again at start).
_ETCD_URL_RE = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})/?")


def check_etcd_endpoints(value: str, *, where: str = "--etcd") -> str:
    """``value`` as ``http://H:P,http://H:P`` (spaces dropped), or ConfigError naming ``where``."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise ConfigError(f"{where}: no etcd client URL given; write it as http://10.0.0.5:2379[,http://10.0.0.6:2379,...] "
                          "(docs/ha.md: three etcd members)")
    for u in urls:
        m = _ETCD_URL_RE.fullmatch(u)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ConfigError(f"{where}: {u!r} is not an etcd client URL; write it as http://10.0.0.5:2379")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{where}: an etcd URL is given twice in {value!r}")
    return ",".join(urls)


def ha_pair(endpoint: str, bind: str, standbys: Sequence[str], etcd: str) -> list[dict]:
    """The brokers of a pair: ``[{"n", "endpoint", "bind", "repl"}]``, broker-1 on ``endpoint``,
    broker-N on ``standbys[N-2]`` (``HOST`` or ``HOST:PORT``; the port defaults to
    ``endpoint``'s). ``repl`` = the host's port + 1. ConfigError (exit 78) naming the flag."""
    from ccsq.common.wire.endpoints import check_endpoint, default_bind, split_tcp

    if not standbys:
        raise ConfigError("--etcd is given without --standby: a single broker uses no etcd; add --standby HOST for each "
                          "standby broker host, or leave out --etcd")
    if not etcd:
        raise ConfigError("--standby needs --etcd http://HOST:2379[,...]: the brokers of a pair elect their primary "
                          "through etcd (docs/ha.md \"Operations\": run etcd with three members)")
    check_etcd_endpoints(etcd)
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"--standby needs a tcp:// --endpoint (the brokers are on different hosts), not {endpoint!r}")
    host1, port1_text = split_tcp(endpoint)
    if not port1_text.isdigit() or host1 == "*":
        raise ConfigError(f"--standby needs an --endpoint with a host and a port that peers connect to, not {endpoint!r}")
    port1 = int(port1_text)
    brokers: list[dict[str, Any]] = [{"n": 1, "endpoint": endpoint, "bind": bind, "host": host1, "port": port1}]
    for i, spec in enumerate(standbys):
        spec = spec.strip()
        host, sep, port_text = spec.rpartition(":")
        if not sep:
            host, port_text = spec, str(port1)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", host) or not port_text.isdigit():
            raise ConfigError(f"--standby {spec!r}: not a host name or address (HOST or HOST:PORT, e.g. broker-2 or 10.0.0.12:5555)")
        port = int(port_text)
        if not 0 < port < 65535:
            raise ConfigError(f"--standby {spec!r}: port {port} is out of range (1-65534; the next port serves standbys)")
        ep = check_endpoint(f"tcp://{host}:{port}", bind=False, where=f"--standby {spec}")
        brokers.append({"n": i + 2, "endpoint": ep, "bind": default_bind(ep), "host": host, "port": port})
    seen: dict[tuple[str, int], str] = {}
    for b in brokers:  # a broker's peer port and its repl port (+1), per host, are taken once
        what = "--endpoint" if b["n"] == 1 else f"--standby {standbys[b['n'] - 2]}"
        for port in (b["port"], b["port"] + 1):
            other = seen.get((b["host"], port))
            if other is not None:
                raise ConfigError(f"{what}: {b['host']}:{port} is taken by {other} (a standby host given twice, or a port "
                                  "and the next one, which serves standbys, overlap); give each broker its own host or port")
            seen[(b["host"], port)] = what
        b["repl"] = f"tcp://{b['host']}:{b['port'] + 1}"
    return brokers


def etcd_security_keys(sec: dict[str, str], etcd: str) -> dict[str, str]:
    """``--etcd-ca`` / ``--etcd-user`` / ``--etcd-password-file`` -> the brokers' ``ha_etcd_*``
    keys (only those given). ConfigError naming the flag when given without ``--etcd`` or
    when a user comes without a password file (or the reverse)."""
    given = {k: v for k, v in sec.items() if v}
    unknown = set(given) - {"ca", "user", "password_file"}
    if unknown:
        raise ValueError(f"unknown etcd_security keys {sorted(unknown)}")
    if given and not etcd:
        flags = ", ".join("--etcd-" + k.replace("_", "-") for k in sorted(given))
        raise ConfigError(f"{flags}: given without --etcd (and --standby): a single broker uses no etcd")
    if bool(given.get("user")) != bool(given.get("password_file")):
        raise ConfigError("--etcd-user needs --etcd-password-file (a file with its password, mode 0600, on the broker hosts)"
                          if given.get("user") else "--etcd-password-file needs --etcd-user (the etcd user it is the password of)")
    names = {"ca": "ha_etcd_ca_cert", "user": "ha_etcd_user", "password_file": "ha_etcd_password_file"}
    return {names[k]: v for k, v in given.items()}


def _ha_keys(b: dict, etcd: str, *, data_dir: str) -> dict:
    """The HA keys of broker-N's ``brokerd.toml`` (docs/ha.md; the table of the config keys)."""
    return {"data_dir": data_dir, "ha_etcd_endpoints": check_etcd_endpoints(etcd), "ha_node_id": f"broker-{b['n']}",
            "ha_node_key": f"keys/broker-{b['n']}.key", "ha_repl_endpoint": b["repl"]}


def _curve_lines(peer_id: str, curve_on: bool) -> dict:
    """A connecting peer's CURVE keys (its secret key, the broker's public key)."""
    return {"curve": curve_on, "curve_secret_key": f"keys/{peer_id}.curve.key", "broker_curve_public_key": "keys/broker.curve.pub"}


def _broker_config(endpoint: str, bind: str, curve_on: bool, overrides: dict | None) -> dict:
    """``brokerd.toml``: the ledger in ``broker-data/``."""
    return {
        "peer_id": "broker",
        "private_key": "keys/broker.key",
        "authorized_keys": "authorized_keys.toml",
        "endpoint": endpoint,
        **({"bind": bind} if bind else {}),
        "data_dir": "broker-data",
        "curve": curve_on,
        "curve_secret_key": "keys/broker.curve.key",
        **(overrides or {}),
    }


def _worker_config(i: int, common: dict, handler: str, curve_on: bool, overrides: dict | None) -> dict:
    """``workerd-<i-1>.toml``: peer ``worker-<i>``, its journal in ``worker-<i>-journal/``."""
    return {
        "peer_id": f"worker-{i}",
        "private_key": f"keys/worker-{i}.key",
        **common,
        "handler": handler,
        "claim_store": "file://blobs",
        "journal_dir": f"worker-{i}-journal",
        **_curve_lines(f"worker-{i}", curve_on),
        **(overrides or {}),
    }


def _producer_config(common: dict, handler: str, curve_on: bool, overrides: dict | None) -> dict:
    """``producer.toml``: ``default_kind`` is the workers' handler."""
    return {"peer_id": "producer-1", "private_key": "keys/producer-1.key", **common, "claim_store": "file://blobs",
            "default_kind": handler, **_curve_lines("producer-1", curve_on), **(overrides or {})}


def _completion_config(common: dict, curve_on: bool, overrides: dict | None) -> dict:
    """``completion.toml``: results into ``results.db`` (SQLite)."""
    return {
        "peer_id": "completion-1",
        "private_key": "keys/completion-1.key",
        **common,
        "claim_store": "file://blobs",
        "database": "sqlite:///results.db",
        **_curve_lines("completion-1", curve_on),
        **(overrides or {}),
    }


def _admin_config(common: dict, curve_on: bool, broker: dict | None) -> dict:
    """``admin.toml``: the broker's ``data_dir`` too (read-only commands read the ledger when it is down)."""
    return {"peer_id": "admin", "private_key": "keys/admin.key", **common, "data_dir": (broker or {}).get("data_dir", "broker-data"),
            **_curve_lines("admin", curve_on)}


def _cmd_init(args: argparse.Namespace) -> int:
    from ccsq.common.wire.endpoints import default_bind

    if args.hosts and (Path(args.dir) / "brokerd.toml").exists():
        # a swarm written before (and its configs edited since, e.g. an s3:// claim_store): split it as it is now
        from ccsq.tools.hosts import render_layout, write_host_layout

        print(f"{args.dir} holds a swarm: writing only its per-host layout, from its configs as they are "
              "(the other options of init are not applied)")
        print(render_layout(write_host_layout(Path(args.dir), gpu_hosts=args.gpu_hosts)))
        return ExitCode.OK
    bind = args.bind if args.bind is not None else default_bind(args.endpoint)
    try:
        written = init_swarm(Path(args.dir), endpoint=args.endpoint, workers=args.workers, handler=args.handler, bind=bind,
                             swarm_id=args.swarm_id, standbys=args.standby or (), etcd=args.etcd or "",
                             etcd_security={"ca": args.etcd_ca or "", "user": args.etcd_user or "",
                                            "password_file": args.etcd_password_file or ""})
    except OSError as exc:
        raise CantCreate.of("the swarm directory", args.dir, exc) from None
    for name, path in written.items():
        print(f"{name:14} {path}")
    if bind:
        print(f"the broker binds {bind}; peers connect to {args.endpoint}")
    if args.standby:
        for name in (n for n in written if n.startswith("brokerd")):
            doc = tomllib.loads(written[name].read_text())
            print(f"{doc['ha_node_id']}: {name}.toml, peers connect to {doc['endpoint']}, serves standbys on {doc['ha_repl_endpoint']}")
        print(f"etcd {args.etcd}: the brokers elect their primary there (docs/ha.md \"Operations\"); peers list every broker")
    swarm_id = tomllib.loads(written["brokerd"].read_text()).get("swarm_id", "")
    print(f"swarm_id {swarm_id} (its name in federation; set with --swarm-id)")
    if args.hosts:
        from ccsq.tools.hosts import render_layout, write_host_layout

        print(render_layout(write_host_layout(Path(args.dir), gpu_hosts=args.gpu_hosts)))
    print(next_steps(Path(args.dir), written, args.handler, hosts=args.hosts))
    return ExitCode.OK


def next_steps(directory: Path, written: dict[str, Path], handler: str, *, hosts: bool = False) -> str:
    """What to run after ``ccsq init`` (README "Run your own swarm"): the broker, each
    worker, the completion service, a submit and ``ccsq status``, with this swarm's paths."""
    d = str(directory)
    steps = [
        (f"export CCSQ_CONFIG={directory.resolve()}", "every ccsq command finds its <name>.toml there"),
        (f"ccsq-brokerd --config {d}/brokerd.toml", f"the broker first (ledger in {d}/broker-data)"),
    ]
    for name in sorted((n for n in written if n.startswith("brokerd-")), key=lambda n: int(n.split("-")[1])):
        n = name.split("-")[1]
        steps.append((f"ccsq-brokerd --config {d}/{name}.toml", f"broker-{n} on its host (ledger in {d}/broker-{n}-data; "
                      "primary or standby, etcd decides)"))
    for name in sorted((n for n in written if n.startswith("workerd-")), key=lambda n: int(n.split("-")[1])):
        gpu = int(name.split("-")[1])
        steps.append((f"ccsq-workerd --config {d}/{name}.toml", f"worker-{gpu + 1} (GPU {gpu}), handler {handler}"))
    steps += [
        (f"ccsq-completiond --config {d}/completion.toml", f"results into {d}/results.db, then ACK"),
        (f"ccsq submit --kind {handler} --wait FILE...", "submit files, wait until each is acknowledged"),
        ("ccsq status", "peers, their kinds, backlog per kind"),
        ("ccsq gap-report", "the books balance: nothing lost"),
    ]
    width = max(len(cmd) for cmd, _ in steps)
    lines = ["", "next steps (README.md \"Run your own swarm\"; the daemons each in a terminal of its own, or with &):"]
    lines += [f"  {cmd:{width}}  # {why}" for cmd, why in steps]
    if hosts:
        lines.append(f"  on several hosts: {d}/hosts/<host>/MANIFEST says what each host runs (docs/deployment.md)")
    return "\n".join(lines)


def _cmd_keygen(args: argparse.Namespace) -> int:
    if args.curve:
        from ccsq.common.wire.keys import write_curve_keypair

        secret, public = write_curve_keypair(Path(args.out), args.id)
        print(f"CURVE secret key {secret} (mode 0600)\nCURVE public key {public}: {public.read_text().strip()}")
        print("broker: curve = true, curve_secret_key = <secret path>; peers: curve = true, "
              "curve_secret_key = <their secret path>, broker_curve_public_key = <the broker's public path>")
        print(f'add to the [peers.{args.id}] entry of authorized_keys.toml (the broker admits only listed keys; '
              f'SIGHUP reloads):\ncurve_public_key = "{public.read_text().strip()}"')
        return ExitCode.OK
    priv, pub = write_keypair(Path(args.out), args.id)
    print(f"private key {priv} (mode 0600)\npublic key  {pub}: {pub.read_text().strip()}")
    print(f'add to authorized_keys.toml:\n[peers.{args.id}]\nrole = "{args.role}"\npublic_key = "{pub.read_text().strip()}"')
    return ExitCode.OK
