"""Admin commands of the ``ccsq`` CLI against a real broker (tests/swarm.py).

``ccsq status``, ``items show|cancel``, ``dlq list|replay|purge``, ``drain`` and
``reconcile`` run in-process through :func:`ccsq.tools.cli.main` (the same
code path as the console script) and talk to a real ``ccsq-brokerd`` over the
signed protocol; the offline path reads the same ledger read-only.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ccsq.brokerd.admin import LEDGER_STATUS_KEYS
from ccsq.brokerd.gap_report import iter_blob_refs
from ccsq.tools import cli
from ccsq.common.storage.claimstore import open_store
from ccsq.common.wire.errors import ExitCode
from tests.swarm import Swarm, wait_until

pytestmark = pytest.mark.timeout(90)


def ccsq(capsys, *argv: str) -> tuple[int, dict | str]:
    """Run ``ccsq ARGV`` in-process; returns (exit code, parsed JSON or text)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr().out
    try:
        return rc, json.loads(out)
    except ValueError:
        return rc, out


def _admin_timeouts(swarm: Swarm, connect_s: float, hello_s: float) -> Path:
    path = swarm.configs["admin"]
    lines = [ln for ln in path.read_text().splitlines() if ln.split("=")[0].strip() not in ("connect_timeout_s", "hello_timeout_s")]
    path.write_text("\n".join(lines) + f"\nconnect_timeout_s = {connect_s}\nhello_timeout_s = {hello_s}\n")
    return path


def fast_admin(swarm: Swarm) -> Path:
    """admin.toml with a short connect timeout (the offline fallback is then quick)."""
    return _admin_timeouts(swarm, 0.5, 0.5)


def patient_admin(swarm: Swarm) -> Path:
    """admin.toml that waits long for the broker (commands that need it, on a loaded machine)."""
    return _admin_timeouts(swarm, 15.0, 10.0)


def ledger_part(doc: dict) -> dict:
    return {k: doc[k] for k in LEDGER_STATUS_KEYS}


