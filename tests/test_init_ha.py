"""``ccsq init --standby HOST --etcd URLS``: a broker pair (docs/ha.md "Operations", HA-CONTRACT).

Without ``--standby`` the files are today's, byte for byte apart from the random keys
(checked against the text the code wrote before the pair existed). With it: one service
identity (``broker.key``, ``broker.curve.key``) shared by both brokers, a node key per
broker listed with role ``standby``, ``brokerd.toml`` / ``brokerd-2.toml`` that load as
``BrokerConfig`` with the HA keys, every peer's ``broker_endpoint`` the list of both, and
``--hosts`` a ``hosts/broker-2/`` bundle whose MANIFEST checks. Refusals exit 78 naming the flag.
"""

from __future__ import annotations

import hashlib
import re
import stat
import tomllib
from pathlib import Path

import pytest

from ccsq.common.wire.config import AdminConfig, BrokerConfig, CompletionConfig, ProducerConfig, WorkerConfig, load
from ccsq.common.wire.endpoints import check_endpoint
from ccsq.common.wire.errors import ExitCode
from ccsq.tools.cli import main
from ccsq.tools.init import init_swarm

ETCD = "http://10.0.0.5:2379,http://10.0.0.6:2379,http://10.0.0.7:2379"

#: What ``init_swarm(d, swarm_id="s1")`` wrote before the pair existed (commit 0704b01), keys
#: replaced by KEY: the single broker must stay bit for bit what it was.
TODAY = {
    "brokerd.toml": '''peer_id = "broker"
private_key = "keys/broker.key"
authorized_keys = "authorized_keys.toml"
endpoint = "tcp://127.0.0.1:5555"
data_dir = "broker-data"
curve = false
curve_secret_key = "keys/broker.curve.key"
swarm_id = "s1"
''',
    "workerd-0.toml": '''peer_id = "worker-1"
private_key = "keys/worker-1.key"
authorized_keys = "authorized_keys.toml"
broker_endpoint = "tcp://127.0.0.1:5555"
broker_id = "broker"
handler = "echo"
claim_store = "file://blobs"
journal_dir = "worker-1-journal"
curve = false
curve_secret_key = "keys/worker-1.curve.key"
broker_curve_public_key = "keys/broker.curve.pub"
''',
    "producer.toml": '''peer_id = "producer-1"
private_key = "keys/producer-1.key"
authorized_keys = "authorized_keys.toml"
broker_endpoint = "tcp://127.0.0.1:5555"
broker_id = "broker"
claim_store = "file://blobs"
default_kind = "echo"
curve = false
curve_secret_key = "keys/producer-1.curve.key"
broker_curve_public_key = "keys/broker.curve.pub"
''',
    "completion.toml": '''peer_id = "completion-1"
private_key = "keys/completion-1.key"
authorized_keys = "authorized_keys.toml"
broker_endpoint = "tcp://127.0.0.1:5555"
broker_id = "broker"
claim_store = "file://blobs"
database = "sqlite:///results.db"
curve = false
curve_secret_key = "keys/completion-1.curve.key"
broker_curve_public_key = "keys/broker.curve.pub"
''',
    "admin.toml": '''peer_id = "admin"
private_key = "keys/admin.key"
authorized_keys = "authorized_keys.toml"
broker_endpoint = "tcp://127.0.0.1:5555"
broker_id = "broker"
data_dir = "broker-data"
curve = false
curve_secret_key = "keys/admin.curve.key"
broker_curve_public_key = "keys/broker.curve.pub"
''',
}
TODAY_FILES = ["admin.toml", "authorized_keys.toml", "blobs", "brokerd.toml", "completion.toml", "keys", "producer.toml",
               "workerd-0.toml", "workerd-1.toml"]
TODAY_KEYS = sorted(f"{p}{ext}" for p in ("admin", "broker", "completion-1", "producer-1", "worker-1", "worker-2")
                    for ext in (".key", ".pub", ".curve.key", ".curve.pub"))
