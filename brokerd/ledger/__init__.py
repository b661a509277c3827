"""The broker's ledger (see docs/ledger.md); being split into modules (issue 13)."""

from ccsq.brokerd.ledger.rules import (  # noqa: F401
    COUNTERS,
    SAMPLES_KEPT,
    STATES,
    Ledger,
    LedgerError,
    LedgerTxn,
    LedgerView,
    Policy,
    ReadersFull,
    ReaderSlot,
    backoff_ms,
    data_paths,
    disk_free_bytes,
    parse_readers,
    reader_report,
    validate_submit_item,
)