def test_reconcile_dead_letters_missing_payloads_then_dlq_and_offline_equivalence(tmp_path: Path, capsys) -> None:
    """reconcile (dry run, then --apply through the broker), dlq list/replay/purge with
    their gap events, and the same answer for status/items/dlq list online and offline."""
    with Swarm(tmp_path, workers=0, producer={"inline_max_bytes": 0}) as swarm:
        admin = patient_admin(swarm)  # online answers while the broker runs; fast fallback once it is stopped
        brokerd = swarm.configs["brokerd"]
        swarm.start_broker()
        with swarm.client() as client:
            ids = [client.submit(f"document {i}".encode(), "echo").item_id for i in range(3)]
        store = open_store("file://blobs", tmp_path)
        payloads = {i: sha for i, _state, sha in iter_blob_refs(tmp_path / "broker-data")}
        for i in ids[:2]:
            store.delete(payloads[i])

        rc, dry = ccsq(capsys, "reconcile", "--config", brokerd, "--store", "file://blobs", "--json")
        assert rc == 0 and dry["dry_run"] and sorted(dry["not_dead_lettered"]) == sorted(ids[:2]) and dry["dead_lettered"] == []
        rc, applied = ccsq(capsys, "reconcile", "--config", brokerd, "--store", "file://blobs", "--apply", "--json")
        assert rc == 0 and sorted(applied["dead_lettered"]) == sorted(ids[:2]) and applied["not_dead_lettered"] == []
        rc, text = ccsq(capsys, "reconcile", "--config", brokerd, "--store", "file://blobs")
        assert rc == 0 and "0 payload(s) missing" in text  # dead items no longer need their payload

        rc, dlq = ccsq(capsys, "dlq", "list", "--config", admin, "--json")
        assert rc == 0 and dlq["source"] == "broker" and dlq["total"] == 2
        assert {r["id"]: r["error"] for r in dlq["items"]} == {i: "payload_missing" for i in ids[:2]}

        # online and offline (read-only snapshot while the broker runs) agree
        rc, online = ccsq(capsys, "status", "--config", admin, "--json")
        rc2, offline = ccsq(capsys, "status", "--config", admin, "--json", "--offline")
        assert rc == rc2 == 0 and online["source"] == "broker" and offline["source"] == "ledger (offline)"
        assert ledger_part(online) == ledger_part(offline)
        assert online["backlog"] == {"echo": {"dead": 2, "ready": 1}} and online["balanced"]
        for args in (("items", "show", ids[0]), ("dlq", "list")):
            _, on = ccsq(capsys, *args, "--config", admin, "--json")
            _, off = ccsq(capsys, *args, "--config", admin, "--json", "--offline")
            on.pop("source"), off.pop("source"), on.pop("lease_in_memory", None), off.pop("lease_in_memory", None)
            assert on == off

        rc, out = ccsq(capsys, "dlq", "replay", ids[0], "--config", admin, "--json")
        assert rc == 0 and out["replayed"] == [ids[0]]
        rc, out = ccsq(capsys, "dlq", "replay", ids[0], "--config", admin, "--json")
        assert rc == ExitCode.REFUSED and out["not_dead"] == [ids[0]]  # no longer dead
        _, shown = ccsq(capsys, "items", "show", ids[0], "--config", admin, "--json")
        assert shown["item"]["state"] == "ready" and shown["item"]["attempt"] == 0
        rc, out = ccsq(capsys, "dlq", "purge", "--all", "--config", admin, "--json")
        assert rc == 0 and out["purged"] == [ids[1]]
        assert ccsq(capsys, "items", "show", ids[1], "--config", admin, "--json")[0] == ExitCode.REFUSED
        _, dlq = ccsq(capsys, "dlq", "list", "--config", admin, "--json")
        assert dlq["items"] == [] and dlq["total"] == 0 and dlq["purged"] == 1  # purged ones are not listed

        rep = swarm.report()
        gaps = {w["id"]: w for w in rep["windows"]}
        assert gaps["G7"]["count"] == 2 and "payload_missing" in gaps["G7"]["recent"][0]["detail"]
        assert gaps["G10"]["count"] == 1 and gaps["G10"]["recent"][0]["item_id"] == ids[0]
        assert gaps["G11"]["count"] == 1 and gaps["G11"]["recent"][0]["item_id"] == ids[1]
        assert rep["balanced"] and rep["counters"]["dead_purged"] == 1 and rep["counters"]["replayed"] == 1
        _, online = ccsq(capsys, "status", "--config", admin, "--json")
        swarm.procs.stop("broker")
        fast_admin(swarm)

        # broker stopped: read-only commands fall back to the ledger by themselves (status exits 69:
        # a health check must not pass on a down broker) ...
        rc, fallback = ccsq(capsys, "status", "--config", admin, "--json")
        assert rc == ExitCode.UNAVAILABLE and fallback["source"] == "ledger (offline)"
        assert ledger_part(fallback) == ledger_part(online)
        # ... and commands that change state refuse (only the broker writes the ledger)
        assert ccsq(capsys, "dlq", "replay", "--all", "--config", admin)[0] == ExitCode.UNAVAILABLE
        assert ccsq(capsys, "drain", "worker-1", "--config", admin)[0] == ExitCode.UNAVAILABLE
        # an unknown item read offline is refused by the ledger query itself: the same AdminFailed, exit 65
        assert ccsq(capsys, "items", "show", "no-such-item", "--config", admin, "--offline")[0] == ExitCode.REFUSED


