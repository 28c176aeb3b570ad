"""Planning a stream's micro-batches (driver side, through the broker's admin calls): where
a topic's log begins, how far a read limit takes a cut, how many messages lie between cuts.
The Spark stream reader asks these; it plans nothing itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierstream.model.positions import Position
from tierstream.splits.split import Cuts, StreamCut

if TYPE_CHECKING:
    from tierstream.client.admin import Admin

__all__ = ["GUESS_BYTES_PER_MESSAGE", "advance_cuts", "bytes_per_message", "count_between",
           "earliest_cut", "with_grown"]

#: Bytes per message assumed for a byte read limit before a topic has any message to measure:
#: the first micro-batch is then sized by it, every later one by the topic's real average.
GUESS_BYTES_PER_MESSAGE = 200


def earliest_cut(admin: Admin, latest: StreamCut) -> StreamCut:
    """Each partition's first surviving position (its latest one if it has no segment)."""
    first: dict[int, int] = {}
    for seg in admin.list_segments(latest.topic):
        first[seg.partition] = min(first.get(seg.partition, seg.segment_id), seg.segment_id)
    return StreamCut.of(latest.topic, {
        p: Position(p, first[p], 0, 0) if p in first else latest[p] for p in latest.partitions})


def with_grown(admin: Admin, begin: StreamCut, latest: StreamCut) -> StreamCut:
    """``begin`` with a position for every partition of ``latest``: a partition grown since
    ``begin`` was taken starts at its beginning."""
    missing = [p for p in latest.partitions if begin.get(p) is None]
    if not missing:
        return begin
    first = earliest_cut(admin, latest)
    return StreamCut.of(begin.topic, {**{p: first[p] for p in missing},
                                      **dict(begin.positions)})


def advance_cuts(admin: Admin, begin: Cuts, target: Cuts, budget: int) -> Cuts:
    """Spend ``budget`` messages fairly over the (topic, partition)s that have new data.

    A partition grown at a scale event does not move while the end of its parent stays
    before the event: a key's messages from after the event are never in an earlier batch
    than its messages from before it (``lineage.py``)."""
    ends = {(t, p): begin[t][p] for t in begin for p in begin[t].partitions}
    active = [k for k in sorted(ends) if k[0] in target and ends[k] < target[k[0]][k[1]]]
    while budget > 0 and active:
        share = max(1, budget // len(active))
        still = []
        for t, p in active:
            if budget <= 0:
                break
            want = min(share, budget)
            end, counted = admin.advance(t, ends[(t, p)], want, target[t][p])
            ends[(t, p)] = end
            budget -= counted
            if counted == want and end < target[t][p]:
                still.append((t, p))  # took its whole share: may have more
        active = still
    out: dict[str, dict[int, Position]] = {}
    for (t, p), pos in ends.items():
        out.setdefault(t, {})[p] = pos
    for t, positions in out.items():
        lineage = admin.get_topic(t).lineage
        for p in sorted(positions):  # ancestors first: a held one holds its descendants
            # an ancestor at its target has nothing more from before the event (the event
            # sealed that part; its end may lie before the boundary when nothing came after)
            if any(a in positions and positions[a] < event.boundary(a)
                   and positions[a] < target[t][a] for a, event in lineage.ancestors(p)):
                positions[p] = begin[t][p]
    return {t: StreamCut.of(t, positions) for t, positions in out.items()}


def bytes_per_message(admin: Admin, topics: Cuts) -> int:
    segs = [s for t in topics for s in admin.list_segments(t) if s.messages]
    messages = sum(s.messages for s in segs)
    return max(1, sum(s.bytes for s in segs) // messages) if messages \
        else GUESS_BYTES_PER_MESSAGE


def count_between(admin: Admin, begin: Cuts, end: Cuts, *, up_to: int) -> int:
    """Messages between ``begin`` and ``end`` (every topic of ``end``), counted from the
    brokers' entry indexes and only up to ``up_to`` (it stops there)."""
    counted = 0
    for topic, cut in end.items():
        for p in cut.partitions:
            if counted < up_to and begin[topic][p] < cut[p]:
                counted += admin.advance(topic, begin[topic][p], up_to - counted, cut[p])[1]
    return counted
