"""etcd with TLS and authentication (brokerd/election.py ``EtcdSecurity``, docs/ha.md "etcd
with TLS and authentication"): a real one-member etcd 3.4 in tmp_path, its certificates made
here with ``cryptography``, users added and auth enabled through etcdctl (v3 API). The right
CA, client certificate and password work (the election, a broker that becomes primary, a
login again after etcd let the token expire); a wrong one is a ConfigError (exit 78 for the
broker) naming the key to fix. Every test here fails on the code before these keys existed:
it refused the keys ``ha_etcd_*`` as unknown and had no ``security`` argument."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
import tomli_w
import tomllib

from ccsq.brokerd.election import CA_KEY, CERT_KEY, PASSWORD_KEY, USER_KEY, Election, EtcdSecurity
from ccsq.common.wire.errors import ConfigError
from tests.test_election import free_port
from tests.test_ha_primary import _refused, brokers, ha_swarm, observer, start  # noqa: F401 - brokers: a fixture

pytest.importorskip("etcd3gw")
ETCD, ETCDCTL = shutil.which("etcd"), shutil.which("etcdctl")
TTL_S, MARGIN_S = 2, 0.5


def _need_etcd() -> None:
    if ETCD is None or ETCDCTL is None:
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed (.ci/run installs Debian's etcd-server and etcd-client)")
        pytest.skip("etcd is not installed (apt-get install etcd-server etcd-client)")


class Pki:
    """A CA and certificates it signs (PEM files under ``root``)."""

    def __init__(self, root: Path, name: str) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.root, self.name = root, name
        root.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_path = root / f"{name}-ca.pem"
        self.ca_path.write_bytes(self._pem(self.cert))

    @staticmethod
    def _pem(obj) -> bytes:
        from cryptography.hazmat.primitives import serialization

        if hasattr(obj, "public_bytes"):
            return obj.public_bytes(serialization.Encoding.PEM)
        return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    def issue(self, cn: str, *, server: bool) -> tuple[Path, Path]:
        """(certificate, key) for ``cn`` (a server certificate names 127.0.0.1 and localhost)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                             x509.DNSName("localhost")]), critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        cert_path, key_path = self.root / f"{cn}.pem", self.root / f"{cn}.key"
        cert_path.write_bytes(self._pem(cert))
        key_path.write_bytes(self._pem(key))
        key_path.chmod(0o600)
        return cert_path, key_path


