"""The Spark adapter's batch reads on a real local Spark (one session for the suite)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.datasource import EqualTo, GreaterThan, GreaterThanOrEqual, In, LessThan, Not

import tierstream as ts
from tierstream.model.positions import Position
from tierstream.spark_adapter import SPARK_ARROW_SCHEMA, register, to_spark_batch
from tierstream.spark_adapter.source import PUSHDOWN_CONF
from tierstream.splits.split import StreamCut

from ..logs import BASE, TOPIC, append, running_log

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def tiered_log(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A log whose data lives in all three places: tier, closed bookies, the open tail."""
    with running_log(tmp_path_factory.mktemp("spark") / "data", maxEntriesPerSegment=4) as log:
        log.store.create_topic(TOPIC, 3)
        i = 0
        for _ in range(14):
            for p in range(3):
                append(log.store, p, [f"{p}-{i + j}" for j in range(40)],
                       keys=[None if j % 9 == 0 else f"user-{(i + j) % 29}" for j in range(40)],
                       times=[BASE + (i + j) * 1000 for j in range(40)])
                i += 40
        off = log.store.offloader
        for plog in log.store.partitions(TOPIC):
            closed = plog.closed_segments()
            for seg in closed[:2]:
                off.delete_bookie_copy(plog, off.offload_segment(plog, seg))
        yield log


def _load(spark: Any, log: Any, **options: str) -> Any:
    register(spark)
    reader = spark.read.format("tierstream").option("dataDir", str(log.data_dir)) \
        .option("broker", log.url)
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def _rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted((r["topic"], r["partition"], r["segment_id"], r["entry_id"], r["batch_index"],
                   r["key"], bytes(r["value"])) for r in df.collect())


