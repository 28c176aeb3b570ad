"""Growing busy topics by themselves (Pravega's scaling policy, off by default).

With ``--auto-scale-rate N`` the broker samples every partition's appended messages at each
housekeeping pass; a topic whose every partition stayed above N messages/s over the last
``--auto-scale-window`` doubles its partitions at a scale event (``Store.set_partitions``,
reason ``auto-scale: ...``: visible in ``tierstream topic get`` and ``segments``).

On several brokers (``--cluster``) the broker serving a topic's partition 0 judges it, with
the counts the other partitions' owners give (``ClusterTopics.appended``), sampled every eighth of
the window rather than at every pass; a partition that moved starts its count again, and so
does the window. A growth gathers the topic's partitions on that broker (``cluster.py``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from tierstream.metadata.records import TopicRecord
from tierstream.metadata.scale_events import growth_refused
from tierstream.util.timeutil import describe_duration

__all__ = ["AutoScaler", "ScalableTopics"]

log = logging.getLogger(__name__)


class ScalableTopics(Protocol):
    """What the scaler needs of the store (``broker/store.py``, which owns the scaler)."""

    def topics(self) -> Sequence[TopicRecord]: ...

    def appended(self, topic: TopicRecord) -> list[int] | None: ...

    def set_partitions(self, name: str, partitions: int, *, reason: str) -> TopicRecord: ...


class AutoScaler:
    def __init__(self, store: ScalableTopics, rate: int, window_ms: int, *,
                 max_partitions: int, sample_every_s: float = 0.0) -> None:
        self._store = store
        self.max_partitions = max_partitions
        self.rate = rate
        self.window_s = window_ms / 1000
        self.sample_every_s = sample_every_s  # several brokers: the counts are asked for
        # per topic: (monotonic time, messages appended per partition) samples, oldest first
        self._samples: dict[str, deque[tuple[float, list[int]]]] = {}
        self._capped: set[str] = set()

    def check(self, now: float) -> None:
        """Sample every topic once; grow those busy for the whole window."""
        for topic in self._store.topics():
            samples = self._samples.setdefault(topic.name, deque())
            if samples and now - samples[-1][0] < self.sample_every_s:
                continue
            counts = self._store.appended(topic)
            if counts is None:  # another broker's to judge, or an owner did not answer
                samples.clear()
                continue
            if samples and (len(samples[-1][1]) != len(counts) or any(
                    c < f for c, f in zip(counts, samples[-1][1], strict=True))):
                samples.clear()  # it grew, or a partition moved: measured from now on
            samples.append((now, counts))
            while len(samples) > 2 and samples[1][0] <= now - self.window_s:
                samples.popleft()  # keep one sample at or before the window's start
            start, first = samples[0]
            if now - start < self.window_s:
                continue
            slowest = min((c - f) / (now - start) for c, f in zip(counts, first, strict=True))
            if slowest <= self.rate:
                continue
            grow = 2 * len(counts)
            if growth_refused(topic) is not None:
                continue  # it is growing already (announced to its Pulsar clients)
            if grow > self.max_partitions:
                if topic.name not in self._capped:
                    self._capped.add(topic.name)
                    log.warning("%s is above the auto-scale rate but cannot double its %d "
                                "partitions (--max-partitions-per-topic)", topic.name,
                                len(counts))
                continue
            reason = (f"auto-scale: every partition above {self.rate} msg/s for "
                      f"{describe_duration(int(self.window_s * 1000))} (slowest "
                      f"{slowest:,.0f} msg/s)")
            self._store.set_partitions(topic.name, grow, reason=reason)
            samples.clear()
