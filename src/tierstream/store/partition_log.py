"""The managed ledger of one partition, on the broker: appends, rollover, reads, the tail.

Appends take the partition lock only to assign the entry id and hand the entry to the bookies;
the wait for the ack quorum happens outside it, so concurrent producers of one partition share
the bookies' group commits. Each bookie writes in queue order, so quorums complete in entry order
and the last confirmed entry (LAC) only ever moves forward by one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tierstream.errors import ConfigError, CorruptionError, NotFoundError, UnavailableError
from tierstream.schema import MESSAGE_SCHEMA, as_produce_batch, key_hashes
from tierstream.splits.positions import KeyRange, Position
from tierstream.store.bookie import Bookie, LedgerReader
from tierstream.store.dedup import ProducerDedup, StoredBatch
from tierstream.store.faults import crash_point
from tierstream.store.ledger import IndexRecord, decode_payload
from tierstream.store.metadata import MetadataStore, SegmentRecord, SegmentState
from tierstream.store.tier import TierStorage
from tierstream.timeutil import now_ms

__all__ = ["Ack", "PartitionLog", "filter_key_ranges"]

_CACHE_BYTES = 64 * 1024**2


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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _InFlight:
    futures: list[Future[IndexRecord]]
    batch: pa.RecordBatch
    producer: str | None
    sequence_id: int | None


@dataclass
class _Open:
    record: SegmentRecord
    records: list[IndexRecord] = field(default_factory=list)  # confirmed entries only
    next_entry: int = 0
    in_flight: dict[int, _InFlight] = field(default_factory=dict)
    failed: bool = False
    messages: int = 0
    bytes: int = 0
    min_pt: int | None = None
    max_pt: int | None = None


class PartitionLog:
    """One partition's segments; owned by the broker's :class:`~tierstream.store.store.Store`."""

    def __init__(
        self,
        *,
        topic: str,
        partition: int,
        metadata: MetadataStore,
        bookies: dict[str, Bookie],
        choose_ensemble: Callable[[], tuple[str, ...]],
        ack_quorum: int,
        max_entries: int,
        max_bytes: int,
        rollover_ms: int,
        closing: threading.Event,
        tier: TierStorage | None = None,
        open_record: SegmentRecord | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self._metadata = metadata
        self._bookies = bookies
        self._choose_ensemble = choose_ensemble
        self._ack_quorum = ack_quorum
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._rollover_ms = rollover_ms
        self._closing = closing
        self._tier = tier
        self._tier_cache: OrderedDict[int, _TierSegment] = OrderedDict()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._closed_segments: list[SegmentRecord] = [
            s for s in metadata.segments(topic, partition) if s.state == SegmentState.CLOSED
        ]
        self._dedup = ProducerDedup.from_rows(metadata.load_dedup(topic, partition))
        self._last_pt = max(
            (s.max_publish_time for s in self._closed_segments if s.max_publish_time is not None),
            default=0,
        )
        self._index_cache: OrderedDict[int, list[IndexRecord]] = OrderedDict()
        self._entry_cache: OrderedDict[tuple[int, int], pa.RecordBatch] = OrderedDict()
        self._entry_cache_bytes = 0
        self._stats_dirty = False
        self.replica_failures = 0
        self._gone = threading.Event()  # the topic was deleted: no appends, reads end
        if open_record is None:
            self._open = self._new_open_segment()
        else:  # registered by the caller (with its topic, or with every partition at start)
            for b in open_record.ensemble:
                self._bookies[b].create_ledger(open_record.segment_id)
            self._open = _Open(open_record)

    # -- appends ------------------------------------------------------------------------------

    def append(self, batch: pa.RecordBatch, *, producer: str | None, sequence_id: int | None,
               requested_now: int | None = None) -> Ack:
        """Append one batch as one entry; returns once an ack quorum has it on disk.

        A batch whose ``(producer, sequence_id)`` was already stored is not stored again: the
        ack repeats the original one with ``duplicate=True``. A re-send of a batch that is still
        being written waits for that write's outcome.
        """
        batch = as_produce_batch(batch)
        if batch.num_rows == 0:
            raise ConfigError("cannot append an empty batch")
        with self._lock:
            if self._gone.is_set():
                raise NotFoundError(f"topic {self.topic!r} was deleted")
            if producer is not None and sequence_id is not None:
                duplicate = self._check_sequence(producer, sequence_id)
                if duplicate is not None:
                    return duplicate
            self._roll_if_due(now_ms())
            seg = self._open
            entry_id = seg.next_entry
            seg.next_entry += 1
            now = requested_now if requested_now is not None else now_ms()
            message_batch, first_pt, last_pt = self._build_entry(batch, seg.record.segment_id,
                                                                 entry_id, now)
            self._last_pt = last_pt
            payload = message_batch.serialize()
            meta: dict[str, Any] = {}
            if producer is not None and sequence_id is not None:
                meta = {"p": producer, "s": sequence_id}
            futures: list[Future[IndexRecord]] = []
            for b in seg.record.ensemble:
                futures.append(self._bookies[b].append(seg.record.segment_id, entry_id, meta,
                                                       payload, message_batch.num_rows,
                                                       first_pt, last_pt))
                crash_point("append.partial-replicas", before=futures[0].result)
            seg.in_flight[entry_id] = _InFlight(futures, message_batch, producer, sequence_id)
        self._wait_quorum(futures)  # outside the lock: other producers keep appending
        with self._lock:
            self._advance(seg)
            if len(seg.records) <= entry_id:
                errors = [str(f.exception()) for f in futures if f.exception() is not None]
                raise UnavailableError(
                    f"entry {entry_id} of segment {seg.record.segment_id} ({self.topic} "
                    f"partition {self.partition}) did not reach an ack quorum of "
                    f"{self._ack_quorum} bookies: {'; '.join(errors) or 'segment was sealed'}"
                )
            crash_point("append.before-ack")
            if seg is self._open and (len(seg.records) >= self._max_entries
                                      or seg.bytes >= self._max_bytes):
                self._roll()
        return Ack(self.partition, seg.record.segment_id, entry_id, message_batch.num_rows,
                   first_pt, last_pt, sequence_id)

    def _wait_quorum(self, futures: list[Future[IndexRecord]]) -> None:
        pending = set(futures)
        while pending:
            ok = sum(1 for f in futures if f.done() and f.exception() is None)
            if ok >= self._ack_quorum:
                return
            _, pending = wait_futures(pending, return_when="FIRST_COMPLETED")

    def _advance(self, seg: _Open, *, roll_on_failure: bool = True) -> None:
        """Confirm in-flight entries in entry order while each has its ack quorum (lock held).

        Each bookie writes in queue order, so quorums complete in entry order; an entry that
        failed its quorum stops the segment: it is sealed at the entry before.
        """
        advanced = False
        while seg.in_flight:
            entry_id = min(seg.in_flight)
            pending = seg.in_flight[entry_id]
            ok = [f for f in pending.futures if f.done() and f.exception() is None]
            if len(ok) < self._ack_quorum and not all(f.done() for f in pending.futures):
                break  # still waiting for its quorum
            if len(ok) < self._ack_quorum:
                # A hole: nothing after it may be confirmed. Seal the segment before it.
                seg.failed = True
                break
            del seg.in_flight[entry_id]
            record = ok[0].result()
            batch = pending.batch
            seg.records.append(record)
            seg.messages += batch.num_rows
            seg.bytes += record.frame_len
            pts = batch.column("publish_time")
            seg.min_pt = pts[0].as_py() if seg.min_pt is None else seg.min_pt
            seg.max_pt = pts[-1].as_py()
            self._cache_put((seg.record.segment_id, entry_id), batch)
            if pending.producer is not None and pending.sequence_id is not None:
                self._dedup.record(pending.producer, StoredBatch(
                    pending.sequence_id, seg.record.segment_id, entry_id, record.messages,
                    record.first_publish_time, record.last_publish_time))
            self._stats_dirty = True
            advanced = True
        if advanced:
            self._changed.notify_all()
        if seg.failed and roll_on_failure and seg is self._open:
            self._roll()

    def _check_sequence(self, producer: str, sequence_id: int) -> Ack | None:
        """The original ack if this batch is stored already, else None (lock held).

        An entry is recorded as stored only once it is confirmed; while an entry of the same
        producer with this id or a later one is still in flight, its outcome decides, so wait.
        """
        while True:
            last = self._dedup.last(producer)
            if last is not None and sequence_id <= last:
                b = self._dedup.stored(producer, sequence_id)
                if b is None:
                    return Ack(self.partition, None, None, 0, 0, 0, sequence_id,
                               duplicate=True)
                return Ack(self.partition, b.segment_id, b.entry_id, b.messages,
                           b.first_publish_time, b.last_publish_time, sequence_id,
                           duplicate=True)
            if not any(f.producer == producer and f.sequence_id is not None
                       and f.sequence_id >= sequence_id for f in self._open.in_flight.values()):
                return None
            self._changed.wait(timeout=1.0)

    def _build_entry(self, batch: pa.RecordBatch, segment_id: int, entry_id: int, now: int
                     ) -> tuple[pa.RecordBatch, int, int]:
        n = batch.num_rows
        requested = pc.fill_null(batch.column("publish_time"), pa.scalar(now, pa.int64()))
        floored = pc.max_element_wise(requested, pa.scalar(self._last_pt, pa.int64()))
        publish_time = pc.cumulative_max(floored)
        columns = [
            batch.column("key"),
            key_hashes(batch.column("key")),
            batch.column("value"),
            publish_time,
            batch.column("event_time"),
            batch.column("properties"),
            pa.repeat(pa.scalar(self.partition, pa.int32()), n),
            pa.repeat(pa.scalar(segment_id, pa.int64()), n),
            pa.repeat(pa.scalar(entry_id, pa.int64()), n),
            pa.array(range(n), type=pa.int32()),
        ]
        out = pa.RecordBatch.from_arrays(columns, schema=MESSAGE_SCHEMA)
        return out, publish_time[0].as_py(), publish_time[-1].as_py()

    # -- rollover -----------------------------------------------------------------------------

    def _new_open_segment(self) -> _Open:
        record = self._metadata.new_segment(self.topic, self.partition,
                                            ensemble=self._choose_ensemble(), created_at=now_ms())
        crash_point("roll.next-registered")
        for b in record.ensemble:
            self._bookies[b].create_ledger(record.segment_id)
        return _Open(record)

    def _roll_if_due(self, now: int) -> None:
        seg = self._open
        if seg.records and now - seg.record.created_at >= self._rollover_ms:
            self._roll()

    def roll_if_aged(self) -> bool:
        """Seal the open segment if it is non-empty and older than the rollover time."""
        with self._lock:
            before = self._open
            self._roll_if_due(now_ms())
            return self._open is not before

    def seal(self) -> SegmentRecord | None:
        """Seal the open segment now (if it has entries) and open a new one."""
        with self._lock:
            if not self._open.records and not self._open.in_flight:
                return None
            self._roll()
            return self._closed_segments[-1] if self._closed_segments else None

    def _roll(self, *, reopen: bool = True) -> None:
        seg = self._open
        wait_futures([f for p in seg.in_flight.values() for f in p.futures])
        self._advance(seg, roll_on_failure=False)
        seg.in_flight.clear()
        last = seg.records[-1].entry_id if seg.records else None
        for b in seg.record.ensemble:
            self._bookies[b].seal_ledger(seg.record.segment_id, last)
        crash_point("roll.bookies-sealed")
        if seg.records:
            sealed = seg.record.with_stats(
                state=SegmentState.CLOSED, entries=len(seg.records), messages=seg.messages,
                bytes=seg.bytes, min_publish_time=seg.min_pt, max_publish_time=seg.max_pt,
                sealed_at=now_ms(),
            )
            self._metadata.seal_segment(sealed, self._dedup.rows())
            crash_point("roll.metadata-sealed")
            self._closed_segments.append(sealed)
            self._index_cache[sealed.segment_id] = seg.records
        else:
            self._metadata.delete_segment(seg.record.segment_id)
            for b in seg.record.ensemble:
                self._bookies[b].delete_ledger(seg.record.segment_id)
        if reopen:
            self._open = self._new_open_segment()
        self._changed.notify_all()

    def close(self) -> None:
        """Clean shutdown: seal the open segment (an empty one is dropped)."""
        with self._lock:
            self._roll(reopen=False)

    def discard(self) -> None:
        """The topic is being deleted: refuse appends, end reads, release the open ledger
        without sealing it (its files are deleted next)."""
        with self._lock:
            self._gone.set()
            wait_futures([f for p in self._open.in_flight.values() for f in p.futures])
            for b in self._open.record.ensemble:
                self._bookies[b].discard_ledger(self._open.record.segment_id)
            self._changed.notify_all()

    def flush_stats(self) -> None:
        """Write the open segment's live stats to the metadata store (planners read them)."""
        with self._lock:
            if not self._stats_dirty:
                return
            seg = self._open
            self._metadata.update_segment_stats(seg.record.with_stats(
                entries=len(seg.records), messages=seg.messages, bytes=seg.bytes,
                min_publish_time=seg.min_pt, max_publish_time=seg.max_pt))
            self._stats_dirty = False

    # -- views --------------------------------------------------------------------------------

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
                self._entry_cache_bytes -= self._entry_cache.pop(key).nbytes

    def last_confirmed(self) -> tuple[Position | None, Position]:
        """(position of the last confirmed message or None, the exclusive end after it)."""
        with self._lock:
            seg = self._open
            if seg.records:
                last = seg.records[-1]
                sid = seg.record.segment_id
            elif self._closed_segments:
                closed = self._closed_segments[-1]
                last = self._segment_index(closed)[-1]
                sid = closed.segment_id
            else:
                return None, Position(self.partition, seg.record.segment_id, 0, 0)
            return (Position(self.partition, sid, last.entry_id, last.messages - 1),
                    Position(self.partition, sid, last.entry_id + 1, 0))

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
            return self.last_confirmed()[1]
        seg = segs[lo]
        records = self._segment_index(seg)
        a, b = 0, len(records)
        while a < b:  # first entry whose last_publish_time >= t
            mid = (a + b) // 2
            if records[mid].last_publish_time < t:
                a = mid + 1
            else:
                b = mid
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
        how many messages lie between: index records only, no data is read."""
        pos, counted = start, 0
        for seg in self.segments():
            if seg.segment_id < pos.segment_id or counted >= max_messages:
                continue
            if seg.segment_id > bound.segment_id:
                break
            for rec in self._segment_index(seg):
                here = Position(self.partition, seg.segment_id, rec.entry_id, 0)
                if here >= bound or counted >= max_messages:
                    break
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

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "segments": len(self._closed_segments) + 1,
                "open_entries": len(self._open.records),
                "replica_failures": self.replica_failures,
            }

    def producer_state(self, producer: str) -> int | None:
        """The producer's last stored sequence id here, or None."""
        with self._lock:
            return self._dedup.last(producer)

    # -- reads --------------------------------------------------------------------------------

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
                for seg, records in self._readable_from(pos):
                    sid = seg.segment_id
                    first = pos.entry_id if sid == pos.segment_id else 0
                    for rec in records[first:]:  # entry ids are 0..n-1: slice by id
                        if end_key is not None and (sid, rec.entry_id, 0) >= end_key:
                            return
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

    def _readable_from(self, pos: Position) -> list[tuple[SegmentRecord, list[IndexRecord]]]:
        """Segments at or after ``pos`` with their confirmed index records (a snapshot)."""
        with self._lock:
            out: list[tuple[SegmentRecord, list[IndexRecord]]] = []
            for seg in self._closed_segments:
                if seg.segment_id >= pos.segment_id and not (
                        seg.segment_id == pos.segment_id and pos.entry_id >= seg.entries):
                    out.append((seg, self._segment_index(seg)))
            open_seg = self._open
            if open_seg.record.segment_id >= pos.segment_id:
                out.append((open_seg.record, open_seg.records[:]))
        return out

    def _segment_index(self, seg: SegmentRecord) -> list[IndexRecord]:
        if seg.segment_id == self._open.record.segment_id:
            return self._open.records
        cached = self._index_cache.get(seg.segment_id)
        if cached is not None:
            self._index_cache.move_to_end(seg.segment_id)
            return cached
        if seg.bookie_deleted_at is not None:
            return self._tier_segment(seg).records
        last_error: Exception | None = None
        for b in seg.ensemble:
            try:
                records = self._bookies[b].index(seg.segment_id)
            except (NotFoundError, OSError) as exc:
                last_error = exc
                continue
            self._index_cache[seg.segment_id] = records
            while len(self._index_cache) > 256:
                self._index_cache.popitem(last=False)
            return records
        moved = self._current(seg)
        if moved.tier_url is not None:  # moved to the tier while we were planning
            return self._tier_segment(moved).records
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
        errors = []
        readers = readers or _Readers()
        for b in seg.ensemble:
            try:
                payload = readers.get(self._bookies[b], seg.segment_id).read(rec)
                return decode_payload(payload)
            except (CorruptionError, NotFoundError, OSError) as exc:
                self.replica_failures += 1
                errors.append(f"{b}: {exc}")
        moved = self._current(seg)
        if moved.tier_url is not None:  # its bookie copy was deleted after it moved
            return self._tier_segment(moved).entry(rec.entry_id)
        raise CorruptionError(
            f"entry {rec.entry_id} of segment {seg.segment_id} ({self.topic} partition "
            f"{self.partition}) is unreadable on every replica: {'; '.join(errors)}"
        )

    def _current(self, seg: SegmentRecord) -> SegmentRecord:
        with self._lock:
            for s in self._closed_segments:
                if s.segment_id == seg.segment_id:
                    return s
        return seg

    def _tier_segment(self, seg: SegmentRecord) -> _TierSegment:
        """A tiered segment's rows in log order, with entry boundaries (a small LRU)."""
        with self._lock:
            cached = self._tier_cache.get(seg.segment_id)
            if cached is not None:
                self._tier_cache.move_to_end(seg.segment_id)
                return cached
        if self._tier is None or seg.tier_url is None:
            raise NotFoundError(f"segment {seg.segment_id} ({self.topic} partition "
                                f"{self.partition}) has neither a bookie copy nor a tier file")
        loaded = _TierSegment.load(self._tier.read_segment(seg.tier_url))
        with self._lock:
            self._tier_cache[seg.segment_id] = loaded
            while len(self._tier_cache) > 2:
                self._tier_cache.popitem(last=False)
        return loaded

    def _cache_put(self, key: tuple[int, int], batch: pa.RecordBatch) -> None:
        self._entry_cache[key] = batch
        self._entry_cache_bytes += batch.nbytes
        while self._entry_cache_bytes > _CACHE_BYTES and self._entry_cache:
            _, old = self._entry_cache.popitem(last=False)
            self._entry_cache_bytes -= old.nbytes


