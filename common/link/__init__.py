"""Layer 2: the DEALER side of every peer (:class:`~ccsq.common.link.peer.BrokerLink`) and
the one request tracker (:mod:`ccsq.common.link.requests`)."""
