"""Fault-injection run (``make chaos``; short version in ``tests/test_chaos.py``).

A real swarm on loopback (broker, workers with the echo handler, completion
service on SQLite, a producer subprocess with an outbox) while a seeded
scheduler SIGKILLs processes (also at named crash points), SIGSTOPs them for
less and more than the liveness window, cuts, delays, resets and blackholes
their TCP links through a proxy, fills the broker's "disk", breaks the claim
store, and a hostile peer sends bad frames. Then the books must balance:
see :mod:`tests.chaos.checks`.

``python -m tests.chaos --duration-s 600 [--seed N] [--rate R] [--dir D]``
"""
