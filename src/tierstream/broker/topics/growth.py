"""Growing a topic's partition count (elastic topics: ``lineage.py``).

A topic whose keys tierstream routes grows at once: under every partition's lock the open
segments are sealed, one metadata transaction records the new count, the scale event and a new
open segment for every partition, and the partitions serve again, refusing batches routed by
the old count (a tierstream producer routes them again).

A topic whose keys its Pulsar clients route (``broker/topics/key_routing.py``) cannot refuse a batch
for its routing: the broker cannot compute a client's hash, and a client routes by the old
count until it looks again (every 60 s). So it grows in two steps, Pravega's rule kept across
them — a new partition is read only after its parent was read up to the event:

1. **announced**: its clients are told the new count (``PARTITIONED_METADATA``) and write to
   the new partitions at once; tierstream's readers still see the old ones, and a Pulsar
   consumer of a new partition gets nothing of it yet;
2. **recorded**, ``--client-refresh-wait`` later, when every client has looked again: the old
   partitions' open segments are sealed and the event is recorded with its boundary there —
   after everything any client routed by the old count — and every reader sees the new
   partitions, each after its parent.

A crash between the steps keeps the announcement (it is in the metadata); the event is
recorded when the wait is over, by whichever broker serves the store then. On several
brokers (``cluster.py``) the broker serving the topic's partition 0 records it, once it has
gathered the other old partitions: their open segments hold the event's boundary.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from tierstream.errors import ConfigError
from tierstream.managed_ledger.partition_log import PartitionLog
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.metadata.scale_events import (
    CLIENT_ROUTING,
    announce_growth,
    growth_refused,
    record_scale_event,
)
from tierstream.metadata.store import MetadataStore
from tierstream.model.names import TopicName
from tierstream.util.faults import crash_point
from tierstream.util.timeutil import describe_duration, now_ms

__all__ = ["Growth", "check_growth"]

log = logging.getLogger(__name__)


class Growth:
    """The store's part that changes partition counts (``broker/store.py`` owns it)."""

    def __init__(self, metadata: MetadataStore, logs: dict[tuple[str, int], PartitionLog], *,
                 locks: tuple[threading.Lock, threading.Lock],
                 choose_ensemble: Callable[[], tuple[str, ...]],
                 open_topic: Callable[[TopicRecord, list[SegmentRecord]], None],
                 max_partitions: int, client_refresh_wait_ms: int,
                 gathered: Callable[[TopicRecord], bool] | None = None) -> None:
        self._metadata = metadata
        self._logs = logs
        # a commit being applied routes its rows by one count (the coordinator's commit
        # lock), and partitions are opened under the topics lock: the event holds both
        self._locks = locks
        self._choose_ensemble = choose_ensemble
        self._open_topic = open_topic
        self.max_partitions = max_partitions
        self.client_refresh_wait_ms = client_refresh_wait_ms
        self._watch = True  # whether a growth may be announced (False: none was, last look)
        #: several brokers: whether this one records an announced growth of the topic now
        #: (it serves the topic's partition 0, and gathered the other old ones); another
        #: broker may announce one, so every pass looks
        self._gathered = gathered

    def set_partitions(self, name: str, partitions: int, *, reason: str = "admin"
                       ) -> TopicRecord:
        """Grow a topic to ``partitions``: at one scale event, or for a client-routed topic
        announced now and recorded :attr:`client_refresh_wait_ms` later."""
        topic = TopicName.parse(name)
        with self._locks[0], self._locks[1]:
            record = self._metadata.get_topic(topic)
            check_growth(record.name, record.partitions, partitions, self.max_partitions)
            if (refused := growth_refused(record)) is not None:
                raise refused  # before anything is sealed
            if partitions == record.partitions:
                return record
            if record.key_routing == CLIENT_ROUTING:
                return self._announce(record, partitions, reason)
            return self._record(record, partitions, reason)

    def record_due(self, now: int) -> None:
        """Record the scale event of every announced growth whose wait is over (the store's
        housekeeping calls this at each pass)."""
        if not self._watch:
            return
        with self._locks[1]:  # an announcement sets _watch under it
            announced = [r for r in self._metadata.list_topics() if r.announced is not None]
            self._watch = bool(announced) or self._gathered is not None
        for record in announced:
            if record.announced_at is not None \
                    and now - record.announced_at >= self.client_refresh_wait_ms \
                    and (self._gathered is None or self._gathered(record)):
                with self._locks[0], self._locks[1]:
                    record = self._metadata.get_topic(record.name)
                    if record.announced is not None and self._served(record):
                        # nobody recorded it meanwhile, nor moved an old partition away
                        self._record(record, record.announced,
                                     f"announced to its Pulsar clients "
                                     f"{describe_duration(now - (record.announced_at or now))} "
                                     "before")

    def _served(self, record: TopicRecord) -> bool:
        """Whether every old partition of ``record`` is served here (a cluster's may have
        moved since it was gathered: recorded at a later pass)."""
        logs = [self._logs.get((record.name, p)) for p in range(record.partitions)]
        return all(plog is not None and not plog.lost for plog in logs)

    def _announce(self, record: TopicRecord, partitions: int, reason: str) -> TopicRecord:
        old = record.partitions
        grown, opened = announce_growth(
            self._metadata, record.name, old, partitions, at=now_ms(),
            ensembles=[self._choose_ensemble() for _ in range(old, partitions)])
        self._watch = True
        crash_point("scale.announced")
        self._open_topic(grown, opened)
        log.info("%s: growing %d -> %d partitions (%s): its Pulsar clients write to the new "
                 "ones now, tierstream's readers see them in %s, when every client has looked "
                 "again", record.name, old, partitions, reason,
                 describe_duration(self.client_refresh_wait_ms))
        return grown

    def _record(self, record: TopicRecord, partitions: int, reason: str) -> TopicRecord:
        """Seal the old partitions' open segments, record the event, serve again."""
        old = record.partitions
        announced = record.announced is not None
        logs = [self._logs[(record.name, p)] for p in range(old)]
        with contextlib.ExitStack() as held:
            for plog in logs:
                held.enter_context(plog.lock)
            for plog in logs:
                plog.seal_for_scale()
            crash_point("scale.sealed")
            grown, opened = record_scale_event(
                self._metadata, record.name, old, partitions, at=now_ms(), reason=reason,
                ensembles=[self._choose_ensemble()
                           for _ in range(old if announced else partitions)])
            crash_point("scale.recorded")
            for seg in opened[:old]:
                logs[seg.partition].reopen(seg, partitions)
            if not announced:
                self._open_topic(grown, opened[old:])
        log.info("%s: %s", record.name, grown.scale_events[-1].describe())
        return grown


def check_growth(topic: str, old: int, new: int, limit: int) -> None:
    """Refuse, in one line, a partition count a topic cannot grow to."""
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise ConfigError(f"invalid partition count {new!r} for topic {topic!r}: expected an "
                          "integer >= 1")
    if new < old:
        raise ConfigError(
            f"cannot shrink topic {topic!r} from {old} to {new} partitions: partitions hold "
            "data and each key's order, so they are never removed (create a new topic and "
            "copy into it to have fewer)")
    if new > limit:
        raise ConfigError(
            f"invalid partition count {new} for topic {topic!r}: this broker allows at most "
            f"{limit} per topic (broker option --max-partitions-per-topic)")
    if new % old:
        raise ConfigError(
            f"cannot grow topic {topic!r} from {old} to {new} partitions: the new count must "
            f"be a multiple of {old} ({old * 2}, {old * 3}, ...), so that each new partition "
            "takes its keys from exactly one old one and every reader keeps their order")
