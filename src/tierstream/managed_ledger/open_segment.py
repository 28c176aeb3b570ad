"""The open segment of a partition as the write path keeps it: confirmed entries, entries in
flight to the bookies, and live stats. Shared by the write, read and position code."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord
from tierstream.metadata.records import SegmentRecord

__all__ = ["InFlight", "OpenSegment"]


@dataclass
class InFlight:
    futures: list[Future[IndexRecord]]
    batch: pa.RecordBatch
    producer: str | None
    sequence_id: int | None


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
