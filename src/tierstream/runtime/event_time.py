"""Reads by ``event_time`` instead of ``publish_time``.

The log is ordered by publish time, so a time window on ``publish_time`` is found by a binary
search over segment metadata and trimmed exactly by the readers. ``event_time`` is whatever
the producer said (an import of last week's clicks has last week's event times and today's
publish times): nothing orders it, so a window on it is a filter over a read of the whole
log up to the latest position. It is exact (a message is in the window when its event_time
is in ``[start, end)``; messages without an event_time are not) and costs a full read, which
is what a user asks for when the times they care about are not the publish times.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from tierstream.errors import ConfigError
from tierstream.model.positions import Offset, OffsetKind

__all__ = ["TIME_FIELDS", "check_time_field", "event_time_window", "within_event_time"]

TIME_FIELDS = ("publish_time", "event_time")


def check_time_field(value: str, what: str = "time_field") -> str:
    field = str(value).strip().lower().replace("-", "_")
    if field not in TIME_FIELDS:
        raise ConfigError(f"invalid {what} {value!r}: expected publish_time or event_time")
    return field


def event_time_window(start: object, end: object, what: str = "--from/--to"
                      ) -> tuple[int | None, int | None]:
    """The ``[start, end)`` event-time window of two time bounds (``earliest``/``latest``
    or None leave that side open); ConfigError for positions or cuts, which are places in
    the log, not event times."""
    window: list[int | None] = []
    for bound in (start, end):
        if bound is None or (isinstance(bound, Offset) and bound.kind in (
                OffsetKind.EARLIEST, OffsetKind.LATEST)):
            window.append(None)
        elif isinstance(bound, Offset) and bound.kind is OffsetKind.TIME:
            window.append(bound.time_ms)
        else:
            raise ConfigError(f"{what} with event_time takes times, earliest or latest, not "
                              f"a position ({bound})")
    lo, hi = window
    if lo is not None and hi is not None and hi < lo:
        raise ConfigError(f"the event-time window ends ({hi}) before it starts ({lo})")
    return lo, hi


def within_event_time(batches: Iterator[pa.RecordBatch], lo: int | None, hi: int | None
                      ) -> Iterator[pa.RecordBatch]:
    """The rows of ``batches`` whose event_time is in ``[lo, hi)``; empty batches dropped."""
    import pyarrow.compute as pc  # where it is used: the CLI imports this module for every
    # command, and most never compute (pyarrow.compute is 70 ms of a 0.5 s start)

    for batch in batches:
        t = batch.column("event_time")
        if pa.types.is_timestamp(t.type):
            t = pc.cast(t, pa.int64())
        mask = pc.is_valid(t)
        if lo is not None:
            mask = pc.and_(mask, pc.greater_equal(t, pa.scalar(lo, pa.int64())))
        if hi is not None:
            mask = pc.and_(mask, pc.less(t, pa.scalar(hi, pa.int64())))
        kept = batch.filter(pc.fill_null(mask, False))
        if kept.num_rows:
            yield kept
