"""A subscription's durable state on one partition: Pulsar's mark-delete position plus the
individually acknowledged ranges beyond it, the subscription type, and dead-letter intents.

Stored as JSON in the ``cursors`` table, one row per (topic, subscription, partition):

- ``mark_delete``: every message before this position is acknowledged (Pulsar stores the last
  acknowledged one; this is the position right after it, which needs no message to exist);
- ``acked``: half-open ``[from, to)`` position ranges beyond it that are acknowledged too
  (Pulsar's individually-deleted ranges), sorted and disjoint, at most :data:`MAX_ACKED_RANGES`
  (Pulsar's ``managedLedgerMaxUnackedRangesToPersist``): past that many holes, the ranges after
  the first ones are kept in memory only, and a broker crash redelivers them;
- ``type``: the subscription type it was created with (None for a cursor a Spark stream keeps);
- ``dead_letters``: messages on their way to the dead-letter topic (written there before they
  are acknowledged here, so a crash between the two re-sends them with the same sequence id and
  the dead-letter topic stores them once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierstream.splits.positions import Position

__all__ = ["MAX_ACKED_RANGES", "CursorState", "DeadLetterIntent"]

MAX_ACKED_RANGES = 10_000


@dataclass
class DeadLetterIntent:
    """Messages a dispatcher sends to ``topic`` as one batch with ``sequence_id``."""

    sequence_id: int
    topic: str
    positions: list[Position]

    def to_json(self) -> dict[str, Any]:
        return {"sequence_id": self.sequence_id, "topic": self.topic,
                "positions": [[p.segment_id, p.entry_id, p.batch_index] for p in self.positions]}

    @classmethod
    def from_json(cls, data: dict[str, Any], partition: int) -> DeadLetterIntent:
        return cls(int(data["sequence_id"]), str(data["topic"]),
                   [Position(partition, int(s), int(e), int(b)) for s, e, b in data["positions"]])


@dataclass
class CursorState:
    partition: int
    mark_delete: Position
    acked: list[tuple[Position, Position]] = field(default_factory=list)
    type: str | None = None
    dead_letters: list[DeadLetterIntent] = field(default_factory=list)
    dead_letter_sequence: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "mark_delete": _pos(self.mark_delete),
                "acked": [[_pos(a), _pos(b)] for a, b in self.acked[:MAX_ACKED_RANGES]],
                "dead_letters": [d.to_json() for d in self.dead_letters],
                "dead_letter_sequence": self.dead_letter_sequence}

    @classmethod
    def from_json(cls, data: Any, partition: int) -> CursorState:
        if isinstance(data, list):
            # written before individual acks (schema version 7): per key range, the next
            # position; the lowest of them is where every range is acknowledged up to
            lowest = min((Position.from_dict(pos) for _, _, pos in data),
                         default=Position(partition, 0, 0, 0))
            return cls(partition, lowest, type=None)

        def at(raw: list[int]) -> Position:
            return Position(partition, int(raw[0]), int(raw[1]), int(raw[2]))

        return cls(partition, at(data["mark_delete"]),
                   [(at(a), at(b)) for a, b in data.get("acked") or []],
                   data.get("type"),
                   [DeadLetterIntent.from_json(d, partition)
                    for d in data.get("dead_letters") or []],
                   int(data.get("dead_letter_sequence") or 0))


def _pos(p: Position) -> list[int]:
    return [p.segment_id, p.entry_id, p.batch_index]
