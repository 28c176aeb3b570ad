"""Scale events in the metadata store (elastic topics: ``lineage.py``).

The event is one metadata transaction: the topic's new partition count, a new open segment for
every partition, and the event row naming the first of those segments. The broker seals the
old open segments before it (``broker/topics/growth.py``), so the event row is the exact boundary.

A topic whose keys its Pulsar clients route grows in two steps, because a client keeps routing
by the old count until it looks again: the growth is first **announced** (its clients are told
the new count and write to the new partitions, tierstream's readers still see the old ones),
and the event is recorded once every client has looked again — its boundary then lies after
everything a client routed by the old count (the Pravega rule: a new partition is read only
after its parent was read up to the event).
"""

from __future__ import annotations

from tierstream.errors import ConflictError, NotFoundError
from tierstream.metadata.backend import Tx
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.metadata.segment_rows import insert_segments
from tierstream.metadata.store import MetadataStore

__all__ = ["CLIENT_ROUTING", "announce_growth", "growth_refused", "record_scale_event",
           "route_keys_by_client"]

#: a topic whose keys its Pulsar clients put in partitions (TopicRecord.key_routing)
CLIENT_ROUTING = "client"


def route_keys_by_client(store: MetadataStore, name: str) -> bool:
    """Record that ``name``'s keys are where its Pulsar clients route them (one transaction);
    False, nothing changed, if the topic grew before: its readers rely on tierstream's
    routing across those scale events (``lineage.py``)."""
    with store.atomic() as c:
        if c.execute("SELECT 1 FROM scale_events WHERE topic=?", (name,)).fetchone():
            return False
        c.execute("UPDATE topics SET key_routing=? WHERE name=?", (CLIENT_ROUTING, name))
    return True


def growth_refused(record: TopicRecord) -> ConflictError | None:
    """Why ``record``'s topic cannot grow now (None: it can): a growth is under way."""
    if record.announced is None:
        return None
    return ConflictError(
        f"{record.name} is growing to {record.announced} partitions (announced to its Pulsar "
        "clients, read as grown once they have all looked again): grow it again after that")


def announce_growth(store: MetadataStore, name: str, old: int, new: int, *, at: int,
                    ensembles: list[tuple[str, ...]]) -> tuple[TopicRecord, list[SegmentRecord]]:
    """The first half of a client-routed topic's growth (one transaction): its Pulsar clients
    are told ``new`` partitions and can write to the new ones (an open segment for each of
    partitions ``old..new-1``, ``ensembles[i]``), while tierstream's readers see ``old``
    until :func:`record_scale_event` (``broker/topics/growth.py``)."""
    with store.atomic() as c:
        _check_count(c, name, old)
        c.execute("UPDATE topics SET announced=?, announced_at=? WHERE name=?", (new, at, name))
        segments = insert_segments(c, name, list(enumerate(ensembles, start=old)), at,
                                   store.owner)
    return store.get_topic(name), segments


def _check_count(c: Tx, name: str, old: int, *, announced: int | None = None) -> None:
    """The topic has ``old`` partitions and no growth under way but to ``announced``."""
    row = c.execute("SELECT partitions, announced FROM topics WHERE name=? AND deleting_at IS "
                    "NULL", (name,)).fetchone()
    if row is None:
        raise NotFoundError(f"topic {name!r} does not exist")
    if row[0] != old:
        raise ConflictError(f"topic {name!r} has {row[0]} partitions, not {old}")
    if row[1] not in (None, announced):
        raise ConflictError(f"topic {name!r} is growing to {row[1]} partitions already")


def record_scale_event(store: MetadataStore, name: str, old: int, new: int, *, at: int,
                       reason: str, ensembles: list[tuple[str, ...]]
                       ) -> tuple[TopicRecord, list[SegmentRecord]]:
    """Record a scale event of ``name`` from ``old`` to ``new`` partitions and, in the same
    transaction, a new open segment for every partition ``p`` of ``ensembles[p]`` — every
    partition, or for a growth announced before (:func:`announce_growth`, whose segments
    opened the new partitions) the old ones only: the event's boundary is in those."""
    with store.atomic() as c:
        _check_count(c, name, old, announced=new)
        c.execute("UPDATE topics SET partitions=?, announced=NULL, announced_at=NULL "
                  "WHERE name=?", (new, name))
        segments = insert_segments(c, name, list(enumerate(ensembles)), at, store.owner)
        seq = c.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM scale_events WHERE topic=?",
                        (name,)).fetchone()[0]
        c.execute("INSERT INTO scale_events (topic, seq, old_partitions, new_partitions, "
                  "first_segment_id, at, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (name, seq, old, new, min(s.segment_id for s in segments), at, reason))
    return store.get_topic(name), segments
