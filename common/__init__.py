"""Shared building blocks of ccsq, by layer (docs/architecture.md; import-linter contracts in pyproject.toml):

* :mod:`ccsq.common.wire` — what processes and files say to each other: messages and the
  strict codec, signed envelopes, keys, errors, config files, the failure policy, the one
  backoff, federation origins, the one frame splitter. Imports nothing else of ccsq.
* :mod:`ccsq.common.runtime` — what a daemon process needs: logging, crash points,
  systemd (sd_notify, watchdog, stop signals), the ``--config`` command line, metrics.
* :mod:`ccsq.common.link` — the ZeroMQ side of every peer (``BrokerLink``) and the one
  request tracker.
* :mod:`ccsq.common.storage` — claim stores (file, S3) and the local SQLite journals.
* :mod:`ccsq.tools` — operator tools (the ``ccsq`` command, the admin client,
  reconcile, ``init --hosts``, the process supervisor of the demo and tests); the top layer.
"""
