"""Following a topic's tail, across scale events: the unbounded part of ``tail()``.

One tail-consumer reader per partition and key range follows the broker from a cut. The
follower looks for scale events every :data:`POLL_S` seconds; a partition grown at one gets
readers from its first position, and they hand over nothing until every message its parent
held from before the event (from where the tail began) was handed over: each key's messages
from before the event come out before its messages from after it (``lineage.py``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tierstream.client.admin import Admin
from tierstream.errors import UnavailableError
from tierstream.model.positions import KeyRange, Position
from tierstream.readers import open_reader
from tierstream.splits.split import ReaderKind, Split, StreamCut
from tierstream.util.fanin import DONE, Cancel, drain, put, start_reader

__all__ = ["POLL_S", "follow"]

#: How often a follower asks the broker whether the topic grew.
POLL_S = 1.0
_ALL = 1 << 62


@dataclass(frozen=True)
class _Gate:
    """A grown partition's readers wait until ``needed`` messages of ``parent`` from
    segments below ``first_segment_id`` (before the event) were handed over."""

    parent: int
    first_segment_id: int
    needed: int


class _Progress:
    """Messages handed over per partition and segment."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._rows: dict[int, dict[int, int]] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        partition = int(batch.column("partition")[0].as_py())
        segments, counts = np.unique(batch.column("segment_id").to_numpy(), return_counts=True)
        with self._changed:
            rows = self._rows.setdefault(partition, {})
            for seg, n in zip(segments.tolist(), counts.tolist(), strict=True):
                rows[seg] = rows.get(seg, 0) + n
            self._changed.notify_all()

    def wait(self, gate: _Gate, stop: Cancel) -> bool:
        """Until ``gate`` opens (True) or ``stop`` is set (False)."""
        def handed() -> int:
            rows = self._rows.get(gate.parent, {})
            return sum(n for seg, n in rows.items() if seg < gate.first_segment_id)

        with self._changed:
            while handed() < gate.needed:
                if stop.is_set():
                    return False
                self._changed.wait(0.1)
        return True


def follow(topic: str, cut: StreamCut, ranges: Sequence[KeyRange], *, broker: str,
           auth_token: str | None, cancel: Cancel) -> Iterator[pa.RecordBatch]:
    """Batches of ``topic`` from ``cut`` on, forever (until ``cancel``), in every key's order
    across scale events."""
    stop = Cancel()
    unlink = cancel.register(stop.set)
    out: queue.Queue[Any] = queue.Queue(maxsize=16 * len(ranges) * max(1, len(cut.partitions)))
    progress = _Progress()
    starts = dict(cut.positions)
    readers = 0

    def read(split: Split, gates: list[_Gate]) -> None:
        try:
            if not all(progress.wait(gate, stop) for gate in gates):
                return
            for batch in open_reader(split, auth_token=auth_token, cancel=stop):
                if not put(out, batch, stop):
                    return
                progress.add(batch)  # after the put: a child's first batch comes after it
        except BaseException as exc:  # handed to the consuming thread
            if not stop.is_set():
                put(out, exc, stop)
        finally:
            put(out, DONE, stop)

    def start(p: int, gates: list[_Gate]) -> None:
        nonlocal readers
        for r in ranges:
            split = Split(topic=topic, partition=p, segment_id=starts[p].segment_id,
                          start=starts[p], end=None, reader=ReaderKind.TAIL, key_range=r,
                          broker=broker)
            readers += 1
            start_reader(read, split, gates, name=f"tierstream-read-tail-{p}-{r}")

    try:
        with Admin(broker, auth_token=auth_token) as admin:
            poll = time.monotonic() + POLL_S

            def look() -> int:  # a busy tail looks as often as an idle one
                nonlocal poll
                before = readers
                if time.monotonic() >= poll and not stop.is_set():
                    try:
                        for p, gates in _grown(admin, topic, starts):
                            start(p, gates)
                    except UnavailableError:  # a broker restart: the readers ride it out
                        pass  # (or fail, after reconnectTimeout); look again next time
                    poll = time.monotonic() + POLL_S
                return readers - before

            for p in sorted(starts):
                start(p, [])
            yield from drain(out, readers, stop, tick=look)
    finally:
        stop.set()
        unlink()


def _grown(admin: Admin, topic: str, starts: dict[int, Position]
           ) -> list[tuple[int, list[_Gate]]]:
    """Partitions grown since ``starts`` was filled in: each with its first position (added
    to ``starts``) and the gates its readers wait at, one per ancestor (an ancestor with a
    backlog from before the event holds a key's later messages, even through a parent that
    has none)."""
    record = admin.get_topic(topic)
    new = [q for q in range(record.partitions) if q not in starts]
    if not new:
        return []
    first: dict[int, int] = {}
    for seg in admin.list_segments(topic):
        first[seg.partition] = min(first.get(seg.partition, seg.segment_id), seg.segment_id)
    out: list[tuple[int, list[_Gate]]] = []
    for q in new:  # ascending: a parent has its start before its children
        ancestors = record.lineage.ancestors(q)
        starts[q] = Position(q, first.get(q, ancestors[0][1].first_segment_id
                                          if ancestors else 0), 0, 0)
        gates = []
        for a, event in ancestors:
            boundary = event.boundary(a)
            if a in starts and starts[a] < boundary:
                needed = admin.advance(topic, starts[a], _ALL, boundary)[1]
                gates.append(_Gate(a, event.first_segment_id, needed))
        out.append((q, gates))
    return out
