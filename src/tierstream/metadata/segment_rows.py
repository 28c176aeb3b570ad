"""The rows of segments as the metadata store writes them: a partition's new open segments
(checked against its owner), a segment's statistics and seal, and the producers'
de-duplication state saved with a seal. Shared by ``store.py`` and ``scale_events.py``, which
write segments in their own transactions.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tierstream.metadata.backend import Tx
from tierstream.metadata.records import SegmentRecord, SegmentState

__all__ = ["SEGMENT_COLUMNS", "SEGMENT_FIELDS", "Holder", "insert_segments", "owners_changed",
           "save_dedup", "segment_of_row", "update_stats"]


SEGMENT_COLUMNS = (
    "topic, partition, segment_id, state, entries, messages, bytes, min_publish_time, "
    "max_publish_time, created_at, sealed_at, ensemble, tier_url, offloaded_at, bookie_deleted_at, "
    "offload_pending_url, tier_bytes, skipped"
)
SEGMENT_FIELDS = tuple(c.strip() for c in SEGMENT_COLUMNS.split(","))


@functools.lru_cache(maxsize=1024)
def _ensemble(text: str) -> tuple[str, ...]:
    return tuple(json.loads(text))  # few distinct ensembles, many segments: decode each once


def segment_of_row(row: tuple[Any, ...]) -> SegmentRecord:
    """The record of a row of ``SEGMENT_COLUMNS``. The columns are the record's fields and
    were checked when written, so the record is filled in directly (a plan reads thousands)."""
    record = object.__new__(SegmentRecord)
    fields = record.__dict__
    fields.update(zip(SEGMENT_FIELDS, row, strict=True))
    fields["ensemble"] = _ensemble(fields["ensemble"])
    skipped = fields["skipped"]
    fields["skipped"] = () if skipped is None else tuple(
        (int(lo), int(hi)) for lo, hi in json.loads(skipped))
    return record


class Holder(Protocol):
    """The broker writing a store, as its segment writes check it (``ownership.py``)."""

    def hold(self, c: Tx, topic: str, partitions: Sequence[int]) -> None:
        """Before the partitions' new segments: owned by this broker, or claimed now."""
        ...

    def check(self, c: Tx, topic: str, partition: int) -> None:
        """Before a partition's segments change: still owned by this broker."""
        ...

    def foreign(self, c: Tx, partitions: set[tuple[str, int]]) -> dict[tuple[str, int], str]:
        """Of ``partitions``, those another broker owns, with its id."""
        ...


def insert_segments(c: Tx, topic: str, partitions: list[tuple[int, tuple[str, ...]]],
                    created_at: int, owner: Holder | None) -> list[SegmentRecord]:
    """A new open segment of each ``(partition, ensemble)``; with ``owner``, each partition
    is held by that broker first (``ownership.py``)."""
    if owner is not None:
        owner.hold(c, topic, [p for p, _ in partitions])
    out = []
    for partition, ensemble in partitions:
        (segment_id,) = c.execute(
            "INSERT INTO segments (topic, partition, state, created_at, ensemble) "
            "VALUES (?, ?, ?, ?, ?) RETURNING segment_id",
            (topic, partition, SegmentState.OPEN, created_at, json.dumps(list(ensemble)))
        ).fetchone()
        out.append(SegmentRecord(
            topic=topic, partition=partition, segment_id=segment_id, state=SegmentState.OPEN,
            entries=0, messages=0, bytes=0, min_publish_time=None, max_publish_time=None,
            created_at=created_at, sealed_at=None, ensemble=ensemble))
    return out


def update_stats(c: Tx, record: SegmentRecord, *, only_open: bool = False) -> None:
    c.execute(
        "UPDATE segments SET state=?, entries=?, messages=?, bytes=?, min_publish_time=?, "
        "max_publish_time=?, sealed_at=?, skipped=? WHERE segment_id=?"
        + (" AND state='OPEN'" if only_open else ""),
        (record.state, record.entries, record.messages, record.bytes, record.min_publish_time,
         record.max_publish_time, record.sealed_at,
         json.dumps([list(r) for r in record.skipped]) if record.skipped else None,
         record.segment_id),
    )


def save_dedup(c: Tx, topic: str, partition: int,
                state: Mapping[str, tuple[int, Any]]) -> None:
    c.executemany(
        "INSERT INTO dedup (topic, partition, producer, sequence_id, position) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic, partition, producer) DO UPDATE "
        "SET sequence_id=excluded.sequence_id, position=excluded.position",
        [(topic, partition, p, seq, json.dumps(pos)) for p, (seq, pos) in state.items()],
    )


def owners_changed(c: Tx) -> None:
    """In transaction ``c``, which changes who owns a partition or where a broker is reached:
    bump ``meta.owners_version``, so every broker's next renewal reads the owners again."""
    c.execute("INSERT INTO meta (key, value) VALUES ('owners_version', '1') ON CONFLICT (key) "
              "DO UPDATE SET value = CAST(CAST(meta.value AS BIGINT) + 1 AS TEXT)")
