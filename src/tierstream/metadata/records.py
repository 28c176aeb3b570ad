"""The records of the metadata store that every side shares: a topic, a segment, and the
small read interface a planner depends on (the local SQLite file in ``store.py``, or the
broker for a planner on another host: ``client/remote_metadata.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tierstream.model.lineage import Lineage, ScaleEvent
from tierstream.model.names import TopicName
from tierstream.model.positions import EntryRanges
from tierstream.schemas.model import SchemaInfo

__all__ = ["MetadataReader", "SegmentRecord", "SegmentState", "TopicRecord"]


class MetadataReader(Protocol):
    """What planning reads from metadata: the small interface a planner depends on.
    :class:`MetadataStore` (the local SQLite file) is one implementation; a planner on another
    host needs one that asks the broker (issue 13)."""

    def list_topics(self, namespace: str | None = None) -> list[TopicRecord]: ...

    def get_topic(self, name: TopicName | str) -> TopicRecord: ...

    def segments_in_windows(self, topic: str, partitions: Sequence[int],
                            start_time: int | None, end_time: int | None
                            ) -> dict[int, list[SegmentRecord]]: ...

    def first_segment_id(self, topic: str, partition: int) -> int | None: ...

    def deleted_segments(self, topic: str, partition: int | None = None
                         ) -> list[dict[str, Any]]: ...

    def bookie_endpoints(self) -> dict[str, str]: ...

    def schema_versions(self, topic: str) -> list[SchemaInfo]: ...

    def compactions(self, topic: str) -> dict[int, Any]:
        """Each partition's compaction snapshot (``metadata/compactions.py``)."""
        ...

    def close(self) -> None: ...


class SegmentState:
    OPEN = "OPEN"
    CLOSED = "CLOSED"


@dataclass(frozen=True, kw_only=True)
class TopicRecord:
    name: str
    partitions: int
    retention_ms: int | None
    created_at: int
    scale_events: tuple[ScaleEvent, ...] = ()  # oldest first (elastic topics: lineage.py)
    #: who puts a key in its partition: ``tierstream`` (key_hash % partitions), or
    #: ``client`` (its Pulsar clients' routing, which the broker cannot compute)
    key_routing: str = "tierstream"
    #: a client-routed topic's growth under way (``metadata/scale_events.py``): the count its
    #: Pulsar clients are told and write to, and since when (ms); None when none is
    announced: int | None = None
    announced_at: int | None = None

    @property
    def lineage(self) -> Lineage:
        return Lineage(self.scale_events)

    @property
    def serving(self) -> int:
        """The partitions Pulsar clients see and write to: during an announced growth more
        than :attr:`partitions`, the ones tierstream's readers see."""
        return self.announced or self.partitions

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "partitions": self.partitions,
            "retention_ms": self.retention_ms,
            "created_at": self.created_at,
            "scale_events": [e.to_dict() for e in self.scale_events],
            "key_routing": self.key_routing,
            "announced": self.announced,
            "announced_at": self.announced_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TopicRecord:
        return cls(name=str(data["name"]), partitions=int(data["partitions"]),
                   retention_ms=data.get("retention_ms"), created_at=int(data["created_at"]),
                   scale_events=tuple(ScaleEvent.from_dict(e)
                                      for e in data.get("scale_events") or ()),
                   key_routing=str(data.get("key_routing") or "tierstream"),
                   announced=data.get("announced"), announced_at=data.get("announced_at"))


@dataclass(frozen=True, kw_only=True)
class SegmentRecord:
    """One segment (Pulsar's ledger) of one partition. ``segment_id`` is unique in the store."""

    topic: str
    partition: int
    segment_id: int
    state: str
    entries: int
    messages: int
    bytes: int
    min_publish_time: int | None
    max_publish_time: int | None
    created_at: int
    sealed_at: int | None
    ensemble: tuple[str, ...]
    tier_url: str | None = None
    offloaded_at: int | None = None
    bookie_deleted_at: int | None = None
    offload_pending_url: str | None = None
    #: the tier file's size: a reader opens it without asking the object store (a HEAD)
    tier_bytes: int | None = None
    #: entries every reader skips: of transactions aborted, or set aside to be written again
    #: at their commit (final when the segment is sealed; ``messages`` does not count them)
    skipped: EntryRanges = ()

    @property
    def location(self) -> str:
        """Where a reader finds the data now: ``tier``, ``bookies`` or ``open``."""
        if self.tier_url is not None:
            return "tier"
        return "open" if self.state == SegmentState.OPEN else "bookies"

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["ensemble"] = list(self.ensemble)
        out["skipped"] = [list(r) for r in self.skipped]
        out["location"] = self.location
        return out

    def with_stats(self, **changes: Any) -> SegmentRecord:
        return replace(self, **changes)
