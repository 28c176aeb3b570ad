"""Fan-in of producer threads into one iterator: the loop the runner and clients share."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

__all__ = ["DONE", "drain"]

#: What a producer thread puts last, after its items (or after an exception).
DONE = object()


def drain(out: queue.Queue[Any], producers: int) -> Iterator[Any]:
    """Items from ``out`` until ``producers`` threads have each put :data:`DONE`; an exception
    a producer put is raised here, in the consuming thread."""
    finished = 0
    while finished < producers:
        item = out.get()
        if item is DONE:
            finished += 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item
