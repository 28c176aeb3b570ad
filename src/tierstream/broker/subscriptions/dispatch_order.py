"""Who gets which waiting message of a ``shared``, ``exclusive`` or ``failover`` subscription's
partition, each consumer up to its permits (``key_shared``: ``key_holds.py``). Each hands
``deliver`` a chunk's rows (ascending, each once) and the consumer they go to."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from tierstream.broker.subscriptions.attached import Attached
from tierstream.broker.subscriptions.read_window import WAITING, Chunk

__all__ = ["in_order", "round_robin"]

Deliver = Callable[[Chunk, np.ndarray, Attached], None]


def in_order(waiting: Iterable[Chunk], consumers: Mapping[int, Attached], active: int | None,
             deliver: Deliver) -> None:
    """``exclusive`` and ``failover``: everything to the active consumer, in log order, once
    the previous active one holds nothing (its messages come first)."""
    c = consumers.get(active) if active is not None else None
    if c is None or any(o.held for o in consumers.values() if o is not c):
        return
    for chunk in waiting:
        if c.permits <= 0:
            return
        rows = np.flatnonzero(chunk.state == WAITING)
        take = rows if c.settings.whole_entries else rows[:c.permits]
        deliver(chunk, take, c)
        if len(take) < len(rows):
            return


def round_robin(waiting: Iterable[Chunk], consumers: Mapping[int, Attached],
                deliver: Deliver) -> None:
    """``shared``: runs of messages to the consumers with permits in turn, the one with the
    most permits first."""
    ring = sorted(consumers.values(), key=lambda c: (-c.permits, c.idx))
    turn = 0
    for chunk in waiting:
        rows = np.flatnonzero(chunk.state == WAITING)
        while len(rows):
            ready = [c for c in ring if c.permits > 0]
            if not ready:
                return
            c = ready[turn % len(ready)]
            turn += 1
            take = rows if c.settings.whole_entries else rows[:c.permits]
            deliver(chunk, take, c)
            rows = rows[len(take):]
