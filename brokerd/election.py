"""Primary election and fencing on etcd (docs/ha.md): who is a swarm's primary broker.

etcd decides; nothing here is a consensus of its own. A broker that wants to be the
primary of swarm ``S`` holds an etcd lease (``ttl_s``, 3 s by default) and, bound to
it, the key ``/ccsq/S/primary`` = JSON ``{"epoch", "endpoint", "lease", ...}`` (plus the
``fields`` given: ``repl_endpoint``, ``node``, ``ledger_id``). It takes the
key with one etcd transaction: the key must be absent and the epoch counter
``/ccsq/S/epoch`` unchanged since it was read; the same transaction writes the counter
+1 (or above the ledger's epoch, ``min_epoch``), so every primary's epoch is higher
than every earlier one's, across failovers and restarts. It renews the lease with
keep-alives (:meth:`Election.renew`, or :meth:`Election.start_keepalive`: every
``ttl_s / 3``). When the key goes (the lease expired or was revoked) a standby's
:meth:`Election.wait_vacant` returns and it campaigns (:meth:`Election.campaign`).

Fencing: :meth:`Election.may_confirm` is true only while ``renewed_at + ttl_s -
margin_s`` is ahead of ``now_mono``; ``renewed_at`` is the broker's monotonic clock
read *before* the keep-alive that etcd answered was sent, so etcd's own expiry of
the lease is at least ``ttl_s`` after it. Clock assumption: the broker's
``time.monotonic`` and the etcd leader's clock advance at rates that differ by less
than ``margin_s / ttl_s`` (1 s in 3 s by default: 33 %; real clocks drift by
parts per million; a process paused mid-confirm is what the epoch in every fencing
token is for). etcd may keep a lease longer than its TTL (a leader change renews
them), never shorter.

Security (:class:`EtcdSecurity`): ``https://`` endpoints are verified against
``ha_etcd_ca_cert`` (else the system CA store); ``ha_etcd_cert`` + ``ha_etcd_key`` are
the client certificate (etcd ``--client-cert-auth``); ``ha_etcd_user`` +
``ha_etcd_password_file`` log in to etcd's v3 authentication (``POST
/v3/auth/authenticate`` -> a token sent as the ``Authorization`` header; when etcd
answers that the token is invalid, as after a simple token's 5 min idle expiry, the
session logs in again and repeats the request once).

Errors: :class:`~ccsq.common.wire.errors.ConfigError` (exit 78) for endpoints that
are malformed or of which none answers as etcd, naming the config key
(:data:`ENDPOINTS_KEY`) and the election key, and for a certificate, key or password
that is missing, unreadable, or that etcd refuses, naming its key;
:class:`EtcdUnavailable` (exit 75) for a request that fails once running (the caller
retries; ``may_confirm`` runs out).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import requests
import structlog

from ccsq.common.wire.errors import ConfigError, ExitCode, RetryableError

log = structlog.get_logger("ccsq.brokerd")

#: The config key that lists the etcd endpoints (named in every ConfigError).
ENDPOINTS_KEY = "ha_etcd_endpoints"
DEFAULT_TTL_S = 3
#: How long before the lease could expire at etcd the primary stops confirming.
DEFAULT_MARGIN_S = 1.0
#: Each request to etcd gives up after this long (a keep-alive that takes longer is lost).
DEFAULT_REQUEST_TIMEOUT_S = 1.0


class EtcdUnavailable(RetryableError):
    """An etcd request failed or timed out (exit 75); the message names the endpoint."""

    code = "ETCD_UNAVAILABLE"
    exit_code = ExitCode.TEMPFAIL


@dataclass(frozen=True)
class Holder:
    """Who holds the primary key: ``epoch``, the broker ``endpoint`` (its ROUTER address),
    the etcd ``lease`` id, and the key's ``mod_revision``; ``repl_endpoint`` (where it
    serves standbys), ``node`` (its node id) and ``ledger_id`` ("" when it wrote none)."""

    epoch: int
    endpoint: str
    lease: int
    revision: int
    repl_endpoint: str = ""
    node: str = ""
    ledger_id: str = ""


@dataclass(frozen=True)
class SyncSet:
    """``/ccsq/S/sync``: the standbys (node ids) the primary of ``epoch`` counts for sync
    confirms; only a member may campaign once the primary's key goes (async: empty, any may)."""

    epoch: int
    members: tuple[str, ...]
    primary: str = ""  # the node id of the primary that wrote it ("" from an older writer)
    handover: bool = False  # written by a planned failover (the writer hands over and rejoins as a standby)


