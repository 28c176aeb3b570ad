"""The streaming reader: offsets are stream cuts, micro-batches are plans between two cuts.

``partitions(start, end)`` plans between two cuts, so a micro-batch that Spark replays after a
restart reads exactly the same messages, from wherever they live by then. ``latestOffset``
honours ``ReadMaxRows`` exactly (the broker counts messages from its entry index) and
``ReadMaxBytes`` approximately (through the topic's average message size); ``commit(end)``
moves a durable cursor on the broker, so retention and operators can see progress.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from tierstream.errors import ConfigError
from tierstream.splits.positions import Offset, OffsetKind, Position
from tierstream.splits.split import Split, StreamCut

__all__ = ["TierstreamStreamReader"]


class TierstreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, settings: Any) -> None:
        if len(settings.topics) != 1:
            raise ConfigError("a streaming read takes exactly one 'topic'")
        if not (isinstance(settings.end, Offset) and settings.end.kind is OffsetKind.LATEST):
            raise ConfigError("a streaming read has no end: remove 'endingTime'/"
                              "'endingPosition'")
        self.settings = settings
        self.topic: str = settings.topics[0]
        self._target: StreamCut | None = None

    def _admin(self) -> Any:
        from tierstream.store.client import Admin

        return Admin(self.settings.broker, auth_token=self.settings.auth_token)

    def _latest(self) -> StreamCut:
        import tierstream

        return tierstream.latest_cut(self.topic, data_dir=self.settings.data_dir,
                                     broker=self.settings.broker,
                                     auth_token=self.settings.auth_token)

    # -- offsets ------------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        start = self.settings.start
        if isinstance(start, StreamCut):
            return start.to_dict()
        latest = self._latest()
        if start.kind is OffsetKind.LATEST:
            return latest.to_dict()
        with self._admin() as admin:
            if start.kind is OffsetKind.TIME:
                assert start.time_ms is not None
                positions = {p: admin.position_at_time(self.topic, p, start.time_ms)
                             for p in latest.partitions}
            else:  # earliest: the first surviving position
                positions = {p: _earliest(admin, self.topic, p, latest[p])
                             for p in latest.partitions}
        return StreamCut.of(self.topic, positions).to_dict()

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.settings.max_records_per_trigger is not None:
            return ReadMaxRows(self.settings.max_records_per_trigger)
        if self.settings.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.settings.max_bytes_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = StreamCut.from_dict(start)
        target = self._target or self._latest()
        if isinstance(limit, ReadAllAvailable) or limit is None:
            return target.to_dict()
        if isinstance(limit, ReadMaxRows):
            budget = int(limit.max_rows)
        elif isinstance(limit, ReadMaxBytes):
            budget = max(1, int(limit.max_bytes) // self._bytes_per_message())
        else:
            return target.to_dict()
        return self._advance(begin, target, budget).to_dict()

    def _advance(self, begin: StreamCut, target: StreamCut, budget: int) -> StreamCut:
        """Spend ``budget`` messages fairly over the partitions that have new data."""
        ends = {p: begin[p] for p in begin.partitions}
        with self._admin() as admin:
            active = [p for p in begin.partitions if begin[p] < target[p]]
            while budget > 0 and active:
                share = max(1, budget // len(active))
                still = []
                for p in active:
                    if budget <= 0:
                        break
                    want = min(share, budget)
                    end, counted = admin.advance(self.topic, ends[p], want, target[p])
                    ends[p] = end
                    budget -= counted
                    if counted == want and end < target[p]:
                        still.append(p)  # took its whole share: may have more
                active = still
        return StreamCut.of(self.topic, ends)

    def _bytes_per_message(self) -> int:
        with self._admin() as admin:
            segs = [s for s in admin.list_segments(self.topic) if s.messages]
        messages = sum(s.messages for s in segs)
        return max(1, sum(s.bytes for s in segs) // messages) if messages else 200

    # -- micro-batches ------------------------------------------------------------------------

    def partitions(self, start: dict[str, Any], end: dict[str, Any]
                   ) -> Sequence[InputPartition]:
        from tierstream.enumerator import Enumerator, Query

        s = self.settings
        begin, finish = StreamCut.from_dict(start), StreamCut.from_dict(end)
        with Enumerator(data_dir=s.data_dir, broker=s.broker, auth_token=s.auth_token,
                        s3_endpoint=s.s3_endpoint, s3_region=s.s3_region) as enum:
            splits = enum.plan(Query(topics=(self.topic,), start=begin, end=finish,
                                     key_ranges=s.key_ranges, max_split_bytes=s.max_split_bytes,
                                     reader=s.reader, fail_on_data_loss=s.fail_on_data_loss))
        # a time start filters every batch, not only the first
        if isinstance(s.start, Offset) and s.start.kind is OffsetKind.TIME:
            splits = [_with_start_time(sp, s.start.time_ms) for sp in splits]
        return [InputPartition(sp.to_json()) for sp in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        from tierstream.readers import open_reader
        from tierstream.spark_adapter.source import to_spark_batch

        if partition.value is None:  # Spark's stand-in when the plan has no split
            return
        for batch in open_reader(Split.from_json(partition.value),
                                 auth_token=self.settings.auth_token):
            yield to_spark_batch(batch)

    def commit(self, end: dict[str, Any]) -> None:
        cut = StreamCut.from_dict(end)
        with self._admin() as admin:
            admin.set_cursor(self.topic, self.settings.subscription,
                             {p: cut[p] for p in cut.partitions})

    def stop(self) -> None:
        pass


def _earliest(admin: Any, topic: str, partition: int, latest: Position) -> Position:
    segs = [s for s in admin.list_segments(topic) if s.partition == partition]
    return Position(partition, segs[0].segment_id, 0, 0) if segs else latest


def _with_start_time(split: Split, time_ms: int | None) -> Split:
    from dataclasses import replace

    return replace(split, start_time=time_ms)
