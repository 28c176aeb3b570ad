"""A topic spread over several brokers (``--cluster``), as a whole: what takes every one of
its partitions at once — a growth (its old partitions' open segments are sealed at the scale
event under every partition's lock at once) — and what judges all of them together —
auto-scaling (``auto_scale.py``).

A growth gathers the topic's partitions on the broker asked first (each other owner hands its
own over, as an unload does: ``Cluster.unload`` with a target), then grows the topic as one
broker does (``growth.py``); the grown topic's partitions stay there until ``topic unload``
spreads them. A topic whose Pulsar clients route its keys grows in two steps: the broker asked
gathers and announces; when the clients' wait is over, the broker serving partition 0 gathers
the old partitions again, if any moved, and records the event. Auto-scaling is judged by the
broker serving partition 0, with the other owners' counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from tierstream.broker.peers import Peers
from tierstream.broker.topics.growth import Growth, check_growth
from tierstream.errors import TierstreamError, UnavailableError
from tierstream.managed_ledger.partition_log import PartitionLog
from tierstream.metadata.ownership import PartitionOwners
from tierstream.metadata.records import TopicRecord
from tierstream.metadata.scale_events import growth_refused
from tierstream.metadata.store import MetadataStore

__all__ = ["ClusterTopics"]

log = logging.getLogger(__name__)


class _Store(Protocol):
    metadata: MetadataStore
    owners: PartitionOwners
    growth: Growth

    def serves(self) -> set[tuple[str, int]]: ...

    def partition(self, topic: str, partition: int) -> PartitionLog: ...


class ClusterTopics:
    """``store``'s topics as wholes, the other brokers asked through ``peers``; ``serve``
    opens partitions handed over to this broker (``Cluster.serve``)."""

    def __init__(self, store: _Store, peers: Peers,
                 serve: Callable[[list[tuple[str, int]]], object]) -> None:
        self.store, self.peers, self._serve = store, peers, serve
        self._ungathered: set[str] = set()  # topics whose announced growth waits for a gather

    def grow(self, name: str, partitions: int, *, reason: str) -> TopicRecord:
        """Grow a topic served by several brokers: its partitions are gathered here (each
        owner hands its own over, as an unload does), and the topic grows as on one broker
        (``growth.py``). Its partitions, old and new, stay served here until ``topic
        unload`` spreads them."""
        store = self.store
        record = store.metadata.get_topic(name)
        check_growth(record.name, record.partitions, partitions, store.growth.max_partitions)
        if (refused := growth_refused(record)) is not None:
            raise refused
        if partitions == record.partitions:
            return record
        self._gather(record.name, record.partitions)
        return store.growth.set_partitions(record.name, partitions, reason=reason)

    def gathered(self, record: TopicRecord) -> bool:
        """For the announced growth of a topic whose Pulsar clients route its keys (its
        wait is over): whether this broker records it now. The broker serving partition 0
        does, once it has gathered the other old partitions (their open segments are sealed
        at the event); the others leave it. A partition it could not gather: False, said in
        the log, and tried again at the next housekeeping pass."""
        if (record.name, 0) not in self.store.serves():
            return False
        try:
            self._gather(record.name, record.partitions)
        except TierstreamError as exc:  # said once, not at every pass until it works
            if record.name not in self._ungathered:
                log.warning("the announced growth of %s is recorded later: %s", record.name,
                            exc)
                self._ungathered.add(record.name)
            return False
        self._ungathered.discard(record.name)
        return True

    def appended(self, record: TopicRecord) -> list[int] | None:
        """For auto-scaling: the messages each partition of ``record``'s topic took since
        its owner opened it, when this broker serves partition 0 (the one that judges the
        topic); the other owners are asked (``topic-stats``). None: another broker's to
        judge, or an owner did not answer (the window starts again)."""
        name, served = record.name, self.store.serves()
        if (name, 0) not in served:
            return None
        counts = {p: self.store.partition(name, p).rate_in.messages_total
                  for p in range(record.partitions) if (name, p) in served}
        asked: dict[str, list[int]] = {}
        for p in range(record.partitions):
            if p in counts:
                continue
            owner = self.store.owners.owner_of(name, p)
            if owner is None or owner.url is None:
                return None  # being taken over, or not reached yet
            asked.setdefault(owner.url, []).append(p)
        answers = self.peers.call_each({url: ("topic-stats", {"topic": name,
                                                              "here_only": True})
                                        for url in asked})
        for url, answer in answers.items():
            if isinstance(answer, Exception):
                return None
            theirs = {int(p["partition"]): int(p["messages_in"])
                      for p in answer["partitions"]}
            if not set(asked[url]) <= set(theirs):
                return None  # moved while it was asked
            counts.update((p, theirs[p]) for p in asked[url])
        return [counts[p] for p in range(record.partitions)]

    def _gather(self, topic: str, count: int) -> None:
        """Serve every one of ``topic``'s ``count`` partitions here: each other owner is
        asked to hand its own over. One with no live owner: UnavailableError, nothing
        grown (those gathered so far stay served here)."""
        me = self.store.owners.broker_id
        wanted = [(topic, p) for p in range(count)]
        for key in wanted:
            if key in self.store.serves():
                continue
            owner = self.store.owners.owner_of(*key)
            if owner is not None and owner.broker_id != me:
                if owner.url is None:
                    raise UnavailableError(f"cannot grow topic {topic!r} now: the owner of "
                                           f"partition {key[1]}, {owner.broker_id}, has not "
                                           "said where it is reached; try again in a moment")
                try:
                    self.peers.call(owner.url, "unload", {"topic": topic,
                                                          "partition": key[1], "to": me})
                except TierstreamError as exc:
                    raise UnavailableError(f"cannot grow topic {topic!r} now: the owner of "
                                           f"partition {key[1]}, {owner.describe()}, did not "
                                           f"hand it over ({exc}); try again once it "
                                           "answers or its partitions are taken over") from None
        self._serve(wanted)
        missing = [p for t, p in wanted if (t, p) not in self.store.serves()]
        if missing:
            raise UnavailableError(f"cannot grow topic {topic!r} now: partition(s) "
                                   f"{', '.join(map(str, missing))} could not be served here "
                                   "(being taken over); try again in a moment")
