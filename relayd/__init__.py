"""ccsq-relayd: federation between swarms (docs/federation.md)."""