def test_drain_stops_dispatch_to_a_worker_until_undone(tmp_path: Path, capsys) -> None:
    """ccsq drain WORKER: no new DISPATCH to it (its credit stays unused); --undo resumes."""
    with Swarm(tmp_path, workers=1) as swarm:
        admin = patient_admin(swarm)  # every online call must reach the broker; offline ones say --offline
        swarm.start_broker()
        swarm.start_worker(1)
        rc, out = ccsq(capsys, "drain", "worker-1", "--wait", "--timeout-s", "10", "--config", admin, "--json")
        assert rc == 0 and out == {"worker": "worker-1", "draining": True, "connected": True, "leases": 0}
        with swarm.client() as client:
            (item_id,) = [client.submit(b"held back", "echo").item_id]
        # the submit woke a dispatch pass; two more admin turns later it is still ready
        for _ in range(2):
            _, st = ccsq(capsys, "status", "--config", admin, "--json")
        w1 = next(x for x in st["peers"] if x["peer_id"] == "worker-1")
        assert w1["draining"] and w1["credit"] > 0 and w1["leases"] == 0 and st["draining"] == ["worker-1"]
        assert st["backlog"]["echo"] == {"ready": 1}
        assert "draining" in ccsq(capsys, "status", "--config", admin)[1]
        # a typo is refused with the known workers named, and drains nothing
        capsys.readouterr()
        rc = cli.main(["drain", "worker-9", "--config", str(admin), "--json"])
        assert rc == ExitCode.REFUSED and "unknown worker 'worker-9'" in capsys.readouterr().err
        # the drain is in the ledger: a restarted broker keeps it (offline status shows it too)
        swarm.procs.stop("broker")
        assert ccsq(capsys, "status", "--config", admin, "--json", "--offline")[1]["draining"] == ["worker-1"]
        assert "draining: worker-1" in ccsq(capsys, "status", "--config", admin, "--offline")[1]
        swarm.start_broker()
        wait_until(lambda: any(x["peer_id"] == "worker-1" for x in ccsq(capsys, "status", "--config", admin, "--json")[1]["peers"]),
                   20, "worker-1 reconnected to the restarted broker")
        for _ in range(2):
            _, st = ccsq(capsys, "status", "--config", admin, "--json")
        assert st["draining"] == ["worker-1"] and st["backlog"]["echo"] == {"ready": 1}
        rc, out = ccsq(capsys, "drain", "worker-1", "--undo", "--config", admin, "--json")
        assert rc == 0 and not out["draining"]
        wait_until(
            lambda: ccsq(capsys, "items", "show", item_id, "--config", admin, "--json")[1]["item"]["attempt"] >= 1,
            20, "the item is dispatched to the undrained worker",
        )


def test_reconcile_refuses_a_wrong_store_and_defaults_to_the_producers(tmp_path: Path, capsys) -> None:
    """Tester #2: a --store root that does not exist is refused (78, nothing created, nothing
    dead-lettered); --apply against a store holding none of the needed payloads is refused
    unless --force; without --store the claim_store of producer.toml next to brokerd.toml is used."""
    with Swarm(tmp_path, workers=0, producer={"inline_max_bytes": 0}) as swarm:
        fast_admin(swarm)
        brokerd = swarm.configs["brokerd"]
        swarm.start_broker()
        with swarm.client() as client:
            item_id = client.submit(b"a document", "echo").item_id
        typo = tmp_path / "does-not-exist"
        rc, _ = ccsq(capsys, "reconcile", "--config", brokerd, "--store", f"file://{typo}", "--apply")
        assert rc == ExitCode.CONFIG and not typo.exists()
        empty = tmp_path / "empty-store"
        empty.mkdir()
        capsys.readouterr()
        rc = cli.main(["reconcile", "--config", str(brokerd), "--store", f"file://{empty}", "--apply"])
        assert rc == ExitCode.CONFIG and "wrong --store?" in capsys.readouterr().err
        rc, out = ccsq(capsys, "reconcile", "--config", brokerd, "--apply", "--json")  # producer.toml's store
        assert rc == 0 and out["missing"] == [] and out["stored"] == 1
        _, shown = ccsq(capsys, "items", "show", item_id, "--config", swarm.configs["admin"], "--json")
        assert shown["item"]["state"] == "ready"
        rc, out = ccsq(capsys, "reconcile", "--config", brokerd, "--store", f"file://{empty}", "--apply", "--force", "--json")
        assert rc == 0 and out["dead_lettered"] == [item_id]


class Terminal(io.StringIO):
    """A stdin that says it is a terminal (the question of ``items cancel --kind`` is asked)."""

    def isatty(self) -> bool:
        return True


