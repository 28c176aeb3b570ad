"""Structured Streaming reads: AvailableNow with read limits, replays, commits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierstream.read_options import ReadOptions
from tierstream.readers import open_reader
from tierstream.spark_adapter import register
from tierstream.spark_adapter.partitions import partition_splits
from tierstream.spark_adapter.stream import TierstreamStreamReader

from ..logs import BASE, TOPIC, append, fill, running_log
from ..timing import scaled

pytestmark = pytest.mark.spark


def _fill(log: Any, partitions: int, batches: int) -> int:
    return fill(log, partitions=partitions, batches=batches, keys=7)


def test_available_now_with_a_read_limit_runs_several_batches_and_stops(
        spark: Any, tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        total = _fill(log, 2, 10)
        register(spark)
        stream = (spark.readStream.format("tierstream").option("topic", TOPIC)
                  .option("dataDir", str(log.data_dir)).option("broker", log.url)
                  .option("maxRecordsPerTrigger", "250").load())
        out = tmp_path / "out"
        query = (stream.writeStream.format("parquet")
                 .option("checkpointLocation", str(tmp_path / "ckpt"))
                 .trigger(availableNow=True).start(str(out)))
        query.awaitTermination(180)
        batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
        assert len(batches) == total // 250
        assert all(p["numInputRows"] <= 250 for p in batches)
        rows = spark.read.parquet(str(out)).select("value").collect()
        values = sorted(bytes(r["value"]).decode() for r in rows)
        assert values == sorted(v.decode() for v in log.everything().column("value")
                                .to_pylist())
        # the committed end is the broker's durable cursor: nothing left behind it
        from tierstream.client import Admin

        with Admin(log.url) as admin:
            progress = admin.subscriptions(TOPIC)
        own = ReadOptions.parse({"topic": TOPIC, "maxRecordsPerTrigger": "250"}).subscription
        assert own.startswith("spark-")  # each query its own cursor by default
        assert {(r["subscription"], r["partition"], r["backlog"]) for r in progress} == {
            (own, 0, 0), (own, 1, 0)}
        # Spark's progress shows what the broker had: the source's latestOffset
        assert all(p["sources"][0]["latestOffset"] is not None for p in batches)


def test_a_replayed_batch_reads_the_same_rows_after_its_segments_moved(tmp_path: Path
                                                                       ) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        _fill(log, 2, 10)
        settings = ReadOptions.parse({"topic": TOPIC, "dataDir": str(log.data_dir),
                              "broker": log.url, "maxRecordsPerTrigger": "300"})
        reader = TierstreamStreamReader(settings)
        start = reader.initialOffset()
        end = reader.latestOffset(start, reader.getDefaultReadLimit())

        def batch_rows() -> list[str]:
            return sorted(v.decode() for part in reader.partitions(start, end)
                          for split in partition_splits(part.value)
                          for b in open_reader(split)
                          for v in b.column("value").to_pylist())

        first = batch_rows()
        assert len(first) == 300
        off = log.store.offloader
        for plog in log.store.partitions(TOPIC):
            for seg in plog.closed_segments():
                off.delete_bookie_copy(plog, off.offload_segment(plog, seg))
        assert batch_rows() == first
        assert reader.latestOffset(start, reader.getDefaultReadLimit()) == end


def _topic_rows(log: Any, topic: str, partitions: int, batches: int) -> list[str]:
    log.store.create_topic(topic, partitions)
    values = []
    for b in range(batches):
        for p in range(partitions):
            vs = [f"{topic}|{p}-{b}-{j}" for j in range(40)]
            append(log.store, p, vs, keys=[f"k{j % 5}" for j in range(40)],
                   times=[BASE + (b * 100 + j) * 1000 for j in range(40)], topic=topic)
            values.extend(vs)
    return values


def test_a_namespace_stream_picks_up_topics_created_mid_stream(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        want = _topic_rows(log, "acme/web/clicks", 2, 5) + _topic_rows(log, "acme/web/views",
                                                                       1, 4)
        settings = ReadOptions.parse({"namespace": "acme/web", "dataDir": str(log.data_dir),
                              "broker": log.url, "maxRecordsPerTrigger": "150"})
        reader = TierstreamStreamReader(settings)
        offset = reader.initialOffset()
        assert set(offset["cuts"]) == {"acme/web/clicks", "acme/web/views"}
        got: list[str] = []

        def drain() -> int:
            nonlocal offset
            batches = 0
            for _ in range(50):  # bounded: a stream that never catches up fails the test
                end = reader.latestOffset(offset, reader.getDefaultReadLimit())
                if end == offset:
                    return batches
                rows = [v.decode() for part in reader.partitions(offset, end)
                        for split in partition_splits(part.value)
                        for b in open_reader(split)
                        for v in b.column("value").to_pylist()]
                assert 0 < len(rows) <= 150
                got.extend(rows)
                reader.commit(end)
                offset, batches = end, batches + 1
            raise AssertionError("the stream did not catch up within 50 micro-batches")

        assert drain() == 4  # 560 messages, 150 per trigger over three topic-partitions
        want += _topic_rows(log, "acme/web/signups", 2, 3)  # created after the stream began
        assert drain() == 2
        assert sorted(got) == sorted(want)
        assert set(offset["cuts"]) == {"acme/web/clicks", "acme/web/signups", "acme/web/views"}
        for topic in offset["cuts"]:  # each committed batch moved every topic's cursor
            assert log.store.metadata.get_cursor(topic, settings.subscription, 0) is not None
        # the stream's offset is a batch read's bound too: everything up to it, once
        import json

        from tierstream.spark_adapter.source import _BatchReader

        batch = _BatchReader(ReadOptions.parse({
            "namespace": "acme/web", "dataDir": str(log.data_dir), "broker": log.url,
            "endingPosition": json.dumps(offset)}))
        assert sorted(v.decode() for sp in batch.plan() for b in open_reader(sp)
                      for v in b.column("value").to_pylist()) == sorted(want)


def test_a_stream_over_several_topics_on_spark(spark: Any, tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        want = _topic_rows(log, "acme/web/clicks", 2, 4) + _topic_rows(log, "acme/web/views",
                                                                       2, 3)
        register(spark)
        stream = (spark.readStream.format("tierstream")
                  .option("topics", "acme/web/clicks,acme/web/views")
                  .option("dataDir", str(log.data_dir)).option("broker", log.url)
                  .option("startingPosition", "earliest")
                  .option("maxRecordsPerTrigger", "200").load())
        out = tmp_path / "out"
        query = (stream.writeStream.format("parquet")
                 .option("checkpointLocation", str(tmp_path / "ckpt"))
                 .trigger(availableNow=True).start(str(out)))
        query.awaitTermination(180)
        assert query.exception() is None
        rows = spark.read.parquet(str(out)).select("topic", "value").collect()
        assert sorted(bytes(r["value"]).decode() for r in rows) == sorted(want)
        assert all(bytes(r["value"]).decode().startswith(r["topic"] + "|") for r in rows)
        assert len([p for p in query.recentProgress if p["numInputRows"]]) == 3  # 560 / 200


def test_min_records_per_trigger_waits_up_to_max_trigger_delay(tmp_path: Path) -> None:
    from ..store.helpers import wait_for

    def add(first: int, n: int) -> None:
        append(log.store, 0, [f"v{i}" for i in range(first, first + n)],
               keys=[f"k{i % 5}" for i in range(n)], times=[None] * n)

    with running_log(tmp_path / "data") as log:
        log.store.create_topic(TOPIC, 1)
        add(0, 50)
        settings = ReadOptions.parse({
            "topic": TOPIC, "dataDir": str(log.data_dir), "broker": log.url,
            "startingPosition": "earliest", "minRecordsPerTrigger": "100",
            "maxTriggerDelay": "2s"})
        reader = TierstreamStreamReader(settings)
        start = reader.initialOffset()
        limit = reader.getDefaultReadLimit()
        assert reader.latestOffset(start, limit) == start  # 50 < 100: no micro-batch yet
        add(50, 60)
        ready = reader.latestOffset(start, limit)  # 110 >= 100: a batch of all of them
        assert ready != start
        add(110, 10)
        assert reader.latestOffset(ready, limit) == ready  # 10 < 100, and the delay is fresh
        wait_for(lambda: reader.latestOffset(ready, limit) != ready, timeout=scaled(15),
                 what="maxTriggerDelay to let the small batch through")