class SecuredEtcd:
    """A one-member etcd in ``root``; ``tls``: https with a server certificate of ``pki``
    (``client_certs``: --client-cert-auth against the same CA); ``users``: {name: password}
    added (root first) and auth enabled."""

    def __init__(self, root: Path, *, pki: Pki | None = None, client_certs: bool = False, users: dict[str, str] | None = None,
                 token_ttl_s: int = 300) -> None:
        _need_etcd()
        scheme = "https" if pki else "http"
        self.url, peer = f"{scheme}://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        args = [ETCD, "--name", "t", "--data-dir", str(root / "etcd"), "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"t={peer}", "--initial-cluster-state", "new", "--logger", "zap", "--log-outputs", "stderr",
                "--auth-token", "simple", "--auth-token-ttl", str(token_ttl_s)]
        self.ctl = [ETCDCTL, "--endpoints", self.url, "--command-timeout", "5s", "--dial-timeout", "5s"]
        self.verify: str | bool = True
        self.cert: tuple[str, str] | None = None
        if pki:
            server_cert, server_key = pki.issue("etcd-server", server=True)
            args += ["--cert-file", str(server_cert), "--key-file", str(server_key)]
            self.ctl += ["--cacert", str(pki.ca_path)]
            self.verify = str(pki.ca_path)
            if client_certs:
                args += ["--client-cert-auth", "--trusted-ca-file", str(pki.ca_path)]
                c, k = pki.issue("etcdctl", server=False)
                self.ctl += ["--cert", str(c), "--key", str(k)]
                self.cert = (str(c), str(k))
        root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "etcd.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(self.url + "/health", timeout=1, verify=self.verify, cert=self.cert).ok:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not become healthy: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        for name, password in (users or {}).items():
            self.etcdctl("user", "add", f"{name}:{password}")
            if name == "root":
                continue
            self.etcdctl("role", "add", name)
            self.etcdctl("role", "grant-permission", "--prefix=true", name, "readwrite", "/ccsq/")
            self.etcdctl("user", "grant-role", name, name)
        if users:
            self.etcdctl("auth", "enable")
            self.ctl += ["--user", f"root:{users['root']}"]

    def etcdctl(self, *args: str) -> str:
        out = subprocess.run(self.ctl + list(args), env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def secured(tmp_path):
    made: list[SecuredEtcd] = []

    def make(**kw) -> SecuredEtcd:
        e = SecuredEtcd(tmp_path / f"etcd-{len(made)}", **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


def password_file(root: Path, password: str, mode: int = 0o600) -> Path:
    p = root / f"etcd-password-{password}"
    p.write_text(password + "\n")
    p.chmod(mode)
    return p


def election(url: str, me: str = "tcp://a:5555", ttl_s: int = TTL_S, **security) -> Election:
    return Election([url], "s1", me, ttl_s=ttl_s, margin_s=MARGIN_S, request_timeout_s=5.0,
                    security=EtcdSecurity(**security))


def _standby_sees_the_key_go(holder: Election, standby: Election) -> None:
    """The standby's watch (a streamed request on the same session) sees the holder resign."""
    assert standby.campaign() is None and not standby.wait_vacant(0.3)
    timer = threading.Timer(0.5, holder.resign)
    timer.start()
    try:
        assert standby.wait_vacant(10)
    finally:
        timer.join()
    assert standby.campaign() == 2
    standby.resign()


def test_etcd_auth_right_password_elects_a_wrong_one_names_the_key(tmp_path, secured):
    etcd = secured(users={"root": "rootpw", "ccsq": "s3cret"})
    good = election(etcd.url, user="ccsq", password_file=str(password_file(tmp_path, "s3cret")))
    good.check()
    assert good.campaign() == 1 and good.renew() and good.holder().endpoint == "tcp://a:5555"
    _standby_sees_the_key_go(good, election(etcd.url, "tcp://b:5555", user="ccsq",
                                            password_file=str(password_file(tmp_path, "s3cret"))))
    bad = election(etcd.url, user="ccsq", password_file=str(password_file(tmp_path, "wrong")))
    with pytest.raises(ConfigError, match=f"{PASSWORD_KEY}: etcd at {etcd.url} refused {USER_KEY} = 'ccsq'"):
        bad.check()
    nobody = election(etcd.url)
    with pytest.raises(ConfigError, match=f"{USER_KEY}: etcd at {etcd.url} has authentication enabled"):
        nobody.check()
    etcd.etcdctl("user", "add", "other:pw")  # no role: may not touch /ccsq/
    stranger = election(etcd.url, user="other", password_file=str(password_file(tmp_path, "pw")))
    with pytest.raises(ConfigError, match=f"{USER_KEY}: etcd at {etcd.url}: {USER_KEY} = 'other' may not"):
        stranger.check()


def test_an_expired_token_is_renewed_by_logging_in_again(tmp_path, secured):
    """etcd's simple tokens expire after ttl idle seconds (300 by default; 1 here): the next
    request is refused 'invalid auth token', the session logs in again and repeats it."""
    etcd = secured(users={"root": "rootpw", "ccsq": "s3cret"}, token_ttl_s=1)
    e = election(etcd.url, ttl_s=30, user="ccsq", password_file=str(password_file(tmp_path, "s3cret")))  # outlives the wait
    assert e.campaign() == 1
    session = e._clients[0].session
    old = session.headers["Authorization"]
    # Any request with the token restarts its idle time, so there is nothing to poll: wait
    # out the TTL (1 s) and etcd's sweep of expired tokens (every second).
    time.sleep(3)
    r = requests.post(etcd.url + "/v3/kv/range", json={"key": "L2Njc3Ev"}, headers={"Authorization": old}, timeout=5)
    assert "invalid auth token" in r.text, r.text
    assert e.renew() and e.holder().epoch == 1  # logged in again: a new token
    assert session.headers["Authorization"] != old
    e.resign()


def test_etcd_tls_right_ca_elects_a_wrong_or_no_ca_names_the_key(tmp_path, secured):
    pki, other = Pki(tmp_path / "pki", "etcd"), Pki(tmp_path / "other", "other")
    etcd = secured(pki=pki)
    assert etcd.url.startswith("https://")
    good = election(etcd.url, ca_cert=str(pki.ca_path))
    good.check()
    assert good.campaign() == 1 and good.renew()
    _standby_sees_the_key_go(good, election(etcd.url, "tcp://b:5555", ca_cert=str(pki.ca_path)))
    with pytest.raises(ConfigError, match=f"{CA_KEY}: etcd's certificate at {etcd.url} does not verify against {CA_KEY} = "):
        election(etcd.url, ca_cert=str(other.ca_path)).check()
    with pytest.raises(ConfigError, match=rf"{CA_KEY}: .* does not verify against {CA_KEY} \(unset: the system CA store\)"):
        election(etcd.url).check()


def test_etcd_client_certificate_required(tmp_path, secured):
    pki = Pki(tmp_path / "pki", "etcd")
    etcd = secured(pki=pki, client_certs=True)
    cert, key = pki.issue("broker-1", server=False)
    good = election(etcd.url, ca_cert=str(pki.ca_path), cert=str(cert), key=str(key))
    good.check()
    assert good.campaign() == 1
    good.resign()
    with pytest.raises(ConfigError, match=f"{CERT_KEY}: etcd at {etcd.url} refused the TLS handshake"):
        election(etcd.url, ca_cert=str(pki.ca_path)).check()


def test_security_files_are_checked_before_etcd_is_asked(tmp_path):
    """No etcd needed: a missing, malformed, open or half-given file is refused naming its key."""
    url = f"https://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=f"{CA_KEY} = .*cannot read the CA certificate"):
        election(url, ca_cert=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=f"{CA_KEY} = .*holds no PEM CA certificate"):
        election(url, ca_cert=str(tmp_path / "junk.pem"))
    with pytest.raises(ConfigError, match=f"{CERT_KEY} is set but ha_etcd_key is not"):
        election(url, cert=str(tmp_path / "junk.pem"))
    with pytest.raises(ConfigError, match=f"{USER_KEY} is set but {PASSWORD_KEY} is not"):
        election(url, user="ccsq")
    with pytest.raises(ConfigError, match=f"{PASSWORD_KEY} = .*readable by group or others .*chmod 600"):
        election(url, user="ccsq", password_file=str(password_file(tmp_path, "pw", 0o644)))
    with pytest.raises(ConfigError, match=f"{PASSWORD_KEY} = .*cannot read the etcd password file"):
        election(url, user="ccsq", password_file=str(tmp_path / "nope"))
    pki = Pki(tmp_path / "pki", "etcd")
    cert, _ = pki.issue("c1", server=False)
    _, key2 = pki.issue("c2", server=False)
    with pytest.raises(ConfigError, match=f"{CERT_KEY} = .*not a PEM certificate and its matching private key"):
        election(url, cert=str(cert), key=str(key2))


def _with(cfg: Path, **keys) -> Path:
    conf = tomllib.loads(cfg.read_text())
    conf.update(keys)
    cfg.write_text(tomli_w.dumps(conf))
    return cfg


def test_broker_with_etcd_credentials_becomes_primary_and_a_wrong_password_exits_78(tmp_path, secured, brokers):  # noqa: F811
    etcd = secured(users={"root": "rootpw", "ccsq": "s3cret"})
    root = tmp_path / "swarm"
    cfg = _with(ha_swarm(root, etcd.url, ha_mode="async"), ha_etcd_user="ccsq",
                ha_etcd_password_file=str(password_file(tmp_path, "s3cret")))
    b = start(brokers, cfg)
    assert b.events("ha_primary")
    conf = tomllib.loads(cfg.read_text())
    seen = Election([etcd.url], conf["ha_swarm_id"], "observer", ttl_s=TTL_S, margin_s=MARGIN_S, request_timeout_s=5.0,
                    security=EtcdSecurity(user="root", password_file=str(password_file(tmp_path, "rootpw"))))
    assert seen.holder().node == "broker-1"
    assert b.stop() == 0
    _with(cfg, ha_etcd_password_file=str(password_file(tmp_path, "wrong")))
    err = _refused(brokers, cfg)
    assert str(cfg) in err and PASSWORD_KEY in err and "refused ha_etcd_user = 'ccsq'" in err, err


def test_broker_with_a_wrong_etcd_ca_exits_78_naming_the_key(tmp_path, secured, brokers):  # noqa: F811
    pki, other = Pki(tmp_path / "pki", "etcd"), Pki(tmp_path / "other", "other")
    etcd = secured(pki=pki)
    cfg = _with(ha_swarm(tmp_path / "swarm", etcd.url, ha_mode="async"), ha_etcd_ca_cert=str(other.ca_path))
    err = _refused(brokers, cfg)
    assert str(cfg) in err and f"{CA_KEY}: etcd's certificate at {etcd.url} does not verify" in err, err
    _with(cfg, ha_etcd_ca_cert=str(tmp_path / "missing.pem"))
    err = _refused(brokers, cfg)
    assert str(cfg) in err and f"{CA_KEY} = " in err and "cannot read the CA certificate" in err, err
    _with(cfg, ha_etcd_ca_cert=str(pki.ca_path))
    b = start(brokers, cfg)
    assert b.events("ha_primary")
    assert b.stop() == 0


def test_a_user_against_an_etcd_without_auth_still_elects(tmp_path, secured):
    """etcd answers the login "authentication is not enabled" (auth being set up, say): the
    broker goes on without a token (and warns) rather than refusing to start."""
    etcd = secured()
    e = election(etcd.url, user="ccsq", password_file=str(password_file(tmp_path, "s3cret")))
    e.check()
    assert e.campaign() == 1 and e.renew() and "Authorization" not in e._clients[0].session.headers
    e.resign()
    https = etcd.url.replace("http://", "https://")
    with pytest.raises(ConfigError, match=f"ha_etcd_endpoints: {https} answers without TLS"):
        election(https).check()