TODAY_PEERS = {"broker": "broker", "producer-1": "producer", "completion-1": "completion", "admin": "admin",
               "worker-1": "worker", "worker-2": "worker"}


def test_without_standby_init_writes_todays_files_bit_for_bit(tmp_path: Path) -> None:
    init_swarm(tmp_path / "s", swarm_id="s1")
    d = tmp_path / "s"
    assert sorted(p.name for p in d.iterdir()) == TODAY_FILES
    assert sorted(p.name for p in (d / "keys").iterdir()) == TODAY_KEYS
    for name, text in TODAY.items():
        assert (d / name).read_text() == text, name
    peers = tomllib.loads((d / "authorized_keys.toml").read_text())["peers"]
    assert {pid: e["role"] for pid, e in peers.items()} == TODAY_PEERS
    doc = tomllib.loads((d / "brokerd.toml").read_text())
    assert not any(k.startswith("ha_") for k in doc)  # the single broker: no etcd, no standby
    assert load(BrokerConfig, d / "brokerd.toml").ha_etcd_endpoints == ""


def _pair(tmp_path: Path, capsys, *extra: str) -> Path:
    d = tmp_path / "pair"
    rc = main(["init", str(d), "--endpoint", "tcp://10.0.0.11:5555", "--standby", "10.0.0.12", "--etcd", ETCD, "--swarm-id", "s1",
               *extra])
    assert rc == 0, capsys.readouterr()
    return d


def test_a_pair_shares_the_service_identity_and_each_broker_loads_with_its_node(tmp_path: Path, capsys) -> None:
    d = _pair(tmp_path, capsys)
    out = capsys.readouterr().out
    assert "broker-2: brokerd-2.toml" in out and "serves standbys on tcp://10.0.0.12:5556" in out
    b1, b2 = load(BrokerConfig, d / "brokerd.toml"), load(BrokerConfig, d / "brokerd-2.toml")
    for n, cfg, host in ((1, b1, "10.0.0.11"), (2, b2, "10.0.0.12")):
        assert cfg.peer_id == "broker" and cfg.private_key == str(d / "keys/broker.key")  # one service identity
        assert cfg.curve and cfg.curve_secret_key == str(d / "keys/broker.curve.key")
        assert cfg.endpoint == f"tcp://{host}:5555" and cfg.bind == "tcp://0.0.0.0:5555"
        assert cfg.ha_etcd_endpoints == ETCD and cfg.ha_node_id == f"broker-{n}"
        assert cfg.ha_node_key == str(d / f"keys/broker-{n}.key") and cfg.ha_repl_endpoint == f"tcp://{host}:5556"
        assert cfg.swarm_id == "s1" and (cfg.ha_mode, cfg.ha_sync_standbys, cfg.ha_on_standby_loss) == ("sync", 1, "wait")
        assert stat.S_IMODE(Path(cfg.ha_node_key).stat().st_mode) == 0o600
    assert b1.data_dir != b2.data_dir  # both can run from this one directory (tests, the chaos run)
    peers = tomllib.loads((d / "authorized_keys.toml").read_text())["peers"]
    assert {pid: e["role"] for pid, e in peers.items() if pid.startswith("broker")} == {
        "broker": "broker", "broker-1": "standby", "broker-2": "standby"}
    from ccsq.common.wire.keys import load_private_key, public_key_b64

    for n in (1, 2):
        assert peers[f"broker-{n}"]["public_key"] == public_key_b64(load_private_key(d / f"keys/broker-{n}.key"))
        assert peers[f"broker-{n}"]["curve_public_key"] == (d / f"keys/broker-{n}.curve.pub").read_text().strip()
    both = "tcp://10.0.0.11:5555,tcp://10.0.0.12:5555"
    for name in ("workerd-0", "workerd-1", "producer", "completion", "admin"):
        doc = tomllib.loads((d / f"{name}.toml").read_text())
        assert doc["broker_endpoint"] == both, name  # every peer lists both brokers, broker-1 first
        for ep in doc["broker_endpoint"].split(","):
            check_endpoint(ep, bind=False)


