"""Delayed delivery: a message whose ``tierstream.deliver_at`` property (Pulsar's deliver_at /
deliver_after) lies ahead is held back from shared and key_shared consumers until then, as
Pulsar's broker does; exclusive and failover consumers get it at once, as Pulsar's do.

A held message is one of the window's DELAYED messages with no owner (a nack's DELAYED ones
have their consumer as owner): nothing about it is stored, as it is not acknowledged, so
after a broker restart it is read again and held again until its time. It holds no key: a
key_shared consumer may get a key's later messages first, as in Pulsar.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tierstream.broker.subscriptions.read_window import DELAYED, WAITING, Chunk
from tierstream.model.message_format import DELIVER_AT, may_have_property
from tierstream.model.subscription_type import SubscriptionType
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.broker.subscriptions.read_window import ReadWindow

__all__ = ["TIMED", "DeliveryTimes", "delivery_times"]

#: an owner that marks a message held for its delivery time (a consumer's index is >= 0)
TIMED = -2


def delivery_times(batch: pa.RecordBatch) -> np.ndarray | None:
    """Each message's delivery time (ms since epoch; 0: at once), or None when no message of
    ``batch`` has one."""
    properties = batch.column("properties")
    if not may_have_property(properties, DELIVER_AT):
        return None
    found = pc.map_lookup(properties, DELIVER_AT, "first")
    if found.null_count == len(found):
        return None
    try:
        times = pc.cast(found, pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # not a number: at once
        return None
    return np.asarray(pc.fill_null(times, 0).to_numpy(zero_copy_only=False), dtype=np.int64)


class DeliveryTimes:
    """The dispatcher's side of delayed delivery (a mixin of ``Dispatcher``)."""

    type: str | None
    window: ReadWindow
    _delayed: int
    _timed: int

    def _set(self, chunk: Chunk, rows: np.ndarray, state: int) -> None:
        raise NotImplementedError  # the dispatcher's

    def _hold_for_time(self, chunk: Chunk) -> None:
        """Hold the messages of a chunk just read whose time lies ahead (not for exclusive
        or failover subscriptions)."""
        if self.type in SubscriptionType.CUMULATIVE or chunk.batch is None:
            return
        times = delivery_times(chunk.batch)
        if times is None:
            return
        ahead = times - now_ms()
        rows = np.flatnonzero((ahead > 0) & (chunk.state == WAITING))
        if len(rows):
            self._set(chunk, rows, DELAYED)
            chunk.owner[rows] = TIMED
            chunk.until[rows] = time.monotonic() + ahead[rows] / 1000
            self._delayed += len(rows)
            self._timed += len(rows)

    def _release_timed(self, chunk: Chunk, rows: np.ndarray) -> np.ndarray:
        """Release the time-held ones of ``rows`` (due, or the subscription turned exclusive
        or failover): waiting again, not redelivered; returns the others."""
        timed = chunk.owner[rows] == TIMED
        mine = rows[timed]
        if len(mine):
            chunk.owner[mine] = -1
            self._delayed -= len(mine)
            self._timed -= len(mine)
            self._set(chunk, mine, WAITING)
        others: np.ndarray = rows[~timed]
        return others

    def _release_all_timed(self) -> None:
        """Exclusive and failover consumers get every message at once."""
        if self._timed:
            for chunk in list(self.window):
                rows = np.flatnonzero((chunk.state == DELAYED) & (chunk.owner == TIMED))
                if len(rows):
                    self._release_timed(chunk, rows)

    def held_for_time(self) -> int:
        """Messages held until their delivery time (stats: Pulsar's msgDelayed)."""
        return self._timed
