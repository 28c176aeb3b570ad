"""Planning metadata through the broker, for a planner on a host without the store's files.

:class:`BrokerMetadata` implements the planner's
:class:`~tierstream.metadata.store.MetadataReader` with broker actions: one ``plan-segments``
call per topic and time window answers every partition (the broker searches its own SQLite
indexes, so planning stays O(log S) per partition), so a plan costs a few round trips however
many partitions the topic has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierstream.client.admin import Admin, segment_record
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.model.names import TopicName
from tierstream.schemas.model import SchemaInfo

__all__ = ["BrokerMetadata"]


class BrokerMetadata:
    """The planner's metadata reads, answered by the broker at ``broker``."""

    def __init__(self, broker: str, *, auth_token: str | None = None,
                 tls_ca: bytes | None = None) -> None:
        self._admin = Admin(broker, auth_token=auth_token, tls_ca=tls_ca)
        self._windows: dict[tuple[str, int | None, int | None], dict[str, Any]] = {}

    def __repr__(self) -> str:
        return f"BrokerMetadata(broker={self._admin.url!r})"

    def list_topics(self, namespace: str | None = None) -> list[TopicRecord]:
        return self._admin.list_topics(namespace)

    def get_topic(self, name: TopicName | str) -> TopicRecord:
        return self._admin.get_topic(str(name))

    def _planned(self, topic: str, start_time: int | None, end_time: int | None
                 ) -> dict[str, Any]:
        key = (topic, start_time, end_time)
        found = self._windows.get(key)
        if found is None:
            found = self._windows[key] = self._admin.action("plan-segments", {
                "topic": topic, "start_time": start_time, "end_time": end_time})
        return found

    def segments_in_windows(self, topic: str, partitions: Sequence[int],
                            start_time: int | None, end_time: int | None
                            ) -> dict[int, list[SegmentRecord]]:
        planned = self._planned(topic, start_time, end_time)
        return {p: [segment_record(s) for s in planned[str(p)]["window"]] for p in partitions}

    def first_segment_id(self, topic: str, partition: int) -> int | None:
        cached = next((w for (t, _, _), w in self._windows.items() if t == topic), None)
        planned = cached if cached is not None else self._planned(topic, None, None)
        first = planned[str(partition)]["first"]
        return None if first is None else int(first)

    def deleted_segments(self, topic: str, partition: int | None = None
                         ) -> list[dict[str, Any]]:
        return [d for d in self._admin.deleted_segments(topic)
                if partition is None or d["partition"] == partition]

    def schema_versions(self, topic: str) -> list[SchemaInfo]:
        return self._admin.list_schemas(topic)[1]

    def compactions(self, topic: str) -> dict[int, Any]:
        from tierstream.metadata.compactions import CompactionRecord

        snapshots = self._admin.compaction(topic)["snapshots"]
        return {int(d["partition"]): CompactionRecord.from_dict(d) for d in snapshots}

    def bookie_endpoints(self) -> dict[str, str]:
        return self._admin.bookie_endpoints()

    def close(self) -> None:
        self._admin.close()
