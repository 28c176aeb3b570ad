"""Filter pushdown: the filters of a batch read that planning applies exactly.

``publish_time`` comparisons narrow the time window (the enumerator's binary search then skips
whole segments and the readers trim to the exact bound), ``partition`` and ``topic``
comparisons drop whole partitions and topics, and a null test on a non-null column is decided
without reading. Everything else goes back to Spark. A filter is claimed only when planning
applies it exactly, because Spark does not evaluate a claimed filter again.

Spark hands over times as timezone-aware datetimes with microseconds; stored publish times are
milliseconds, so each comparison becomes a whole-millisecond bound with no rounding error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql.datasource import (
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNotNull,
    IsNull,
    LessThan,
    LessThanOrEqual,
)

__all__ = ["Pushed"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_NOT_NULL = ("topic", "partition", "publish_time")
_COMPARISONS = (EqualTo, EqualNullSafe, GreaterThan, GreaterThanOrEqual, LessThan,
                LessThanOrEqual)


@dataclass
class Pushed:
    """What the claimed filters allow. ``time_from``/``time_to``: publish time in ms,
    ``[from, to)``; ``partition_lo``/``partition_hi`` inclusive; None is unrestricted."""

    time_from: int | None = None
    time_to: int | None = None
    partition_lo: int | None = None
    partition_hi: int | None = None
    partitions: frozenset[int] | None = None
    topics: frozenset[str] | None = None
    nothing: bool = False  # a claimed filter no row can pass

    def push(self, filters: Iterable[Filter]) -> Iterable[Filter]:
        """``DataSourceReader.pushFilters``: absorb what planning applies, return the rest."""
        return (f for f in filters if not self._absorb(f))

    def allows_topic(self, topic: str) -> bool:
        return not self.nothing and (self.topics is None or topic in self.topics)

    def allowed_partitions(self, count: int) -> list[int]:
        if self.nothing:
            return []
        lo = 0 if self.partition_lo is None else max(0, self.partition_lo)
        hi = count - 1 if self.partition_hi is None else min(count - 1, self.partition_hi)
        return [p for p in range(lo, hi + 1)
                if self.partitions is None or p in self.partitions]

    @property
    def restricts_partitions(self) -> bool:
        return not (self.partition_lo is None and self.partition_hi is None
                    and self.partitions is None)

    # -- one filter -------------------------------------------------------------------------

    def _absorb(self, f: Filter) -> bool:
        path: tuple[str, ...] = getattr(f, "attribute", ())  # Not(...) has none: for Spark
        column = path[0] if len(path) == 1 else None
        if isinstance(f, IsNotNull):
            return column in _NOT_NULL
        if isinstance(f, IsNull):
            if column in _NOT_NULL:
                self.nothing = True
                return True
            return False
        if column == "publish_time":
            return self._time(f)
        if column == "partition":
            return self._partition(f)
        if column == "topic":
            return self._topic(f)
        return False

    def _time(self, f: Any) -> bool:
        if not isinstance(f, _COMPARISONS):
            return False
        us = _micros(f.value)
        if us is None:
            return False
        floor_ms, ceil_ms = us // 1000, -(-us // 1000)
        lo = hi = None
        if isinstance(f, GreaterThan):
            lo = floor_ms + 1
        elif isinstance(f, GreaterThanOrEqual):
            lo = ceil_ms
        elif isinstance(f, LessThan):
            hi = ceil_ms
        elif isinstance(f, LessThanOrEqual):
            hi = floor_ms + 1
        else:  # EqualTo / EqualNullSafe: only a whole millisecond can match
            lo, hi = ceil_ms, floor_ms + 1
        self.time_from = _narrow(self.time_from, lo, max)
        self.time_to = _narrow(self.time_to, hi, min)
        return True

    def _partition(self, f: Any) -> bool:
        if isinstance(f, In):
            values = list(f.value)
            if not all(_is_int(v) for v in values if v is not None):
                return False
            self._only(frozenset(v for v in values if v is not None))
            return True
        if not isinstance(f, _COMPARISONS) or not _is_int(f.value):
            return False
        v = int(f.value)
        lo = hi = None
        if isinstance(f, (EqualTo, EqualNullSafe)):
            self._only(frozenset((v,)))
        elif isinstance(f, GreaterThan):
            lo = v + 1
        elif isinstance(f, GreaterThanOrEqual):
            lo = v
        elif isinstance(f, LessThan):
            hi = v - 1
        else:
            hi = v
        self.partition_lo = _narrow(self.partition_lo, lo, max)
        self.partition_hi = _narrow(self.partition_hi, hi, min)
        return True

    def _only(self, values: frozenset[int]) -> None:
        self.partitions = values if self.partitions is None else self.partitions & values

    def _topic(self, f: Any) -> bool:
        if isinstance(f, In):
            values = frozenset(v for v in f.value if isinstance(v, str))
        elif isinstance(f, (EqualTo, EqualNullSafe)) and isinstance(f.value, str):
            values = frozenset((f.value,))
        else:
            return False
        self.topics = values if self.topics is None else self.topics & values
        return True


def _narrow(current: int | None, new: int | None, tighter: Any) -> int | None:
    """A bound tightened by another (``tighter`` is max for lower bounds, min for upper)."""
    if new is None:
        return current
    return new if current is None else tighter(current, new)


def _micros(value: Any) -> int | None:
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:  # Spark sends UTC instants; be exact if one ever arrives naive
        value = value.replace(tzinfo=UTC)
    return int((value - _EPOCH) // _US)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
