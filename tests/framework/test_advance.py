"""The broker's message counting for streaming read limits, against brute force."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from .logs import BASE, TOPIC, append, running_log


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
        from tierstream.splits.positions import Position

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
