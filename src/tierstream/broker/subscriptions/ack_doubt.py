"""Whether an ack came too late: the messages of a resent ack that the broker may have
delivered to another consumer before it arrived.

A consumer's ack that a broker crash interrupted is sent again to the restarted broker, which
knows nothing of who held those messages before: it may have handed them to another consumer
of the subscription already (Key_Shared gives a consumer that re-attaches first every key).
The same holds for an ack of messages received on a connection that was lost since. Such an
ack is sent as a retry, and the dispatcher answers how many of its messages are in doubt, so
that the consumer raises :class:`~tierstream.errors.AckInDoubtError` instead of returning as
if nobody else could have seen them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection

import numpy as np

from tierstream.broker.subscriptions.cursor_state import CursorState
from tierstream.broker.subscriptions.read_window import (
    DELAYED,
    DELIVERED,
    WAITING,
    Chunk,
    ReadWindow,
)
from tierstream.model.positions import Position

__all__ = ["LoadedCursor", "cumulative_in_doubt", "in_doubt"]


class LoadedCursor:
    """What a subscription's stored cursor said was acknowledged when this broker loaded it:
    acknowledged before the outage, so by the ack's own first attempt or long before."""

    def __init__(self, state: CursorState) -> None:
        self.mark_delete = state.mark_delete
        self.acked = sorted(state.acked)

    def covers(self, pos: Position) -> bool:
        if pos < self.mark_delete:
            return True
        i = bisect.bisect_right(self.acked, pos, key=lambda r: r[0]) - 1
        return i >= 0 and self.acked[i][0] <= pos < self.acked[i][1]


def in_doubt(window: ReadWindow, loaded: LoadedCursor, mine: Collection[int],
             segment: np.ndarray, entry: np.ndarray, index: np.ndarray) -> int:
    """How many of the named messages (before the ack is applied) another consumer may have
    been sent: held by another consumer, or acknowledged since the cursor was loaded (by
    another). Safe are those acknowledged in the loaded cursor, those not read yet or waiting
    (never sent by this broker), and those that ``mine`` (the acking consumer's attachments)
    hold: the consumer drops its own copies."""
    doubt = 0
    for s, e, b in set(zip(segment.tolist(), entry.tolist(), index.tolist(), strict=True)):
        pos = Position(window.partition, s, e, b)
        if loaded.covers(pos):
            continue
        found = window.chunk_of(pos)
        if found is None:
            doubt += pos < window.read_pos  # read, and acknowledged since
        else:
            doubt += _sent_elsewhere(*found, mine)
    return doubt


def cumulative_in_doubt(window: ReadWindow, loaded: LoadedCursor, mine: Collection[int],
                        end: Position, backlog: Callable[[Position, Position], int]) -> int:
    """:func:`in_doubt` for a resent cumulative ack of everything before ``end``: the same
    rule over the window's messages before ``end``, and the messages acknowledged since the
    load that have left the window already (counted with ``backlog``, the partition's
    message count between two positions, less the ranges the loaded cursor held)."""
    doubt = 0
    first = window.chunks[0].position(0) if window.chunks else window.read_pos
    lo, hi = loaded.mark_delete, min(first, end)
    if lo < hi:
        doubt += backlog(lo, hi) - sum(backlog(max(a, lo), min(b, hi))
                                       for a, b in loaded.acked if a < hi and b > lo)
    for chunk in window.chunks:
        if chunk.position(0) >= end:
            break
        for row in range(chunk.count_before(end)):
            if not loaded.covers(chunk.position(row)):
                doubt += _sent_elsewhere(chunk, row, mine)
    return doubt


def _sent_elsewhere(chunk: Chunk, row: int, mine: Collection[int]) -> bool:
    """Whether a message in the window, not acknowledged in the loaded cursor, may have gone
    to another consumer: acknowledged since the load (its whole entry, or it alone), or held
    by another; not when waiting or held by the acking consumer."""
    if chunk.open == 0:
        return True  # the entry's every message was acknowledged since
    state = int(chunk.state[row])
    held = state in (DELIVERED, DELAYED) and int(chunk.owner[row]) in mine
    return not (state == WAITING or held)
