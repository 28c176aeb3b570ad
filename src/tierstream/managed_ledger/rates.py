"""Message and byte rates of the last minute, as ``topics stats`` and the metrics show them.

A :class:`RateMeter` keeps one bucket per second of the last :data:`WINDOW_S` seconds and
running totals: adding is one lock and two additions (an append path adds once per entry, not
per message), reading sums at most 60 buckets.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["WINDOW_S", "RateMeter"]

#: The window rates are averaged over, in seconds (Pulsar's stats use one minute too).
WINDOW_S = 60


class RateMeter:
    """Messages and bytes counted as they pass; rates over the last minute, and totals."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[list[int]] = deque()  # [second, messages, bytes]
        self._started = clock()
        self.messages_total = 0
        self.bytes_total = 0

    def add(self, messages: int, nbytes: int) -> None:
        second = int(self._clock())
        with self._lock:
            self.messages_total += messages
            self.bytes_total += nbytes
            if self._buckets and self._buckets[-1][0] == second:
                bucket = self._buckets[-1]
                bucket[1] += messages
                bucket[2] += nbytes
            else:
                self._buckets.append([second, messages, nbytes])
                self._trim(second)

    def _trim(self, now: int) -> None:
        while self._buckets and self._buckets[0][0] <= now - WINDOW_S:
            self._buckets.popleft()

    def window_s(self) -> float:
        """The seconds :meth:`rate` averages over: a minute, or less since this meter
        started (stats say which, so a young meter's rate is not read as a minute's)."""
        return max(1.0, min(float(WINDOW_S), self._clock() - self._started))

    def rate(self) -> tuple[float, float]:
        """(messages per second, bytes per second) over the last minute, or over the time
        since this meter started when that is shorter."""
        now = self._clock()
        with self._lock:
            self._trim(int(now))
            messages = sum(b[1] for b in self._buckets)
            nbytes = sum(b[2] for b in self._buckets)
        span = max(1.0, min(float(WINDOW_S), now - self._started))
        return messages / span, nbytes / span
