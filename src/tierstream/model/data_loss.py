"""The data-loss rule every bounded reader applies: which segments that retention deleted lie
in a read's window, and what the read does about them (guarantee 5 of the design).

One rule for the planner (``read``, ``plan``, ``backfill``, Spark) and for reads through the
broker (``consume``, :func:`tierstream.client.read`): a read that would have returned part of
a window without a word is how rows went missing silently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from tierstream.errors import DataLossError
from tierstream.util.timeutil import format_ms

__all__ = ["HOW_TO_SKIP", "lost_segments", "report_data_loss"]

log = logging.getLogger("tierstream.model.data_loss")

HOW_TO_SKIP = ("to read what survives, set failOnDataLoss=false (Spark option; "
               "fail_on_data_loss=False in Python; --skip-data-loss on the command line)")


def lost_segments(deleted: Iterable[dict[str, Any]], *, from_segment: int | None = None,
                  t0: int | None = None, t1: int | None = None) -> list[dict[str, Any]]:
    """The deleted segments (records of ``deleted_segments``, one partition's) that held data
    of a read starting at segment ``from_segment`` and/or publish time ``t0`` and ending
    before publish time ``t1`` (None: unbounded on that side)."""
    return [d for d in deleted
            if (from_segment is None or d["segment_id"] >= from_segment)
            and (t0 is None or (d["max_publish_time"] or 0) >= t0)
            and (t1 is None or d["min_publish_time"] is None or d["min_publish_time"] < t1)]


def report_data_loss(topic: str, partition: int, lost: list[dict[str, Any]], *,
                     fail: bool) -> None:
    """Raise DataLossError naming topic, partition and the missing range; or, with ``fail``
    false, log a warning that says what is skipped (stderr on the command line)."""
    if not lost:
        return
    ids = f"{lost[0]['segment_id']}..{lost[-1]['segment_id']}"
    window = (f"{format_ms(lost[0]['min_publish_time'])} .. "
              f"{format_ms(lost[-1]['max_publish_time'])}")
    messages = sum(d["messages"] for d in lost)
    text = (f"data loss in {topic!r} partition {partition}: segments {ids} ({messages} "
            f"messages, publish times {window}) were deleted by {lost[-1]['reason']}")
    if fail:
        raise DataLossError(f"{text}; {HOW_TO_SKIP}")
    log.warning("%s; skipping them (failOnDataLoss=false)", text)
