"""Where each segment's data is as it moves to the tier, and what retention removed
(``broker/topics/offload.py`` drives the steps): columns of ``segments`` and the table
``deleted_segments``. A part of :class:`~tierstream.metadata.store.MetadataStore`."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from tierstream.metadata.backend import Tx
from tierstream.metadata.records import SegmentRecord

__all__ = ["TierRows"]


class TierRows:
    """The tier's rows of a metadata store (its ``atomic``, ``_held``, ``_by_topic``)."""

    def atomic(self) -> AbstractContextManager[Tx]:
        raise NotImplementedError

    def _held(self, c: Tx, segment_id: int) -> None:
        raise NotImplementedError

    def _by_topic(self, select: str, topic: str, partition: int | None) -> list[Any]:
        raise NotImplementedError

    def set_offload_pending(self, segment_id: int, url: str) -> None:
        """Record where the offloader writes this segment, before it writes anything, so a
        retry after a crash reuses the same file instead of leaving an orphan."""
        with self.atomic() as c:
            self._held(c, segment_id)
            c.execute("UPDATE segments SET offload_pending_url=? WHERE segment_id=?",
                      (url, segment_id))

    def flip_to_tier(self, segment_id: int, url: str, *, offloaded_at: int,
                     tier_bytes: int | None = None) -> None:
        """From now on readers read this segment from ``url`` (a file of ``tier_bytes``)."""
        with self.atomic() as c:
            self._held(c, segment_id)
            c.execute("UPDATE segments SET tier_url=?, offloaded_at=?, tier_bytes=?, "
                      "offload_pending_url=NULL WHERE segment_id=?",
                      (url, offloaded_at, tier_bytes, segment_id))

    def mark_bookie_deleted(self, segment_id: int, *, deleted_at: int) -> None:
        with self.atomic() as c:
            self._held(c, segment_id)
            c.execute("UPDATE segments SET bookie_deleted_at=? WHERE segment_id=?",
                      (deleted_at, segment_id))

    def record_deletion(self, record: SegmentRecord, *, deleted_at: int, reason: str) -> None:
        """Remove a segment record and remember what was removed and why, in one step."""
        with self.atomic() as c:
            self._held(c, record.segment_id)
            c.execute(
                "INSERT INTO deleted_segments (segment_id, topic, partition, entries, "
                "messages, min_publish_time, max_publish_time, deleted_at, reason) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (segment_id) DO UPDATE SET "
                "topic=excluded.topic, partition=excluded.partition, entries=excluded.entries, "
                "messages=excluded.messages, min_publish_time=excluded.min_publish_time, "
                "max_publish_time=excluded.max_publish_time, deleted_at=excluded.deleted_at, "
                "reason=excluded.reason",
                (record.segment_id, record.topic, record.partition, record.entries,
                 record.messages, record.min_publish_time, record.max_publish_time, deleted_at,
                 reason),
            )
            c.execute("DELETE FROM segments WHERE segment_id=?", (record.segment_id,))

    def deleted_segments(self, topic: str, partition: int | None = None) -> list[dict[str, Any]]:
        """Segments removed by retention, oldest first: what readers report as data loss."""
        rows = self._by_topic(
            "SELECT segment_id, topic, partition, entries, messages, min_publish_time, "
            "max_publish_time, deleted_at, reason FROM deleted_segments", topic, partition)
        keys = ("segment_id", "topic", "partition", "entries", "messages", "min_publish_time",
                "max_publish_time", "deleted_at", "reason")
        return [dict(zip(keys, r, strict=True)) for r in rows]