def test_peer_configs_of_a_pair_load_once_endpoint_lists_are_accepted(tmp_path: Path, capsys) -> None:
    """The peers' ``broker_endpoint`` list is parsed by hapeers' config change (HA-CONTRACT);
    before it lands a list is refused as one endpoint, and this says which side is missing."""
    d = _pair(tmp_path, capsys)
    from ccsq.common.wire.errors import ConfigError

    for cls, name in ((WorkerConfig, "workerd-0"), (ProducerConfig, "producer"), (CompletionConfig, "completion"),
                      (AdminConfig, "admin")):
        try:
            cfg = load(cls, d / f"{name}.toml")
        except ConfigError as exc:
            if "broker_endpoint" in str(exc):
                pytest.xfail(f"endpoint lists not parsed yet (hapeers' common/wire/config.py): {exc}")
            raise
        assert "10.0.0.12:5555" in str(cfg.broker_endpoint)


def test_hosts_writes_a_bundle_per_broker_with_its_node_key_and_a_manifest(tmp_path: Path, capsys) -> None:
    d = _pair(tmp_path, capsys, "--hosts")
    for host, n in (("broker", 1), ("broker-2", 2)):
        h = d / "hosts" / host
        doc = tomllib.loads((h / "brokerd.toml").read_text())
        assert doc["ha_node_id"] == f"broker-{n}" and doc["data_dir"] == "/var/lib/ccsq/broker"
        for rel in ("keys/broker.key", "keys/broker.curve.key", f"keys/broker-{n}.key", "admin.toml", "authorized_keys.toml"):
            assert (h / rel).is_file(), (host, rel)
        assert stat.S_IMODE((h / f"keys/broker-{n}.key").stat().st_mode) == 0o600
        assert not (h / f"keys/broker-{3 - n}.key").exists()  # only its own node key
        listed = {}
        for line in (h / "MANIFEST").read_text().splitlines():
            digest, rel = line.split(maxsplit=1)
            listed[rel.lstrip("*")] = digest
        files = {str(p.relative_to(h)) for p in h.rglob("*") if p.is_file() and p.name != "MANIFEST"}
        assert set(listed) == files
        for rel, digest in listed.items():
            assert hashlib.sha256((h / rel).read_bytes()).hexdigest() == digest
    peers = tomllib.loads((d / "hosts" / "broker-2" / "authorized_keys.toml").read_text())["peers"]
    assert {"broker-1", "broker-2", "worker-1", "admin"} <= set(peers)


def test_standby_on_loopback_ports_for_one_host(tmp_path: Path) -> None:
    """A pair on one host (the chaos run, the bench): ``HOST:PORT`` standbys, repl on port + 1."""
    written = init_swarm(tmp_path / "s", endpoint="tcp://127.0.0.1:7100", standbys=["127.0.0.1:7200", "127.0.0.1:7300"],
                         etcd="http://127.0.0.1:2379", swarm_id="s1")
    assert {"brokerd", "brokerd-2", "brokerd-3"} <= set(written)
    cfgs = [load(BrokerConfig, written[n]) for n in ("brokerd", "brokerd-2", "brokerd-3")]
    assert [c.endpoint for c in cfgs] == ["tcp://127.0.0.1:7100", "tcp://127.0.0.1:7200", "tcp://127.0.0.1:7300"]
    assert [c.ha_repl_endpoint for c in cfgs] == ["tcp://127.0.0.1:7101", "tcp://127.0.0.1:7201", "tcp://127.0.0.1:7301"]
    assert [c.bind for c in cfgs] == ["", "", ""] and not any(c.curve for c in cfgs)
    assert len({c.data_dir for c in cfgs}) == 3


