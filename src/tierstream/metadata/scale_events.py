"""Scale events in the metadata store (elastic topics: ``lineage.py``).

The event is one metadata transaction: the topic's new partition count, a new open segment for
every partition, and the event row naming the first of those segments. The broker seals the
old open segments before it (``broker/store.py``), so the event row is the exact boundary.
"""

from __future__ import annotations

from tierstream.errors import ConflictError, NotFoundError
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.metadata.store import MetadataStore, _insert_segments

__all__ = ["record_scale_event"]


def record_scale_event(store: MetadataStore, name: str, old: int, new: int, *, at: int,
                       reason: str, ensembles: list[tuple[str, ...]]
                       ) -> tuple[TopicRecord, list[SegmentRecord]]:
    """Record a scale event of ``name`` from ``old`` to ``new`` partitions and, in the same
    transaction, a new open segment for every partition (``ensembles[p]``)."""
    with store.atomic() as c:
        row = c.execute("SELECT partitions FROM topics WHERE name=? AND deleting_at IS NULL",
                        (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"topic {name!r} does not exist")
        if row[0] != old:
            raise ConflictError(f"topic {name!r} has {row[0]} partitions, not {old}")
        c.execute("UPDATE topics SET partitions=? WHERE name=?", (new, name))
        segments = _insert_segments(c, name, list(enumerate(ensembles)), at)
        seq = c.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM scale_events WHERE topic=?",
                        (name,)).fetchone()[0]
        c.execute("INSERT INTO scale_events (topic, seq, old_partitions, new_partitions, "
                  "first_segment_id, at, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (name, seq, old, new, min(s.segment_id for s in segments), at, reason))
    return store.get_topic(name), segments
