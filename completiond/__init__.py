"""ccsq completiond: the completion service, a daemon of its own (``ccsq-completiond``).

A peer with role ``completion``: results from the broker into a database (SQLite or
PostgreSQL, :mod:`ccsq.completiond.resultsdb`), then ACK (:mod:`ccsq.completiond.completion`);
its Prometheus metrics in :mod:`ccsq.completiond.completion_metrics`.
"""
