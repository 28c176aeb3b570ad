"""Spark partitions shaped like the local runner: with partitioning=key-ranges each key of a
topic partition lives in exactly one Spark partition, its messages in log order."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tierstream.errors import ConfigError
from tierstream.read_options import ReadOptions
from tierstream.spark_adapter.source import register

from ..logs import TOPIC, fill, running_log

pytestmark = pytest.mark.spark


def _placement(rows: list[Any]) -> tuple[dict[tuple[int, str], set[int]], bool]:
    """Spark partitions each (topic partition, key) landed in, and whether positions increase
    within every Spark partition in the order the rows came out."""
    where: dict[tuple[int, str], set[int]] = defaultdict(set)
    by_pid: dict[int, list[Any]] = defaultdict(list)
    for r in rows:
        where[(r.partition, r.key)].add(r.pid)
        by_pid[r.pid].append(r)
    ordered = True
    for pid_rows in by_pid.values():
        pid_rows.sort(key=lambda r: r.idx)  # the order the partition produced them
        for key in {(r.partition, r.key) for r in pid_rows}:
            positions = [(r.segment_id, r.entry_id, r.batch_index) for r in pid_rows
                         if (r.partition, r.key) == key]
            ordered &= positions == sorted(positions)
    return where, ordered


def _with_ids(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select("partition", "key", "segment_id", "entry_id", "batch_index",
                     F.spark_partition_id().alias("pid"),
                     F.monotonically_increasing_id().alias("idx"))


def test_batch_reads_offer_one_spark_partition_per_key_range_in_log_order(
        spark: Any, tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=2) as log:
        fill(log, partitions=2, batches=6, n=30, keys=13)
        options = {"topic": TOPIC, "dataDir": str(log.data_dir), "broker": log.url,
                   "keyRanges": "3"}
        register(spark)
        where, ordered = _placement(_with_ids(spark.read.format("tierstream").options(
            **options, partitioning="key-ranges").load()).collect())
        assert len(where) == 2 * 13 and ordered
        assert all(len(pids) == 1 for pids in where.values())
        # the default for batch: one Spark partition per split, so a key spans several
        where, _ = _placement(_with_ids(spark.read.format("tierstream").options(**options)
                                        .load()).collect())
        assert any(len(pids) > 1 for pids in where.values())


def test_streaming_micro_batches_keep_each_key_in_one_spark_partition(
        spark: Any, tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=2) as log:
        fill(log, partitions=2, batches=6, n=30, keys=13)
        register(spark)
        batches: list[tuple[dict[tuple[int, str], set[int]], bool]] = []

        def each(df: Any, batch_id: int) -> None:
            batches.append(_placement(_with_ids(df).collect()))

        query = (spark.readStream.format("tierstream")
                 .options(topic=TOPIC, dataDir=str(log.data_dir), broker=log.url,
                          keyRanges="3", startingPosition="earliest")
                 .load().writeStream.foreachBatch(each)
                 .option("checkpointLocation", str(tmp_path / "ckpt"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
        assert not query.isActive and batches
        assert sum(len(w) for w, _ in batches) >= 2 * 13
        for where, ordered in batches:
            assert ordered and all(len(pids) == 1 for pids in where.values())


def test_a_bad_partitioning_is_named() -> None:
    with pytest.raises(ConfigError, match="invalid option 'partitioning' 'keys'"):
        ReadOptions.parse({"topic": TOPIC, "partitioning": "keys"})
