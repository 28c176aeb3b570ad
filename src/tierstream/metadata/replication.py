"""Which segments lack a whole copy on their bookies, kept in the metadata store.

BookKeeper marks under-replicated ledgers in ZooKeeper, not in its auditor's memory, so that
any recovery worker resumes after a failover; this is the same list for tierstream: a row per
segment known to lack a copy (sealed while a bookie of it did not answer, placed on fewer
bookies than the write quorum, recovered without one, found short by the auditor, or held by
a bookie whose disk was lost), written when it is learnt and removed in the same transaction
that records the segment's repaired ensemble. A broker that takes the store over, or restarts,
goes on from it; ``broker stats`` counts it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tierstream.metadata.backend import Tx
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.store import SEGMENT_COLUMNS, MetadataStore, segment_of_row
from tierstream.util.timeutil import now_ms

__all__ = ["mark_under_replicated", "repaired", "segments_on_bookies", "segments_with_bookie",
           "under_replicated"]


def mark_under_replicated(metadata: MetadataStore, segments: Iterable[tuple[int, str]], *,
                          tx: Tx | None = None) -> None:
    """Record that each ``(segment id, reason)`` lacks a copy (a segment already listed keeps
    its first reason and time). In ``tx`` when given, else in a transaction of its own."""
    rows = [(int(s), reason, now_ms()) for s, reason in segments]
    if not rows:
        return
    sql = ("INSERT INTO under_replicated (segment_id, reason, since) VALUES (?, ?, ?) "
           "ON CONFLICT (segment_id) DO NOTHING")
    if tx is not None:
        tx.executemany(sql, rows)
        return
    with metadata.atomic() as c:
        c.executemany(sql, rows)


def under_replicated(metadata: MetadataStore) -> dict[int, str]:
    """Every segment listed as lacking a copy, with why."""
    return {int(s): str(r) for s, r in metadata.query(
        "SELECT segment_id, reason FROM under_replicated ORDER BY segment_id")}


def repaired(metadata: MetadataStore, segment_id: int,
             ensemble: tuple[str, ...] | None = None) -> None:
    """``segment_id`` needs nothing more: off the list, with its new ``ensemble`` recorded in
    the same transaction when it was re-replicated."""
    with metadata.atomic() as c:
        if ensemble is not None:
            c.execute("UPDATE segments SET ensemble=? WHERE segment_id=?",
                      (json.dumps(list(ensemble)), segment_id))
        c.execute("DELETE FROM under_replicated WHERE segment_id=?", (segment_id,))


def segments_on_bookies(metadata: MetadataStore) -> list[SegmentRecord]:
    """Closed segments whose copies are still on bookies (what an audit checks)."""
    rows = metadata.query(
        f"SELECT {SEGMENT_COLUMNS} FROM segments WHERE state=? AND entries > 0 AND "
        "bookie_deleted_at IS NULL ORDER BY segment_id", (SegmentState.CLOSED,))
    return [segment_of_row(r) for r in rows]


def segments_with_bookie(metadata: MetadataStore, bookie_id: str, *, tx: Tx | None = None
                         ) -> list[int]:
    """Segments with entries whose ensemble names ``bookie_id`` and whose copies are still
    on bookies (an open one's count is as last recorded: the broker also learns of a lost
    copy when that bookie refuses the next entry)."""
    sql = ("SELECT segment_id, ensemble FROM segments WHERE bookie_deleted_at IS NULL AND "
           "entries > 0 AND ensemble LIKE ?")
    args = (f'%{json.dumps(bookie_id)}%',)
    rows = tx.execute(sql, args).fetchall() if tx is not None else metadata.query(sql, args)
    return [int(s) for s, ensemble in rows if bookie_id in json.loads(ensemble)]
