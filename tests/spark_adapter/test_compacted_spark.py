"""``option("compacted", "true")``: one row per live key through Spark, equal to the fold of
the log, one Spark partition per key range with no shuffle."""

from __future__ import annotations

import random
from typing import Any

import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin
from tierstream.spark_adapter import register

from ..store.test_compaction import TOPIC, _oracle, _write
from ..timing import scaled


def _compacted(spark: Any, broker: BrokerProcess, **options: str) -> Any:
    register(spark)
    reader = spark.read.format("tierstream").option("broker", broker.url) \
        .option("topic", TOPIC).option("compacted", "true")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def _rows(df: Any) -> dict[tuple[int, str], tuple[Any, ...]]:
    out = {}
    for r in df.collect():
        key = (r["partition"], r["key"])
        assert key not in out, f"{key} twice"
        out[key] = (bytes(r["value"]), r["segment_id"], r["entry_id"], r["batch_index"],
                    int(r["publish_time"].timestamp() * 1000 + 0.5))
    return out


def test_a_compacted_spark_read_is_one_row_per_live_key(spark: Any,
                                                        start_broker: Any) -> None:
    broker = start_broker()
    rng = random.Random(21)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
        _write(broker, rng, 600, 0)
        df = _compacted(spark, broker, keyRanges="4")
        assert df.rdd.getNumPartitions() == 4
        assert _rows(df) == _oracle(broker)  # never compacted: the log folded
        admin.compact(TOPIC)
        _write(broker, rng, 150, 600)
        assert _rows(_compacted(spark, broker)) == _oracle(broker)
    plan = _compacted(spark, broker)._jdf.queryExecution().executedPlan().toString()
    assert "Exchange" not in plan, plan


def test_a_compacted_read_refuses_a_window(spark: Any, start_broker: Any) -> None:
    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with pytest.raises(Exception, match="give it no startingPosition"):
        _compacted(spark, broker, startingPosition="latest").collect()


def _stream_once(spark: Any, broker: BrokerProcess, tmp_path: Any) -> list[dict[str, Any]]:
    """One availableNow run of a compacted stream into Parquet (checkpoint kept between
    runs): the rows its micro-batches added, each with its batch id."""
    register(spark)
    stream = spark.readStream.format("tierstream").option("broker", broker.url) \
        .option("topic", TOPIC).option("compacted", "true") \
        .option("maxRecordsPerTrigger", "50").option("keyRanges", "3").load()
    out = tmp_path / "out"
    seen = {p.name for p in out.glob("*.parquet")} if out.exists() else set()
    query = stream.writeStream.format("parquet") \
        .option("checkpointLocation", str(tmp_path / "ckpt")) \
        .trigger(availableNow=True).start(str(out))
    query.awaitTermination()
    assert query.exception() is None
    new = [str(p) for p in out.glob("*.parquet") if p.name not in seen]
    return [r.asDict() for r in spark.read.parquet(*new).collect()] if new else []


def test_a_compacted_stream_starts_with_the_state_and_goes_on_with_the_log(
        spark: Any, start_broker: Any, tmp_path: Any) -> None:
    broker = start_broker()
    rng = random.Random(5)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
        _write(broker, rng, 500, 0)
        admin.compact(TOPIC, wait=True)
        _write(broker, rng, 120, 500)
    state = _stream_once(spark, broker, tmp_path)
    got = {(r["partition"], r["key"]): (bytes(r["value"]), r["segment_id"], r["entry_id"],
                                        r["batch_index"]) for r in state}
    assert len(got) == len(state), "a key twice in the state"
    assert got == {k: v[:4] for k, v in _oracle(broker).items()}  # one batch, not limited
    # then the log after the state's cut, as it is: tombstones and keyless messages too
    ident = ("partition", "segment_id", "entry_id", "batch_index")

    def log_ids() -> set[tuple[int, ...]]:
        return {tuple(r[c] for c in ident)
                for r in tierstream.read(TOPIC, broker=broker.url).to_pylist()}

    before = log_ids()
    _write(broker, rng, 130, 620)
    changes = _stream_once(spark, broker, tmp_path)
    assert sorted(tuple(r[c] for c in ident) for r in changes) == sorted(log_ids() - before)
    assert any(r["key"] is None for r in changes) and any(not r["value"] for r in changes)


def test_a_compacted_stream_refuses_a_starting_position(spark: Any, start_broker: Any) -> None:
    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    register(spark)
    with pytest.raises(Exception, match="give it no startingPosition"):
        spark.readStream.format("tierstream").option("broker", broker.url) \
            .option("topic", TOPIC).option("compacted", "true") \
            .option("startingPosition", "latest").load().writeStream.format("console") \
            .start().awaitTermination(scaled(60))
