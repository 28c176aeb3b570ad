"""Scale events in the metadata store (elastic topics: ``lineage.py``).

The event is one metadata transaction: the topic's new partition count, a new open segment for
every partition, and the event row naming the first of those segments. The broker seals the
old open segments before it (``broker/store.py``), so the event row is the exact boundary.
"""

from __future__ import annotations

from tierstream.errors import ConfigError, ConflictError, NotFoundError
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.metadata.store import MetadataStore, _insert_segments

__all__ = ["CLIENT_ROUTING", "growth_refused", "record_scale_event", "route_keys_by_client"]

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


def growth_refused(name: str, key_routing: str | None) -> ConfigError | None:
    """Why topic ``name`` cannot grow (None: it can): its keys are routed by its clients."""
    if key_routing != CLIENT_ROUTING:
        return None
    return ConfigError(
        f"{name} cannot grow: its keys are where its Pulsar clients routed them (not "
        "by tierstream's hash), so after a scale event the broker could not tell a key a "
        "client still routes by the old count from one where it now belongs, and per-key "
        "order would break; make a new topic with "
        "more partitions, or route keys with tierstream's hash from the start (see README, "
        "'Pulsar clients')")


def record_scale_event(store: MetadataStore, name: str, old: int, new: int, *, at: int,
                       reason: str, ensembles: list[tuple[str, ...]]
                       ) -> tuple[TopicRecord, list[SegmentRecord]]:
    """Record a scale event of ``name`` from ``old`` to ``new`` partitions and, in the same
    transaction, a new open segment for every partition (``ensembles[p]``)."""
    with store.atomic() as c:
        row = c.execute("SELECT partitions FROM topics WHERE name=? AND deleting_at IS NULL",
                        (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"topic {name!r} does not exist")
        if row[0] != old:
            raise ConflictError(f"topic {name!r} has {row[0]} partitions, not {old}")
        routing = c.execute("SELECT key_routing FROM topics WHERE name=?", (name,)).fetchone()
        refused = growth_refused(name, routing[0])  # the broker checks before sealing too
        if refused is not None:
            raise refused
        c.execute("UPDATE topics SET partitions=? WHERE name=?", (new, name))
        segments = _insert_segments(c, name, list(enumerate(ensembles)), at)
        seq = c.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM scale_events WHERE topic=?",
                        (name,)).fetchone()[0]
        c.execute("INSERT INTO scale_events (topic, seq, old_partitions, new_partitions, "
                  "first_segment_id, at, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (name, seq, old, new, min(s.segment_id for s in segments), at, reason))
    return store.get_topic(name), segments
