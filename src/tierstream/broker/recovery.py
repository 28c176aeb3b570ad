"""Crash recovery of segments left OPEN: seal each at its last durable entry.

Every replica of a ledger is scanned for its valid prefix of frames (a torn tail is cut). An
acknowledged entry is on at least an ack quorum of replicas, so the longest valid prefix holds
every acknowledged entry; it becomes the ledger's content on every replica (re-replication), and
the segment is sealed there. The frames' metadata rebuilds the producers' de-duplication state,
saved in the same metadata transaction as the seal (``managed_ledger/dedup.py`` says why).

Recovery is idempotent: rewriting a replica is write-to-temp-then-rename, and until the seal is
committed the segment stays OPEN, so a crash during recovery makes the next start redo it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tierstream.bookie.storage import Bookie
from tierstream.faults import crash_point
from tierstream.managed_ledger.dedup import ProducerDedup, StoredBatch
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.store import MetadataStore
from tierstream.timeutil import now_ms

__all__ = ["RecoveryReport", "recover_open_segments"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryReport:
    segment_id: int
    topic: str
    partition: int
    entries: int
    cut_bytes: int
    repaired_replicas: int


def recover_open_segments(metadata: MetadataStore, bookies: dict[str, Bookie]
                          ) -> list[RecoveryReport]:
    reports = []
    for seg in metadata.open_segments():
        reports.append(_recover(seg, metadata, bookies))
    return reports


def _recover(seg: SegmentRecord, metadata: MetadataStore, bookies: dict[str, Bookie]
             ) -> RecoveryReport:
    replicas = [bookies[b].recover_ledger(seg.segment_id) for b in seg.ensemble if b in bookies]
    best = max(replicas, key=lambda r: len(r.records), default=None)
    if best is None or not best.records:
        for b in seg.ensemble:
            if b in bookies:
                bookies[b].delete_ledger(seg.segment_id)
        metadata.delete_segment(seg.segment_id)
        log.info("recovery: dropped empty segment %s (%s/%s)", seg.segment_id, seg.topic,
                 seg.partition)
        return RecoveryReport(seg.segment_id, seg.topic, seg.partition, 0,
                              sum(r.cut_bytes for r in replicas), 0)
    source = bookies[best.bookie_id]
    frames = [(rec, source.read_raw_frame(seg.segment_id, rec)) for rec in best.records]
    repaired = 0
    for replica in replicas:
        if len(replica.records) != len(best.records) or replica.cut_bytes:
            repaired += 1
        # Rewriting also rebuilds each index from the frames, which is the truth.
        bookies[replica.bookie_id].rewrite_ledger(seg.segment_id, frames)
        crash_point("recovery.replica-repaired")
    records = best.records
    sealed = seg.with_stats(
        state=SegmentState.CLOSED,
        entries=len(records),
        messages=sum(r.messages for r in records),
        bytes=sum(r.frame_len for r in records),
        min_publish_time=records[0].first_publish_time,
        max_publish_time=records[-1].last_publish_time,
        sealed_at=now_ms(),
    )
    # The saved state covers every sealed segment; the frames of this one carry the rest.
    dedup = ProducerDedup.from_rows(metadata.load_dedup(seg.topic, seg.partition))
    for rec, meta in zip(records, best.metas, strict=True):
        if "p" in meta and "s" in meta:
            dedup.record(str(meta["p"]), StoredBatch(
                int(meta["s"]), seg.segment_id, rec.entry_id, rec.messages,
                rec.first_publish_time, rec.last_publish_time))
    metadata.seal_segment(sealed, dedup.rows())
    crash_point("recovery.sealed")
    cut = max(r.cut_bytes for r in replicas)
    log.info("recovery: sealed segment %s (%s/%s) at %d entries, cut %d torn bytes, "
             "repaired %d replica(s)", seg.segment_id, seg.topic, seg.partition, len(records),
             cut, repaired)
    return RecoveryReport(seg.segment_id, seg.topic, seg.partition, len(records), cut, repaired)
