"""Key-range reads of bookie data: exact rows at any bounds, and the local runner reading the
key ranges of a bookie segment once.

A key-range split of a bookie segment filters groups of entries at once (readers/
bookie_log.py); its bounds can fall anywhere in a group (mid-entry positions, publish times
inside an entry). The local runner reads the aligned key ranges of a bookie segment as one
whole read (``local.phases``): the union is the same rows, each key still in log order, also
when the chain crosses tier files and the open segment.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstream.enumerator import Enumerator, Query
from tierstream.model.positions import KeyRange, Offset, Position
from tierstream.readers import ReadStats, open_reader
from tierstream.runtime.local import phases, run_splits
from tierstream.splits.split import ReaderKind, Split, StreamCut, chains

from ..logs import BASE, TOPIC, Log, append, running_log

ENTRIES, PER_ENTRY = 70, 9  # more than four groups of 16 entries in the segment
KEYS = [None, *(f"user-{i}" for i in range(11))]


@pytest.fixture(scope="module")
def segment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Log]:
    """One closed bookie segment of 70 entries; every time is distinct and increasing."""
    with running_log(tmp_path_factory.mktemp("kr") / "data",
                     maxEntriesPerSegment=ENTRIES) as log:
        log.store.create_topic(TOPIC, 1)
        for e in range(ENTRIES):
            n = e * PER_ENTRY
            append(log.store, 0, [f"m{n + j}" for j in range(PER_ENTRY)],
                   keys=[KEYS[(n + j * 5) % len(KEYS)] for j in range(PER_ENTRY)],
                   times=[BASE + (n + j) * 10 for j in range(PER_ENTRY)])
        log.store.seal(TOPIC)
        yield log


def _pos(r: dict) -> Position:
    return Position(r["partition"], r["segment_id"], r["entry_id"], r["batch_index"])


def _rows(batches: Iterator[pa.RecordBatch]) -> list[dict]:
    return [r for b in batches for r in b.select(
        ["value", "key", "key_hash", "partition", "segment_id", "entry_id", "batch_index",
         "publish_time"]).to_pylist()]


def _assert_each_key_in_log_order(rows: list[dict]) -> None:
    per_key: dict[tuple[int, str | None], list[Position]] = defaultdict(list)
    for r in rows:  # partitions are independent logs
        per_key[r["partition"], r["key"]].append(_pos(r))
    for key, seq in per_key.items():
        assert seq == sorted(seq), f"key {key} out of log order"


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=st.floats(0, 1), b=st.floats(0, 1), k=st.sampled_from([2, 3, 4, 7]),
       window=st.none() | st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_a_key_range_split_reads_exactly_its_rows_at_any_bounds(
        segment: Log, a: float, b: float, k: int, window: tuple[float, float] | None) -> None:
    rows = segment.everything().to_pylist()
    lo, hi = sorted((int(a * (len(rows) - 1)), int(b * (len(rows) - 1))))
    start, end = _pos(rows[lo]), _pos(rows[hi])  # mid-entry positions, in any group
    want = rows[lo:hi]
    time_from = time_to = None
    if window is not None:
        t = sorted(BASE + int(w * ENTRIES * PER_ENTRY) * 10 + 5 for w in window)
        time_from, time_to = t
        want = [r for r in want if time_from <= r["publish_time"] < time_to]
    with Enumerator(**segment.kw()) as enum:
        splits = enum.plan(Query(topics=(TOPIC,), start=StreamCut.of(TOPIC, {0: start}),
                                 end=StreamCut.of(TOPIC, {0: end}), key_ranges=k,
                                 time_from=time_from, time_to=time_to))
    assert all(s.reader is ReaderKind.BOOKIE for s in splits)
    got = []
    for split in splits:  # each alone, as a Spark task reads it
        mine = _rows(open_reader(split))
        assert all(split.key_range.contains(r["key_hash"]) for r in mine)
        _assert_each_key_in_log_order(mine)
        got += mine
    assert Counter(r["value"] for r in got) == Counter(r["value"] for r in want)
    together = _rows(run_splits(splits, parallelism=k))  # read once, whole
    assert Counter(r["value"] for r in together) == Counter(r["value"] for r in want)
    _assert_each_key_in_log_order(together)


def test_the_runner_reads_aligned_bookie_key_ranges_once_and_keeps_key_order(
        tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=6) as log:
        log.store.create_topic(TOPIC, 2)
        for i in range(40):  # 6 closed segments per partition and an open one
            for p in range(2):
                append(log.store, p, [f"{p}-{i}-{j}" for j in range(10)],
                       keys=[KEYS[(i * 3 + j) % len(KEYS)] for j in range(10)],
                       times=[BASE + i * 1000 + j for j in range(10)])
        for plog in log.store.partitions(TOPIC):  # the two oldest in the tier, bookie copy gone
            for seg in plog.closed_segments()[:2]:
                log.store.offloader.delete_bookie_copy(
                    plog, log.store.offloader.offload_segment(plog, seg))
        with Enumerator(**log.kw()) as enum:
            splits = enum.plan(Query(topics=(TOPIC,), end=Offset.latest(), key_ranges=4))
        roots = phases(chains(splits))
        assert len(roots) == 2  # one per partition
        for root in roots:
            kinds = [[s.reader for c in phase for s in c] for phase in root]
            # tier files: 4 range chains; bookies: one chain of whole segments; the open
            # segment through the broker: 4 range chains again
            assert [len(phase) for phase in root] == [4, 1, 4]
            assert set(kinds[0]) == {ReaderKind.TIER}
            assert set(kinds[1]) == {ReaderKind.BOOKIE}
            assert all(s.key_range.is_full for s in root[1][0])
            assert len(root[1][0]) == 4  # segments 3..6 of the partition, once each
            assert set(kinds[2]) == {ReaderKind.TAIL}
        stats = ReadStats()
        got = _rows(run_splits(splits, parallelism=3, stats=stats))
        truth = log.everything().to_pylist()
        assert Counter(r["value"] for r in got) == Counter(r["value"] for r in truth)
        _assert_each_key_in_log_order(got)
        assert stats.rows() == len(truth)
        assert stats.rows("bookie-log") == 2 * 4 * 6 * 10


def test_chains_that_are_not_aligned_run_as_planned() -> None:
    def split(key_range: KeyRange, segment_id: int) -> Split:
        return Split(topic=TOPIC, partition=0, segment_id=segment_id,
                     start=Position(0, segment_id, 0, 0), end=Position(0, segment_id, 5, 0),
                     reader=ReaderKind.BOOKIE, key_range=key_range)

    half, rest = KeyRange(0, 32768), KeyRange(32768, 65536)
    aligned = [[split(half, 1), split(half, 2)], [split(rest, 1), split(rest, 2)]]
    assert phases(aligned) == [[[[s.whole() for s in aligned[0]]]]]
    # a range missing (the ranges do not cover every key) or segments that differ
    partial = [[split(half, 1)], [split(KeyRange(40000, 65536), 1)]]
    assert phases(partial) == [[partial]]  # one root, one phase: its chains
    differ = [[split(half, 1)], [split(rest, 2)]]
    assert phases(differ) == [[differ]]


@pytest.mark.parametrize("k", [2, 4, 7])
def test_spark_split_partitions_cut_bookie_key_ranges_into_entry_ranges(
        segment: Log, k: int) -> None:
    """With one Spark partition per split, the k key ranges of a bookie chunk become k entry
    ranges of it (each every key): the same rows, each entry read once."""
    from tierstream.spark_adapter.partitions import by_entries

    rows = segment.everything().to_pylist()
    start, end = _pos(rows[5]), _pos(rows[-4])  # mid-entry at both ends
    with Enumerator(**segment.kw()) as enum:
        splits = list(enum.plan(Query(topics=(TOPIC,), start=StreamCut.of(TOPIC, {0: start}),
                                      end=StreamCut.of(TOPIC, {0: end}), key_ranges=k)))
    cut = by_entries(splits)
    assert len(cut) == k and all(s.key_range.is_full for s in cut)
    assert cut[0].start == start and cut[-1].end == end
    assert all(a.end == b.start for a, b in itertools.pairwise(cut))
    got = [r["value"] for s in cut for r in _rows(open_reader(s))]
    assert got == [r["value"] for r in rows[5:-4]]  # in log order, once each
    # not every range of the chunk in the plan: nothing is cut
    assert by_entries(splits[1:]) == splits[1:]
