"""The open segment of a partition as the write path keeps it: confirmed entries, entries in
flight to the bookies, and live stats. Shared by the write, read and position code."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord
from tierstream.metadata.records import SegmentRecord
from tierstream.model.positions import EntryRanges, entry_ranges

__all__ = ["TXN_PRODUCER", "Ack", "InFlight", "OpenSegment", "PendingAppend", "TxnPart",
           "txn_of_producer"]

#: Entries a transaction staged are written as the producer ``txn/<id>`` (sequence ids 0, 1,
#: 2... per partition); those a commit writes again as ``txn/<id>/moved/<p>``.
TXN_PRODUCER = "txn/"


def txn_of_producer(producer: str | None) -> str | None:
    """The transaction a frame's producer name says wrote it, or None."""
    if not producer or not producer.startswith(TXN_PRODUCER):
        return None
    return producer[len(TXN_PRODUCER):].split("/", 1)[0]


@dataclass(frozen=True)
class Ack:
    """What a producer gets back for one batch. A re-sent batch that was already stored gets
    its original ack with ``duplicate=True``; if it is older than the remembered window its
    position is unknown (None) and ``messages`` is 0."""

    partition: int
    segment_id: int | None
    entry_id: int | None
    messages: int
    first_publish_time: int
    last_publish_time: int
    sequence_id: int | None
    duplicate: bool = False
    #: messages whose requested publish time was before the partition's newest message and
    #: were stamped later (publish_time never runs backwards within a partition)
    restamped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class InFlight:
    futures: list[Future[IndexRecord]]
    batch: pa.RecordBatch
    producer: str | None
    sequence_id: int | None
    size: int = 0  # payload bytes: about its frame's length, before the bookies confirm it
    txn: str | None = None  # the transaction that staged it (None: an ordinary entry)
    routed: int | None = None  # the partition count a staged entry was routed by


@dataclass
class TxnPart:
    """What one partition holds of one transaction: its staged entries in the open segment,
    in order, until the transaction is decided."""

    txn_id: str
    entries: list[int] = field(default_factory=list)  # entry ids in the open segment
    rows: int = 0  # rows of those entries
    routed: set[int | None] = field(default_factory=set)  # counts its entries were routed by
    #: some of its entries here were set aside in a sealed segment: at the commit all of them
    #: are written again, in order, rather than shown where they are
    set_aside: bool = False
    state: str = "pending"  # then "committed" (shown in place) or "skipped"
    next_seq: int = 0


@dataclass
class OpenSegment:
    record: SegmentRecord
    # confirmed entries readers may read, entry ids 0..n-1 (skipped ones among them)
    records: list[IndexRecord] = field(default_factory=list)
    # confirmed entries not visible yet, in order: behind an undecided transaction's entry
    # (Pulsar's max read position) or confirmed while the partition is held for a commit
    hidden: list[tuple[IndexRecord, pa.RecordBatch | None]] = field(default_factory=list)
    next_entry: int = 0
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    failed: bool = False
    #: sealed in the metadata, and no next segment could be opened yet (too few bookies
    #: answered): appends try to open one first, and nothing seals this one again
    sealed: bool = False
    messages: int = 0
    bytes: int = 0
    min_pt: int | None = None
    max_pt: int | None = None
    #: entries readers skip (of aborted transactions, or of ones written again elsewhere)
    skipped: set[int] = field(default_factory=set)
    #: staged entries: entry id -> (its transaction, the partition count it was routed by)
    txn_of: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    #: when an entry that is not a transaction's began to wait behind one (monotonic s)
    blocked_since: float | None = None
    _skipped_ranges: EntryRanges | None = None

    def skipped_ranges(self) -> EntryRanges:
        if self._skipped_ranges is None:
            self._skipped_ranges = entry_ranges(self.skipped)
        return self._skipped_ranges

    def skip(self, entry_id: int) -> None:
        self.skipped.add(entry_id)
        self._skipped_ranges = None


@dataclass
class PendingAppend:
    """An entry on its way to the bookies (``PartitionLog.submit``): :meth:`result` waits
    for its ack quorum and gives its ack (a duplicate's original ack at once). ``finish`` is
    the log's wait for the quorum (a callable, so that this module needs no log)."""

    finish: Callable[[PendingAppend], Ack]
    ack: Ack | None = None
    seg: OpenSegment | None = None
    entry_id: int | None = None
    futures: list[Future[IndexRecord]] = field(default_factory=list)
    batch: pa.RecordBatch | None = None  # as sent (its requested publish times)
    stored: pa.RecordBatch | None = None  # as stored
    sequence_id: int | None = None
    requested: pa.Array | None = None  # the publish times it asked for (None: the broker's)

    def result(self) -> Ack:
        if self.ack is None:
            self.ack = self.finish(self)
        return self.ack