@pytest.mark.parametrize("argv, flag", [
    (["--standby", "10.0.0.12"], "--standby needs --etcd"),
    (["--etcd", ETCD], "--etcd is given without --standby"),
    (["--standby", "10.0.0.12", "--standby", "10.0.0.12", "--etcd", ETCD], "--standby 10.0.0.12"),
    (["--standby", "10.0.0.11", "--etcd", ETCD], "--standby 10.0.0.11"),
    (["--standby", "10.0.0.11:5556", "--etcd", ETCD], "--standby 10.0.0.11:5556"),
    (["--standby", "10.0.0.12", "--etcd", "10.0.0.5:2379"], "--etcd: '10.0.0.5:2379' is not an etcd client URL"),
    (["--standby", "10.0.0.12", "--etcd", "http://e:2379,http://e:2379"], "--etcd: an etcd URL is given twice"),
    (["--standby", "bad host", "--etcd", ETCD], "--standby 'bad host'"),
    (["--standby", "10.0.0.12", "--etcd", ETCD, "--endpoint", "ipc:///tmp/b.sock"], "--standby needs a tcp:// --endpoint"),
    (["--etcd-ca", "/etc/ccsq/etcd-ca.pem"], "--etcd-ca: given without --etcd"),
    (["--standby", "10.0.0.12", "--etcd", ETCD, "--etcd-user", "ccsq"], "--etcd-user needs --etcd-password-file"),
    (["--standby", "10.0.0.12", "--etcd", ETCD, "--etcd-password-file", "pw"], "--etcd-password-file needs --etcd-user"),
])
def test_bad_pair_flags_exit_78_naming_the_flag_and_write_nothing(tmp_path: Path, capsys, argv: list[str], flag: str) -> None:
    d = tmp_path / "s"
    if "--endpoint" not in argv:
        argv = [*argv, "--endpoint", "tcp://10.0.0.11:5555"]
    assert main(["init", str(d), *argv]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert flag in err, err
    assert not d.exists()


def test_etcd_tls_and_login_flags_reach_every_broker(tmp_path: Path, capsys) -> None:
    """``--etcd-ca``, ``--etcd-user``, ``--etcd-password-file``: the keys ``ha_etcd_*`` in every
    brokerd config (paths as given: the files live on the broker hosts), which load."""
    d = tmp_path / "s"
    tls = "https://10.0.0.5:2379,https://10.0.0.6:2379"
    assert main(["init", str(d), "--endpoint", "tcp://10.0.0.11:5555", "--swarm-id", "s1", "--standby", "10.0.0.12",
                 "--etcd", tls, "--etcd-ca", "/etc/ccsq/etcd-ca.pem", "--etcd-user", "ccsq-broker",
                 "--etcd-password-file", "keys/etcd-password"]) == 0
    for name in ("brokerd.toml", "brokerd-2.toml"):
        cfg = load(BrokerConfig, d / name)
        assert (cfg.ha_etcd_endpoints, cfg.ha_etcd_ca_cert, cfg.ha_etcd_user) == (tls, "/etc/ccsq/etcd-ca.pem", "ccsq-broker")
        assert cfg.ha_etcd_password_file == str(d / "keys/etcd-password") and not cfg.ha_etcd_cert
    plain = tmp_path / "p"
    assert main(["init", str(plain), "--endpoint", "tcp://10.0.0.11:5555", "--standby", "10.0.0.12", "--etcd", ETCD]) == 0
    assert not any(k.startswith(("ha_etcd_ca", "ha_etcd_user")) for k in tomllib.loads((plain / "brokerd.toml").read_text()))


def test_init_help_names_the_pair_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["init", "--help"])
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "--standby HOST[:PORT]" in out and "--etcd URLS" in out
    assert "--etcd-ca FILE" in out and "--etcd-user NAME" in out and "--etcd-password-file FILE" in out
