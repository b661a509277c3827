"""The broker's ledger: all item state in one LMDB environment (docs/ledger.md).

Read it in this order: :mod:`~ccsq.brokerd.ledger.schema` (sub-databases, every key,
the item record), :mod:`~ccsq.brokerd.ledger.store` (the environment:
:class:`Ledger`, map growth, reader slots, backup), :mod:`~ccsq.brokerd.ledger.view`
(read queries: :class:`LedgerView`), :mod:`~ccsq.brokerd.ledger.rules` (the state
transitions: :class:`LedgerTxn`), :mod:`~ccsq.brokerd.ledger.maintenance` (deadline
expiry, purges, samples, the reader report). Only the broker's actor writes.

The names below are the package's public face (``from ccsq.brokerd.ledger import Ledger``).
"""

from ccsq.brokerd.ledger.maintenance import ReaderSlot, parse_readers, reader_report
from ccsq.brokerd.ledger.rules import LedgerTxn, backoff_ms
from ccsq.brokerd.ledger.schema import COUNTERS, STATES, Item
from ccsq.brokerd.ledger.store import Ledger, LedgerError, Policy, ReadersFull, data_paths, disk_free_bytes
from ccsq.brokerd.ledger.view import LedgerView

__all__ = [
    "COUNTERS",
    "STATES",
    "Item",
    "Ledger",
    "LedgerError",
    "LedgerTxn",
    "LedgerView",
    "Policy",
    "ReaderSlot",
    "ReadersFull",
    "backoff_ms",
    "data_paths",
    "disk_free_bytes",
    "parse_readers",
    "reader_report",
]
