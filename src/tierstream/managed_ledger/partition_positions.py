"""Position arithmetic of one partition: where it begins and ends, the position at a time,
N messages after a position, and how many lie between two. Index records only: no data is
read, except one entry to place a time inside it."""

from __future__ import annotations

import pyarrow.compute as pc

from tierstream.bookie.ledger import entries_before
from tierstream.managed_ledger.partition_reads import PartitionReads
from tierstream.metadata.records import SegmentState
from tierstream.model.positions import Position, in_ranges

__all__ = ["PartitionPositions"]


class PartitionPositions(PartitionReads):
    """Positions of :class:`~tierstream.managed_ledger.partition_log.PartitionLog` (a mixin)."""

    def end(self) -> Position:
        """The exclusive end after the last confirmed message, from what the broker holds in
        memory: no data is read. A read or a subscription starting at ``latest``, a backlog
        and a lag ask for it, and must have it while the tier is slow or away."""
        with self._lock:
            seg = self._open
            if seg.records:
                return Position(self.partition, seg.record.segment_id,
                                seg.records[-1].entry_id + 1, 0)
            if self._closed_segments:
                closed = self._closed_segments[-1]
                return Position(self.partition, closed.segment_id, closed.entries, 0)
            return Position(self.partition, seg.record.segment_id, 0, 0)

    def last_confirmed(self) -> tuple[Position | None, Position]:
        """(position of the last confirmed message or None, :meth:`end`). When the open
        segment is empty, the last message is in the last closed segment, whose entry index
        may have to be read from a bookie or the tier: that read holds no lock."""
        with self._lock:
            seg = self._open
            if seg.records:
                last = seg.records[-1]
                return (Position(self.partition, seg.record.segment_id, last.entry_id,
                                 last.messages - 1), self.end())
            if not self._closed_segments:
                return None, self.end()
            closed = self._closed_segments[-1]
        last = self._segment_index(closed)[-1]
        return (Position(self.partition, closed.segment_id, last.entry_id, last.messages - 1),
                Position(self.partition, closed.segment_id, last.entry_id + 1, 0))

    def earliest(self) -> Position:
        with self._lock:
            first = self._closed_segments[0] if self._closed_segments else self._open.record
            return Position(self.partition, first.segment_id, 0, 0)

    def position_at_time(self, t: int) -> Position:
        """The first position whose message has ``publish_time >= t`` (or the end)."""
        segs = self.segments()
        lo, hi = 0, len(segs)
        while lo < hi:  # first segment whose max_publish_time >= t
            mid = (lo + hi) // 2
            mx = segs[mid].max_publish_time
            if mx is not None and mx < t:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(segs):
            return self.end()
        seg = segs[lo]
        records = self._segment_index(seg)
        a = entries_before(records, t)  # the first entry whose last publish time reaches t
        if a == len(records):
            return Position(self.partition, seg.segment_id, len(records), 0)
        batch = self._entry(seg, records[a])
        idx = int(pc.sum(pc.less(batch.column("publish_time"), t)).as_py() or 0)
        return Position(self.partition, seg.segment_id, records[a].entry_id, idx)

    def backlog(self, start: Position, end: Position) -> int:
        """Messages in ``[start, end)``: whole segments by their record's count, only the
        partial ones through their entry index (a tiered segment's file is not read unless a
        bound falls inside it)."""
        total = 0
        for seg in self.segments():
            if seg.segment_id < start.segment_id:
                continue
            if seg.segment_id > end.segment_id:
                break
            first = Position(self.partition, seg.segment_id, 0, 0)
            after = Position(self.partition, seg.segment_id, seg.entries, 0)
            if seg.state == SegmentState.CLOSED and start <= first and after <= end:
                total += seg.messages
            else:
                lo = max(start, first)
                hi = end if seg.state != SegmentState.CLOSED else min(end, after)
                if lo < hi:
                    total += self.advance(lo, 1 << 62, hi)[1]
        return total

    def advance(self, start: Position, max_messages: int, bound: Position
                ) -> tuple[Position, int]:
        """The position ``max_messages`` messages after ``start`` (never past ``bound``), and
        how many messages lie between: index records only, no data is read. Skipped entries
        (aborted or set-aside transactions') are not counted."""
        pos, counted = start, 0
        for seg in self.segments():
            if seg.segment_id < pos.segment_id or counted >= max_messages:
                continue
            if seg.segment_id > bound.segment_id:
                break
            skipped = self.skipped_in(seg)
            for rec in self._segment_index(seg):
                here = Position(self.partition, seg.segment_id, rec.entry_id, 0)
                if here >= bound or counted >= max_messages:
                    break
                if skipped and in_ranges(skipped, rec.entry_id):
                    continue  # never read: not counted
                first = pos.batch_index if (seg.segment_id, rec.entry_id) == (
                    pos.segment_id, pos.entry_id) else 0
                if (seg.segment_id, rec.entry_id) < (pos.segment_id, pos.entry_id):
                    continue
                last = rec.messages
                if (bound.segment_id, bound.entry_id) == (seg.segment_id, rec.entry_id):
                    last = min(last, bound.batch_index)
                take = min(last - first, max_messages - counted)
                if take <= 0:
                    continue
                counted += take
                end_index = first + take
                pos = (Position(self.partition, seg.segment_id, rec.entry_id + 1, 0)
                       if end_index >= rec.messages
                       else Position(self.partition, seg.segment_id, rec.entry_id, end_index))
        return (min(pos, bound) if counted else start), counted
