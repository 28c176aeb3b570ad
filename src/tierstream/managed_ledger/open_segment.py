"""The open segment of a partition as the write path keeps it: confirmed entries, entries in
flight to the bookies, and live stats. Shared by the write, read and position code."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord
from tierstream.metadata.records import SegmentRecord

if TYPE_CHECKING:
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["Ack", "InFlight", "OpenSegment", "PendingAppend"]


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


@dataclass
class OpenSegment:
    record: SegmentRecord
    records: list[IndexRecord] = field(default_factory=list)  # confirmed, visible entries
    # confirmed while the partition is held for a transaction commit: visible on release
    hidden: list[tuple[IndexRecord, pa.RecordBatch]] = field(default_factory=list)
    next_entry: int = 0
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    failed: bool = False
    messages: int = 0
    bytes: int = 0
    min_pt: int | None = None
    max_pt: int | None = None


@dataclass
class PendingAppend:
    """An entry on its way to the bookies (``PartitionLog.submit``): :meth:`result` waits
    for its ack quorum and gives its ack (a duplicate's original ack at once)."""

    log: PartitionLog
    ack: Ack | None = None
    seg: OpenSegment | None = None
    entry_id: int | None = None
    futures: list[Future[IndexRecord]] = field(default_factory=list)
    batch: pa.RecordBatch | None = None  # as sent (its requested publish times)
    stored: pa.RecordBatch | None = None  # as stored
    sequence_id: int | None = None

    def result(self) -> Ack:
        if self.ack is None:
            self.ack = self.log._finish(self)
        return self.ack
