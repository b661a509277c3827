"""Layer 1: messages, codec, envelopes, keys, errors, config files, failure policy, backoff,
federation origins, frame splitting. Pure: no sockets, no files beyond reading config and
key files, and no import of any other ccsq package."""