class _TierSegment:
    """A segment read back from its Parquet file, in log order, served entry by entry."""

    def __init__(self, table: pa.Table, records: list[IndexRecord],
                 bounds: dict[int, tuple[int, int]]) -> None:
        self.table = table
        self.records = records
        self._bounds = bounds

    @classmethod
    def load(cls, rows: pa.Table) -> _TierSegment:
        table = rows.sort_by([("entry_id", "ascending"), ("batch_index", "ascending")])
        table = table.combine_chunks()
        entry_ids = table.column("entry_id").to_numpy()
        pts = table.column("publish_time").to_numpy()
        records, bounds = [], {}
        start = 0
        n = len(entry_ids)
        while start < n:
            e = int(entry_ids[start])
            end = start
            while end < n and entry_ids[end] == e:
                end += 1
            bounds[e] = (start, end - start)
            records.append(IndexRecord(e, 0, 0, end - start, int(pts[start]), int(pts[end - 1])))
            start = end
        return cls(table, records, bounds)

    def entry(self, entry_id: int) -> pa.RecordBatch:
        start, count = self._bounds[entry_id]
        batches = self.table.slice(start, count).to_batches()
        return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


class _Readers:
    """Open ledger files of one read call, at most one per (bookie, segment)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], LedgerReader] = {}

    def get(self, bookie: Bookie, segment_id: int) -> LedgerReader:
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
    if not key_ranges or any(r.is_full for r in key_ranges):
        return batch
    hashes = batch.column("key_hash")
    mask = None
    for r in key_ranges:
        m = pc.and_(pc.greater_equal(hashes, r.lo), pc.less(hashes, r.hi))
        mask = m if mask is None else pc.or_(mask, m)
    return batch.filter(mask)
