"""How a plan's splits are packed into Spark tasks (partitioning=splits), as Spark packs small
files: a pure function of the splits' sizes, checked without Spark."""

from __future__ import annotations

from tierstream.model.positions import Position
from tierstream.spark_adapter.partitions import SPLIT_OPEN_COST, packed
from tierstream.splits.split import ReaderKind, Split

MIB = 1024**2


def _splits(sizes: list[int]) -> list[Split]:
    return [Split(topic="a/b/c", partition=i % 4, segment_id=i,
                  start=Position(i % 4, i, 0, 0), end=Position(i % 4, i, 40, 0),
                  reader=ReaderKind.BOOKIE, estimated_bytes=size)
            for i, size in enumerate(sizes)]


def test_small_splits_share_tasks_but_never_fewer_than_the_cores() -> None:
    splits = _splits([10_000] * 600)  # 622 tiny splits were 622 Spark tasks
    bins = packed(splits, 128 * MIB, min_partitions=2)
    assert len(bins) == 19  # 32 splits of 4 MiB open cost each fill 128 MiB, as in Spark
    assert sorted(s.segment_id for b in bins for s in b) == list(range(600))  # each once
    for b in bins:  # a task reads its splits in log order
        assert b == sorted(b, key=lambda s: (s.topic, s.partition, s.start))
    assert len(packed(splits, 128 * MIB, min_partitions=16)) >= 16


def test_a_split_at_max_bytes_is_a_task_of_its_own() -> None:
    splits = _splits([128 * MIB, 128 * MIB, MIB, MIB])
    bins = packed(splits, 128 * MIB, min_partitions=1)
    assert [len(b) for b in bins] == [1, 1, 2]
    assert packed([], 128 * MIB, min_partitions=2) == []


def test_many_cores_give_one_task_per_split() -> None:
    # the target never drops below the open cost: no split shares a task then
    splits = _splits([SPLIT_OPEN_COST // 2] * 10)
    assert [len(b) for b in packed(splits, 128 * MIB, min_partitions=1_000_000)] == [1] * 10