def primary_key(swarm_id: str) -> str:
    return f"/ccsq/{swarm_id}/primary"


def epoch_key(swarm_id: str) -> str:
    return f"/ccsq/{swarm_id}/epoch"


def sync_key(swarm_id: str) -> str:
    return f"/ccsq/{swarm_id}/sync"


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def parse_endpoints(endpoints: Sequence[str] | str, swarm_id: str) -> list[tuple[str, str, int]]:
    """``["http://host:port", ...]`` (or one comma-separated string) -> ``[(scheme, host,
    port)]``. Raises :class:`ConfigError` naming :data:`ENDPOINTS_KEY` and the key."""
    if isinstance(endpoints, str):
        endpoints = [e for e in (x.strip() for x in endpoints.split(",")) if e]
    out = []
    for ep in endpoints:
        u = urllib.parse.urlsplit(ep)
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme not in ("http", "https") or not u.hostname or port is None or u.path not in ("", "/"):
            raise ConfigError(f"{ENDPOINTS_KEY}: {ep!r} is not an etcd client URL like http://10.0.0.5:2379 "
                              f"(for the election key {primary_key(swarm_id)}): fix the endpoint")
        out.append((u.scheme, u.hostname, port))
    if not out:
        raise ConfigError(f"{ENDPOINTS_KEY} is empty: list the etcd client URLs that hold "
                          f"{primary_key(swarm_id)} (e.g. http://10.0.0.5:2379)")
    return out


#: The config keys of etcd's TLS and authentication (named in every ConfigError about them).
CA_KEY, CERT_KEY, KEY_KEY = "ha_etcd_ca_cert", "ha_etcd_cert", "ha_etcd_key"
USER_KEY, PASSWORD_KEY = "ha_etcd_user", "ha_etcd_password_file"


class EtcdAuthFailed(EtcdUnavailable):
    """etcd refused the user name or password (``/v3/auth/authenticate``), or a request
    with this user's token (permission denied). A retryable error while running (the
    operator may fix etcd's users); :meth:`Election.check` turns it into a ConfigError."""

    code = "ETCD_AUTH_FAILED"

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key  # the config key to fix


def _readable(key: str, path: str, what: str, *, private: bool = False) -> None:
    """ConfigError naming ``key`` unless ``path`` is a readable file (and, ``private``, not
    readable by group or others)."""
    try:
        st = os.stat(path)
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{key} = {path!r}: cannot read the {what} ({exc.strerror or exc}): fix the path or the "
                          "file's owner (the broker's user must read it)") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{key} = {path!r} is not a file: give the path of the {what}")
    if private and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{key} = {path!r}: the {what} is readable by group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); run chmod 600 {path}")


