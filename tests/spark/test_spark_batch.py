"""The Spark adapter's batch reads on a real local Spark (one session for the suite)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import tierstream as ts
from tierstream.spark_adapter import SPARK_ARROW_SCHEMA, register, to_spark_batch
from tierstream.splits.positions import Position
from tierstream.splits.split import StreamCut

from ..framework.logs import BASE, TOPIC, append, running_log

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
    assert df.rdd.getNumPartitions() == len(splits)
    assert _rows(df) == _local(tiered_log)
    window = _load(spark, tiered_log, topic=TOPIC, startingTime=str(BASE + 300_000),
                   endingTime="2026-11-01T00:20:00Z")
    assert _rows(window) == _local(tiered_log, start=BASE + 300_000,
                                   end="2026-11-01T00:20:00Z")


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


def test_filters_are_exact_and_do_not_leak_into_later_scans(spark: Any, tiered_log: Any
                                                             ) -> None:
    # guards the reason pushFilters is not implemented: a filtered scan first, then the
    # unfiltered one, of the same DataFrame, must both be exact
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
