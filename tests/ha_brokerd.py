"""``python tests/ha_brokerd.py --config FILE``: ccsq-brokerd with tests/ha_fakes.py standing
in for brokerd/replserver.py and brokerd/standby.py while those are missing (the real
modules are used when they import)."""

import sys
import types

import ha_fakes

try:
    import ccsq.brokerd.replserver  # noqa: F401
except ImportError:
    mod = types.ModuleType("ccsq.brokerd.replserver")
    mod.ReplicationServer = ha_fakes.FakeReplicationServer
    sys.modules["ccsq.brokerd.replserver"] = mod
try:
    import ccsq.brokerd.standby  # noqa: F401
except ImportError:
    mod = types.ModuleType("ccsq.brokerd.standby")
    mod.run_standby = ha_fakes.run_standby
    mod.StandbyOutcome = ha_fakes.StandbyOutcome
    sys.modules["ccsq.brokerd.standby"] = mod

from ccsq.brokerd.main import main  # noqa: E402

main()
