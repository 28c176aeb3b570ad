"""The managed ledger of one partition, on the broker: appends and rollover. Reads and the
tail are in ``partition_reads.py``, position arithmetic in ``partition_positions.py``, what
readers may see of the open segment (transactions' staged entries) in ``visibility.py``.

Appends take the partition lock only to assign the entry id and hand the entry to the bookies;
the wait for the ack quorum happens outside it, so concurrent producers of one partition share
the bookies' group commits. Each bookie writes in queue order, so quorums complete in entry order
and the last confirmed entry (LAC) only ever moves forward by one.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tierstream.bookie.ledger import IndexRecord
from tierstream.errors import (
    ConfigError,
    FencedError,
    NotFoundError,
    NotOwnerError,
    StaleRoutingError,
    UnavailableError,
)
from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.managed_ledger.dedup import ProducerDedup, StoredBatch
from tierstream.managed_ledger.entries import ENTRY_PUBLISH_TIME, PRODUCE_PUBLISH_TIME, build_entry
from tierstream.managed_ledger.open_segment import (
    TXN_PRODUCER,
    Ack,
    InFlight,
    OpenSegment,
    PendingAppend,
    TxnPart,
)
from tierstream.managed_ledger.partition_reads import TierSegment, filter_key_ranges
from tierstream.managed_ledger.rates import RateMeter
from tierstream.managed_ledger.rollover import PartitionRollover
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.store import MetadataStore
from tierstream.metadata.transaction_records import TransactionRecords
from tierstream.model.message_format import as_produce_columns
from tierstream.model.positions import Position
from tierstream.tier.storage import TierStorage
from tierstream.util.faults import crash_point
from tierstream.util.timeutil import describe_duration, format_ms, now_ms

__all__ = ["Ack", "PartitionLog", "filter_key_ranges"]

log = logging.getLogger(__name__)

class PartitionLog(PartitionRollover):
    """One partition's segments; owned by the broker's :class:`~tierstream.broker.store.Store`."""

    def __init__(
        self,
        *,
        topic: str,
        partition: int,
        metadata: MetadataStore,
        bookies: dict[str, BookieClient],
        choose_ensemble: Callable[[], tuple[str, ...]],
        ack_quorum: int,
        max_entries: int,
        max_bytes: int,
        rollover_ms: int,
        closing: threading.Event,
        tier: TierStorage | None = None,
        open_record: SegmentRecord | None = None,
        routing: int | None = None,
        on_fenced: Callable[[str, int, str], None] | None = None,
        on_sealed: Callable[[SegmentRecord, bool], None] | None = None,
        max_publish_ahead_ms: int | None = None,
    ) -> None:
        self.topic = topic
        #: a requested publish time further ahead of this broker's clock is refused: it
        #: would stamp every later message of the partition with it (publish time is kept
        #: monotonic), hiding them from time windows for good
        self.max_publish_ahead_ms = max_publish_ahead_ms
        self.partition = partition
        #: the topic's partition count in force: a batch routed by another is refused
        #: (set under the lock at a scale event: broker/store.py)
        self.routing = routing
        self._metadata = metadata
        self._bookies = bookies
        self._choose_ensemble = choose_ensemble
        self._ack_quorum = ack_quorum
        #: told (topic, partition, reason) when a bookie refused a write as fenced, or the
        #: metadata a seal: a newer broker took the partition, or the store, over
        self._on_fenced = on_fenced
        #: told of each sealed segment, and whether a bookie of it missed writes or the seal
        self._on_sealed = on_sealed
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._rollover_ms = rollover_ms
        self._closing = closing
        self._tier = tier
        self._tier_cache: OrderedDict[int, TierSegment] = OrderedDict()
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
        self._lost: NotOwnerError | None = None  # another broker owns it: lose()
        self.appended = 0  # messages appended since the broker started (auto-scaling)
        #: messages since the broker started whose requested publish time was before the
        #: partition's newest and were stamped with that (topic stats: ``restamped``)
        self.restamped = 0
        self.rate_in = RateMeter()   # confirmed entries (topic stats, metrics)
        self.rate_out = RateMeter()  # what the broker streamed to readers and consumers
        self._held = False  # a transaction commit is being applied: see hold()
        #: transactions with staged entries in the open segment (or set aside earlier)
        self._txns: dict[str, TxnPart] = {}
        self._txn_records = TransactionRecords(metadata)
        if open_record is None:
            self._open = self._new_open_segment()
        else:  # registered by the caller (with its topic, or with every partition at start)
            for b in open_record.ensemble:
                self._bookies[b].create_ledger(open_record.segment_id)
            self._open = OpenSegment(open_record)

    # -- appends ------------------------------------------------------------------------------

    def append(self, batch: pa.RecordBatch, *, producer: str | None, sequence_id: int | None,
               requested_now: int | None = None, routed: int | None = None) -> Ack:
        """Append one batch as one entry; returns once an ack quorum has it on disk.

        A batch whose ``(producer, sequence_id)`` was already stored is not stored again: the
        ack repeats the original one with ``duplicate=True``. A re-send of a batch that is still
        being written waits for that write's outcome. A batch ``routed`` by a partition count
        that is no longer the topic's (it grew meanwhile) is refused with StaleRoutingError,
        unless it was stored before: the producer routes it again.
        """
        return self.submit(batch, producer=producer, sequence_id=sequence_id,
                           requested_now=requested_now, routed=routed).result()

    def submit(self, batch: pa.RecordBatch, *, producer: str | None, sequence_id: int | None,
               requested_now: int | None = None, routed: int | None = None,
               txn: str | None = None) -> PendingAppend:
        """:meth:`append` without the wait: the entry is on its way to the bookies when this
        returns (in entry order), and ``result()`` waits for its quorum and gives the ack.
        A stream of batches submitted back to back shares the bookies' group commits (one
        fsync for what arrived meanwhile) instead of paying one each. Refusals (a deleted
        topic, stale routing, an empty batch) are raised here.

        With ``txn``, the entry is staged by that transaction (as the producer ``txn/<id>``,
        its own sequence ids): durable like any entry, invisible until the transaction is
        decided, and so is everything confirmed after it (:meth:`resolve`). A staged entry
        routed by a count the topic no longer has is taken: the commit routes it again."""
        batch, columns = as_produce_columns(batch)  # asked for once (each is ~9,000 instr.)
        if batch.num_rows == 0:
            raise ConfigError("cannot append an empty batch")
        times = columns[PRODUCE_PUBLISH_TIME]
        requested = None if times.null_count == len(times) else times  # None: the broker's
        self._check_publish_times(requested, requested_now)
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._gone.is_set():
                raise NotFoundError(f"topic {self.topic!r} was deleted")
            if txn is not None:
                part = self._txn_part(txn)
                producer, sequence_id = TXN_PRODUCER + txn, part.next_seq
                part.next_seq += 1
            elif producer is not None and sequence_id is not None:
                duplicate = self._check_sequence(producer, sequence_id)
                if duplicate is not None:
                    return PendingAppend(self._finish, ack=duplicate)
                if (cut := self._dedup.refused_after_cut(producer, sequence_id)) is not None:
                    raise UnavailableError(  # on the wire behind a failed write (dedup.py)
                        f"batch {sequence_id} of producer {producer!r} is not stored: the write"
                        f" of its sequence id {cut} failed ({self.topic} partition "
                        f"{self.partition}); send again from sequence id {cut}")
            if txn is None and routed is not None and self.routing is not None \
                    and routed != self.routing:
                raise StaleRoutingError(
                    f"topic {self.topic!r} now has {self.routing} partitions: a batch routed "
                    f"by {routed} is not stored; route it again", partitions=self.routing)
            self._reopen_if_sealed()
            self._roll_if_due(now_ms())
            self._roll_if_full()
            self.appended += batch.num_rows
            seg = self._open
            entry_id = seg.next_entry
            seg.next_entry += 1
            now = requested_now if requested_now is not None else now_ms()
            message_batch, first_pt, last_pt = build_entry(
                batch, partition=self.partition, segment_id=seg.record.segment_id,
                entry_id=entry_id, now=now, floor=self._last_pt, columns=columns)
            self._last_pt = last_pt
            payload = message_batch.serialize()
            meta: dict[str, Any] = {}
            if producer is not None and sequence_id is not None:
                meta = {"p": producer, "s": sequence_id}
                if txn is not None:
                    meta["r"] = routed  # recovery decides a staged entry's place by it
            futures: list[Future[IndexRecord]] = []
            for b in seg.record.ensemble:
                futures.append(self._bookies[b].append(seg.record.segment_id, entry_id, meta,
                                                       payload, message_batch.num_rows,
                                                       first_pt, last_pt))
                crash_point("append.partial-replicas", before=futures[0].result)
            seg.in_flight[entry_id] = InFlight(futures, message_batch, producer, sequence_id,
                                               payload.size, txn=txn, routed=routed)
        return PendingAppend(self._finish, seg=seg, entry_id=entry_id, futures=futures, batch=batch,
                             stored=message_batch, sequence_id=sequence_id, requested=requested)

    def _finish(self, p: PendingAppend) -> Ack:
        """Wait for a submitted entry's quorum and confirm it: its ack."""
        assert p.seg is not None and p.entry_id is not None and p.stored is not None
        assert p.batch is not None
        seg, entry_id, message_batch = p.seg, p.entry_id, p.stored
        self._wait_quorum(p.futures)  # outside the lock: other producers keep appending
        with self._lock:
            self._advance(seg)
            if len(seg.records) + len(seg.hidden) <= entry_id:
                fenced = [f.exception() for f in p.futures
                          if isinstance(f.exception(), FencedError)]
                if fenced:
                    self._fenced(str(fenced[0]))
                    if self._lost is not None:  # another broker owns the partition now
                        raise self._lost
                    raise FencedError(
                        f"entry {entry_id} of {self.topic} partition {self.partition} is not "
                        f"stored: {fenced[0]}; reconnect to the broker that serves the store "
                        "now")
                errors = [str(f.exception()) for f in p.futures if f.exception() is not None]
                raise UnavailableError(
                    f"entry {entry_id} of segment {seg.record.segment_id} ({self.topic} "
                    f"partition {self.partition}) did not reach an ack quorum of "
                    f"{self._ack_quorum} bookies: {'; '.join(errors) or 'segment was sealed'}"
                )
            crash_point("append.before-ack")
            if seg is self._open and not self._held and (
                    len(seg.records) >= self._max_entries or seg.bytes >= self._max_bytes):
                self._roll()
        restamped = 0 if p.requested is None else int(pc.sum(pc.less(
            p.requested, message_batch.column(ENTRY_PUBLISH_TIME))).as_py() or 0)
        self.restamped += restamped
        # the publish times as the quorum's record has them (not two scalars of a column)
        rec = next(f.result() for f in p.futures if f.done() and f.exception() is None)
        return Ack(self.partition, seg.record.segment_id, entry_id, message_batch.num_rows,
                   rec.first_publish_time, rec.last_publish_time, p.sequence_id,
                   restamped=restamped)

    def _check_publish_times(self, requested: pa.Array | None, requested_now: int | None
                             ) -> None:
        if requested is None:
            return  # the broker stamps them
        latest = pc.max(requested).as_py()
        if latest is None or self.max_publish_ahead_ms is None:
            return
        now = requested_now if requested_now is not None else now_ms()
        if latest > now + self.max_publish_ahead_ms:
            raise ConfigError(
                f"invalid publish_time {latest} ({format_ms(latest)}): "
                f"{describe_duration(latest - now)} ahead of the broker's clock "
                f"({format_ms(now)}), and this broker accepts at most "
                f"{describe_duration(self.max_publish_ahead_ms)} (broker option "
                "--max-publish-time-ahead): every later message of the partition would be "
                "stamped with it, as publish time never runs backwards; nothing of this batch "
                "was stored")

    def _wait_quorum(self, futures: list[Future[IndexRecord]]) -> None:
        if self._ack_quorum >= len(futures):  # each must answer: waited for in turn (a
            for f in futures:                 # future's own wait, not wait()'s waiters)
                f.exception()
            return
        pending = set(futures)
        while pending:
            ok = sum(1 for f in futures if f.done() and f.exception() is None)
            if ok >= self._ack_quorum:
                return
            _, pending = wait_futures(pending, return_when="FIRST_COMPLETED")

    def _advance(self, seg: OpenSegment, *, roll_on_failure: bool = True) -> None:
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
            if any(f.done() and f.exception() is not None for f in pending.futures):
                # stored on an ack quorum, but the ensemble lost a member: the segment is
                # sealed after what is confirmed, and the next one placed on others
                seg.failed = True
            record = ok[0].result()
            self.rate_in.add(record.messages, record.frame_len)
            if pending.producer is not None and pending.sequence_id is not None:
                self._dedup.record(pending.producer, StoredBatch(
                    pending.sequence_id, seg.record.segment_id, entry_id, record.messages,
                    record.first_publish_time, record.last_publish_time))
            state = None
            if pending.txn is not None:
                part = self._txn_part(pending.txn)
                seg.txn_of[entry_id] = (pending.txn, pending.routed)
                part.entries.append(entry_id)
                part.rows += record.messages
                part.routed.add(pending.routed)
                state = part.state
            if self._held or seg.hidden or state == "pending":
                # not visible yet: a commit is being applied, or an undecided transaction's
                # entry is here or before it (visibility is a prefix: Pulsar's max read
                # position). A staged entry's rows are not kept in memory: read when shown.
                if state is None and not self._held and seg.blocked_since is None:
                    seg.blocked_since = time.monotonic()
                keep = None if (pending.txn is not None or self._held) else pending.batch
                seg.hidden.append((record, keep))
            elif state == "skipped":
                self._show_skipped(seg, record)
                advanced = True
            else:
                self._show(seg, record, pending.batch)
                advanced = True
        if advanced:
            self._changed.notify_all()
        if seg.failed and roll_on_failure and seg is self._open:
            self._roll()

    def forget_producers(self, names: set[str]) -> None:
        """Drop the de-duplication state of producers that will never send again (applied
        transactions): it is saved with every seal, so it must not grow without end."""
        with self._lock:
            self._dedup.forget(names)

    def _check_sequence(self, producer: str, sequence_id: int) -> Ack | None:
        """The original ack if this batch is stored already, else None (lock held).

        An entry is recorded as stored only once it is confirmed; while an entry of the same
        producer with this id or a later one is still in flight, its outcome decides, so wait.
        Before waiting, entries whose quorum came are confirmed: the one this batch repeats
        may have been submitted by a path that will never wait for it (a connection whose
        receipt thread died), and nothing else would confirm it.
        """
        confirmed = False
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
            if not confirmed:
                self._advance(self._open)
                confirmed = True
                continue
            confirmed = False
            self._changed.wait(timeout=1.0)

    @property
    def lock(self) -> Any:
        """This log's lock: held by a scale event from sealing to reopening."""
        return self._lock

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

    def lose(self, refusal: NotOwnerError) -> None:
        """Another broker owns this partition now: stop serving it, without sealing (the
        owner fences the open ledger and recovers it). Appends are refused with
        ``refusal``, following reads end, and rollover, stats and a clean shutdown leave
        it alone."""
        with self._lock:
            self._lost = refusal
            self._gone.set()
            self._changed.notify_all()

    @property
    def lost(self) -> bool:
        """Whether another broker owns this partition now (:meth:`lose`)."""
        return self._lost is not None

    def flush_stats(self) -> None:
        """Write the open segment's live stats to the metadata store (planners read them).
        They are taken under the partition's lock and written outside it: appends and reads
        never wait for the metadata server (the write is of an open segment only, so one
        that lands after the seal changes nothing)."""
        with self._lock:
            if not self._stats_dirty or self._open.sealed or self._lost is not None:
                return
            seg = self._open
            record = seg.record.with_stats(
                entries=len(seg.records), messages=seg.messages, bytes=seg.bytes,
                min_publish_time=seg.min_pt, max_publish_time=seg.max_pt)
            self._stats_dirty = False  # an append meanwhile makes them dirty again
        try:
            self._metadata.update_segment_stats(record)
        except BaseException:
            with self._lock:
                self._stats_dirty = True
            raise

    # -- views --------------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "segments": len(self._closed_segments) + 1,
                "open_entries": len(self._open.records),
                "replica_failures": self.replica_failures,
            }

    def producers(self) -> list[str]:
        """Names of the producers whose de-duplication state this partition keeps."""
        with self._lock:
            return self._dedup.producers()

    def producer_state(self, producer: str) -> int | None:
        """The producer's last stored sequence id here, or None."""
        with self._lock:
            return self._dedup.last(producer)

    def last_stored(self, producer: str) -> dict[str, Any] | None:
        """The producer's last stored message here: its sequence id (its batch's), key and
        the SHA-256 of its value, so that a replay can be told from other input under the
        same name (``tierstream produce --name``); None if it stored nothing here, or its
        last batch is older than the remembered acks (then only ``sequence_id``)."""
        with self._lock:
            last = self._dedup.last(producer)
            stored = None if last is None else self._dedup.stored(producer, last)
        if last is None or stored is None:
            return None if last is None else {"sequence_id": last}
        at = Position(self.partition, stored.segment_id, stored.entry_id, 0)
        rows = [b for b in self.read(at, end=Position(self.partition, stored.segment_id,
                                                      stored.entry_id + 1, 0)) if b.num_rows]
        if not rows:  # removed by retention since
            return {"sequence_id": last}
        key, value = rows[-1].column("key")[-1].as_py(), rows[-1].column("value")[-1].as_py()
        return {"sequence_id": last, "key": key,
                "value_sha256": hashlib.sha256(value or b"").hexdigest()}

