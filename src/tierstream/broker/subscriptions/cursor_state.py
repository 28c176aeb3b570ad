"""A subscription's durable state on one partition: Pulsar's mark-delete position plus the
individually acknowledged ranges beyond it, the subscription type, and dead-letter intents.

Stored as JSON in the ``cursors`` table, one row per (topic, subscription, partition):

- ``mark_delete``: every message before this position is acknowledged (Pulsar stores the last
  acknowledged one; this is the position right after it, which needs no message to exist);
- ``acked``: half-open ``[from, to)`` position ranges beyond it that are acknowledged too
  (Pulsar's individually-deleted ranges), sorted and disjoint, at most :data:`MAX_ACKED_RANGES`
  (Pulsar's ``managedLedgerMaxUnackedRangesToPersist``): past that many holes, the ranges after
  the first ones are kept in memory only, and a broker crash redelivers them;
- ``acked_entries``: the same for entries acknowledged in part, as ``[segment, entry, first
  batch index, count, bitmap]`` with the bitmap in base64 (one bit a message, set when
  acknowledged): Key_Shared consumers acknowledge interleaved messages, and a hole every few
  messages is far smaller as bits than as ranges. Read back, they become ranges again;
- ``type``: the subscription type it was created with (None for a cursor a Spark stream keeps);
- ``dead_letters``: messages on their way to the dead-letter topic (written there before they
  are acknowledged here, so a crash between the two re-sends them with the same sequence id and
  the dead-letter topic stores them once).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierstream.model.positions import Position

__all__ = ["MAX_ACKED_RANGES", "AckedEntry", "CursorState", "DeadLetterIntent"]

MAX_ACKED_RANGES = 10_000

#: ``(segment_id, entry_id, first batch index, messages, packed bits: 1 = acknowledged)``
AckedEntry = tuple[int, int, int, int, bytes]


@dataclass
class DeadLetterIntent:
    """Messages a dispatcher sends to ``topic`` as one batch with ``sequence_id``."""

    sequence_id: int
    topic: str
    positions: list[Position]

    def to_json(self) -> dict[str, Any]:
        return {"sequence_id": self.sequence_id, "topic": self.topic,
                "positions": [[p.segment_id, p.entry_id, p.batch_index] for p in self.positions]}

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The positions as segment, entry and batch index arrays."""
        return (np.array([p.segment_id for p in self.positions], dtype=np.int64),
                np.array([p.entry_id for p in self.positions], dtype=np.int64),
                np.array([p.batch_index for p in self.positions], dtype=np.int64))

    @classmethod
    def from_json(cls, data: dict[str, Any], partition: int) -> DeadLetterIntent:
        return cls(int(data["sequence_id"]), str(data["topic"]),
                   [Position(partition, int(s), int(e), int(b)) for s, e, b in data["positions"]])


#: the label of a non-durable subscription's cursor (a Pulsar reader's): deleted when its
#: reader leaves, and by the next broker start if the broker stopped first
NON_DURABLE = "non-durable (a Pulsar reader's)"


@dataclass
class CursorState:
    partition: int
    mark_delete: Position
    acked: list[tuple[Position, Position]] = field(default_factory=list)
    type: str | None = None
    dead_letters: list[DeadLetterIntent] = field(default_factory=list)
    dead_letter_sequence: int = 0
    acked_entries: list[AckedEntry] = field(default_factory=list)
    #: whose cursor this is, for a person reading ``tierstream subscriptions`` (a Spark
    #: stream's query and checkpoint); None for consumers' subscriptions
    label: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "mark_delete": _pos(self.mark_delete),
                "acked": [[_pos(a), _pos(b)] for a, b in self.acked[:MAX_ACKED_RANGES]],
                "acked_entries": [[s, e, b, n, base64.b64encode(bits).decode("ascii")]
                                  for s, e, b, n, bits in self.acked_entries],
                "dead_letters": [d.to_json() for d in self.dead_letters],
                "dead_letter_sequence": self.dead_letter_sequence,
                **({"label": self.label} if self.label else {})}

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

        ranges = [(at(a), at(b)) for a, b in data.get("acked") or []]
        for s, e, b, n, bits in data.get("acked_entries") or []:
            ranges.extend(_entry_ranges(partition, int(s), int(e), int(b), int(n),
                                        base64.b64decode(bits)))
        mark_delete = at(data["mark_delete"])
        # (an entry's bitmap also covers what it holds before the mark-delete position)
        ranges = [(max(a, mark_delete), b) for a, b in _merged(ranges) if b > mark_delete]
        return cls(partition, mark_delete, ranges,
                   data.get("type"),
                   [DeadLetterIntent.from_json(d, partition)
                    for d in data.get("dead_letters") or []],
                   int(data.get("dead_letter_sequence") or 0),
                   label=data.get("label"))


def _entry_ranges(partition: int, segment: int, entry: int, bi0: int, n: int, bits: bytes
                  ) -> list[tuple[Position, Position]]:
    """The runs of set bits of one entry's bitmap, as position ranges."""
    acked = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], acked, [0]))))
    return [(Position.known(partition, segment, entry, bi0 + int(a)),
             Position.known(partition, segment, entry, bi0 + int(b)))
            for a, b in zip(edges[0::2], edges[1::2], strict=True)]


def _merged(ranges: list[tuple[Position, Position]]) -> list[tuple[Position, Position]]:
    """``ranges`` sorted, with touching and overlapping ones joined."""
    merged: list[tuple[Position, Position]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _pos(p: Position) -> list[int]:
    return [p.segment_id, p.entry_id, p.batch_index]
