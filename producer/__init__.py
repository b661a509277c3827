"""ccsq.producer: the producer library (:class:`Client`, :class:`AsyncClient`) and its
outbox. The completion service is :mod:`ccsq.completiond`; claim-store reconcile is
:mod:`ccsq.tools.reconcile` (an operator tool, ``ccsq reconcile``)."""

from ccsq.producer.client import AsyncClient, Client, Receipt, derive_key

__all__ = ["AsyncClient", "Client", "Receipt", "derive_key"]
