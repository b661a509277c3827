"""ccsq.producer: the producer library (:class:`Client`, :class:`AsyncClient`), the
completion service (:mod:`ccsq.producer.completion`) and claim-store reconcile."""

from ccsq.producer.client import AsyncClient, Client, Receipt, derive_key

__all__ = ["AsyncClient", "Client", "Receipt", "derive_key"]
