"""The streaming reader: offsets are stream cuts, micro-batches are plans between two cuts.

``partitions(start, end)`` plans between two cuts, so a micro-batch that Spark replays after a
restart reads exactly the same messages, from wherever they live by then. ``latestOffset``
honours ``ReadMaxRows`` exactly (the broker counts messages from its entry index) and
``ReadMaxBytes`` approximately (through the topics' average message size). The durable cursor
of ``subscription`` on the broker follows every finished batch (``commit(end)``, and the start
Spark asks ``latestOffset`` from), so ``tierstream subscriptions`` shows a stream's progress
and backlog.

A read of one ``topic`` uses that topic's stream cut as its offset, so an offset from Spark's
progress or checkpoint can be passed back as ``startingPosition``. A read of ``topics`` or a
``namespace`` uses ``{"v": 1, "cuts": {topic: cut}}``; a namespace read looks for new topics
at every trigger and reads a topic that appeared mid-stream from its earliest message.

With ``compacted=true`` the stream starts from ``{"v": 1, "compacted": topic}``, before its
state: the first micro-batch is the topic's compacted view up to the cut it ends at
(``compacted.py``, one row per live key, whatever the read limit), and every later one the
log after it, a changelog (tombstones and keyless messages included, as the log holds them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from tierstream.client.admin import Admin
from tierstream.client.retry import with_reconnect
from tierstream.enumerator.streaming import (
    advance_cuts,
    bytes_per_message,
    count_between,
    earliest_cut,
    with_grown,
)
from tierstream.errors import ConfigError
from tierstream.model.positions import Offset, OffsetKind
from tierstream.spark_adapter.compacted import (
    check_compacted,
    compacted_partitions,
    is_compacted,
    spark_compacted,
)
from tierstream.spark_adapter.partitions import read_partition, spark_partitions
from tierstream.splits.split import (
    CUT_FORMAT_VERSION,
    Cuts,
    Split,
    StreamCut,
    cuts_from_dict,
    cuts_to_dict,
)

if TYPE_CHECKING:  # source.py imports this module: only the type, no import cycle
    from tierstream.read_options import ReadOptions
    from tierstream.schemas.codec import Decoder

__all__ = ["TierstreamStreamReader"]

T = TypeVar("T")


def _before_state(offset: dict[str, Any]) -> bool:
    """Whether ``offset`` is a compacted stream's start, before its state's micro-batch."""
    return "compacted" in offset


class TierstreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, settings: ReadOptions, decoder: Decoder | None = None) -> None:
        if not (isinstance(settings.end, Offset) and settings.end.kind is OffsetKind.LATEST):
            raise ConfigError("a streaming read has no end: remove 'endingTime'/"
                              "'endingPosition'")
        self.settings = settings
        # valueFormat=auto: the schema versions when the query started (a version added
        # later fails to decode: restart the query to take it)
        self.decoder = decoder
        self.single = settings.namespace is None and len(settings.topics) == 1
        if settings.compacted:
            check_compacted(settings)
        self._target: Cuts | None = None
        self._cursor: dict[str, Any] | None = None  # the last offset stored as the cursor
        self._last_batch = time.monotonic()  # when the last micro-batch was planned

    def _retrying(self, call: Callable[[], T], what: str) -> T:
        """A driver-side call that rides out a broker restart (option reconnectTimeout)."""
        return with_reconnect(call, what=f"stream {what}",
                              timeout_s=self.settings.reconnect_timeout_ms / 1000)

    def _admin(self) -> Admin:
        return Admin(self.settings.broker, auth_token=self.settings.auth_token,
                     tls_ca=self.settings.tls_ca)

    def _topics(self, admin: Admin) -> list[str]:
        """The topics read now: the named ones, or every topic the namespace has so far."""
        if self.settings.namespace is None:
            return list(self.settings.topics)
        found = sorted(t.name for t in admin.list_topics(self.settings.namespace))
        if not found:
            raise ConfigError(f"namespace {self.settings.namespace!r} has no topics")
        return found

    def _latest(self, admin: Admin) -> Cuts:
        return {t: admin.latest_cut(t) for t in self._topics(admin)}

    # -- offsets ------------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        return self._retrying(self._initial_offset, "initialOffset")

    def _initial_offset(self) -> dict[str, Any]:
        start = self.settings.start
        if self.settings.compacted:
            return {"v": CUT_FORMAT_VERSION, "compacted": self.settings.topics[0]}
        if isinstance(start, (StreamCut, dict)):
            # cuts given: topics without one (of a namespace, or new) start at their earliest
            cuts = {start.topic: start} if isinstance(start, StreamCut) else dict(start)
            missing = sorted(set(self.settings.topics) - set(cuts))
            if missing and not self.single:
                raise ConfigError(f"invalid option 'startingPosition': it has no cut of "
                                  f"{missing}")
            return cuts_to_dict(cuts, single=self.single)
        with self._admin() as admin:
            cuts = {}
            for topic in self._topics(admin):
                latest = admin.latest_cut(topic)
                if start.kind is OffsetKind.LATEST:
                    cuts[topic] = latest
                elif start.kind is OffsetKind.TIME:
                    assert start.time_ms is not None
                    cuts[topic] = StreamCut.of(topic, {
                        p: admin.position_at_time(topic, p, start.time_ms)
                        for p in latest.partitions})
                else:  # earliest: the first surviving position
                    cuts[topic] = earliest_cut(admin, latest)
        return cuts_to_dict(cuts, single=self.single)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.settings.max_records_per_trigger is not None:
            return ReadMaxRows(self.settings.max_records_per_trigger)
        if self.settings.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.settings.max_bytes_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._retrying(self._prepare_available_now, "prepareForTriggerAvailableNow")

    def _prepare_available_now(self) -> None:
        with self._admin() as admin:
            self._target = self._latest(admin)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        return self._retrying(lambda: self._latest_offset(start, limit), "latestOffset")

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """What the broker has now: Spark's progress shows it as the source's latestOffset."""
        def latest() -> dict[str, Any]:
            with self._admin() as admin:
                return cuts_to_dict(self._latest(admin), single=self.single)
        return self._retrying(latest, "reportLatestOffset")

    def _latest_offset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark asks from the end of the last batch, which its commit log already holds:
        # that batch is done. Spark's own commit(end) for it only comes once a next batch is
        # planned, so without this the cursor of a stream that went idle, or of an AvailableNow
        # run, would stay one batch behind.
        if _before_state(start):  # the state's batch: all of it, up to what exists now
            with self._admin() as admin:
                target = dict(self._target) if self._target is not None \
                    else self._latest(admin)
            self._last_batch = time.monotonic()
            return cuts_to_dict(target, single=True)
        begin = cuts_from_dict(start)
        with self._admin() as admin:
            self._move_cursor(start, admin)
            # AvailableNow: what existed when the query started
            target = dict(self._target) if self._target is not None else self._latest(admin)
            for topic in target:  # a topic (or partition) new since the last batch starts
                if topic not in begin:  # at its beginning
                    begin[topic] = earliest_cut(admin, target[topic])
                begin[topic] = with_grown(admin, begin[topic], target[topic])
            if self._too_few(admin, begin, target):
                return start  # wait for minRecordsPerTrigger, up to maxTriggerDelay
            self._last_batch = time.monotonic()
            if isinstance(limit, ReadMaxRows):
                budget = int(limit.max_rows)
            elif isinstance(limit, ReadMaxBytes):
                budget = max(1, int(limit.max_bytes) // bytes_per_message(admin, target))
            else:  # ReadAllAvailable (or none)
                return cuts_to_dict({**begin, **target}, single=self.single)
            ends = advance_cuts(admin, begin, target, budget)
        return cuts_to_dict(ends, single=self.single)

    def _too_few(self, admin: Admin, begin: Cuts, target: Cuts) -> bool:
        """Whether fewer than ``minRecordsPerTrigger`` messages are new and the last batch
        is younger than ``maxTriggerDelay`` (AvailableNow never waits)."""
        least = self.settings.min_records_per_trigger
        if least is None or self._target is not None:
            return False
        if time.monotonic() - self._last_batch >= self.settings.max_trigger_delay_ms / 1000:
            return False
        return count_between(admin, begin, target, up_to=least) < least

    # -- micro-batches ------------------------------------------------------------------------

    def partitions(self, start: dict[str, Any], end: dict[str, Any]
                   ) -> Sequence[InputPartition]:
        return self._retrying(lambda: self._partitions(start, end), "partitions")

    def _partitions(self, start: dict[str, Any], end: dict[str, Any]
                    ) -> Sequence[InputPartition]:
        from tierstream.enumerator import Query

        s = self.settings
        if _before_state(start):
            return compacted_partitions(s, end=cuts_from_dict(end)[s.topics[0]])
        begin, finish = cuts_from_dict(start), cuts_from_dict(end)
        # a time start filters every batch, not only the first
        time_from = s.start.time_ms if isinstance(s.start, Offset) \
            and s.start.kind is OffsetKind.TIME else None
        splits: list[Split] = []
        with s.enumerator() as enum:
            for topic in sorted(finish):
                splits.extend(enum.plan(Query(
                    topics=(topic,), start=begin.get(topic) or Offset.earliest(),
                    end=finish[topic], key_ranges=s.key_ranges,
                    max_split_bytes=s.max_split_bytes, reader=s.reader,
                    fail_on_data_loss=s.fail_on_data_loss, time_from=time_from)))
        return spark_partitions(splits, s.partitioning or "key-ranges",
                                max_bytes=s.max_split_bytes, min_partitions=s.min_partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if self.settings.compacted and is_compacted(partition):
            return spark_compacted(self.settings, partition, self.decoder)
        return read_partition(self.settings, partition, decoder=self.decoder)

    def commit(self, end: dict[str, Any]) -> None:
        self._retrying(lambda: self._commit(end), "commit")

    def _commit(self, end: dict[str, Any]) -> None:
        with self._admin() as admin:
            self._move_cursor(end, admin)

    def _move_cursor(self, done: dict[str, Any], admin: Admin) -> None:
        """Store ``done`` as the subscription's durable cursor (forward only, on the broker)."""
        if done == self._cursor or _before_state(done):
            return  # an idle stream asks every trigger: write only what is new
        for topic, cut in cuts_from_dict(done).items():
            admin.set_cursor(topic, self.settings.subscription,
                             {p: cut[p] for p in cut.partitions},
                             label=self.settings.cursor_label or "a Spark stream")
        self._cursor = done

    def stop(self) -> None:
        pass
