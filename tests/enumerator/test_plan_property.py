"""The plan reads every message of a query exactly once, whatever the log looks like.

Random logs (partitions, rollovers, some segments offloaded, some bookie copies deleted, an
open tail), random windows or cuts, random k and split sizes, sometimes a publish-time filter
on top (as Spark pushes it down): the union of all split reads equals a brute-force filter of
every message, and within a split each key's messages keep log order.
"""

from __future__ import annotations

import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstream.enumerator import Enumerator, Query
from tierstream.model.positions import KeyRange, Offset, Position
from tierstream.readers import open_reader
from tierstream.splits.split import StreamCut

from ..logs import BASE, TOPIC, append, running_log

KEYS = [None, *(f"user-{i}" for i in range(12))]


@st.composite
def logs(draw: st.DrawFn) -> dict:
    partitions = draw(st.integers(1, 3))
    per_segment = draw(st.integers(2, 6))
    batches = []
    for p in range(partitions):
        for _ in range(draw(st.integers(0, 14))):
            n = draw(st.integers(1, 25))
            back = draw(st.booleans())  # sometimes ask for earlier times: the broker refuses
            batches.append((p, n, back))
    return {
        "partitions": partitions, "per_segment": per_segment, "batches": batches,
        "offload": draw(st.floats(0, 1)), "delete_bookies": draw(st.floats(0, 1)),
        "tail_batches": draw(st.integers(0, 3)),
        "key_seed": draw(st.integers(0, 10_000)),
    }


@st.composite
def queries(draw: st.DrawFn) -> dict:
    return {
        "kind": draw(st.sampled_from(["all", "window", "from-time", "cut"])),
        "a": draw(st.floats(0, 1)), "b": draw(st.floats(0, 1)),
        "k": draw(st.sampled_from([1, 2, 3, 4, 7, 16])),
        "max_split_bytes": draw(st.sampled_from([1, 3_000, 20_000, 1 << 30])),
        "filter": draw(st.none() | st.tuples(st.floats(0, 1), st.floats(0, 1))),
    }


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=logs(), q=queries())
def test_union_of_split_reads_is_exactly_the_query(spec: dict, q: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp, running_log(
            Path(tmp) / "data", maxEntriesPerSegment=spec["per_segment"]) as log:
        store = log.store
        store.create_topic(TOPIC, spec["partitions"])
        counter = 0
        t = BASE
        for i, (p, n, back) in enumerate(spec["batches"] + [
                (0, 5, False)] * spec["tail_batches"]):
            values = [f"{p}-{counter + j}" for j in range(n)]
            keys = [KEYS[(spec["key_seed"] + counter + j * 7) % len(KEYS)] for j in range(n)]
            times = [t - 50_000 if back and j == 0 else t + j * 10 for j in range(n)]
            append(store, p, values, keys=keys, times=times)
            counter += n
            t += n * 10 + (i % 3) * 1000
        # move some closed segments to the tier, and drop some of their bookie copies
        off = store.offloader
        for plog in store.partitions(TOPIC):
            closed = plog.closed_segments()
            for j, seg in enumerate(closed):
                if j < len(closed) * spec["offload"]:
                    moved = off.offload_segment(plog, seg)
                    if j < len(closed) * spec["offload"] * spec["delete_bookies"]:
                        off.delete_bookie_copy(plog, moved)
        truth = log.everything()
        times_all = sorted(truth.column("publish_time").to_pylist()) or [BASE]
        lo = times_all[int(q["a"] * (len(times_all) - 1))]
        hi = times_all[int(q["b"] * (len(times_all) - 1))] + 1
        lo, hi = min(lo, hi), max(lo, hi)
        rows = truth.to_pylist()
        if q["kind"] == "all":
            start, end, want = None, "latest", rows
        elif q["kind"] == "window":
            start, end = Offset.at_time(lo), Offset.at_time(hi)
            want = [r for r in rows if lo <= r["publish_time"] < hi]
        elif q["kind"] == "from-time":
            start, end = Offset.at_time(lo), "latest"
            want = [r for r in rows if lo <= r["publish_time"]]
        else:  # between two cuts taken at message positions
            def pos(r: dict) -> Position:
                return Position(r["partition"], r["segment_id"], r["entry_id"],
                                r["batch_index"])
            cut_a, cut_b = {}, {}
            for p in range(spec["partitions"]):
                mine = [pos(r) for r in rows if r["partition"] == p]
                end_p = store.partition(TOPIC, p).last_confirmed()[1]
                cut_a[p] = mine[int(q["a"] * (len(mine) - 1))] if mine else end_p
                cut_b[p] = mine[int(q["b"] * (len(mine) - 1))] if mine else end_p
                cut_a[p], cut_b[p] = min(cut_a[p], cut_b[p]), max(cut_a[p], cut_b[p])
            start, end = StreamCut.of(TOPIC, cut_a), StreamCut.of(TOPIC, cut_b)
            want = [r for r in rows if cut_a[r["partition"]] <= pos(r) < cut_b[r["partition"]]]
        time_from = time_to = None
        if q["filter"] is not None:  # [from, to) on top of the bounds; may be empty
            time_from = times_all[int(q["filter"][0] * (len(times_all) - 1))]
            time_to = times_all[int(q["filter"][1] * (len(times_all) - 1))] + 1
            want = [r for r in want if time_from <= r["publish_time"] < time_to]
        with Enumerator(**log.kw()) as enum:
            splits = enum.plan(Query(
                topics=(TOPIC,), start=_bound(start), end=_bound(end), key_ranges=q["k"],
                max_split_bytes=q["max_split_bytes"], time_from=time_from, time_to=time_to))
        counted = len(splits)  # counted before the split objects exist, after enum is closed
        assert len(list(splits)) == counted
        got: list[str] = []
        for split in splits:
            per_key: dict[str | None, list[tuple[int, int, int]]] = defaultdict(list)
            for batch in open_reader(split):
                for r in batch.select(["value", "key", "key_hash", "segment_id", "entry_id",
                                       "batch_index", "topic"]).to_pylist():
                    assert r["topic"] == TOPIC
                    assert split.key_range.contains(r["key_hash"])
                    got.append(r["value"].decode())
                    per_key[r["key"]].append((r["segment_id"], r["entry_id"],
                                              r["batch_index"]))
            for key, seq in per_key.items():
                assert seq == sorted(seq), f"key {key} out of order in {split.split_id}"
        expected = Counter(r["value"].decode() for r in want)
        assert Counter(got) == expected, (
            f"missing {sorted(expected - Counter(got))[:5]}, "
            f"extra {sorted(Counter(got) - expected)[:5]}")
        assert all(v == 1 for v in Counter(got).values()), "a message was read twice"
        KeyRange.split(q["k"])  # the ranges used above are this split


def _bound(bound: Offset | StreamCut | str | None) -> Offset | StreamCut:
    if bound is None:
        return Offset.earliest()
    return Offset.parse(bound) if isinstance(bound, str) else bound
