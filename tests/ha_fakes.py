"""Test support, ONLY until harepl's brokerd/replserver.py and brokerd/standby.py land
(HA-CONTRACT.md): minimal stand-ins with the contract's interface, installed by
tests/ha_brokerd.py when the real modules are missing (the real ones win once merged).

- :class:`FakeReplicationServer`: serves no standby. ``durable_seq()`` is the log's last
  seq in async mode and 0 in sync mode (no standby ever acknowledges); ``status()`` lists
  no standby. With ``CCSQ_TEST_STUB_STANDBY=NODE`` in the environment, a stub standby
  NODE is in sync from the start (``on_members([NODE])``) and acknowledges every turn at
  once (``durable_seq()`` = the log's last seq).
- :func:`run_standby`: waits until the primary key is vacant and this node may take over
  (a member of ``/sync``, or ``ha_mode = async``: PROMOTE) or the stop event (STOPPED);
  applies nothing.
"""

from __future__ import annotations

import asyncio
import enum
import os
from typing import Any

import structlog

log = structlog.get_logger("ccsq.brokerd")


class FakeReplicationServer:
    def __init__(self, cfg: Any, ledger: Any, log_: Any, epoch: int, *, sync_standbys: int, on_durable: Any,
                 on_members: Any) -> None:
        self.cfg, self.ledger, self.log, self.epoch = cfg, ledger, log_, epoch
        self.on_durable, self.on_members = on_durable, on_members
        self._stop: asyncio.Event | None = None
        self._stopped = False
        self.stub = os.environ.get("CCSQ_TEST_STUB_STANDBY", "")

    def sink(self, ws: Any) -> None:
        if self.cfg.ha_mode == "async" or self.stub:
            self.on_durable()

    def durable_seq(self) -> int:
        return self.log.position[1] if self.cfg.ha_mode == "async" or self.stub else 0

    async def run(self) -> None:
        self._stop = asyncio.Event()
        if self._stopped:  # stop() came first
            return
        log.info("fake_replserver_running", epoch=self.epoch, stub_standby=self.stub)
        if self.stub:
            await asyncio.to_thread(self.on_members, [self.stub])
        await self._stop.wait()

    def stop(self) -> None:  # (harepl's is a plain method)
        self._stopped = True
        if self._stop is not None:
            self._stop.set()

    def status(self) -> dict:
        last = self.log.position[1]
        standbys = [{"node": self.stub, "seq": last, "lag_turns": 0, "lag_bytes": 0, "lag_s": 0.0, "in_sync": True,
                     "copying": None}] if self.stub else []
        return {"standbys": standbys, "durable_seq": self.durable_seq(), "last_seq": last}


class StandbyOutcome(enum.Enum):
    PROMOTE = "promote"
    STOPPED = "stopped"


async def run_standby(cfg: Any, election: Any, stop_event: asyncio.Event) -> StandbyOutcome:
    log.info("fake_standby_running", node=cfg.ha_node_id)
    while not stop_event.is_set():
        try:
            holder = await asyncio.to_thread(election.holder)
            sync = await asyncio.to_thread(election.read_sync) if holder is None else None
        except Exception:  # noqa: BLE001 - etcd away: try again
            holder = sync = ...
        if holder is None and (cfg.ha_mode == "async" or sync is None or cfg.ha_node_id in sync.members):
            return StandbyOutcome.PROMOTE
        try:
            await asyncio.wait_for(stop_event.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    return StandbyOutcome.STOPPED
