"""Positions in the log, key ranges, and named start/stop strategies.

A :class:`Position` is a cut point inside one partition: as a start it is inclusive, as an end it
is exclusive. Positions need not name an existing message: ``(p, s, e + 1, 0)`` is the point right
after entry ``e`` of segment ``s``, which sorts before every message of a later segment.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from dataclasses import dataclass
from typing import Any

from tierstream.errors import ConfigError
from tierstream.model.message_format import KEY_HASH_SLOTS

__all__ = ["EntryRanges", "KeyRange", "Offset", "OffsetKind", "Position", "cut_entries",
           "entries_between", "entry_ranges", "in_position_order", "in_ranges",
           "ranges_within"]

#: Entry ids of one segment as sorted, disjoint half-open ranges ``((lo, hi), ...)``: the
#: entries readers skip (aborted or set-aside transaction entries: see
#: ``broker/transactions/coordinator.py``). Small: one range per run of such entries.
EntryRanges = tuple[tuple[int, int], ...]


@dataclass(frozen=True, order=True)
class Position:
    """``(partition, segment_id, entry_id, batch_index)``: totally ordered within a partition."""

    partition: int
    segment_id: int
    entry_id: int
    batch_index: int = 0

    def __post_init__(self) -> None:
        p, s, e, b = self.partition, self.segment_id, self.entry_id, self.batch_index
        # one fast test on the hot path (planning makes many positions); details on failure
        if type(p) is int and type(s) is int and type(e) is int and type(b) is int \
                and p >= 0 and s >= 0 and e >= 0 and b >= 0:
            return
        values = (p, s, e, b)
        for name, value in zip(("partition", "segment_id", "entry_id", "batch_index"), values,
                               strict=True):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(
                    f"invalid position: {name} must be an integer >= 0, got {value!r}"
                )

    @classmethod
    def known(cls, partition: int, segment_id: int, entry_id: int, batch_index: int = 0
              ) -> Position:
        """A position of values already known to be valid (ints >= 0 read from the metadata
        store or taken from other positions): the planner makes thousands, so no checks."""
        pos = object.__new__(cls)
        pos.__dict__.update(partition=partition, segment_id=segment_id, entry_id=entry_id,
                            batch_index=batch_index)
        return pos

    def to_dict(self) -> dict[str, int]:
        return {
            "partition": self.partition,
            "segment_id": self.segment_id,
            "entry_id": self.entry_id,
            "batch_index": self.batch_index,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Position:
        try:
            return cls(
                int(data["partition"]),
                int(data["segment_id"]),
                int(data["entry_id"]),
                int(data.get("batch_index", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(
                f"invalid position {data!r}: expected partition, segment_id, entry_id, batch_index"
            ) from exc

    @classmethod
    def parse(cls, text: str) -> Position:
        """Parse ``partition:segment:entry[:batch]``."""
        parts = text.split(":")
        if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
            raise ConfigError(
                f"invalid position {text!r}: expected partition:segment:entry[:batch_index], "
                "e.g. 0:12:345:0"
            )
        return cls(*(int(p) for p in parts))

    def __str__(self) -> str:
        return f"{self.partition}:{self.segment_id}:{self.entry_id}:{self.batch_index}"


@dataclass(frozen=True, order=True)
class KeyRange:
    """A half-open range ``[lo, hi)`` of Key_Shared hash slots, ``0 <= lo < hi <= 65536``."""

    lo: int = 0
    hi: int = KEY_HASH_SLOTS

    def __post_init__(self) -> None:
        ok = (
            isinstance(self.lo, int)
            and isinstance(self.hi, int)
            and 0 <= self.lo < self.hi <= KEY_HASH_SLOTS
        )
        if not ok:
            raise ConfigError(
                f"invalid key range [{self.lo!r}, {self.hi!r}): expected 0 <= lo < hi <= "
                f"{KEY_HASH_SLOTS}"
            )

    @classmethod
    def full(cls) -> KeyRange:
        return cls(0, KEY_HASH_SLOTS)

    @property
    def is_full(self) -> bool:
        return self.lo == 0 and self.hi == KEY_HASH_SLOTS

    def contains(self, slot: int) -> bool:
        return self.lo <= slot < self.hi

    @classmethod
    def parse(cls, text: str) -> KeyRange:
        """Parse ``LO:HI`` (half-open)."""
        lo, sep, hi = text.partition(":")
        if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
            raise ConfigError(
                f"invalid key range {text!r}: expected LO:HI with 0 <= LO < HI <= {KEY_HASH_SLOTS}"
                ", e.g. 0:16384"
            )
        return cls(int(lo), int(hi))

    @classmethod
    def split(cls, k: int) -> list[KeyRange]:
        """``k`` contiguous ranges covering all slots, as equal as integers allow."""
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= KEY_HASH_SLOTS:
            raise ConfigError(f"invalid number of key ranges {k!r}: expected 1..{KEY_HASH_SLOTS}")
        bounds = [i * KEY_HASH_SLOTS // k for i in range(k + 1)]
        return [cls(bounds[i], bounds[i + 1]) for i in range(k)]

    @staticmethod
    def tile(ranges: list[KeyRange]) -> bool:
        """Whether ``ranges`` together are every slot, each exactly once."""
        ordered = sorted(ranges, key=lambda r: r.lo)
        return bool(ordered) and ordered[0].lo == 0 and ordered[-1].hi == KEY_HASH_SLOTS \
            and all(a.hi == b.lo for a, b in itertools.pairwise(ordered))

    def to_list(self) -> list[int]:
        return [self.lo, self.hi]

    def __str__(self) -> str:
        return f"{self.lo}:{self.hi}"


def entry_ranges(ids: Any) -> EntryRanges:
    """``ids`` (entry ids, any order, repeats allowed) as :data:`EntryRanges`."""
    out: list[list[int]] = []
    for i in sorted(set(int(x) for x in ids)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((lo, hi) for lo, hi in out)


def in_ranges(ranges: EntryRanges, entry_id: int) -> bool:
    """Whether ``entry_id`` lies in one of ``ranges``."""
    if not ranges:
        return False
    i = bisect.bisect_right(ranges, (entry_id, 1 << 62)) - 1
    return i >= 0 and ranges[i][0] <= entry_id < ranges[i][1]


def ranges_within(ranges: EntryRanges, lo: int, hi: int) -> EntryRanges:
    """The part of ``ranges`` inside entries ``[lo, hi)``."""
    return tuple((max(a, lo), min(b, hi)) for a, b in ranges if a < hi and b > lo)


def entries_between(start: Position, end: Position) -> int:
    """How many entries of one segment ``[start, end)`` touches (at least 1)."""
    return max(1, (end.entry_id if end.batch_index == 0 else end.entry_id + 1)
               - start.entry_id)


def cut_entries(start: Position, end: Position, n: int) -> list[tuple[Position, Position]]:
    """``[start, end)`` of one segment cut into at most ``n`` ranges of whole entries (the
    first starts at ``start``, the last ends at ``end``, both possibly mid-entry)."""
    first, entries = start.entry_id, entries_between(start, end)
    n = max(1, min(n, entries))
    bounds = [first + entries * i // n for i in range(n + 1)]
    return [(start if i == 0 else Position(start.partition, start.segment_id, bounds[i], 0),
             end if i == n - 1 else Position(start.partition, start.segment_id,
                                              bounds[i + 1], 0))
            for i in range(n)]


def in_position_order(*columns: Any) -> bool:
    """Whether the rows of ``columns`` (numpy arrays of one length: partition, segment, entry,
    batch index, or a leading part of them) never go down from one row to the next in
    lexicographic order: rows read from the log, or acks a client sends, usually do, and then
    need no sort."""
    import numpy as np  # not at the top: most processes never compare positions in bulk

    steps = [np.diff(c.astype(np.int64, copy=False)) for c in columns]
    ok = steps[-1] >= 0
    for step in reversed(steps[:-1]):
        ok = (step > 0) | ((step == 0) & ok)
    return bool(np.all(ok))


class OffsetKind(enum.Enum):
    EARLIEST = "earliest"
    LATEST = "latest"
    TIME = "time"
    POSITION = "position"


@dataclass(frozen=True)
class Offset:
    """Where a read starts or stops, built with the named constructors.

    As a start: ``earliest()`` is the first surviving message, ``latest()`` is just after the last
    confirmed one (only new messages), ``at_time(t)`` is the first message with
    ``publish_time >= t``, ``at_position(p)`` is ``p`` itself (inclusive).
    As an end (exclusive): ``latest()`` is the last confirmed message at the time the read is
    planned, ``at_time(t)`` stops before the first message with ``publish_time >= t``.
    """

    kind: OffsetKind
    time_ms: int | None = None
    position: Position | None = None

    @classmethod
    def earliest(cls) -> Offset:
        return cls(OffsetKind.EARLIEST)

    @classmethod
    def latest(cls) -> Offset:
        return cls(OffsetKind.LATEST)

    @classmethod
    def at_time(cls, time_ms: int) -> Offset:
        from tierstream.util.timeutil import parse_time_ms

        return cls(OffsetKind.TIME, time_ms=parse_time_ms(time_ms))

    @classmethod
    def at_position(cls, position: Position) -> Offset:
        if not isinstance(position, Position):
            raise ConfigError(f"at_position needs a Position, got {position!r}")
        return cls(OffsetKind.POSITION, position=position)

    @classmethod
    def parse(cls, text: str, *, what: str = "offset") -> Offset:
        """``earliest``, ``latest``, a position ``p:s:e[:b]``, ISO-8601 or epoch milliseconds."""
        from tierstream.util.timeutil import parse_time_ms

        t = text.strip()
        if t.lower() == "earliest":
            return cls.earliest()
        if t.lower() == "latest":
            return cls.latest()
        if t.count(":") >= 2 and all(p.isdigit() for p in t.split(":")):
            return cls.at_position(Position.parse(t))
        try:
            return cls(OffsetKind.TIME, time_ms=parse_time_ms(t, what=what))
        except ConfigError as exc:
            if str(exc).startswith("ambiguous"):
                raise  # it says what to write instead
            raise ConfigError(
                f"invalid {what} {text!r}: expected earliest, latest, an ISO-8601 time, "
                "epoch milliseconds, or a position partition:segment:entry[:batch]"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        if self.time_ms is not None:
            out["time_ms"] = self.time_ms
        if self.position is not None:
            out["position"] = self.position.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Offset:
        try:
            kind = OffsetKind(data["kind"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"invalid offset {data!r}") from exc
        if kind is OffsetKind.TIME:
            return cls.at_time(data.get("time_ms"))
        if kind is OffsetKind.POSITION:
            return cls.at_position(Position.from_dict(data.get("position")))
        return cls(kind)

    def __str__(self) -> str:
        if self.kind is OffsetKind.TIME:
            from tierstream.util.timeutil import format_ms

            return f"time {format_ms(self.time_ms)}"
        if self.kind is OffsetKind.POSITION:
            return f"position {self.position}"
        return str(self.kind.value)
