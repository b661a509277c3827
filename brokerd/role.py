"""The role loop of a replicated broker (``ha_etcd_endpoints`` set; docs/ha.md).

``ccsq-brokerd`` with HA on runs, until SIGTERM::

    election.check()                              # at start, in check_start (exit 78)
    loop:
        open the Ledger; campaign(min_epoch = the ledger's epoch)
        won  -> primary: replicate(epoch, sink=server.sink), adopt_epoch(epoch), bind the
                peer endpoint, ReplicationServer on ha_repl_endpoint, keep-alives, the actor
                with a ConfirmGate (brokerd/primary.py); publish /ccsq/<swarm>/primary
                (endpoint, repl_endpoint, node, ledger_id) and /sync; serve until SIGTERM
                (resign: the standby takes over at once), the lease is lost (stop confirming
                at once, stop the actor, close the ledger) or a planned failover
        lost -> close the Ledger; run_standby (brokerd/standby.py) until PROMOTE (campaign
                again) or STOPPED

A single broker (``ha_etcd_endpoints = ""``) never enters this module.

Start checks (:func:`check_start`; :class:`~ccsq.common.wire.errors.ConfigError`, exit
78, naming the file and the key): ``ha_node_key`` readable and private;
``ha_repl_endpoint`` an address of this host; no other broker on this host claims the
same ``ha_node_id`` for the same swarm (a lock file in ``/run/lock``, else the temp
directory, held while running); nothing on this host has ``ha_repl_endpoint`` bound
(probed); etcd answers at ``ha_etcd_endpoints`` and takes the TLS and login settings
(``ha_etcd_ca_cert``, ``ha_etcd_cert``/``ha_etcd_key``, ``ha_etcd_user``/
``ha_etcd_password_file``: each named when wrong); the optional
dependency (extra ``ha``) installed. Two configs sharing a ``data_dir`` are refused by
the ledger lock (exit 75), sharing an endpoint by the bind (exit 75).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import importlib
import inspect
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import structlog
import uvloop
import zmq

from ccsq.brokerd.actor import Broker
from ccsq.brokerd.ledger.store import Ledger, LedgerError, Policy
from ccsq.brokerd.primary import ConfirmGate, HaPrimary, alone_at_promotion
from ccsq.brokerd.transport import EndpointInUse, Transport
from ccsq.common.runtime.daemon import die
from ccsq.common.runtime.systemd import Notifier, stop_signals_and_watchdog
from ccsq.common.wire.config import BrokerConfig
from ccsq.common.wire.endpoints import bind_error, check_bind_local
from ccsq.common.wire.envelope import EnvelopeCodec
from ccsq.common.wire.errors import ConfigError, ExitCode, PortInUse, ledger_failure
from ccsq.common.wire.keys import AuthorizedKeys, load_private_key

log = structlog.get_logger("ccsq.brokerd")

#: Seconds between campaigns while etcd cannot be reached (the role loop retries).
ETCD_RETRY_S = 1.0


@dataclasses.dataclass
class HaStart:
    """What :func:`check_start` opened: the election, the node key, the node lock's fd."""

    election: Any
    node_key: Any
    lock_fd: int

    def close(self) -> None:
        os.close(self.lock_fd)


def _lock_dir() -> Path:
    run = Path("/run/lock")
    return run if os.access(run, os.W_OK) else Path(tempfile.gettempdir())


