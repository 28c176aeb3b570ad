"""The enumerator: a query becomes splits, from segment metadata only (driver side).

Per partition it finds the segments of the window with two index lookups on min/max publish
time (a binary search, O(log S)), resolves ``latest`` to the broker's last confirmed positions
(so a bounded read always ends), and gives each split the reader that fits where its data
lives: tier -> parquet-tier, closed in bookies -> bookie-log, open -> tail-consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstream.enumerator.plan import PartitionPlan, Plan, SegmentPlan, no_gc
from tierstream.errors import ConfigError, NotFoundError
from tierstream.metadata.records import MetadataReader, SegmentRecord, SegmentState, TopicRecord
from tierstream.metadata.store import MetadataStore
from tierstream.model.data_loss import lost_segments, report_data_loss
from tierstream.model.layout import DataDir
from tierstream.model.names import TopicName
from tierstream.model.positions import KeyRange, Offset, OffsetKind, Position
from tierstream.schemas.model import SchemaInfo
from tierstream.splits.split import ReaderKind, Replica, StreamCut, TierLocation, check_window
from tierstream.util.timeutil import format_ms

__all__ = ["Enumerator", "Query"]

log = logging.getLogger(__name__)

Bound = Offset | StreamCut


@dataclass(frozen=True, kw_only=True)
class Query:
    """What to read. ``end=None`` is unbounded (a tail); a bounded ``latest`` is resolved at
    planning time. ``key_ranges=k`` splits every partition into k key ranges.

    ``time_from``/``time_to`` (ms, ``[from, to)``) restrict publish time on top of ``start`` and
    ``end`` (Spark's pushed-down filters arrive this way); an empty window plans nothing.
    """

    topics: tuple[str, ...] = ()
    namespace: str | None = None
    start: Bound = field(default_factory=Offset.earliest)
    end: Bound | None = field(default_factory=Offset.latest)
    key_ranges: int = 1
    max_split_bytes: int = 128 * 1024**2
    reader: ReaderKind | None = None
    fail_on_data_loss: bool = True
    partitions: tuple[int, ...] | None = None
    time_from: int | None = None
    time_to: int | None = None

    def __post_init__(self) -> None:
        if not self.topics and self.namespace is None:
            raise ConfigError("a query needs topics or a namespace")
        for t in self.topics:
            TopicName.parse(t)
        KeyRange.split(self.key_ranges)  # validates 1..65536
        if self.max_split_bytes < 1:
            raise ConfigError(f"invalid maxSplitBytes {self.max_split_bytes}: expected >= 1")
        check_window(self.start, self.end)


class Enumerator:
    """Plans splits for one store. ``broker`` resolves ``latest`` and serves open segments."""

    def __init__(self, *, data_dir: str | Path | None = None, broker: str | None = None,
                 auth_token: str | None = None, s3_endpoint: str | None = None,
                 s3_region: str | None = None, tls_ca: bytes | None = None) -> None:
        self.data_dir = Path(data_dir) if data_dir is not None else None
        if self.data_dir is not None and self.data_dir.exists() and not self.data_dir.is_dir():
            raise ConfigError(f"invalid data_dir {str(data_dir)!r}: a file, not the store's "
                              "data directory")
        local = DataDir.at(self.data_dir).metadata if self.data_dir is not None else None
        self.metadata: MetadataReader
        if local is not None and (local.exists() or broker is None):
            self.metadata = MetadataStore(local, read_only=True)  # the fast path
            self.metadata_source = f"local file {local}"
        elif broker is not None:  # another host: the same reads, answered by the broker
            from tierstream.client.remote_metadata import BrokerMetadata

            self.metadata = BrokerMetadata(broker, auth_token=auth_token, tls_ca=tls_ca)
            self.metadata_source = f"broker {broker}"
        else:
            raise ConfigError("planning needs the store's data directory (option 'dataDir') "
                              "or its broker (option 'broker')")
        self.broker = broker
        self.auth_token = auth_token
        self.tls_ca = tls_ca
        self.tier = TierLocation(s3_endpoint=s3_endpoint, s3_region=s3_region)
        self._bookie_dirs: dict[str, str] = {}
        self._endpoints: dict[str, str] | None = None
        self._facts: dict[tuple[Any, ...], dict[str, Any]] = {}

    def __repr__(self) -> str:
        where = None if self.data_dir is None else str(self.data_dir)
        return (f"Enumerator(data_dir={where!r}, broker={self.broker!r}, "
                f"metadata from {self.metadata_source})")

    def close(self) -> None:
        self.metadata.close()

    def __enter__(self) -> Enumerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public -------------------------------------------------------------------------------

    def topics(self, query: Query) -> list[TopicRecord]:
        if query.namespace is not None:
            found = self.metadata.list_topics(query.namespace)
            if not found:
                raise NotFoundError(f"namespace {query.namespace!r} has no topics")
            return found
        return [self.metadata.get_topic(TopicName.parse(t)) for t in query.topics]

    def schema_versions(self, topic: str) -> list[SchemaInfo]:
        """The topic's schema versions, in order (empty: its values are bytes)."""
        return self.metadata.schema_versions(str(TopicName.parse(topic)))

    def compacted_start(self, topic: str, partitions: Sequence[int] | None = None,
                        end: StreamCut | None = None) -> tuple[StreamCut | None, dict[int, Any]]:
        """Where a compacted read of ``topic`` (those ``partitions``) reads the log from:
        each partition's snapshot horizon, or its first segment without one; and the
        snapshots (``metadata/compactions.py``). None for the cut: no snapshot, read all.
        With an ``end`` cut, a snapshot whose horizon is past it is left out (it may hold
        later versions): that partition's log is read from its start."""
        snapshots = self.metadata.compactions(topic)
        if end is not None:
            snapshots = {p: s for p, s in snapshots.items()
                         if end.get(p) is not None and s.horizon <= end[p]}
        if not snapshots:
            return None, {}
        wanted = partitions if partitions else range(self.metadata.get_topic(topic).partitions)
        starts: dict[int, Position] = {}
        for p in wanted:
            snap = snapshots.get(p)
            first = self.metadata.first_segment_id(topic, p)
            starts[p] = snap.horizon if snap is not None else Position(p, first or 0, 0, 0)
        return StreamCut.of(topic, starts), {p: s for p, s in snapshots.items() if p in starts}

    def latest_cut(self, topic: str) -> StreamCut:
        """The broker's last confirmed positions, as an exclusive end cut."""
        from tierstream.client import Admin

        if self.broker is None:
            raise ConfigError("resolving 'latest' needs a broker address (option 'broker')")
        with Admin(self.broker, auth_token=self.auth_token, tls_ca=self.tls_ca) as admin:
            return admin.latest_cut(topic)

    def _messages_between(self, topic: str, p: int, lo: Position, hi: Position,
                          confirmed: Position | None) -> bool:
        """Whether partition ``p`` holds messages in ``[lo, hi)``, as its segment records
        and its last ``confirmed`` position (the open segment's count) say. Two positions
        can name one point: the end of a segment and the start of the partition's next."""
        for seg in self.metadata.segments_in_windows(topic, [p], None, None)[p]:
            if lo.segment_id <= seg.segment_id <= hi.segment_id:
                entries = seg.entries
                if confirmed is not None and confirmed.segment_id == seg.segment_id:
                    entries = max(entries, confirmed.entry_id)
                first = lo.entry_id if seg.segment_id == lo.segment_id else 0
                last = hi.entry_id if seg.segment_id == hi.segment_id else entries
                if min(last, entries) > first or (
                        lo.segment_id == hi.segment_id and lo.entry_id == hi.entry_id
                        and lo.batch_index < hi.batch_index):
                    return True
        return False

    def _position_at_time(self, topic: str, partition: int, time_ms: int) -> Position:
        """The first position published at or after ``time_ms`` (a time start against a
        position end: the segments' times alone cannot tell whether it is before the end)."""
        from tierstream.client import Admin

        assert self.broker is not None
        with Admin(self.broker, auth_token=self.auth_token, tls_ca=self.tls_ca) as admin:
            return admin.position_at_time(topic, partition, time_ms)

    def plan(self, query: Query) -> Plan:
        """The splits of ``query``; together they read every message in it exactly once."""
        with no_gc():
            partitions: list[PartitionPlan] = []
            for topic in self.topics(query):
                partitions.extend(self._plan_topic(topic, query))
            if self._endpoints is None:  # what a split's replicas need, read while open
                self._endpoints = self.metadata.bookie_endpoints()
        if query.reader is not None or query.key_ranges > 1:
            # a forced reader that cannot read a segment fails here, at planning
            kinds = [(seg.segment_id, _reader_for(seg, query.reader))
                     for part in partitions for seg in part.records()]
            on_bookies = {sid for sid, kind in kinds if kind is ReaderKind.BOOKIE}
            if query.key_ranges > 1 and on_bookies:  # key ranges over log-ordered data
                log.info("keyRanges=%d over %d bookie-resident segment(s): a key-range split "
                         "read alone reads and verifies all of its entries (the local runner "
                         "and Spark's partitioning=splits read each entry once; Spark's "
                         "partitioning=key-ranges cannot); tiered segments are bucketed by "
                         "key and are not affected", query.key_ranges, len(on_bookies))
        return Plan(partitions, self._segment_plans)

    def _replica(self, bookie_id: str) -> Replica:
        """Where a reader finds one bookie's copy: its advertised endpoint, and its directory
        when planning from the store's own files (a reader on this host reads it directly)."""
        if self._endpoints is None:  # once per enumerator: endpoints change only on restart
            self._endpoints = self.metadata.bookie_endpoints()
        local = None
        if isinstance(self.metadata, MetadataStore) and self.data_dir is not None:
            local = self._bookie_dirs.get(bookie_id)
            if local is None:  # resolving a path stats every component: once per bookie
                local = self._bookie_dirs[bookie_id] = str(
                    DataDir.at(self.data_dir).bookie(bookie_id).resolve())
        return Replica(bookie_id, self._endpoints.get(bookie_id), local)

    # -- per topic ----------------------------------------------------------------------------

    def _plan_topic(self, topic: TopicRecord, query: Query) -> list[PartitionPlan]:
        partitions = range(topic.partitions)
        if query.partitions is not None:
            bad = [p for p in query.partitions if not 0 <= p < topic.partitions]
            if bad:
                raise ConfigError(f"invalid partition(s) {bad} for {topic.name!r}: it has "
                                  f"0..{topic.partitions - 1}")
            partitions = sorted(set(query.partitions))  # type: ignore[assignment]
        cache: list[StreamCut] = []
        lost_by_partition: dict[int, list[dict[str, Any]]] = {}
        for d in self.metadata.deleted_segments(topic.name):  # one read, usually empty
            lost_by_partition.setdefault(d["partition"], []).append(d)

        def latest() -> StreamCut:  # resolved once per topic, and only when needed
            if not cache:
                cache.append(self.latest_cut(topic.name))
            return cache[0]

        t0, t1 = _window(query)
        if t0 is not None and t1 is not None and t1 <= t0:
            return []
        out: list[PartitionPlan] = []
        windows = self.metadata.segments_in_windows(topic.name, partitions, t0, t1)
        ranges = tuple(KeyRange.split(query.key_ranges))
        for p in partitions:
            planned = self._plan_partition(topic, p, query, (t0, t1), latest,
                                           lost_by_partition.get(p, []), windows[p], ranges)
            if planned is not None:
                out.append(planned)
        return _chained(topic, out)

    def _plan_partition(self, topic: TopicRecord, p: int, query: Query,
                        window: tuple[int | None, int | None],
                        latest: Callable[[], StreamCut], deleted: list[dict[str, Any]],
                        segments: list[SegmentRecord], ranges: tuple[KeyRange, ...]
                        ) -> PartitionPlan | None:
        t0, t1 = window
        if _grown_since(query.end, p, topic):
            return None  # the end cut was taken before this partition existed
        start = self._start_position(topic, p, query, window, latest, segments, deleted)
        end: Position | None
        if query.end is None:
            end = None
        elif _is_latest(query.end):
            end = latest().get(p)
        else:
            end = _position_of(query.end, p, topic.name)
            if end is None and any(s.state == SegmentState.OPEN for s in segments):
                # a time end: the open segment is read up to the last confirmed entry, so
                # a bounded read finishes even if nothing reaches the end time yet
                end = latest().get(p)
        # the start as given, not as moved past segments retention deleted (then an end
        # before it is nothing left to read, not a mix-up)
        start_time, begins = _time_of(query.start), _given_position(query.start, p) or start
        if start_time is not None and end is not None and t0 == start_time \
                and not _is_latest(query.end) and self.broker is not None and start is not None:
            begins = max(start, self._position_at_time(topic.name, p, start_time))
        if begins is not None and end is not None and end < begins and (
                start_time is None or t0 == start_time) and self._messages_between(
                    topic.name, p, end, begins,
                    latest().get(p) if self.broker is not None else None):
            # resolved: a time start is the first segment published at or after it (unless a
            # filter narrowed the window further), so an end before that is before the start
            at = "" if start_time is None else f" (where {format_ms(start_time)} begins)"
            raise ConfigError(f"the read of {topic.name!r} ends at {end} in partition {p}, "
                              f"before it starts there at {begins}{at}: give an end after "
                              "the start")
        if start is None or (end is not None and end <= start) or not segments:
            return None
        return PartitionPlan(topic.name, segments, start, end, t0, t1, ranges, query.reader,
                             query.max_split_bytes)

    def _segment_plans(self, part: PartitionPlan) -> list[SegmentPlan]:
        """What a partition's plan reads of each segment (when the plan's splits are made)."""
        out: list[SegmentPlan] = []
        for seg in part.records():
            planned = self._segment_plan(part, seg)
            if planned is not None:
                out.append(planned)
        return out

    def _start_position(self, record: TopicRecord, p: int, query: Query,
                        window: tuple[int | None, int | None],
                        latest: Callable[[], StreamCut], segments: list[SegmentRecord],
                        deleted: list[dict[str, Any]]) -> Position | None:
        start, topic = query.start, record.name
        if _is_latest(start):
            return latest().get(p)
        if (isinstance(start, Offset) and start.kind is OffsetKind.EARLIEST) \
                or _grown_since(start, p, record):  # a cut from before p: all of p
            first_id = self.metadata.first_segment_id(topic, p)
            return Position(p, first_id, 0, 0) if first_id is not None else None
        t0, t1 = window
        if isinstance(start, Offset) and start.kind is OffsetKind.TIME:
            assert t0 is not None
            report_data_loss(topic, p, lost_segments(deleted, t0=t0, t1=t1),
                             fail=query.fail_on_data_loss)
            return Position(p, segments[0].segment_id, 0, 0) if segments else None
        pos = _position_of(start, p, topic)
        if pos is None:
            return None
        lost = lost_segments(deleted, from_segment=pos.segment_id, t0=t0, t1=t1)
        if lost:
            report_data_loss(topic, p, lost, fail=query.fail_on_data_loss)
            first_id = self.metadata.first_segment_id(topic, p)
            return Position(p, first_id, 0, 0) if first_id is not None else None
        return pos

    def _segment_plan(self, part: PartitionPlan, seg: SegmentRecord) -> SegmentPlan | None:
        p, start, end = seg.partition, part.start, part.end
        kind = _reader_for(seg, part.reader)
        seg_start = start if start.segment_id == seg.segment_id else Position.known(
            p, seg.segment_id, 0, 0)  # start is never past this segment here
        if seg.state == SegmentState.OPEN:
            seg_end = end  # the open tail: to the resolved end, or unbounded
            if seg_end is not None and seg_end <= seg_start:
                return None  # nothing of it is in the window: no split of 0 entries
        else:
            seg_end = Position.known(p, seg.segment_id, seg.entries, 0)
            if end is not None and end < seg_end:
                seg_end = end
            if seg_end <= seg_start:
                return None
        facts = self._facts.get((kind, seg.ensemble, seg.tier_url))
        if facts is None:  # shared by every split with the same location
            facts = {"broker": self.broker}
            if kind is ReaderKind.BOOKIE:  # a store has few distinct ensembles
                facts["replicas"] = tuple(self._replica(b) for b in seg.ensemble)
            if kind is ReaderKind.TIER:
                facts.update(tier_url=seg.tier_url, tier_bytes=seg.tier_bytes, tier=self.tier)
            if kind is not ReaderKind.TIER:  # tier URLs are one per segment: not worth keeping
                self._facts[(kind, seg.ensemble, seg.tier_url)] = facts
        # a chunk bounds what one split reads: a bookie-log split reads its whole entry range
        # whatever its key range, so chunks are sized by max_split_bytes alone
        return SegmentPlan(part.topic, seg, seg_start, seg_end, kind, part.start_time,
                           part.end_time, part.key_ranges, part.max_split_bytes, facts,
                           part.chain)


def _grown_since(bound: Bound | None, p: int, topic: TopicRecord) -> bool:
    """Whether ``bound`` is a cut taken before partition ``p`` was grown (it has no position
    for ``p``): as a start, all of ``p`` follows it; as an end, none of ``p`` precedes it."""
    return isinstance(bound, StreamCut) and bound.get(p) is None \
        and topic.lineage.created_by(p) is not None


def _chained(topic: TopicRecord, plans: list[PartitionPlan]) -> list[PartitionPlan]:
    """``plans`` with each grown partition joined to the chain of the nearest ancestor whose
    data from before the partition's keys left it is in the read (``lineage.py``): read in
    one chain, every key's messages come out in log order across the scale events. Without
    such data the partition stays a chain of its own (a read after the event keeps all of
    its parallelism)."""
    lineage = topic.lineage
    if not lineage or len(plans) < 2:
        return plans
    by_partition = {plan.start.partition: plan for plan in plans}
    chain: dict[int, int] = {}
    out = []
    for plan in sorted(plans, key=lambda pl: pl.start.partition):
        p = plan.start.partition
        up = lineage.parent(p)
        while up is not None:
            parent, event = up
            found = by_partition.get(parent)
            if found is not None and found.start < event.boundary(parent):
                chain[p] = chain.get(parent, parent)
                break
            up = lineage.parent(parent)
        out.append(plan._replace(chain=chain.get(p)))
    return out


def _reader_for(seg: SegmentRecord, forced: ReaderKind | None) -> ReaderKind:
    if seg.state == SegmentState.OPEN:
        natural = ReaderKind.TAIL
    elif seg.tier_url is not None:
        natural = ReaderKind.TIER
    else:
        natural = ReaderKind.BOOKIE
    if forced is None or forced is natural:
        return natural
    possible = {ReaderKind.TAIL}  # the broker serves every location
    if seg.tier_url is not None:
        possible.add(ReaderKind.TIER)
    if seg.state == SegmentState.CLOSED and seg.bookie_deleted_at is None:
        possible.add(ReaderKind.BOOKIE)
    if forced not in possible:
        raise ConfigError(
            f"reader {forced.value!r} cannot read segment {seg.segment_id} of {seg.topic!r} "
            f"partition {seg.partition} (it lives in {seg.location}); possible: "
            f"{', '.join(sorted(k.value for k in possible))}")
    return forced


def _given_position(bound: Bound, p: int) -> Position | None:
    if isinstance(bound, StreamCut):
        return bound.get(p)
    if bound.kind is OffsetKind.POSITION and bound.position is not None \
            and bound.position.partition == p:
        return bound.position
    return None


def _is_latest(bound: Bound | None) -> bool:
    return isinstance(bound, Offset) and bound.kind is OffsetKind.LATEST


def _window(query: Query) -> tuple[int | None, int | None]:
    """The publish-time window ``[t0, t1)`` of ``query``: its time bounds and time filter."""
    t0, t1 = _time_of(query.start), _time_of(query.end)
    if query.time_from is not None:
        t0 = query.time_from if t0 is None else max(t0, query.time_from)
    if query.time_to is not None:
        t1 = query.time_to if t1 is None else min(t1, query.time_to)
    return t0, t1


def _time_of(bound: Bound | None) -> int | None:
    if isinstance(bound, Offset) and bound.kind is OffsetKind.TIME:
        return bound.time_ms
    return None


def _position_of(bound: Bound, p: int, topic: str) -> Position | None:
    """A position bound for partition ``p``; None where the bound is a time (no position)."""
    if isinstance(bound, StreamCut):
        if bound.topic != topic:
            raise ConfigError(f"stream cut is for {bound.topic!r}, not {topic!r}")
        pos = bound.get(p)
        if pos is None:
            raise ConfigError(f"stream cut for {topic!r} has no position for partition {p}")
        return pos
    if bound.kind is OffsetKind.POSITION:
        assert bound.position is not None
        if bound.position.partition != p:
            raise ConfigError(f"position {bound.position} is not in partition {p}; use a "
                              "stream cut to give a position per partition")
        return bound.position
    if bound.kind is OffsetKind.EARLIEST:
        return Position(p, 0, 0, 0)
    return None