@dataclass(frozen=True)
class EtcdSecurity:
    """How the broker proves itself to etcd and checks etcd (all optional; "" = unset):
    ``ca_cert``: PEM file of the CA that signed etcd's server certificates (https
    endpoints; "" = the system CA store); ``cert`` + ``key``: the client certificate and
    its private key (PEM; both or neither); ``user`` + ``password_file``: etcd v3
    authentication (the file holds the password, a trailing newline is dropped; mode 0600)."""

    ca_cert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password_file: str = ""

    def validate(self) -> None:
        """ConfigError naming the key of a missing, unreadable, malformed or half-given setting."""
        if bool(self.cert) != bool(self.key):
            given, missing = (CERT_KEY, KEY_KEY) if self.cert else (KEY_KEY, CERT_KEY)
            raise ConfigError(f"{given} is set but {missing} is not: a client certificate needs both (the PEM certificate "
                              f"in {CERT_KEY}, its private key in {KEY_KEY}); set both or neither")
        if bool(self.user) != bool(self.password_file):
            given, missing = (USER_KEY, PASSWORD_KEY) if self.user else (PASSWORD_KEY, USER_KEY)
            raise ConfigError(f"{given} is set but {missing} is not: etcd authentication needs the user name "
                              f"({USER_KEY}) and a file with its password ({PASSWORD_KEY}); set both or neither")
        if self.ca_cert:
            _readable(CA_KEY, self.ca_cert, "CA certificate")
            try:
                ssl.create_default_context(cafile=self.ca_cert)
            except (ssl.SSLError, ValueError) as exc:
                raise ConfigError(f"{CA_KEY} = {self.ca_cert!r} holds no PEM CA certificate ({exc}): give the CA that "
                                  "signed etcd's server certificates (etcd --trusted-ca-file's CA, PEM)") from None
        if self.cert:
            _readable(CERT_KEY, self.cert, "client certificate")
            _readable(KEY_KEY, self.key, "client certificate's private key", private=True)
            try:
                ssl.create_default_context().load_cert_chain(self.cert, self.key)
            except (ssl.SSLError, ValueError) as exc:
                raise ConfigError(f"{CERT_KEY} = {self.cert!r} / {KEY_KEY} = {self.key!r}: not a PEM certificate and "
                                  f"its matching private key ({exc}): fix the pair") from None
        if self.password_file:
            self.password()

    def password(self) -> str:
        """The password (ConfigError naming :data:`PASSWORD_KEY` when unreadable, open to others, or empty)."""
        _readable(PASSWORD_KEY, self.password_file, "etcd password file", private=True)
        with open(self.password_file, encoding="utf-8") as f:
            text = f.read().rstrip("\r\n")
        if not text:
            raise ConfigError(f"{PASSWORD_KEY} = {self.password_file!r} is empty: write the password of "
                              f"{USER_KEY} = {self.user!r} into it (one line, mode 0600)")
        return text


#: etcd's answers to a request whose token it does not take (log in again, then repeat it once).
_TOKEN_REFUSED = ("invalid auth token", "auth token is expired", "user name is empty", "revision of auth store is old")


class _EtcdSession(requests.Session):
    """A requests session to one etcd member with TLS settings and, with a user, a token:
    logs in before the first request and again when etcd refuses the token."""

    def __init__(self, base_url: str, sec: EtcdSecurity, timeout_s: float) -> None:
        super().__init__()
        self.base_url, self.sec, self.timeout_s = base_url, sec, timeout_s
        if sec.ca_cert:
            self.verify = sec.ca_cert
        if sec.cert:
            self.cert = (sec.cert, sec.key)
        self._token_lock = threading.Lock()
        self._token = ""

    def login(self) -> None:
        """``POST /v3/auth/authenticate``; raises :class:`EtcdAuthFailed` when etcd refuses the
        user or password, requests' errors when it cannot be reached."""
        resp = self.send_plain("POST", self.base_url + "/v3/auth/authenticate", timeout=self.timeout_s,
                               headers={"Authorization": None},  # etcd refuses a login that carries a stale token
                               json={"name": self.sec.user, "password": self.sec.password()})
        if resp.status_code != 200 and "authentication is not enabled" in resp.text:
            self._token = "off"  # etcd without auth: send no token (log in once it answers "user name is empty")
            log.warning("etcd_auth_not_enabled", endpoint=self.base_url, user=self.sec.user,
                        note=f"{USER_KEY} is set but etcd has authentication disabled: anyone reaching etcd may take the key")
            self.headers.pop("Authorization", None)
            return
        if resp.status_code != 200:
            key = PASSWORD_KEY if "password" in resp.text else USER_KEY
            raise EtcdAuthFailed(f"etcd at {self.base_url} refused {USER_KEY} = {self.sec.user!r} with the password in "
                                 f"{PASSWORD_KEY} = {self.sec.password_file!r} ({resp.status_code}: {resp.text[:200]}): fix "
                                 "the user name or the password (etcdctl user passwd)", key)
        self._token = str(resp.json()["token"])
        self.headers["Authorization"] = self._token

    def send_plain(self, method: str, url: str, *args: Any, **kwargs: Any) -> requests.Response:
        """One request without the login logic. ``verify`` is passed on each request: requests
        lets ``REQUESTS_CA_BUNDLE`` in the environment override a session's CA file."""
        if kwargs.get("verify") is None:
            kwargs["verify"] = self.verify
        return super().request(method, url, *args, **kwargs)

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        if not self.sec.user:
            return self.send_plain(method, url, *args, **kwargs)
        if not self._token:
            with self._token_lock:
                if not self._token:
                    self.login()
        token = self._token
        resp = self.send_plain(method, url, *args, **kwargs)
        if resp.status_code in (400, 401) and any(t in resp.text for t in _TOKEN_REFUSED):
            with self._token_lock:
                if self._token == token:
                    log.info("etcd_login_again", endpoint=self.base_url, why=resp.text[:200])
                    self.login()
            resp = self.send_plain(method, url, *args, **kwargs)
        if resp.status_code == 403:
            raise EtcdAuthFailed(f"etcd at {self.base_url}: {USER_KEY} = {self.sec.user!r} may not do this ({resp.text[:200]}): "
                                 "grant the user a role with readwrite on the prefix /ccsq/ (etcdctl role grant-permission "
                                 "--prefix ROLE readwrite /ccsq/)", USER_KEY)
        return resp


