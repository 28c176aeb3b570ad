"""The broker's message counting (streaming read limits, subscription backlogs), against
brute force."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ..logs import BASE, TOPIC, append, running_log


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12),
       picks=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.integers(0, 30)),
                      min_size=1, max_size=8))
def test_advance_counts_exactly_the_messages_it_skips(tmp_path_factory, sizes, picks) -> None:  # type: ignore[no-untyped-def]
    with running_log(Path(tmp_path_factory.mktemp("adv")) / "data",
                     maxEntriesPerSegment=3) as log:
        log.store.create_topic(TOPIC, 1)
        n = 0
        for size in sizes:
            append(log.store, 0, [str(n + j) for j in range(size)], keys=[None] * size,
                   times=[BASE + n + j for j in range(size)])
            n += size
        plog = log.store.partition(TOPIC, 0)
        rows = log.everything().to_pylist()
        from tierstream.model.positions import Position

        positions = [Position(0, r["segment_id"], r["entry_id"], r["batch_index"])
                     for r in rows]
        end = plog.last_confirmed()[1]
        cuts = [*positions, end]
        for a, b, k in picks:
            start = cuts[int(a * (len(cuts) - 1))]
            bound = cuts[int(b * (len(cuts) - 1))]
            if bound < start:
                start, bound = bound, start
            got, counted = plog.advance(start, k, bound)
            between = [p for p in positions if start <= p < bound]
            assert counted == min(k, len(between))
            assert [p for p in positions if start <= p < got] == between[:counted]
            assert got <= bound
            assert plog.backlog(start, bound) == len(between)


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12),
       moved=st.integers(0, 4), picks=st.lists(st.floats(0, 1), min_size=1, max_size=6))
def test_backlog_counts_across_tiered_bookie_and_open_segments(  # type: ignore[no-untyped-def]
        tmp_path_factory, sizes, moved, picks) -> None:
    from tierstream.model.positions import Position

    with running_log(Path(tmp_path_factory.mktemp("backlog")) / "data",
                     maxEntriesPerSegment=3) as log:
        log.store.create_topic(TOPIC, 1)
        n = 0
        for size in sizes:
            append(log.store, 0, [str(n + j) for j in range(size)], keys=[None] * size,
                   times=[BASE + n + j for j in range(size)])
            n += size
        plog = log.store.partition(TOPIC, 0)
        off = log.store.offloader
        for seg in plog.closed_segments()[:moved]:  # tiered, bookie copies gone
            off.delete_bookie_copy(plog, off.offload_segment(plog, seg))
        positions = [Position(0, r["segment_id"], r["entry_id"], r["batch_index"])
                     for r in log.everything().to_pylist()]
        end = plog.last_confirmed()[1]
        for a in picks:
            start = [*positions, end][int(a * len(positions))]
            assert plog.backlog(start, end) == len([p for p in positions if p >= start])
