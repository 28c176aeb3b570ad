"""A plan: the splits of a query, decided per segment and made into objects on demand.

Planning decides, per segment in the window, the position range and the reader; the split
objects (entry chunks x key ranges) follow from those facts alone. A :class:`Plan` keeps one
small record per segment and makes the :class:`Split` objects the first time a caller looks at
them, so asking how much work a query is (``len``, the segments, the readers) costs no more
than the binary search: ``python -m bench plan`` measures both.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, overload

from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.model.message_format import KEY_HASH_SLOTS
from tierstream.model.positions import (
    KeyRange,
    Position,
    cut_entries,
    entries_between,
    ranges_within,
)
from tierstream.splits.split import ReaderKind, Split

__all__ = ["PartitionPlan", "Plan", "SegmentPlan", "no_gc"]


class SegmentPlan(NamedTuple):
    """What a plan reads of one segment: ``[start, end)`` (``end=None``: the open tail) with
    ``reader``; ``facts`` are the location fields every split of the segment shares."""

    topic: str
    segment: SegmentRecord
    start: Position
    end: Position | None
    reader: ReaderKind
    start_time: int | None
    end_time: int | None
    key_ranges: tuple[KeyRange, ...]
    max_split_bytes: int
    facts: dict[str, Any]
    chain: int | None = None  # see Split.chain

    @property
    def _chunked(self) -> bool:
        """A closed segment's range is cut by size; the open tail is one range."""
        return self.end is not None and self.segment.state == SegmentState.CLOSED

    def chunks(self) -> list[tuple[Position, Position | None]]:
        if not self._chunked:
            return [(self.start, self.end)]
        assert self.end is not None
        return entry_chunks(self.segment, self.start, self.end, self.max_split_bytes)

    def split_count(self) -> int:
        """How many splits :meth:`splits` makes, without making them."""
        if not self._chunked:
            return len(self.key_ranges)
        assert self.end is not None
        return _chunk_count(self.segment, self.start, self.end,
                            self.max_split_bytes) * len(self.key_ranges)

    def splits(self) -> Iterator[Split]:
        seg = self.segment
        per_entry = seg.bytes / seg.entries if seg.entries else 0
        for a, b in self.chunks():
            entries = (b.entry_id - a.entry_id + 1) if b is not None else 0
            skipped = ranges_within(seg.skipped, a.entry_id, b.entry_id + 1) \
                if seg.skipped and b is not None else seg.skipped
            for r in self.key_ranges:
                yield Split(topic=self.topic, partition=seg.partition,
                            segment_id=seg.segment_id, start=a, end=b, reader=self.reader,
                            key_range=r, start_time=self.start_time, end_time=self.end_time,
                            estimated_bytes=int(per_entry * entries * (r.hi - r.lo)
                                                / KEY_HASH_SLOTS),
                            chain=self.chain, skipped=skipped, **self.facts)


class PartitionPlan(NamedTuple):
    """What a plan reads of one partition: the segment records of its window between
    ``start`` and ``end`` (``None``: unbounded). The per-segment facts follow from these."""

    topic: str
    window: list[SegmentRecord]
    start: Position
    end: Position | None
    start_time: int | None
    end_time: int | None
    key_ranges: tuple[KeyRange, ...]
    reader: ReaderKind | None  # forced, or None: by where the data lives
    max_split_bytes: int
    chain: int | None = None  # see Split.chain

    def records(self) -> Iterator[SegmentRecord]:
        """The records of the segments between ``start`` and ``end``, in log order."""
        start, end = self.start.segment_id, self.end
        for seg in self.window:
            if seg.segment_id < start:
                continue
            if end is not None and seg.segment_id > end.segment_id:
                break
            yield seg


class Plan(Sequence[Split]):
    """The splits of a query in plan order (topic, partition, segment, entry range, key
    range). A sequence: index, iterate, ``len``. Planning keeps one record per partition;
    the per-segment plans and the split objects are made once, on first use."""

    def __init__(self, partitions: list[PartitionPlan],
                 segment_plans: Callable[[PartitionPlan], list[SegmentPlan]]) -> None:
        self.partitions = partitions
        self._segment_plans = segment_plans
        self._segments: list[SegmentPlan] | None = None
        self._splits: list[Split] | None = None

    def __repr__(self) -> str:
        return f"Plan({len(self)} splits over {len(self.segments)} segments)"

    @property
    def segments(self) -> list[SegmentPlan]:
        if self._segments is None:
            self._segments = [s for part in self.partitions for s in self._segment_plans(part)]
        return self._segments

    def __len__(self) -> int:
        if self._splits is not None:
            return len(self._splits)
        return sum(s.split_count() for s in self.segments)

    def _made(self) -> list[Split]:
        if self._splits is None:
            with no_gc():
                self._splits = [split for seg in self.segments for split in seg.splits()]
            self._segments = None  # the splits hold everything now
        return self._splits

    @overload
    def __getitem__(self, index: int) -> Split: ...

    @overload
    def __getitem__(self, index: slice) -> list[Split]: ...

    def __getitem__(self, index: int | slice) -> Split | list[Split]:
        return self._made()[index]

    def __iter__(self) -> Iterator[Split]:
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Plan):
            return self._made() == other._made()
        return isinstance(other, list) and self._made() == other

    __hash__ = None  # type: ignore[assignment]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection inside: planning makes tens of thousands of small acyclic
    objects, so the collector's passes cost time (up to a third of a plan) and free nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _chunk_count(seg: SegmentRecord, start: Position, end: Position, max_bytes: int) -> int:
    """How many chunks ``[start, end)`` is cut into by ``max_bytes``."""
    entries = entries_between(start, end)
    per_entry = seg.bytes / seg.entries if seg.entries else 0
    return max(1, min(entries, math.ceil(per_entry * entries / max_bytes)))


def entry_chunks(seg: SegmentRecord, start: Position, end: Position, max_bytes: int
                 ) -> list[tuple[Position, Position | None]]:
    """``[start, end)`` of one closed segment cut into entry ranges of about ``max_bytes``."""
    n = _chunk_count(seg, start, end, max_bytes)
    if n == 1:
        return [(start, end)]
    return list(cut_entries(start, end, n))
