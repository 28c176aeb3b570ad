"""Crash recovery of segments left OPEN: seal each at its last durable entry.

Every replica of a ledger is scanned for its valid prefix of frames (a torn tail is cut). An
acknowledged entry is on at least an ack quorum of replicas, so the longest valid prefix holds
every acknowledged entry; it becomes the ledger's content on every replica (re-replication), and
the segment is sealed there. The frames' metadata rebuilds the producers' de-duplication state,
saved in the same metadata transaction as the seal (``managed_ledger/dedup.py`` says why), and
names the transaction of each staged entry: its recorded state says whether readers see it
(``_staged_entries``).

Recovery is idempotent: rewriting a replica is write-to-temp-then-rename, and until the seal is
committed the segment stays OPEN, so a crash during recovery makes the next start redo it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from tierstream.bookie.ledger import IndexRecord, RecoveredLedger
from tierstream.errors import FencedError, NotFoundError, UnavailableError
from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.managed_ledger.dedup import ProducerDedup, StoredBatch
from tierstream.managed_ledger.open_segment import txn_of_producer
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.store import MetadataStore
from tierstream.metadata.transaction_records import TransactionRecords, TxnState
from tierstream.model.positions import entry_ranges
from tierstream.util.faults import crash_point
from tierstream.util.timeutil import now_ms

__all__ = ["RecoveryReport", "recover_open_segments"]

#: What a staged entry's transaction state makes of it in a segment recovery seals
_SHOWN, _SKIPPED, _SET_ASIDE = "shown", "skipped", "set aside"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryReport:
    segment_id: int
    topic: str
    partition: int
    entries: int
    cut_bytes: int
    repaired_replicas: int
    #: bookies of its ensemble that did not answer: their copies are re-replicated later
    missing_replicas: int = 0


def recover_open_segments(metadata: MetadataStore, bookies: dict[str, BookieClient], *,
                          ack_quorum: int = 1,
                          partitions: Collection[tuple[str, int]] | None = None
                          ) -> list[RecoveryReport]:
    """Seal every segment left open (``partitions``: of those partitions only, which this
    broker took over)."""
    reports = []
    for seg in metadata.open_segments():
        if partitions is None or (seg.topic, seg.partition) in partitions:
            reports.append(_recover(seg, metadata, bookies, ack_quorum))
    return reports


def _staged_entries(seg: SegmentRecord, records: list[IndexRecord],
                    metas: list[dict[str, Any]], metadata: MetadataStore
                    ) -> tuple[set[int], dict[str, list[list[Any]]]]:
    """The entries of a segment being sealed that readers skip, and those of them set aside
    per transaction (``[entry_id, rows, routed]``, written again at its commit), decided by
    each staging transaction's state as metadata records it (the decision is made there
    first, so this is what the broker would have done):

    - committed (or applied) where it was staged: shown;
    - committed to be written again (``moved`` in its record, or some of its entries in
      this partition set aside since the decision): skipped, and set aside unless the commit
      was applied already;
    - open or prepared: skipped and set aside, so that it can still be committed;
    - aborted, or forgotten long after it ended: skipped.

    Entries a commit wrote again (``txn/<id>/moved/<p>``) are ordinary, committed entries."""
    skipped: set[int] = set()
    set_aside: dict[str, list[list[Any]]] = {}
    states: dict[str, str] = {}
    txns = TransactionRecords(metadata)
    for rec, meta in zip(records, metas, strict=True):
        producer = meta.get("p")
        txn_id = txn_of_producer(producer)
        if txn_id is None or "/moved/" in str(producer):
            continue
        if txn_id not in states:
            states[txn_id] = _placement(txns, txn_id, seg.topic, seg.partition)
        state = states[txn_id]
        if state == _SHOWN:
            continue
        skipped.add(rec.entry_id)
        if state == _SET_ASIDE:
            set_aside.setdefault(txn_id, []).append([rec.entry_id, rec.messages,
                                                     meta.get("r")])
    return skipped, set_aside


def _placement(txns: TransactionRecords, txn_id: str, topic: str, partition: int) -> str:
    try:
        record = txns.get(txn_id)
    except NotFoundError:
        return _SKIPPED
    if record.state in (TxnState.OPEN, TxnState.PREPARED):
        return _SET_ASIDE
    if record.state == TxnState.ABORTED:
        return _SKIPPED
    if (topic, partition) in record.moved:
        return _SET_ASIDE if record.state == TxnState.COMMITTED else _SKIPPED
    if record.state == TxnState.COMMITTED and txns.has_set_aside(txn_id, topic, partition):
        return _SET_ASIDE  # set aside since the decision: the commit writes it all again
    return _SHOWN


def _replicas(seg: SegmentRecord, bookies: dict[str, BookieClient], ack_quorum: int
              ) -> list[RecoveredLedger]:
    """What each bookie of the segment's ensemble has of it; a network bookie is fenced at
    this broker's epoch first (its earlier writer's appends are refused from then on).
    Recovery needs all but ack-quorum-minus-one of them to answer: then every acknowledged
    entry (on an ack quorum) is on one that did."""
    replicas, missing = [], []
    for b in seg.ensemble:
        if b not in bookies:
            missing.append(f"{b}: not a bookie of this broker")
            continue
        try:
            replicas.append(bookies[b].recover_ledger(seg.segment_id))
        except FencedError:
            raise  # a newer broker fenced it: this one is not the writer
        except UnavailableError as exc:
            missing.append(f"{b}: {exc}")
    need = len(seg.ensemble) - ack_quorum + 1
    if missing and len(replicas) < need:
        raise UnavailableError(
            f"cannot recover segment {seg.segment_id} ({seg.topic} partition "
            f"{seg.partition}): {len(replicas)} of its {len(seg.ensemble)} bookies answered, "
            f"{need} are needed to be sure no acknowledged entry is missed "
            f"({'; '.join(missing)})")
    if missing:
        log.warning("recovery of segment %s without %d of its bookies: %s", seg.segment_id,
                    len(missing), "; ".join(missing))
    return replicas


def _recover(seg: SegmentRecord, metadata: MetadataStore, bookies: dict[str, BookieClient],
             ack_quorum: int) -> RecoveryReport:
    replicas = _replicas(seg, bookies, ack_quorum)
    missing = len(seg.ensemble) - len(replicas)
    best = max(replicas, key=lambda r: len(r.records), default=None)
    if best is None or not best.records:
        for r in replicas:
            bookies[r.bookie_id].delete_ledger(seg.segment_id)
        metadata.delete_segment(seg.segment_id)
        log.info("recovery: dropped empty segment %s (%s/%s)", seg.segment_id, seg.topic,
                 seg.partition)
        return RecoveryReport(seg.segment_id, seg.topic, seg.partition, 0,
                              sum(r.cut_bytes for r in replicas), 0)
    frames = list(bookies[best.bookie_id].read_raw_frames(seg.segment_id, best.records))
    repaired = 0
    for replica in replicas:
        if len(replica.records) != len(best.records) or replica.cut_bytes:
            repaired += 1
        # Rewriting also rebuilds each index from the frames, which is the truth.
        bookies[replica.bookie_id].rewrite_ledger(seg.segment_id, frames)
        crash_point("recovery.replica-repaired")
    records = best.records
    skipped, set_aside = _staged_entries(seg, records, best.metas, metadata)
    sealed = seg.with_stats(
        state=SegmentState.CLOSED,
        entries=len(records),
        messages=sum(r.messages for r in records if r.entry_id not in skipped),
        bytes=sum(r.frame_len for r in records),
        min_publish_time=records[0].first_publish_time,
        max_publish_time=records[-1].last_publish_time,
        sealed_at=now_ms(),
        skipped=entry_ranges(skipped),
    )
    # The saved state covers every sealed segment; the frames of this one carry the rest.
    dedup = ProducerDedup.from_rows(metadata.load_dedup(seg.topic, seg.partition))
    for rec, meta in zip(records, best.metas, strict=True):
        if "p" in meta and "s" in meta:
            dedup.record(str(meta["p"]), StoredBatch(
                int(meta["s"]), seg.segment_id, rec.entry_id, rec.messages,
                rec.first_publish_time, rec.last_publish_time))
    metadata.seal_segment(sealed, dedup.rows(), set_aside)
    crash_point("recovery.sealed")
    cut = max(r.cut_bytes for r in replicas)
    log.info("recovery: sealed segment %s (%s/%s) at %d entries, cut %d torn bytes, "
             "repaired %d replica(s)%s", seg.segment_id, seg.topic, seg.partition, len(records),
             cut, repaired, f", {len(skipped)} staged entries skipped, of which "
             f"{sum(len(v) for v in set_aside.values())} set aside" if skipped else "")
    return RecoveryReport(seg.segment_id, seg.topic, seg.partition, len(records), cut, repaired,
                          missing)
