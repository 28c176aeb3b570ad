"""Compacted topics' snapshots in the metadata store (table ``compactions``): per partition,
the horizon its snapshot covers (every message before it), the snapshot's Parquet file on the
tier and what it holds. A run replaces a partition's row in one transaction, so a reader sees
the old snapshot or the new one, never half; the file it replaced stays one more run
(``previous_url``) for readers still on it, and goes at the run after. Table
``compaction_policies``: the topics compacted by a threshold of bytes written since."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from tierstream.model.positions import Position

__all__ = ["CompactionRecord", "compaction_thresholds", "compactions_of", "save_compaction",
           "set_compaction_threshold"]

_COLUMNS = ("partition, horizon_segment, horizon_entry, horizon_index, url, previous_url, keys, "
            "bytes, compacted_at, duration_ms")


class MetadataStore(Protocol):
    """What this module uses of ``metadata/store.py``'s MetadataStore (which uses it)."""

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]: ...

    def atomic(self) -> AbstractContextManager[Any]: ...


@dataclass(frozen=True)
class CompactionRecord:
    """A partition's snapshot: the latest live message of each key before ``horizon``."""

    topic: str
    partition: int
    horizon: Position  # exclusive: the snapshot holds what came before it
    url: str | None  # None: no key was live
    keys: int
    bytes: int
    compacted_at: int
    duration_ms: int
    previous_url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["horizon"] = [self.horizon.segment_id, self.horizon.entry_id,
                          self.horizon.batch_index]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompactionRecord:
        seg, entry, index = (int(x) for x in data["horizon"])
        return cls(**{**data, "horizon": Position(int(data["partition"]), seg, entry, index)})


def compactions_of(metadata: MetadataStore, topic: str) -> dict[int, CompactionRecord]:
    """The snapshot of each of ``topic``'s partitions that has one."""
    rows = metadata.query(f"SELECT {_COLUMNS} FROM compactions WHERE topic = ? "
                          "ORDER BY partition", (topic,))
    return {int(r[0]): CompactionRecord(topic, int(r[0]), Position(int(r[0]), *map(int, r[1:4])),
                                        r[4], int(r[6]), int(r[7]), int(r[8]), int(r[9]), r[5])
            for r in rows}


def save_compaction(metadata: MetadataStore, record: CompactionRecord) -> None:
    """Make ``record`` its partition's snapshot in one transaction; the snapshot it replaces
    becomes ``previous_url`` (its files are the compactor's to remove: see its sweep)."""
    with metadata.atomic() as c:
        row = c.execute("SELECT url FROM compactions WHERE topic = ? AND partition = ?",
                        (record.topic, record.partition)).fetchone()
        previous = row[0] if row else None
        c.execute("DELETE FROM compactions WHERE topic = ? AND partition = ?",
                  (record.topic, record.partition))
        h = record.horizon
        c.execute(f"INSERT INTO compactions (topic, {_COLUMNS}) VALUES "
                  "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (record.topic, record.partition, h.segment_id, h.entry_id, h.batch_index,
                   record.url, previous, record.keys, record.bytes, record.compacted_at,
                   record.duration_ms))


def set_compaction_threshold(metadata: MetadataStore, topic: str, threshold: int | None) -> None:
    """Compact ``topic`` whenever a partition has ``threshold`` bytes after its snapshot's
    horizon (Pulsar's ``compactionThreshold``); None: only on demand."""
    with metadata.atomic() as c:
        c.execute("DELETE FROM compaction_policies WHERE topic = ?", (topic,))
        if threshold is not None:
            c.execute("INSERT INTO compaction_policies (topic, threshold_bytes) VALUES (?, ?)",
                      (topic, threshold))


def compaction_thresholds(metadata: MetadataStore) -> dict[str, int]:
    """Each topic's compaction threshold, of those that have one."""
    return {str(t): int(b) for t, b in metadata.query(
        "SELECT topic, threshold_bytes FROM compaction_policies ORDER BY topic")}
