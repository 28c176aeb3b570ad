"""Reading one partition on the broker: bounded reads and the followed tail, from the open
segment, the bookies (another replica when one fails its checksum) or the tier once the
bookie copy is gone, with small caches of entries, indexes and tier segments."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from tierstream.bookie.ledger import IndexRecord, decode_payload, first_good_replica, unreadable
from tierstream.errors import NotFoundError
from tierstream.managed_ledger.bookies.client import BookieClient, EntryReader
from tierstream.managed_ledger.open_segment import OpenSegment
from tierstream.metadata.records import SegmentRecord
from tierstream.model.message_format import key_range_mask
from tierstream.model.positions import EntryRanges, KeyRange, Position, in_ranges
from tierstream.tier.storage import TierStorage

__all__ = ["PartitionReads", "TierSegment", "filter_key_ranges"]

_CACHE_BYTES = 64 * 1024**2


class PartitionReads:
    """The read side of :class:`~tierstream.managed_ledger.partition_log.PartitionLog` (a mixin over
    its state, declared below)."""

    # The partition's state, owned and kept by PartitionLog (managed_ledger/partition_log.py).
    topic: str
    partition: int
    _lock: threading.RLock
    _changed: threading.Condition
    _closing: threading.Event
    _gone: threading.Event
    _open: OpenSegment
    _closed_segments: list[SegmentRecord]
    _bookies: dict[str, BookieClient]
    _tier: TierStorage | None
    _tier_cache: OrderedDict[int, TierSegment]
    _index_cache: OrderedDict[int, list[IndexRecord]]
    _entry_cache: OrderedDict[tuple[int, int], pa.RecordBatch]
    _entry_cache_bytes: int
    replica_failures: int

    def segments(self) -> list[SegmentRecord]:
        """Every segment of the partition, the open one with its live stats."""
        with self._lock:
            seg = self._open
            live = seg.record.with_stats(
                entries=len(seg.records), messages=seg.messages, bytes=seg.bytes,
                min_publish_time=seg.min_pt, max_publish_time=seg.max_pt)
            return [*self._closed_segments, live]

    def closed_segments(self) -> list[SegmentRecord]:
        with self._lock:
            return list(self._closed_segments)

    def update_segment(self, record: SegmentRecord) -> None:
        """Replace a closed segment's record (it moved to the tier, or lost its bookie copy)."""
        with self._lock:
            self._closed_segments = [record if s.segment_id == record.segment_id else s
                                     for s in self._closed_segments]
            if record.bookie_deleted_at is not None:
                self._index_cache.pop(record.segment_id, None)

    def remove_segment(self, segment_id: int) -> None:
        """Stop serving a closed segment (retention)."""
        with self._lock:
            self._closed_segments = [s for s in self._closed_segments
                                     if s.segment_id != segment_id]
            self._index_cache.pop(segment_id, None)
            self._tier_cache.pop(segment_id, None)
            for key in [k for k in self._entry_cache if k[0] == segment_id]:
                self._entry_cache_bytes -= self._entry_cache.pop(key).get_total_buffer_size()

    def read(
        self,
        start: Position,
        *,
        end: Position | None,
        end_time: int | None = None,
        key_ranges: list[KeyRange] | None = None,
        follow: bool = False,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[pa.RecordBatch]:
        """Batches from ``start`` (inclusive) to ``end`` (exclusive) or ``end_time``.

        With ``follow`` and no end, waits for new entries (the tail) until ``cancelled()`` or
        the broker closes; a new message is delivered as soon as it is confirmed.
        """
        pos = start
        end_key = None if end is None else (end.segment_id, end.entry_id, end.batch_index)
        readers = _Readers()
        try:
            while True:
                progressed = False
                for seg, records, skipped in self._readable_from(pos):
                    sid = seg.segment_id
                    first = pos.entry_id if sid == pos.segment_id else 0
                    for rec in records[first:]:  # entry ids are 0..n-1: slice by id
                        if end_key is not None and (sid, rec.entry_id, 0) >= end_key:
                            return
                        if skipped and in_ranges(skipped, rec.entry_id):
                            # an aborted or set-aside transaction's entry: never read
                            pos = Position(self.partition, sid, rec.entry_id + 1, 0)
                            progressed = True
                            continue
                        batch = self._entry(seg, rec, readers)
                        lo = pos.batch_index if (sid, rec.entry_id) == (
                            pos.segment_id, pos.entry_id) else 0
                        hi = batch.num_rows
                        if end_key is not None and end_key[:2] == (sid, rec.entry_id):
                            hi = min(hi, end_key[2])
                        stop = end_time is not None and rec.last_publish_time >= end_time
                        if stop:
                            hi = min(hi, int(pc.sum(pc.less(batch.column("publish_time"),
                                                            end_time)).as_py() or 0))
                        if hi > lo:
                            out = filter_key_ranges(batch.slice(lo, hi - lo), key_ranges)
                            if out.num_rows:
                                yield out
                        if stop:
                            return
                        pos = Position(self.partition, sid, rec.entry_id + 1, 0)
                        progressed = True
                    readers.close_segment(sid)
                    if cancelled():
                        return
                if end is not None and pos >= end:
                    return
                if not follow:
                    return
                if not progressed:
                    with self._lock:
                        if not self._has_after(pos):
                            self._changed.wait(timeout=0.2)
                    if cancelled() or self._closing.is_set() or self._gone.is_set():
                        return
        finally:
            readers.close()

    def _has_after(self, pos: Position) -> bool:
        """Whether a confirmed message lies at or after ``pos`` (lock held). The end of a
        sealed segment is the start of the next one: it has nothing after it until the open
        segment gets an entry, so a caught-up follower waits there instead of spinning."""
        seg = self._open
        if pos.segment_id >= seg.record.segment_id:
            return len(seg.records) > (pos.entry_id if pos.segment_id == seg.record.segment_id
                                       else 0)
        if seg.records:
            return True
        for closed in reversed(self._closed_segments):
            if closed.segment_id < pos.segment_id:
                break
            if closed.entries > (pos.entry_id if closed.segment_id == pos.segment_id else 0):
                return True
        return False

    def _readable_from(self, pos: Position
                       ) -> list[tuple[SegmentRecord, list[IndexRecord], EntryRanges]]:
        """Segments at or after ``pos`` with their visible index records and the entries of
        those to skip (a snapshot)."""
        with self._lock:
            out: list[tuple[SegmentRecord, list[IndexRecord], EntryRanges]] = []
            for seg in self._closed_segments:
                if seg.segment_id >= pos.segment_id and not (
                        seg.segment_id == pos.segment_id and pos.entry_id >= seg.entries):
                    out.append((seg, self._segment_index(seg), seg.skipped))
            open_seg = self._open
            if open_seg.record.segment_id >= pos.segment_id:
                out.append((open_seg.record, open_seg.records[:], open_seg.skipped_ranges()))
        return out

    def skipped_in(self, seg: SegmentRecord) -> EntryRanges:
        """The entries of ``seg`` readers skip (the open segment's as they are now)."""
        with self._lock:
            if seg.segment_id == self._open.record.segment_id:
                return self._open.skipped_ranges()
            return seg.skipped

    def _segment_index(self, seg: SegmentRecord) -> list[IndexRecord]:
        if seg.segment_id == self._open.record.segment_id:
            return self._open.records
        with self._lock:  # several readers (and the broker's threads) share it
            cached = self._index_cache.get(seg.segment_id)
            if cached is not None:
                self._index_cache.move_to_end(seg.segment_id)
                return cached
        if seg.bookie_deleted_at is not None:
            return self._tier_index(seg)
        last_error: Exception | None = None
        for b in seg.ensemble:
            try:
                # a copy whose seal was missed (its bookie was away) may run past the entries
                # the segment's record holds: those were never acknowledged
                records = self._bookies[b].index(seg.segment_id)[:seg.entries]
            except (NotFoundError, OSError) as exc:
                last_error = exc
                continue
            if len(records) < seg.entries:  # missed writes while its bookie was away
                last_error = NotFoundError(f"bookie {b} holds {len(records)} of the "
                                           f"{seg.entries} entries")
                continue
            self._keep_index(seg, records)
            return records
        moved = self._current(seg)
        if moved.tier_url is not None:  # moved to the tier while we were planning
            return self._tier_index(moved)
        raise NotFoundError(f"no replica of segment {seg.segment_id} ({self.topic} partition "
                            f"{self.partition}) has an index: {last_error}")

    def _entry(self, seg: SegmentRecord, rec: IndexRecord, readers: _Readers | None = None
               ) -> pa.RecordBatch:
        key = (seg.segment_id, rec.entry_id)
        with self._lock:
            cached = self._entry_cache.get(key)
        if cached is not None:
            return cached
        if seg.bookie_deleted_at is not None:
            return self._tier_segment(seg).entry(rec.entry_id)
        # a caller reading many entries passes its readers (and closes them); one entry read
        # alone opens and closes its own
        open_readers = readers or _Readers()

        def read(bookie: str) -> Callable[[], pa.Buffer]:
            return lambda: open_readers.get(self._bookies[bookie], seg.segment_id).read(rec)

        try:
            payload, errors = first_good_replica((b, read(b)) for b in seg.ensemble)
        finally:
            if readers is None:
                open_readers.close()
        self.replica_failures += len(errors)
        if payload is not None:
            return decode_payload(payload)
        moved = self._current(seg)
        if moved.tier_url is not None:  # its bookie copy was deleted after it moved
            return self._tier_segment(moved).entry(rec.entry_id)
        raise unreadable(rec.entry_id, seg.segment_id, self.topic, self.partition, errors)

    def _current(self, seg: SegmentRecord) -> SegmentRecord:
        with self._lock:
            for s in self._closed_segments:
                if s.segment_id == seg.segment_id:
                    return s
        return seg

    def _keep_index(self, seg: SegmentRecord, records: list[IndexRecord]) -> None:
        with self._lock:
            self._index_cache[seg.segment_id] = records
            while len(self._index_cache) > 256:
                self._index_cache.popitem(last=False)

    def _read_tier_file(self, seg: SegmentRecord, columns: list[str] | None = None
                        ) -> pa.Table:
        """``seg``'s tier file (or ``columns`` of it); NotFoundError when it has none."""
        if self._tier is None or seg.tier_url is None:
            raise NotFoundError(f"segment {seg.segment_id} ({self.topic} partition "
                                f"{self.partition}) has neither a bookie copy nor a tier file")
        return self._tier.read_segment(seg.tier_url, size=seg.tier_bytes, columns=columns)

    def _tier_index(self, seg: SegmentRecord) -> list[IndexRecord]:
        """A tiered segment's entry index: from its rows if they are held, else from the
        file's entry ids and publish times alone (a few percent of its bytes: a time's
        position or the last message's does not fetch the messages)."""
        with self._lock:
            held = self._tier_cache.get(seg.segment_id)
        if held is not None:
            return held.records
        rows = self._read_tier_file(seg, ["entry_id", "batch_index", "publish_time"])
        records = TierSegment.load(rows, entries=seg.entries).records
        self._keep_index(seg, records)
        return records

    def _tier_segment(self, seg: SegmentRecord) -> TierSegment:
        """A tiered segment's rows in log order, with entry boundaries (a small LRU)."""
        with self._lock:
            cached = self._tier_cache.get(seg.segment_id)
            if cached is not None:
                self._tier_cache.move_to_end(seg.segment_id)
                return cached
        loaded = TierSegment.load(self._read_tier_file(seg), entries=seg.entries)
        with self._lock:
            self._tier_cache[seg.segment_id] = loaded
            while len(self._tier_cache) > 2:
                self._tier_cache.popitem(last=False)
        return loaded

    def _cache_put(self, key: tuple[int, int], batch: pa.RecordBatch) -> None:
        self._entry_cache[key] = batch
        # an entry's batch owns its buffers: their plain sum, a fortieth of nbytes' cost
        self._entry_cache_bytes += batch.get_total_buffer_size()
        while self._entry_cache_bytes > _CACHE_BYTES and self._entry_cache:
            _, old = self._entry_cache.popitem(last=False)
            self._entry_cache_bytes -= old.get_total_buffer_size()


class TierSegment:
    """A segment read back from its Parquet file, in log order, served entry by entry."""

    def __init__(self, table: pa.Table, records: list[IndexRecord],
                 bounds: dict[int, tuple[int, int]]) -> None:
        self.table = table
        self.records = records
        self._bounds = bounds

    @classmethod
    def load(cls, rows: pa.Table, *, entries: int = 0) -> TierSegment:
        """The file's rows with an index record per entry id ``0 .. max(entries, last + 1)``:
        entries the file does not hold (skipped: aborted or set-aside transactions') get a
        record of no messages, so records stay indexed by entry id."""
        table = rows.sort_by([("entry_id", "ascending"), ("batch_index", "ascending")])
        table = table.combine_chunks()
        entry_ids = table.column("entry_id").to_numpy()
        pts = table.column("publish_time").to_numpy()
        records: list[IndexRecord] = []
        bounds = {}
        start = 0
        n = len(entry_ids)
        last_pt = int(pts[0]) if n else 0
        while start < n:
            e = int(entry_ids[start])
            end = start
            while end < n and entry_ids[end] == e:
                end += 1
            while len(records) < e:  # a gap: an entry not in the file
                records.append(IndexRecord(len(records), 0, 0, 0, last_pt, last_pt))
            bounds[e] = (start, end - start)
            records.append(IndexRecord(e, 0, 0, end - start, int(pts[start]), int(pts[end - 1])))
            last_pt = int(pts[end - 1])
            start = end
        while len(records) < entries:
            records.append(IndexRecord(len(records), 0, 0, 0, last_pt, last_pt))
        return cls(table, records, bounds)

    def entry(self, entry_id: int) -> pa.RecordBatch:
        if entry_id not in self._bounds:  # skipped, not in the file
            return self.table.slice(0, 0).to_batches()[0] if self.table.num_rows else \
                pa.RecordBatch.from_pylist([], schema=self.table.schema)
        start, count = self._bounds[entry_id]
        batches = self.table.slice(start, count).to_batches()
        return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


class _Readers:
    """Open ledger files of one read call, at most one per (bookie, segment)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], EntryReader] = {}

    def get(self, bookie: BookieClient, segment_id: int) -> EntryReader:
        key = (bookie.bookie_id, segment_id)
        reader = self._open.get(key)
        if reader is None:
            reader = self._open[key] = bookie.open_reader(segment_id)
        return reader

    def close_segment(self, segment_id: int) -> None:
        for key in [k for k in self._open if k[1] == segment_id]:
            self._open.pop(key).close()

    def close(self) -> None:
        for reader in self._open.values():
            reader.close()
        self._open.clear()


def filter_key_ranges(batch: pa.RecordBatch, key_ranges: list[KeyRange] | None
                      ) -> pa.RecordBatch:
    """The rows of ``batch`` whose key_hash lies in one of ``key_ranges`` (None: all)."""
    mask = key_range_mask(batch.column("key_hash"), [(r.lo, r.hi) for r in key_ranges or []])
    return batch if mask is None else batch.filter(mask)
