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

Errors: :class:`~ccsq.common.wire.errors.ConfigError` (exit 78) for endpoints that
are malformed or of which none answers as etcd, naming the config key
(:data:`ENDPOINTS_KEY`) and the election key; :class:`EtcdUnavailable` (exit 75) for
a request that fails once running (the caller retries; ``may_confirm`` runs out).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
                 clock: Callable[[], float] = time.monotonic, fields: dict[str, str] | None = None) -> None:
        from etcd3gw.client import Etcd3Client  # optional dependency: extra "ha"

        if not 0 < margin_s < ttl_s:
            raise ConfigError(f"ha_lease_margin_s = {margin_s} must be above 0 and below ha_lease_ttl_s = {ttl_s}")
        self.swarm_id, self.endpoint = swarm_id, endpoint
        self.key, self.epoch_key, self.sync_key = primary_key(swarm_id), epoch_key(swarm_id), sync_key(swarm_id)
        #: more fields of the primary key's value (``repl_endpoint``, ``node``, ``ledger_id``)
        self.fields = dict(fields or {})
        self.created_revision = 0  # the etcd revision that created this holder's key (guards /sync writes)
        self.ttl_s, self.margin_s, self.clock = ttl_s, margin_s, clock
        self._clients = [Etcd3Client(host=h, port=p, protocol=s, timeout=request_timeout_s, api_path="/v3/")
                         for s, h, p in parse_endpoints(endpoints, swarm_id)]
        self._names = [f"{s}://{h}:{p}" for s, h, p in parse_endpoints(endpoints, swarm_id)]
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
        """At start: some endpoint answers as etcd (``/version``). Raises :class:`ConfigError`
        naming :data:`ENDPOINTS_KEY` and the election key when none does."""
        import requests

        why = []
        for i, client in enumerate(self._clients):
            try:
                resp = client.session.get(client.base_url + "/version", timeout=client.timeout)
                if resp.ok and "etcdserver" in resp.json():
                    return
                why.append(f"{self._names[i]} answered {resp.status_code} without an etcd version")
            except (requests.RequestException, ValueError) as exc:
                why.append(f"{self._names[i]}: {type(exc).__name__}")
        raise ConfigError(f"{ENDPOINTS_KEY}: no etcd answers for the election key {self.key} ("
                          + "; ".join(why) + "): fix the endpoints or start etcd")

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