def test_items_cancel_takes_a_stuck_ready_item_and_leaves_a_leased_one(tmp_path: Path, capsys, monkeypatch) -> None:
    """Issue 27: an item of a typo'd kind waits in ready forever; ``ccsq items cancel ID``
    makes it dead (reason cancelled, G7) through the broker, a leased item is left as it is
    and reported with its state, an unknown id is named; ``--kind`` cancels every ready item
    of a kind only when confirmed (--yes; without a terminal it refuses and changes
    nothing). The books stay balanced."""
    with Swarm(tmp_path, workers=1, handler="sleep") as swarm:
        admin = patient_admin(swarm)
        swarm.start_broker()
        swarm.start_worker(1)
        with swarm.client() as client:
            running = client.submit(b"long job", "sleep", params={"seconds": 30}).item_id
            typos = [client.submit(f"typo {i}".encode(), "slep").item_id for i in range(3)]
        wait_until(lambda: ccsq(capsys, "items", "show", running, "--config", admin, "--json")[1]["item"]["state"] == "leased",
                   30, "the sleep item is leased")

        rc, out = ccsq(capsys, "items", "cancel", typos[0], running, "no-such-item", "--config", admin, "--json")
        assert rc == ExitCode.REFUSED
        assert out == {"cancelled": [typos[0]], "not_ready": {running: "leased"}, "unknown": ["no-such-item"]}
        rc, text = ccsq(capsys, "items", "cancel", typos[0], running, "--config", admin)
        assert rc == ExitCode.REFUSED and f"{typos[0]}  not ready: state dead" in text and f"{running}  not ready: state leased" in text
        _, shown = ccsq(capsys, "items", "show", typos[0], "--config", admin, "--json")
        assert shown["item"]["state"] == "dead" and shown["item"]["error"] == "cancelled"
        _, shown = ccsq(capsys, "items", "show", running, "--config", admin, "--json")
        assert shown["item"]["state"] == "leased" and shown["lease_in_memory"]["worker"] == "worker-1"

        rc, text = ccsq(capsys, "status", "--config", admin)
        text = " ".join(text.split())  # the screen wraps at its width
        assert "no connected worker serves kind 'slep'" in text and "kinds served: 'sleep'" in text, text
        assert "ccsq items cancel --kind slep" in text

        # by kind: not confirmed (no terminal) -> refused, nothing cancelled
        monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # not a terminal: no question is asked
        capsys.readouterr()
        rc = cli.main(["items", "cancel", "--kind", "slep", "--config", str(admin)])
        err = capsys.readouterr().err
        assert rc == ExitCode.USAGE and "would cancel 2 ready item(s) of kind 'slep'" in err and "--yes" in err
        _, st = ccsq(capsys, "status", "--config", admin, "--json")
        assert st["backlog"]["slep"] == {"dead": 1, "ready": 2}
        monkeypatch.setattr("sys.stdin", Terminal("n\n"))  # asked, and answered no
        rc = cli.main(["items", "cancel", "--kind", "slep", "--config", str(admin)])
        assert rc == ExitCode.USAGE and "cancel 2 ready item(s) of kind 'slep'" in capsys.readouterr().out
        rc, out = ccsq(capsys, "items", "cancel", "--kind", "slep", "--yes", "--config", admin, "--json")
        assert rc == 0 and sorted(out["cancelled"]) == sorted(typos[1:])
        with swarm.client() as client:
            typos.append(client.submit(b"typo again", "slep").item_id)
        monkeypatch.setattr("sys.stdin", Terminal("y\n"))  # asked, and answered yes
        rc, text = ccsq(capsys, "items", "cancel", "--kind", "slep", "--config", admin)
        assert rc == 0 and "cancelled 1 ready item(s) of kind 'slep'" in text and "dlq replay" in text
        capsys.readouterr()
        rc = cli.main(["items", "cancel", "--kind", "slep", "--yes", "--config", str(admin)])
        assert rc == ExitCode.REFUSED and "no ready item of kind 'slep'" in capsys.readouterr().err

        _, st = ccsq(capsys, "status", "--config", admin, "--json")
        assert st["backlog"]["slep"] == {"dead": 4} and st["backlog"]["sleep"] == {"leased": 1} and st["balanced"]
        _, dlq = ccsq(capsys, "dlq", "list", "--config", admin, "--json")
        assert {r["id"]: r["error"] for r in dlq["items"]} == {i: "cancelled" for i in typos}
        rep = swarm.report()
        g7 = next(w for w in rep["windows"] if w["id"] == "G7")
        assert rep["balanced"] and g7["count"] == 4 and "cancelled" in g7["recent"][0]["detail"]
