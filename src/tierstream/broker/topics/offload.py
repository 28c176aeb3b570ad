"""The offloader: CLOSED segments to Parquet in the tier, registered in Iceberg; retention.

One segment moves in steps, each idempotent, each safe to crash after:

1. record the target URL in the segment record (a retry reuses it: no orphan files);
2. write the Parquet file (it appears whole or not at all);
3. add it to the topic's Iceberg table (on a retry: unless the current snapshot has it);
4. flip the segment record to the tier: from here on readers read the file;
5. after the deletion lag, delete the bookie copies.

Until step 4 readers use the bookies; after it, the tier. Re-running after a crash anywhere
completes the move and neither loses nor duplicates a message or a registered file.
Fault points (``fault(name)``) let tests crash the offloader between the steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from tierstream.errors import ConfigError, CorruptionError, NotOwnerError
from tierstream.metadata.compactions import compaction_thresholds, compactions_of
from tierstream.metadata.ownership import PartitionOwners
from tierstream.metadata.records import SegmentRecord, SegmentState, TopicRecord
from tierstream.metadata.store import MetadataStore
from tierstream.metadata.transaction_records import TransactionRecords
from tierstream.model.message_format import MESSAGE_SCHEMA
from tierstream.model.names import TopicName
from tierstream.model.positions import Position
from tierstream.tier.catalog import TierCatalog
from tierstream.tier.storage import TierStorage
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.managed_ledger.bookies.client import BookieClient
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["FAULT_POINTS", "OffloadHost", "Offloader"]

log = logging.getLogger(__name__)

FAULT_POINTS = ("after_parquet", "after_iceberg", "after_flip", "before_bookie_delete")


class OffloadHost(Protocol):
    """What the offloader uses of the store that runs it (the store implements it)."""

    metadata: MetadataStore
    bookies: dict[str, BookieClient]
    owners: PartitionOwners

    def topic(self, name: str) -> TopicRecord: ...

    def topics(self, namespace: str | None = None) -> list[TopicRecord]: ...

    def partitions(self, topic: str) -> list[PartitionLog]: ...


class Offloader:
    """Moves segments of one store to its tier. Runs inside the broker process."""

    def __init__(self, store: OffloadHost, tier: TierStorage, catalog: TierCatalog, *,
                 deletion_lag_ms: int, fault: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.tier = tier
        self.catalog = catalog
        self.deletion_lag_ms = deletion_lag_ms
        self._fault = fault or (lambda point: None)
        self._lock = threading.Lock()  # one offload pass at a time

    def __repr__(self) -> str:
        return f"Offloader(tier={self.tier.url!r}, deletion_lag_ms={self.deletion_lag_ms})"

    # -- one segment --------------------------------------------------------------------------

    def offload_segment(self, plog: PartitionLog, seg: SegmentRecord) -> SegmentRecord:
        """Move one CLOSED segment to the tier (steps 1-4); returns its new record."""
        self.store.owners.serving(seg.topic, seg.partition)  # the owner's work, not ours
        if seg.state != SegmentState.CLOSED:
            raise ConfigError(f"segment {seg.segment_id} is {seg.state}; only CLOSED ones move "
                              "(tierstream seal closes the open one)")
        if seg.tier_url is not None:
            return seg
        topic = TopicName.parse(seg.topic)
        metadata = self.store.metadata
        url = metadata.get_segment(seg.segment_id).offload_pending_url  # not a cached record
        retry = url is not None  # an earlier attempt may have gone as far as Iceberg
        if url is None:
            url = self.tier.segment_url(topic, seg.partition, seg.segment_id)
            metadata.set_offload_pending(seg.segment_id, url)
        # Only an attempt that recorded the URL first can have written the file (one that
        # crashed after it): a first attempt skips the lookup (on S3 a HEAD and a listing).
        if retry and self.tier.exists(url):
            size = self.tier.size(url)
        else:
            size = self.tier.write_segment(url, self.segment_rows(plog, seg))
        self._fault("after_parquet")
        self.catalog.register(topic, url, retry=retry)
        self._fault("after_iceberg")
        metadata.flip_to_tier(seg.segment_id, url, offloaded_at=now_ms(), tier_bytes=size)
        moved = metadata.get_segment(seg.segment_id)
        plog.update_segment(moved)
        self._fault("after_flip")
        log.info("offloaded segment %s of %s/%s to %s", seg.segment_id, seg.topic,
                 seg.partition, url)
        return moved

    def segment_rows(self, plog: PartitionLog, seg: SegmentRecord) -> pa.Table:
        """The rows that offloading ``seg`` writes to the tier, read from its bookies (and
        checked against its record's count)."""
        start = Position(seg.partition, seg.segment_id, 0, 0)
        end = Position(seg.partition, seg.segment_id, seg.entries, 0)
        batches = list(plog.read(start, end=end))
        rows = pa.Table.from_batches(batches, MESSAGE_SCHEMA)
        if rows.num_rows != seg.messages:
            raise CorruptionError(
                f"segment {seg.segment_id} ({seg.topic} partition {seg.partition}) read "
                f"{rows.num_rows} messages from bookies, its record says {seg.messages}")
        return rows

    def delete_bookie_copy(self, plog: PartitionLog, seg: SegmentRecord) -> SegmentRecord:
        """Step 5: delete the bookie copies of a tiered segment (the caller checks the lag)."""
        if seg.tier_url is None:
            raise ConfigError(f"segment {seg.segment_id} is not in the tier; its bookie copy "
                              "stays")
        # nothing is deleted of a partition another broker owns (each metadata write
        # checks too, in its transaction, but the bookies' files go first)
        self.store.owners.serving(seg.topic, seg.partition)
        self._fault("before_bookie_delete")
        for b in seg.ensemble:
            bookie = self.store.bookies.get(b)
            if bookie is not None:
                bookie.delete_ledger(seg.segment_id)
        self.store.metadata.mark_bookie_deleted(seg.segment_id, deleted_at=now_ms())
        moved = self.store.metadata.get_segment(seg.segment_id)
        plog.update_segment(moved)
        return moved

    # -- passes over topics -------------------------------------------------------------------

    def offload_topic(self, topic: str, *, older_than_ms: int | None = None,
                      now: int | None = None, segment_ids: set[int] | None = None
                      ) -> list[SegmentRecord]:
        """Offload every CLOSED bookie-resident segment of ``topic`` (whose newest message is
        older than ``older_than_ms``, if given; only ``segment_ids``, if given), then finish
        due bookie deletions."""
        explicit_now = now
        now = now_ms() if now is None else now
        moved = []
        with self._lock:
            for plog in self._served(topic):
                for seg in plog.closed_segments():
                    if seg.tier_url is not None or (segment_ids is not None
                                                    and seg.segment_id not in segment_ids):
                        continue
                    if older_than_ms is not None and (seg.max_publish_time or 0) >= \
                            now - older_than_ms:
                        continue
                    moved.append(self.offload_segment(plog, seg))
            # the segments just moved count their lag from now, not from when the pass began
            self._delete_due_bookie_copies(topic, now_ms() if explicit_now is None else now)
        return moved

    def _served(self, topic: str) -> list[PartitionLog]:
        """The partitions of ``topic`` this broker serves: another broker's owner offloads,
        deletes and applies retention in its own."""
        served = []
        for plog in self.store.partitions(topic):
            try:
                self.store.owners.serving(plog.topic, plog.partition)
            except NotOwnerError:
                continue
            served.append(plog)
        return served

    def _delete_due_bookie_copies(self, topic: str, now: int) -> int:
        deleted = 0
        # a segment holding an undecided transaction's set-aside entries keeps its bookie
        # copy: the tier file does not have them, and the commit writes them again from it
        needed = TransactionRecords(self.store.metadata).set_aside_segments()
        for plog in self._served(topic):
            for seg in plog.closed_segments():
                if seg.tier_url is not None and seg.bookie_deleted_at is None and \
                        seg.offloaded_at is not None and seg.segment_id not in needed and \
                        now - seg.offloaded_at >= self.deletion_lag_ms:
                    self.delete_bookie_copy(plog, seg)
                    deleted += 1
        return deleted

    def apply_retention(self, topic: str, *, now: int | None = None) -> list[dict[str, Any]]:
        """Delete segments whose newest message is older than the topic's retention, from
        bookies, the tier and the Iceberg table, and record each deletion."""
        now = now_ms() if now is None else now
        record = self.store.topic(topic)
        if record.retention_ms is None:
            return []
        removed = []
        name = TopicName.parse(topic)
        needed = TransactionRecords(self.store.metadata).set_aside_segments()
        # a compacted topic's history before a partition's horizon is its snapshot: only
        # what the snapshot covers may go, or a key's latest value would leave its view
        snapshots = compactions_of(self.store.metadata, str(name))
        compacted = bool(snapshots) or str(name) in compaction_thresholds(self.store.metadata)
        with self._lock:
            for plog in self._served(topic):
                snap = snapshots.get(plog.partition)
                for seg in plog.closed_segments():
                    if (seg.max_publish_time or 0) >= now - record.retention_ms:
                        break  # max publish time never decreases along the segments
                    if compacted and (snap is None or Position(
                            seg.partition, seg.segment_id, seg.entries, 0) > snap.horizon):
                        log.info("retention keeps segment %s of %s/%s: its compaction "
                                 "snapshot does not cover it yet", seg.segment_id, topic,
                                 seg.partition)
                        break
                    if seg.segment_id in needed:
                        log.info("retention keeps segment %s of %s/%s until the transactions "
                                 "with entries set aside there end", seg.segment_id, topic,
                                 seg.partition)
                        break
                    plog.remove_segment(seg.segment_id)  # stop serving it first
                    if seg.tier_url is not None:
                        self.catalog.unregister(name, seg.tier_url, seg.segment_id)
                        self.tier.delete(seg.tier_url)
                    for b in seg.ensemble:
                        if b in self.store.bookies:
                            self.store.bookies[b].delete_ledger(seg.segment_id)
                    self.store.metadata.record_deletion(seg, deleted_at=now, reason="retention")
                    removed.append({"segment_id": seg.segment_id, "partition": seg.partition,
                                    "messages": seg.messages})
                    log.info("retention removed segment %s of %s/%s", seg.segment_id, topic,
                             seg.partition)
        return removed

    def run_policies(self, *, offload_after_ms: int | None, threshold_bytes: int | None,
                     now: int | None = None) -> dict[str, int]:
        """The broker's automatic pass: offload by age and by bookie bytes per topic, delete
        bookie copies past the lag, apply retention."""
        now = now_ms() if now is None else now
        counts = {"offloaded": 0, "bookie_copies_deleted": 0, "retained_out": 0}
        for topic in self.store.topics():
            if offload_after_ms is not None:
                counts["offloaded"] += len(self.offload_topic(topic.name,
                                                              older_than_ms=offload_after_ms,
                                                              now=now))
            if threshold_bytes is not None:
                counts["offloaded"] += self._offload_over_threshold(topic.name, threshold_bytes)
            with self._lock:
                counts["bookie_copies_deleted"] += self._delete_due_bookie_copies(topic.name,
                                                                                  now)
            counts["retained_out"] += len(self.apply_retention(topic.name, now=now))
        return counts

    def _offload_over_threshold(self, topic: str, threshold_bytes: int) -> int:
        """Offload the oldest closed segments while the topic's bookies hold too many bytes."""
        with self._lock:
            plogs = self.store.partitions(topic)
            resident = [(seg, plog) for plog in plogs for seg in plog.segments()
                        if seg.tier_url is None]
            total = sum(seg.bytes for seg, _ in resident)
            moved = 0
            candidates = sorted(((s, p) for s, p in resident if s.state == SegmentState.CLOSED),
                                key=lambda sp: (sp[0].max_publish_time or 0, sp[0].segment_id))
            for seg, plog in candidates:
                if total <= threshold_bytes:
                    break
                self.offload_segment(plog, seg)
                total -= seg.bytes
                moved += 1
            return moved
