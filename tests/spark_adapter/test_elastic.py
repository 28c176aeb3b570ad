"""Spark over elastic topics: a batch read with partitioning=key-ranges keeps every key in
one Spark partition in log order across scale events, and a Structured Streaming query
restarted across an event reads each message once, each key in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierstream.client import Admin
from tierstream.spark_adapter.source import register

from ..elastic import grow_while_writing, order_errors
from ..logs import running_log

pytestmark = pytest.mark.spark

TOPIC = "acme/web/elastic"


def _in_order(rows: list[Any]) -> tuple[list[Any], dict[str, set[Any]]]:
    """Rows sorted as the query produced them per key, and where each key was read."""
    where: dict[str, set[Any]] = {}
    for r in rows:
        where.setdefault(r.key, set()).add((r.batch, r.pid))
    return sorted(rows, key=lambda r: (r.batch, r.idx)), where


@pytest.mark.parametrize("seed", [11, 12])
def test_a_key_ranges_batch_read_keeps_each_key_in_one_spark_partition_in_order(
        spark: Any, tmp_path: Path, seed: int) -> None:
    from pyspark.sql import functions as F

    with running_log(tmp_path / "data", maxEntriesPerSegment=5) as log:
        written = grow_while_writing(log.url, TOPIC, seed, messages=600)
        register(spark)
        for key_ranges in ("1", "4"):
            df = (spark.read.format("tierstream")
                  .options(topic=TOPIC, broker=log.url, dataDir=str(log.data_dir),
                           partitioning="key-ranges", keyRanges=key_ranges).load()
                  .select("key", "value", F.lit(0).alias("batch"),
                          F.spark_partition_id().alias("pid"),
                          F.monotonically_increasing_id().alias("idx")))
            rows, where = _in_order(df.collect())
            assert all(len(pids) == 1 for pids in where.values())
            assert order_errors(written, [r.key for r in rows],
                                [bytes(r.value) for r in rows]) == []


def test_a_stream_restarted_across_scale_events_reads_once_in_key_order(
        spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    seen: list[Any] = []

    def keep(df: Any, batch_id: int) -> None:
        seen.extend(df.select("key", "value", F.lit(batch_id).alias("batch"),
                              F.spark_partition_id().alias("pid"),
                              F.monotonically_increasing_id().alias("idx")).collect())

    def run(log: Any) -> None:
        query = (spark.readStream.format("tierstream")
                 .options(topic=TOPIC, broker=log.url, dataDir=str(log.data_dir),
                          startingPosition="earliest", maxRecordsPerTrigger="97").load()
                 .writeStream.foreachBatch(keep)
                 .option("checkpointLocation", str(tmp_path / "ckpt"))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        assert query.exception() is None

    with running_log(tmp_path / "data", maxEntriesPerSegment=5) as log:
        register(spark)
        written = grow_while_writing(log.url, TOPIC, 21, messages=300, events=1)
        run(log)  # reads through the first event, 97 messages a batch
        with Admin(log.url) as admin:
            assert admin.get_topic(TOPIC).partitions == written.counts[-1]
        grow_while_writing(log.url, TOPIC, 22, messages=300, events=2, written=written,
                           create=False)
        run(log)  # restarted from the checkpoint: the new partitions join at its next batch
    rows, where = _in_order(seen)
    assert all(len({pid for batch, pid in places if batch == b}) == 1
               for places in where.values() for b, _ in places)
    assert len(written.counts) == 4
    assert order_errors(written, [r.key for r in rows], [bytes(r.value) for r in rows]) == []


def test_a_running_stream_takes_grown_partitions_at_its_next_trigger(
        spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    from ..store.helpers import wait_for
    from ..timing import scaled

    seen: list[Any] = []

    def keep(df: Any, batch_id: int) -> None:
        seen.extend(df.select("key", "value", F.lit(batch_id).alias("batch"),
                              F.spark_partition_id().alias("pid"),
                              F.monotonically_increasing_id().alias("idx")).collect())

    with running_log(tmp_path / "data", maxEntriesPerSegment=5) as log:
        register(spark)
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 2)
        query = (spark.readStream.format("tierstream")
                 .options(topic=TOPIC, broker=log.url, dataDir=str(log.data_dir),
                          startingPosition="earliest", maxRecordsPerTrigger="150").load()
                 .writeStream.foreachBatch(keep)
                 .option("checkpointLocation", str(tmp_path / "ckpt"))
                 .trigger(processingTime="200 milliseconds").start())
        try:
            written = grow_while_writing(log.url, TOPIC, 31, messages=450, events=2,
                                         create=False)
            wait_for(lambda: len(seen) >= written.total or query.exception() is not None,
                     timeout=scaled(120), what="the running query to read everything")
        finally:
            query.stop()
        assert query.exception() is None
    rows, _ = _in_order(seen)
    assert len(written.counts) == 3
    assert order_errors(written, [r.key for r in rows], [bytes(r.value) for r in rows]) == []
