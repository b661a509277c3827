"""Shared, I/O-free building blocks of ccsq: protocol, envelopes, keys, config, errors."""
