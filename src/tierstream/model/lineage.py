"""Elastic topics: scale events, and which partition a grown partition's keys came from.

A topic grows at a **scale event** from ``old`` to ``new`` partitions, ``new`` a multiple of
``old``. Keys route by ``key_hash % partitions`` with the count in force when they are written,
so a key that lived in partition ``h % old`` before the event lives in ``h % new`` after it, and
``(h % new) % old == h % old``: every new partition ``q`` takes its keys from exactly one old
one, its **parent** ``q % old``. Parents always have lower numbers than their children, so
reading a partition before the partitions grown from it keeps every key's order.

The event seals every open segment of the topic and opens new ones in one metadata
transaction, so it has an exact **boundary** in every old partition: segments with ids below
``first_segment_id`` hold what was written before it, the others what was written after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tierstream.model.positions import Position

__all__ = ["Lineage", "ScaleEvent"]


@dataclass(frozen=True)
class ScaleEvent:
    """One growth of a topic, as the metadata store records it."""

    seq: int  # 1, 2, ... per topic
    old: int  # partitions before the event
    new: int  # partitions after it
    first_segment_id: int  # the topic's segments from before the event have smaller ids
    at: int  # ms since epoch
    reason: str = "admin"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScaleEvent:
        return cls(int(data["seq"]), int(data["old"]), int(data["new"]),
                   int(data["first_segment_id"]), int(data["at"]), str(data.get("reason", "")))

    def boundary(self, partition: int) -> Position:
        """The first position of ``partition`` written after this event: everything before
        it was written before, everything at or after it later."""
        return Position.known(partition, self.first_segment_id, 0, 0)

    def describe(self) -> str:
        return f"scale event {self.seq}: {self.old} -> {self.new} partitions ({self.reason})"


class Lineage:
    """The scale events of one topic, and what they imply for each partition."""

    def __init__(self, events: Iterable[ScaleEvent] = ()) -> None:
        self.events = tuple(sorted(events, key=lambda e: e.seq))

    def __bool__(self) -> bool:
        return bool(self.events)

    def created_by(self, partition: int) -> ScaleEvent | None:
        """The event that created ``partition`` (None: it existed from the topic's start)."""
        for e in self.events:
            if e.old <= partition < e.new:
                return e
        return None

    def parent(self, partition: int) -> tuple[int, ScaleEvent] | None:
        """``(parent partition, event)`` for a grown partition, else None."""
        e = self.created_by(partition)
        return None if e is None else (partition % e.old, e)

    def ancestors(self, partition: int) -> list[tuple[int, ScaleEvent]]:
        """Every partition ``partition``'s keys passed through, nearest first, each with the
        event at which they left it (its :meth:`ScaleEvent.boundary` in that partition)."""
        out = []
        while (up := self.parent(partition)) is not None:
            out.append(up)
            partition = up[0]
        return out

    def root(self, partition: int) -> int:
        """The partition of the topic's first generation that ``partition`` descends from."""
        while (up := self.parent(partition)) is not None:
            partition = up[0]
        return partition
