"""Layer 2: the process runtime every daemon shares: structlog setup, named crash points,
systemd notify/watchdog/stop signals, the ``--config FILE`` command line, Prometheus metrics."""