def node_lock(cfg: BrokerConfig) -> int:
    """An flock held while this broker runs, one per (swarm, node id) on this host; a second
    config claiming the same node id is a ConfigError naming ``ha_node_id``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{cfg.ha_namespace()}-{cfg.ha_node_id}")
    path = _lock_dir() / f"ccsq-brokerd-ha-{safe}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ConfigError(f"{cfg.config_path}: ha_node_id = {cfg.ha_node_id!r}: another ccsq-brokerd on this host claims "
                          f"the same node of swarm {cfg.ha_namespace()!r} ({holder or path}): give each broker of the pair "
                          "its own ha_node_id (and data_dir, endpoint, ha_repl_endpoint)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, config {cfg.config_path}\n".encode(), 0)
    return fd


def _probe_repl_endpoint(cfg: BrokerConfig) -> None:
    """Refuse (ConfigError naming ``ha_repl_endpoint``) when another process on this host
    has the replication endpoint bound now (e.g. the primary of a second config with the
    same ``ha_repl_endpoint``). A port 0 (ephemeral) is not probed."""
    ep = cfg.ha_repl_endpoint
    if not ep.startswith("tcp://") or ep.endswith(":0"):
        return
    sock: Any = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ep)
        sock.unbind(ep)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise ConfigError(f"{cfg.config_path}: ha_repl_endpoint = {ep!r} is in use by another process on this host "
                              "(another broker of the pair configured with the same endpoint?): give each broker its "
                              "own ha_repl_endpoint") from None
        # other errors (no such address) are the bind check's and the server's to name
    finally:
        sock.close(linger=0)


def check_start(cfg: BrokerConfig) -> HaStart:
    """The HA checks at start (module docstring). Raises ConfigError (exit 78)."""
    where = cfg.config_path
    try:
        node_key = load_private_key(Path(cfg.ha_node_key))
    except ConfigError as exc:
        raise ConfigError(f"{where}: ha_node_key: {exc}: the node key of ha_node_id = {cfg.ha_node_id!r} "
                          f"(`ccsq keygen {cfg.ha_node_id}` writes one; every broker lists it with role standby)") from None
    check_bind_local(cfg.ha_repl_endpoint, where=f"{where}: ha_repl_endpoint")
    _probe_repl_endpoint(cfg)
    try:
        from ccsq.brokerd.election import Election, EtcdSecurity
    except ImportError as exc:  # pragma: no cover - the extra is installed with the package's tests
        raise ConfigError(f"{where}: ha_etcd_endpoints is set but the etcd client is missing ({exc}): "
                          "pip install 'ccsq[ha]'") from None
    try:
        election = Election(cfg.ha_etcd_endpoints, cfg.ha_namespace(), cfg.endpoint, ttl_s=cfg.ha_lease_ttl_s,
                            margin_s=cfg.ha_lease_margin_s,
                            fields={"repl_endpoint": cfg.ha_repl_endpoint, "node": cfg.ha_node_id},
                            security=EtcdSecurity(cfg.ha_etcd_ca_cert, cfg.ha_etcd_cert, cfg.ha_etcd_key, cfg.ha_etcd_user,
                                                  cfg.ha_etcd_password_file))
        election.check()
    except ImportError as exc:
        raise ConfigError(f"{where}: ha_etcd_endpoints is set but the etcd client is missing ({exc}): "
                          "pip install 'ccsq[ha]'") from None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for module, owner in (("replserver", "the replication server"), ("standby", "the standby mode")):
        try:
            importlib.import_module(f"ccsq.brokerd.{module}")
        except ImportError as exc:
            raise ConfigError(f"{where}: ha_etcd_endpoints is set but this build of ccsq-brokerd lacks {owner} "
                              f"(ccsq.brokerd.{module}: {exc}): install a build with high availability") from None
    fd = node_lock(cfg)
    return HaStart(election, node_key, fd)


def _fail(code: ExitCode | BaseException, message: str | None = None) -> int:
    return die("ccsq-brokerd", code, message)


def serve(cfg: BrokerConfig, key: Any, authorized: AuthorizedKeys, ledger_dir: Path, data_dir: Path, notifier: Notifier,
          curve_secret: bytes | None, ha: HaStart) -> int:
    """Run the role loop until SIGTERM; returns the exit code (as ``_serve`` of a single broker)."""
    loop = RoleLoop(cfg, key, authorized, ledger_dir, data_dir, notifier, curve_secret, ha)
    try:
        return uvloop.run(loop.run())
    except _Exit as exc:
        return exc.code


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class RoleLoop:
    """Primary or standby, in turn (module docstring). One instance per process."""

    def __init__(self, cfg: BrokerConfig, key: Any, authorized: AuthorizedKeys, ledger_dir: Path, data_dir: Path,
                 notifier: Notifier, curve_secret: bytes | None, ha: HaStart) -> None:
        self.cfg, self.key, self.authorized = cfg, key, authorized
        self.ledger_dir, self.data_dir, self.notifier, self.curve_secret = ledger_dir, data_dir, notifier, curve_secret
        self.election = ha.election
        self.stop_event = asyncio.Event()
        self.broker: Broker | None = None
        self.stepped_down = ""  # why the current primary phase ends ("" = SIGTERM or still serving)
        self._ready = False

    def on_stop(self, _sig: str) -> None:
        self.notifier.stopping()
        self.stop_event.set()
        if self.broker is not None:
            self.broker.stop()

    async def run(self) -> int:
        async with stop_signals_and_watchdog(self.notifier, self.on_stop):
            while not self.stop_event.is_set():
                if self.stepped_down:  # deposed or handed over: a standby now, without campaigning first
                    self.stepped_down = ""
                elif await self._try_primary():
                    continue
                elif self.stop_event.is_set():
                    break
                outcome = await self._standby()
                if getattr(outcome, "name", str(outcome)).upper().endswith("STOPPED"):
                    break
        return int(ExitCode.OK)

    def may_campaign(self) -> str:
        """"" when this node may campaign now, else why not (then it is a standby). A node
        may take the key only if it holds every confirmed turn: the key is vacant, and the
        swarm never had a primary (no ``/sync``), or ``ha_mode = async``, or it is listed in
        ``/sync``, or it is the primary that wrote it (its own ledger has every turn it
        confirmed). A node whose ledger does not exist yet never takes over an existing swarm.
        Raises EtcdUnavailable."""
        if self.election.holder() is not None:
            return "another broker holds the primary key"
        sync = self.election.read_sync()
        if sync is None:
            return ""
        node = self.cfg.ha_node_id
        if not (self.ledger_dir / "data.mdb").exists():
            return "this node has no ledger yet: it seeds from the primary as a standby"
        if self.cfg.ha_mode == "async" or node in sync.members or sync.primary == node:
            return ""
        return (f"{node} is not in the sync set {list(sync.members)} of epoch {sync.epoch}: it may lack confirmed turns; "
                "a listed standby (or the last primary) must take over")

    async def _try_primary(self) -> bool:
        """Open the ledger and campaign; True when this broker served as primary (or etcd
        could not be reached: try again), False when another broker holds the key or this
        node may not take it (:meth:`may_campaign`)."""
        try:
            why = await asyncio.to_thread(self.may_campaign)
        except Exception as exc:  # noqa: BLE001 - EtcdUnavailable: retried
            log.warning("ha_campaign_failed", error=str(exc)[:300], retry_s=ETCD_RETRY_S)
            await self._wait_stop(ETCD_RETRY_S)
            return True
        if why:
            log.info("ha_not_campaigning", why=why)
            return False
        ledger = self._open_ledger()
        try:
            with ledger.read() as view:
                min_epoch = view.epoch()
            self.election.fields["ledger_id"] = ledger.ledger_id
            epoch = await self._campaign(min_epoch)
        except BaseException:
            ledger.close()
            raise
        if epoch is None or epoch == -1:
            ledger.close()
            if epoch is None:
                return False
            await self._wait_stop(ETCD_RETRY_S)
            return True
        await self._primary(ledger, epoch)  # closes the ledger
        return True

    async def _campaign(self, min_epoch: int) -> int | None:
        """One campaign: the epoch won, None (another broker holds the key), -1 (etcd unreachable: retry)."""
        try:
            return await asyncio.to_thread(self.election.campaign, min_epoch)
        except Exception as exc:  # noqa: BLE001 - EtcdUnavailable, a refused request: retried
            log.warning("ha_campaign_failed", error=str(exc)[:300], retry_s=ETCD_RETRY_S)
            return -1

    async def _wait_stop(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.stop_event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _open_ledger(self) -> Ledger:
        cfg = self.cfg
        try:
            return Ledger(self.ledger_dir, map_size_bytes=cfg.map_size_bytes, max_map_size_bytes=cfg.max_map_size_bytes,
                          policy=Policy.from_config(cfg), max_readers=cfg.max_readers)
        except LedgerError as exc:
            raise _Exit(_fail(exc)) from None

    async def _standby(self) -> Any:
        run_standby = importlib.import_module("ccsq.brokerd.standby").run_standby  # brokerd/standby.py (harepl)

        log.info("ha_standby", node=self.cfg.ha_node_id, swarm=self.cfg.ha_namespace())
        if not self._ready:
            self._ready = True
            self.notifier.ready("standby")
        return await run_standby(self.cfg, self.election, self.stop_event)

    # --- the primary phase ---
    async def _primary(self, ledger: Ledger, epoch: int) -> None:
        ReplicationServer = importlib.import_module("ccsq.brokerd.replserver").ReplicationServer  # brokerd/replserver.py (harepl)

        cfg, election = self.cfg, self.election
        aloop = asyncio.get_running_loop()
        self.stepped_down = ""
        transport = server = metrics = None
        try:
            codec = EnvelopeCodec(cfg.peer_id, self.key, self.authorized, max_frame_bytes=cfg.max_frame_bytes,
                                  max_clock_skew_s=cfg.max_clock_skew_s, require_hello=True, session_macs=True)
            try:
                transport = Transport(cfg.bind or cfg.endpoint, codec, sndhwm=cfg.sndhwm, max_frame_bytes=cfg.max_frame_bytes,
                                      curve_secret_key=self.curve_secret, curve_allow=self.authorized.curve_allowed)
            except EndpointInUse as exc:
                raise _Exit(_fail(exc)) from None
            except zmq.ZMQError as exc:
                err = bind_error(cfg.bind or cfg.endpoint, exc.errno, exc.strerror, where=f"{cfg.config_path}: endpoint")
                if err is None:
                    raise
                raise _Exit(_fail(ExitCode.CONFIG, f"config error: {err}")) from None
            gate = ConfirmGate(mode=cfg.ha_mode, sync_standbys=cfg.ha_sync_standbys, on_standby_loss=cfg.ha_on_standby_loss,
                               degrade_after_s=cfg.ha_degrade_after_s, election=election, server=None,  # type: ignore[arg-type]
                               last_seq=lambda: ledger.replication.position[1] if ledger.replication else 0,
                               wake=lambda: _call_soon(aloop, transport.wake),  # called in etcd threads
                               epoch=epoch, node=cfg.ha_node_id)
            sinks: list[Any] = []
            repl_log = ledger.replicate(epoch, sink=lambda ws: sinks[0](ws) if sinks else None)
            server = ReplicationServer(cfg, ledger, repl_log, epoch, sync_standbys=cfg.ha_sync_standbys,
                                       on_durable=transport.wake, on_members=gate.on_members)
            sinks.append(server.sink)
            gate.server = server
            ledger.adopt_epoch(epoch)
            try:
                previous = await asyncio.to_thread(election.read_sync)  # the last primary's set (this epoch writes next)
            except Exception as exc:  # noqa: BLE001 - EtcdUnavailable: wait ha_degrade_after_s as usual
                previous = None
                log.warning("ha_sync_set_read_failed", error=str(exc)[:300])
            alone = alone_at_promotion(previous, cfg.ha_node_id, mode=cfg.ha_mode, on_standby_loss=cfg.ha_on_standby_loss)
            if alone:  # a pair's new primary after an unplanned failover: no standby can be back within the wait
                log.warning("ha_degrade_at_promotion", why=alone, note="confirming alone once etcd's sync set is written "
                            "empty (ha_on_standby_loss = degrade), without waiting ha_degrade_after_s")
            # this epoch's sync set: nobody until a standby is in sync (async: always empty); degraded at once if alone
            gate.set_members([], initial=True, degrade=bool(alone))

            def lost(why: str) -> None:  # the keep-alive thread: stop confirming at once, then leave the role
                gate.lose(why)
                aloop.call_soon_threadsafe(self._step_down, f"lease lost: {why}")

            election.start_keepalive(on_lost=lost)
            ha = HaPrimary(epoch, gate, server, cfg.ha_repl_endpoint, step_down=self._step_down)
            try:
                broker = Broker(cfg, ledger, transport, ha=ha)
            except LedgerError as exc:
                raise _Exit(_fail(exc)) from None
            except lmdb.Error as exc:
                code, why = ledger_failure(exc, ledger.path / "data.mdb", "starting on the ledger")
                raise _Exit(_fail(code, why)) from None
            self.broker = broker
            server.on_durable = broker.release_durable  # an ack read between two turns releases at once
            gate.observe_held = broker.stats.held_histogram().observe  # ccsq_ha_held_seconds
            (self.data_dir / "endpoint").write_text(transport.endpoint + "\n")
            if cfg.metrics_port or cfg.metrics_listen:
                from ccsq.brokerd.metrics import broker_listen, start_metrics

                try:
                    metrics = start_metrics(broker, broker_listen(cfg.metrics_listen, cfg.metrics_port),
                                            where=f"{cfg.config_path}: metrics_listen")
                except ConfigError as exc:
                    raise _Exit(_fail(exc, f"config error: {exc}")) from None
                except PortInUse as exc:
                    raise _Exit(_fail(exc, f"transient: {exc}")) from None
            log.info("ha_primary", epoch=epoch, node=cfg.ha_node_id, swarm=cfg.ha_namespace(), mode=cfg.ha_mode,
                     repl_endpoint=cfg.ha_repl_endpoint, ledger_id=ledger.ledger_id)
            if self.stop_event.is_set():
                broker.stop()
            if not self._ready:
                self._ready = True
                self.notifier.ready(f"primary (epoch {epoch}) serving on {transport.endpoint}")
            aloop.add_signal_handler(signal.SIGHUP, broker.reload_keys)
            server_task = asyncio.create_task(server.run(), name="ccsq-replserver")
            try:
                await broker.run()
            except lmdb.Error as exc:
                code, why = ledger_failure(exc, ledger.path / "data.mdb", "a ledger write")
                log.error("ledger_write_failed", error=f"{type(exc).__name__}: {exc}", exit_code=int(code), advice=why)
                raise _Exit(_fail(code, why)) from None
            finally:
                gate.lose(self.stepped_down or "stopping")
                await _stop(server, server_task)
        finally:
            self.broker = None
            why = self.stepped_down or ("stopped" if self.stop_event.is_set() else "left")
            await asyncio.to_thread(election.resign)  # the key goes at once (a lost lease: already gone)
            log.warning("ha_primary_ended", why=why, epoch=epoch) if self.stepped_down else log.info("ha_primary_ended", why=why)
            if metrics is not None:
                metrics.shutdown()
            if transport is not None:
                transport.close(linger_ms=1000)
            ledger.close()

    def _step_down(self, why: str) -> None:
        """Leave the primary role (lease lost, planned failover): the actor stops after its turn."""
        if not self.stepped_down:
            self.stepped_down = why
            log.warning("ha_stepping_down", why=why)
        if self.broker is not None:
            self.broker.stop()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """Run ``fn`` in ``loop``'s thread (from any thread)."""
    loop.call_soon_threadsafe(fn)


async def _stop(server: Any, task: asyncio.Task) -> None:
    try:
        res = server.stop()
        if inspect.isawaitable(res):
            await res
        await asyncio.wait_for(asyncio.shield(task), 5.0)  # its BYEs to the standbys, its socket closed
    except asyncio.TimeoutError:
        log.warning("replserver_stop_slow", note="the replication server did not stop within 5 s: cancelled")
    except Exception:  # noqa: BLE001 - stopping: log and go on
        log.exception("replserver_stop_failed")
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)

