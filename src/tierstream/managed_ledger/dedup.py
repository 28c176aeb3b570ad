"""Producer de-duplication state of one partition: which sequence ids are stored, and where.

A named producer numbers its batches per partition (0, 1, 2, ...) and re-sends every batch it
has no ack for after a reconnect. The broker stores a batch only if its sequence id is above the
producer's last *stored* one, and answers a re-sent batch with the original ack (position,
count, publish times) when it is among the producer's last :data:`WINDOW` batches.

Why this is crash-safe (the invariant the broker keeps; ``tests/store/test_crash_points.py``
kills it at every step that could break it):

- An id is recorded only when its entry is *confirmed* (on the ack quorum), never when it is
  submitted: a batch whose write fails is not mistaken for a stored one when it is re-sent.
- Nothing of a producer is stored past a batch whose write failed until that batch is sent
  again (:meth:`ProducerDedup.cut_off`): a later batch already on the wire would otherwise move
  the last stored id past it, and its re-send would be taken for a duplicate.
- Every confirmed entry is either in a segment that is OPEN in metadata, whose frames carry
  ``(producer, sequence id)`` and are re-read by recovery, or in a CLOSED one, whose seal was
  committed **in the same metadata transaction** as the state covering it. So the state after
  any crash is derived from what is durable, with no window between two writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["WINDOW", "ProducerDedup", "StoredBatch"]

#: Acks remembered per producer and partition: at least a producer's batches in flight
#: (``Producer.max_in_flight``, 8 by default), so every re-sent batch gets its original ack.
WINDOW = 64


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """One stored batch of a named producer: what its ack says."""

    sequence_id: int
    segment_id: int
    entry_id: int
    messages: int
    first_publish_time: int
    last_publish_time: int

    def to_list(self) -> list[int]:
        return [self.sequence_id, self.segment_id, self.entry_id, self.messages,
                self.first_publish_time, self.last_publish_time]


class ProducerDedup:
    """Per producer: the last stored sequence id and the acks of the last :data:`WINDOW`
    batches. Not thread-safe: the partition log calls it under its lock."""

    def __init__(self, recent: Mapping[str, Iterable[StoredBatch]] | None = None) -> None:
        self._recent: dict[str, list[StoredBatch]] = {
            p: sorted(batches, key=lambda b: b.sequence_id)[-WINDOW:]
            for p, batches in (recent or {}).items()}
        #: per producer, the first sequence id a failed write cut off (in memory: after a
        #: crash, nothing was stored past it)
        self._cut: dict[str, int] = {}

    def last(self, producer: str) -> int | None:
        """The producer's last stored sequence id, or None if it stored nothing here."""
        recent = self._recent.get(producer)
        return recent[-1].sequence_id if recent else None

    def stored(self, producer: str, sequence_id: int) -> StoredBatch | None:
        """The stored batch with this id, if it is recent enough to be remembered."""
        for b in reversed(self._recent.get(producer, [])):
            if b.sequence_id == sequence_id:
                return b
            if b.sequence_id < sequence_id:
                return None
        return None

    def record(self, producer: str, batch: StoredBatch) -> None:
        """Remember a confirmed batch (ids only move forward; an older one is ignored)."""
        recent = self._recent.setdefault(producer, [])
        if recent and batch.sequence_id <= recent[-1].sequence_id:
            return
        recent.append(batch)
        if len(recent) > WINDOW:
            del recent[:len(recent) - WINDOW]

    def cut_off(self, producer: str, sequence_id: int) -> None:
        """A write of this batch failed, and with it those after it in its segment."""
        self._cut[producer] = min(sequence_id, self._cut.get(producer, sequence_id))

    def refused_after_cut(self, producer: str, sequence_id: int) -> int | None:
        """For a batch that is not a duplicate: the sequence id cut off before it, which must
        be sent again first (refuse this one), or None (store it). The re-send of the cut-off
        batch itself, or of an earlier one, ends the cut."""
        cut = self._cut.get(producer)
        if cut is not None and sequence_id > cut:
            return cut
        self._cut.pop(producer, None)
        return None

    def producers(self) -> list[str]:
        return list(self._recent)

    def forget(self, producers: set[str]) -> None:
        """Drop these producers' state (they will never send again)."""
        for p in producers:
            self._recent.pop(p, None)
            self._cut.pop(p, None)

    def rows(self) -> dict[str, tuple[int, Any]]:
        """What the metadata store keeps: per producer, (last id, the recent acks as JSON)."""
        return {p: (recent[-1].sequence_id, {"recent": [b.to_list() for b in recent]})
                for p, recent in self._recent.items() if recent}

    @classmethod
    def from_rows(cls, rows: Mapping[str, tuple[int, Any]]) -> ProducerDedup:
        """Inverse of :meth:`rows`; also reads the older one-position format
        (``{"segment_id", "entry_id"}``), whose counts and times were not kept."""
        recent: dict[str, list[StoredBatch]] = {}
        for producer, (last, saved) in rows.items():
            if "recent" in saved:
                recent[producer] = [StoredBatch(*map(int, b)) for b in saved["recent"]]
            else:
                recent[producer] = [StoredBatch(int(last), int(saved["segment_id"]),
                                                int(saved["entry_id"]), 0, 0, 0)]
        return cls(recent)