class Election:
    """One broker's side of the election for ``swarm_id``; ``endpoint``: what it writes
    as its address. ``endpoints``: etcd client URLs (tried in order; a failing one is
    passed over). ``clock``: monotonic seconds (``time.monotonic``; tests pass theirs).

    Thread use: :meth:`start_keepalive` runs :meth:`renew` in a thread; the other
    methods are for one thread (the broker's election thread). :meth:`may_confirm` may be
    read from any thread.
    """

    def __init__(self, endpoints: Sequence[str] | str, swarm_id: str, endpoint: str, *, ttl_s: int = DEFAULT_TTL_S,
                 margin_s: float = DEFAULT_MARGIN_S, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, fields: dict[str, str] | None = None,
                 security: EtcdSecurity | None = None) -> None:
        from etcd3gw.client import Etcd3Client  # optional dependency: extra "ha"

        if not 0 < margin_s < ttl_s:
            raise ConfigError(f"ha_lease_margin_s = {margin_s} must be above 0 and below ha_lease_ttl_s = {ttl_s}")
        self.swarm_id, self.endpoint = swarm_id, endpoint
        self.key, self.epoch_key, self.sync_key = primary_key(swarm_id), epoch_key(swarm_id), sync_key(swarm_id)
        #: more fields of the primary key's value (``repl_endpoint``, ``node``, ``ledger_id``)
        self.fields = dict(fields or {})
        self.created_revision = 0  # the etcd revision that created this holder's key (guards /sync writes)
        self.ttl_s, self.margin_s, self.clock = ttl_s, margin_s, clock
        self.security = security or EtcdSecurity()
        self.security.validate()
        self._names = [f"{s}://{h}:{p}" for s, h, p in parse_endpoints(endpoints, swarm_id)]
        self._sessions = [_EtcdSession(name, self.security, request_timeout_s) for name in self._names]
        self._clients = [Etcd3Client(host=h, port=p, protocol=s, timeout=request_timeout_s, api_path="/v3/", session=session)
                         for (s, h, p), session in zip(parse_endpoints(endpoints, swarm_id), self._sessions, strict=True)]
        self._lock = threading.Lock()
        self.lease_id = 0
        self.epoch = 0
        #: monotonic time before the last keep-alive (or grant) etcd answered; None: not holding
        self.renewed_at: float | None = None
        self._keepalive: threading.Thread | None = None
        self._stop = threading.Event()

    # --- talking to etcd ---
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from etcd3gw import exceptions as etcd_errors

        errors = []
        for i, client in enumerate(self._clients):
            try:
                return client.post(client.get_url(path), json=body)
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError, etcd_errors.InternalServerError) as exc:
                errors.append(f"{self._names[i]}: {str(exc)[:200]}")
        raise EtcdUnavailable(f"etcd for {self.key}: " + "; ".join(errors))

    def check(self) -> None:
        """At start: some endpoint answers as etcd (``/version``) and lets this broker read
        the election key (TLS, login, permission). Raises :class:`ConfigError` naming
        :data:`ENDPOINTS_KEY` and the election key when none answers, or naming the key to
        fix when etcd refuses the CA (:data:`CA_KEY`), the client certificate
        (:data:`CERT_KEY`), the user or password (:data:`USER_KEY`, :data:`PASSWORD_KEY`)."""
        from etcd3gw import exceptions as etcd_errors

        why = []
        for i, client in enumerate(self._clients):
            name = self._names[i]
            try:
                resp = self._sessions[i].send_plain("GET", client.base_url + "/version", timeout=client.timeout)
                if not (resp.ok and "etcdserver" in resp.json()):
                    why.append(f"{name} answered {resp.status_code} without an etcd version")
                    continue
                client.post(client.get_url("/kv/range"), json={"key": _b64(self.key)})
                return
            except requests.exceptions.SSLError as exc:
                raise self._tls_refused(name, exc) from None
            except etcd_errors.ConnectionFailedError as exc:
                if "SSL" in str(exc) or "certificate" in str(exc).lower():
                    raise self._tls_refused(name, exc) from None
                if name.startswith("https://") and self._answers_plain_http(name):
                    raise self._plain_http(name) from None
                why.append(f"{name}: {type(exc).__name__}")
            except EtcdAuthFailed as exc:
                raise ConfigError(f"{exc.key}: {exc} (for the election key {self.key})") from None
            except etcd_errors.Etcd3Exception as exc:
                detail = str(exc.detail_text or exc)
                if "user name is empty" in detail or "invalid auth token" in detail:
                    raise ConfigError(f"{USER_KEY}: etcd at {name} has authentication enabled and this broker logs in as "
                                      f"nobody (for the election key {self.key}): set {USER_KEY} and {PASSWORD_KEY} "
                                      "(docs/ha.md \"etcd with TLS and authentication\")") from None
                why.append(f"{name}: {detail[:200]}")
            except (requests.RequestException, etcd_errors.ConnectionTimeoutError, ValueError) as exc:
                # a TLS ClientHello to a plain-HTTP etcd may end as a reset connection rather than
                # an SSLError (the server's answer cut the handshake): the same scheme typo
                if name.startswith("https://") and self._answers_plain_http(name):
                    raise self._plain_http(name) from None
                why.append(f"{name}: {type(exc).__name__}")
        raise ConfigError(f"{ENDPOINTS_KEY}: no etcd answers for the election key {self.key} ("
                          + "; ".join(why) + "): fix the endpoints or start etcd")

    def _answers_plain_http(self, name: str) -> bool:
        """True when the https endpoint ``name`` answers as etcd over plain HTTP (a scheme typo)."""
        try:
            resp = requests.get("http://" + name.removeprefix("https://") + "/version", timeout=2.0)
            return resp.ok and "etcdserver" in resp.json()
        except (requests.RequestException, ValueError):
            return False

    def _plain_http(self, name: str) -> ConfigError:
        """The ConfigError for an https endpoint ``name`` whose etcd speaks plain HTTP."""
        return ConfigError(f"{ENDPOINTS_KEY}: {name} answers without TLS (for the election key {self.key}): write it "
                           "http://, or give etcd --cert-file/--key-file and https:// client URLs")

    def _tls_refused(self, name: str, exc: Exception) -> ConfigError:
        """The ConfigError for a TLS handshake with ``name`` that failed: this side did not
        verify etcd's certificate (:data:`CA_KEY`), or etcd refused ours (:data:`CERT_KEY`)."""
        text = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" not in text and self._answers_plain_http(name):
            return self._plain_http(name)
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
            ca = f"{CA_KEY} = {self.security.ca_cert!r}" if self.security.ca_cert else f"{CA_KEY} (unset: the system CA store)"
            return ConfigError(f"{CA_KEY}: etcd's certificate at {name} does not verify against {ca} "
                               f"({text[-200:]}; for the election key {self.key}): set {CA_KEY} to the PEM file of the CA "
                               "that signed etcd's server certificate (etcd --cert-file)")
        if self.security.cert:
            return ConfigError(f"{CERT_KEY}: etcd at {name} refused the TLS handshake with the client certificate "
                               f"{CERT_KEY} = {self.security.cert!r} ({text[-200:]}): give a certificate signed by etcd's "
                               "--trusted-ca-file")
        return ConfigError(f"{CERT_KEY}: etcd at {name} refused the TLS handshake ({text[-200:]}; for the election key "
                           f"{self.key}): etcd may require a client certificate (--client-cert-auth): set {CERT_KEY} "
                           f"and {KEY_KEY}")

    def holder(self) -> Holder | None:
        """The current primary (None when the key is absent)."""
        kvs = self._post("/kv/range", {"key": _b64(self.key)}).get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        d = json.loads(_unb64(kv["value"]))
        return Holder(int(d["epoch"]), str(d["endpoint"]), int(kv.get("lease", 0)), int(kv["mod_revision"]),
                      str(d.get("repl_endpoint", "")), str(d.get("node", "")), str(d.get("ledger_id", "")))

    # --- the primary's side ---
    def campaign(self, min_epoch: int = 0) -> int | None:
        """Try once to become primary: grant a lease and, in one transaction, create the
        key (if absent) with an epoch above the counter and above ``min_epoch`` (the
        ledger's). Returns the new epoch, or None when another broker holds the key (the
        lease is revoked). Raises :class:`EtcdUnavailable`."""
        t0 = self.clock()
        grant = self._post("/lease/grant", {"TTL": self.ttl_s, "ID": 0})
        lease_id = int(grant["ID"])
        rng = self._post("/kv/range", {"key": _b64(self.epoch_key)})
        kvs = rng.get("kvs") or []
        if kvs:
            current = int(_unb64(kvs[0]["value"]))
            guard = {"key": _b64(self.epoch_key), "target": "MOD", "result": "EQUAL",
                     "mod_revision": int(kvs[0]["mod_revision"])}
        else:
            current = 0
            guard = {"key": _b64(self.epoch_key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        epoch = max(current, min_epoch) + 1
        value = json.dumps({**self.fields, "epoch": epoch, "endpoint": self.endpoint, "lease": lease_id})
        txn = {
            "compare": [{"key": _b64(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}, guard],
            "success": [{"request_put": {"key": _b64(self.key), "value": _b64(value), "lease": lease_id}},
                        {"request_put": {"key": _b64(self.epoch_key), "value": _b64(str(epoch))}}],
            "failure": [],
        }
        out = self._post("/kv/txn", txn)
        if not out.get("succeeded"):
            try:
                self._post("/kv/lease/revoke", {"ID": lease_id})
            except EtcdUnavailable:
                pass  # it expires by itself
            return None
        with self._lock:
            self.lease_id, self.epoch, self.renewed_at = lease_id, epoch, t0
            self.created_revision = int(out["header"]["revision"])
        return epoch

    def write_sync(self, members: Sequence[str], *, handover: bool = False) -> bool:
        """As the primary: ``/ccsq/S/sync`` = ``{"epoch", "members", "node"}`` (and
        ``"handover": true`` from a planned failover) in one transaction that holds only while
        this broker's key is the one it created (a deposed primary writes nothing). True when
        written. Raises :class:`EtcdUnavailable`."""
        if not self.created_revision:
            return False
        doc: dict[str, Any] = {"epoch": self.epoch, "members": sorted(members), "node": self.fields.get("node", "")}
        if handover:
            doc["handover"] = True
        value = json.dumps(doc)
        txn = {"compare": [{"key": _b64(self.key), "target": "CREATE", "result": "EQUAL",
                            "create_revision": self.created_revision}],
               "success": [{"request_put": {"key": _b64(self.sync_key), "value": _b64(value)}}], "failure": []}
        return bool(self._post("/kv/txn", txn).get("succeeded"))

    def read_sync(self) -> SyncSet | None:
        """The sync set the last primary wrote (None: none written)."""
        kvs = self._post("/kv/range", {"key": _b64(self.sync_key)}).get("kvs") or []
        if not kvs:
            return None
        d = json.loads(_unb64(kvs[0]["value"]))
        return SyncSet(int(d.get("epoch", 0)), tuple(str(m) for m in d.get("members", [])), str(d.get("node", "")),
                       bool(d.get("handover", False)))

    def renew(self) -> bool:
        """One keep-alive. True: renewed (``renewed_at`` moves to the time before it was
        sent); False: the lease is gone at etcd (this broker is no longer primary).
        Raises :class:`EtcdUnavailable` (``renewed_at`` stays: :meth:`may_confirm` runs out)."""
        if not self.lease_id:
            return False
        t0 = self.clock()
        out = self._post("/lease/keepalive", {"ID": self.lease_id})
        ttl = int((out.get("result") or {}).get("TTL", -1))
        with self._lock:
            if ttl <= 0:
                self.lease_id, self.renewed_at = 0, None
                return False
            self.renewed_at = t0
        return True

    def may_confirm(self, now_mono: float) -> bool:
        """True while this broker holds the key and ``now_mono`` (seconds, the clock
        given at construction) is before ``renewed_at + ttl_s - margin_s``: before etcd
        can have expired the lease (see the module's clock assumption)."""
        at = self.renewed_at
        return at is not None and now_mono < at + self.ttl_s - self.margin_s

    def confirm_deadline(self) -> float | None:
        """The monotonic time at which :meth:`may_confirm` turns false (None: not holding)."""
        at = self.renewed_at
        return None if at is None else at + self.ttl_s - self.margin_s

    def start_keepalive(self, on_lost: Callable[[str], None] | None = None) -> None:
        """Renew every ``ttl_s / 3`` in a daemon thread until :meth:`resign` or etcd says
        the lease is gone (then ``on_lost("lease expired at etcd")`` and the thread ends).
        A failed request is retried at the next tick; once :meth:`may_confirm` has run
        out meanwhile, ``on_lost("cannot renew: ...")`` is called (once per outage). A
        later successful renewal means etcd still held the lease, so no other broker
        can have taken the key, and confirming may go on."""
        self._stop.clear()

        def loop() -> None:
            told = False
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    if not self.renew():
                        if on_lost:
                            on_lost("lease expired at etcd")
                        return
                    told = False
                except EtcdUnavailable as exc:
                    if not told and not self.may_confirm(self.clock()) and self.renewed_at is not None:
                        told = True
                        if on_lost is not None:
                            on_lost(f"cannot renew: {exc}")

        self._keepalive = threading.Thread(target=loop, name="ccsq-etcd-keepalive", daemon=True)
        self._keepalive.start()

    def resign(self) -> None:
        """Stop renewing and revoke the lease (the key goes at once)."""
        self._stop.set()
        if self._keepalive is not None:
            self._keepalive.join(self.ttl_s)
            self._keepalive = None
        lease_id, self.lease_id, self.renewed_at, self.created_revision = self.lease_id, 0, None, 0
        if lease_id:
            from etcd3gw import exceptions as etcd_errors

            try:
                self._post("/kv/lease/revoke", {"ID": lease_id})
            except EtcdUnavailable:
                pass  # it expires within ttl_s
            except etcd_errors.Etcd3Exception as exc:  # e.g. 404 "lease not found": it expired already
                log.info("etcd_lease_already_gone", key=self.key, lease=lease_id, detail=str(exc.detail_text)[:200])

    # --- the standby's side ---
    def wait_vacant(self, timeout_s: float) -> bool:
        """Block until the primary key is absent (True) or ``timeout_s`` passed (False).
        Watches the key from the revision it was read at, so a delete between the read
        and the watch is not missed."""
        from etcd3gw import exceptions as etcd_errors

        deadline = self.clock() + timeout_s
        rng = self._post("/kv/range", {"key": _b64(self.key)})
        if not rng.get("kvs"):
            return True
        start = int(rng["header"]["revision"]) + 1
        while True:
            left = deadline - self.clock()
            if left <= 0:
                return False
            event = None
            for i, client in enumerate(self._clients):  # the first endpoint that takes the watch
                try:
                    event = client.watch_once(self.key, timeout=left, start_revision=start)
                    break
                except etcd_errors.WatchTimedOut:
                    return False
                except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError, OSError) as exc:
                    if i == len(self._clients) - 1:
                        raise EtcdUnavailable(f"watching {self.key}: {exc}") from None
            assert event is not None
            if event.get("type") == "DELETE":
                return True
            start = int((event.get("kv") or {}).get("mod_revision", start - 1)) + 1