def _local(log: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
    t = ts.read(TOPIC, **log.kw(), **kwargs)
    return sorted(zip(*(t.column(c).to_pylist() for c in (
        "topic", "partition", "segment_id", "entry_id", "batch_index", "key", "value")),
        strict=True))


def test_batch_equals_the_local_runner_across_all_three_readers(spark: Any, tiered_log: Any
                                                                 ) -> None:
    splits = ts.plan(TOPIC, key_ranges=2, **tiered_log.kw())
    assert {s.reader.value for s in splits} == {"parquet-tier", "bookie-log", "tail-consumer"}
    df = _load(spark, tiered_log, topic=TOPIC, keyRanges="2")
    # small splits are packed into Spark partitions (never fewer than the cores), each split
    # read by its own reader; asked for, one partition per split
    assert min(len(splits), os.cpu_count() or 1) <= df.rdd.getNumPartitions() < len(splits)
    assert _rows(df) == _local(tiered_log)
    unpacked = _load(spark, tiered_log, topic=TOPIC, keyRanges="2", minPartitions="1000000")
    assert unpacked.rdd.getNumPartitions() == len(splits)
    assert _rows(unpacked) == _local(tiered_log)
    window = _load(spark, tiered_log, topic=TOPIC, startingTime=str(BASE + 300_000),
                   endingTime="2026-11-01T00:20:00Z")
    assert _rows(window) == _local(tiered_log, start=BASE + 300_000,
                                   end="2026-11-01T00:20:00Z")


def test_an_empty_plan_reads_no_rows(spark: Any, tiered_log: Any) -> None:
    # Spark stands in one partition with no value when partitions() is empty
    before = _load(spark, tiered_log, topic=TOPIC, startingTime=str(BASE - 60_000),
                   endingTime=str(BASE - 1))
    assert before.count() == 0


def test_schema_is_exactly_the_declared_one(spark: Any, tiered_log: Any) -> None:
    df = _load(spark, tiered_log, topic=TOPIC)
    assert [(f.name, f.dataType.simpleString(), f.nullable) for f in df.schema.fields] == [
        ("topic", "string", False), ("partition", "int", False), ("key", "string", True),
        ("key_hash", "int", False), ("value", "binary", False),
        ("publish_time", "timestamp", False), ("event_time", "timestamp", True),
        ("properties", "map<string,string>", True), ("segment_id", "bigint", False),
        ("entry_id", "bigint", False), ("batch_index", "int", False)]
    first = df.orderBy("publish_time").first()
    assert first["publish_time"].replace(tzinfo=None) == datetime.fromtimestamp(
        BASE / 1000, UTC).replace(tzinfo=None) or spark.conf.get("spark.sql.session.timeZone")
    batch = next(iter(ts.scan(TOPIC, **tiered_log.kw())))
    converted = to_spark_batch(batch)
    assert converted.schema == SPARK_ARROW_SCHEMA
    assert converted.column("publish_time").cast(pa.int64()).to_pylist() == [
        t * 1000 for t in batch.column("publish_time").to_pylist()]


def test_small_reader_batches_reach_spark_joined_and_in_order(tiered_log: Any) -> None:
    from tierstream.spark_adapter.partitions import SPARK_BATCH_ROWS, spark_batches

    small = [b.slice(i, 1000) for b in ts.scan(TOPIC, **tiered_log.kw())
             for i in range(0, b.num_rows, 1000)] * 12  # > 8 x SPARK_BATCH_ROWS in all
    out = list(spark_batches(small))
    assert all(b.schema == SPARK_ARROW_SCHEMA for b in out)
    assert all(b.num_rows >= SPARK_BATCH_ROWS for b in out[:-1]) and len(out) < len(small)
    assert pa.Table.from_batches(out).column("entry_id").to_pylist() == [
        e for b in small for e in b.column("entry_id").to_pylist()]


def test_filters_are_exact_and_do_not_leak_into_later_scans(spark: Any, tiered_log: Any
                                                             ) -> None:
    # without Spark's pushdown switch (the default) a DataFrame may be reused: a filtered
    # scan first, then the unfiltered one, must both be exact
    full = _load(spark, tiered_log, topic=TOPIC)
    everything = _local(tiered_log)
    lo = datetime.fromtimestamp((BASE + 1_200_000) / 1000, UTC)
    filtered = full.where(full.partition == 1).where(full.publish_time >= lo)
    got = _rows(filtered)
    assert got and all(r[1] == 1 for r in got)
    assert _rows(full) == everything


@pytest.mark.parametrize(("options", "needle"), [
    ({"topic": TOPIC, "keyRange": "4"}, "unknown option 'keyRange'"),
    ({"topic": TOPIC, "keyRanges": "many"}, "invalid option 'keyRanges'"),
    ({"topic": TOPIC, "startingTime": "soon"}, "invalid option 'startingTime'"),
    ({"topic": TOPIC, "endingPosition": "{broken"}, "endingPosition"),
    ({}, "option 'topic', 'topics' or 'namespace' is required"),
    ({"topic": TOPIC, "reader": "fast"}, "invalid reader 'fast'"),
])
def test_bad_options_fail_at_load_naming_the_option(spark: Any, tiered_log: Any,
                                                    options: dict[str, str], needle: str) -> None:
    with pytest.raises(Exception) as info:
        _load(spark, tiered_log, **options).schema  # noqa: B018 - load() is where it fails
    assert needle.lower() in str(info.value).lower()  # Spark lower-cases option keys


def test_unreachable_broker_is_a_clear_error(spark: Any, tiered_log: Any) -> None:
    register(spark)
    df = spark.read.format("tierstream").option("dataDir", str(tiered_log.data_dir)) \
        .option("broker", "grpc://127.0.0.1:1").option("topic", TOPIC).load()
    with pytest.raises(Exception) as info:
        df.count()
    assert "cannot reach the broker at grpc://127.0.0.1:1" in str(info.value)


def test_fail_on_data_loss_both_ways(spark: Any, tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=2) as log:
        log.store.create_topic(TOPIC, 1)
        for b in range(6):
            append(log.store, 0, [f"0-{b}-{j}" for j in range(10)], keys=[None] * 10,
                   times=[BASE + (b * 10 + j) * 1000 for j in range(10)])
        log.store.set_retention(TOPIC, 1)
        first = log.store.partition(TOPIC, 0).closed_segments()[0]
        log.store.offloader.apply_retention(TOPIC, now=(first.max_publish_time or 0) + 2)
        with pytest.raises(Exception) as info:
            _load(spark, log, topic=TOPIC, startingTime=str(BASE)).count()
        assert "data loss" in str(info.value) and "partition 0" in str(info.value)
        survived = _load(spark, log, topic=TOPIC, startingTime=str(BASE),
                         failOnDataLoss="false").count()
        assert survived == 40
        cut = StreamCut.of(TOPIC, {0: Position(0, first.segment_id + 1, 0, 0)})
        assert _load(spark, log, topic=TOPIC, startingPosition=json.dumps(cut.to_dict())
                     ).count() == 40


@pytest.fixture
def pushdown(spark: Any) -> Iterator[Any]:
    """The session with Spark's pushdown switch on and tierstream registered under it."""
    spark.conf.set(PUSHDOWN_CONF, "true")
    register(spark)
    try:
        yield spark
    finally:
        spark.conf.unset(PUSHDOWN_CONF)
        register(spark)


def _micros(ms: int, extra_us: int = 0) -> str:
    t = datetime.fromtimestamp(ms / 1000, UTC) + timedelta(microseconds=extra_us)
    return "timestamp'" + t.strftime("%Y-%m-%d %H:%M:%S.%f") + "+00:00'"


@pytest.mark.parametrize("where", [
    # bounds between two milliseconds, on a millisecond, and an exact match
    f"publish_time >= {_micros(BASE + 300_000, 500)} and publish_time < "
    f"{_micros(BASE + 900_000, 1)}",
    f"publish_time > {_micros(BASE + 300_000)} and publish_time <= {_micros(BASE + 900_000)}",
    f"publish_time = {_micros(BASE + 400_000)}",
    f"publish_time = {_micros(BASE + 400_000, 7)}",
    f"publish_time > {_micros(BASE + 900_000)} and publish_time < {_micros(BASE + 300_000)}",
    "partition = 1", "partition in (0, 2)", "partition > 0 and partition <= 1",
    f"partition = 2 and publish_time < {_micros(BASE + 600_000)} and key = 'user-3'",
    f"topic = '{TOPIC}'", "topic = 'acme/web/other'", "partition is null",
    f"partition = 1 or publish_time < {_micros(BASE + 100_000)}",  # not pushable: Spark's
])
def test_pushdown_is_exact(spark: Any, tiered_log: Any, where: str) -> None:
    expected = _rows(_load(spark, tiered_log, topic=TOPIC).where(where))  # Spark filters
    spark.conf.set(PUSHDOWN_CONF, "true")
    try:
        register(spark)
        df = _load(spark, tiered_log, topic=TOPIC)  # one DataFrame per query (see register)
        assert _rows(df.where(where)) == expected
    finally:
        spark.conf.unset(PUSHDOWN_CONF)
        register(spark)


def test_pushdown_plans_fewer_splits_and_bytes(pushdown: Any, tiered_log: Any) -> None:
    def planned(where: str | None) -> int:  # Spark partitions of a fresh DataFrame
        df = _load(pushdown, tiered_log, topic=TOPIC, minPartitions="1000000")  # unpacked
        return (df if where is None else df.where(where)).rdd.getNumPartitions()

    everything = _reader(tiered_log)
    all_bytes = sum(s.estimated_bytes for s in everything.plan())
    window = _reader(tiered_log, GreaterThanOrEqual(("publish_time",), _dt(BASE + 600_000)),
                     LessThan(("publish_time",), _dt(BASE + 800_000)))
    one = _reader(tiered_log, EqualTo(("partition",), 1))
    assert not window.unclaimed and not one.unclaimed
    assert 0 < sum(s.estimated_bytes for s in window.plan()) < all_bytes / 2  # whole segments
    assert {s.partition for s in one.plan()} == {1}
    assert 0 < len(window.plan()) < len(everything.plan())
    assert planned(f"publish_time >= {_micros(BASE + 600_000)} and publish_time < "
                   f"{_micros(BASE + 800_000)}") == len(window.plan())
    assert planned("partition = 1") == len(one.plan())
    assert planned(None) == len(everything.plan())
    nothing = _reader(tiered_log, EqualTo(("topic",), "acme/web/other"))
    assert nothing.plan() == []  # Spark stands one empty partition in for an empty plan
    assert planned("topic = 'acme/web/other'") == 1
    assert _load(pushdown, tiered_log, topic=TOPIC).where("topic = 'acme/web/other'").count() == 0


def test_not_pushable_filters_go_back_to_spark(tiered_log: Any) -> None:
    kept = [EqualTo(("key",), "user-3"), Not(EqualTo(("partition",), 1)),
            In(("publish_time",), [_dt(BASE)]), GreaterThan(("partition",), 1.5)]
    r = _reader(tiered_log, *kept)
    assert r.unclaimed == kept
    assert len(r.plan()) == len(_reader(tiered_log).plan())


@dataclass
class _Pushed:
    reader: Any
    unclaimed: list[Any]

    def plan(self) -> list[Any]:
        return self.reader.plan()


def _reader(log: Any, *filters: Any) -> _Pushed:
    from tierstream.spark_adapter.source import TierstreamPushdownDataSource

    source = TierstreamPushdownDataSource({"topic": TOPIC, "dataDir": str(log.data_dir),
                                           "broker": log.url})
    reader = source.reader(None)
    return _Pushed(reader, list(reader.pushFilters(list(filters))))


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def test_register_follows_the_pushdown_switch(spark: Any, tiered_log: Any,
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="tierstream.spark_adapter.source"):
        spark.conf.set(PUSHDOWN_CONF, "true")
        try:
            register(spark)
        finally:
            spark.conf.unset(PUSHDOWN_CONF)
    assert "load() a new DataFrame for each differently filtered query" in caplog.text
    register(spark)  # switch off: a reader without pushFilters, which Spark accepts
    assert _load(spark, tiered_log, topic=TOPIC).where("partition = 1").count() > 0
