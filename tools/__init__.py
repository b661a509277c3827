"""Layer 4: operator tools: the ``ccsq`` command (:mod:`.cli`, with its commands in :mod:`.init`,
:mod:`.submit_cmd`, :mod:`.admin_cmds`, :mod:`.ledger_cmds`), the admin client, reconcile,
``ccsq init --hosts``, and the process supervisor used by the demo and the tests. May import
any daemon package; nothing below imports it."""
