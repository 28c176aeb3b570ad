"""``option("compacted", "true")``: one row per live key through Spark, equal to the fold of
the log, one Spark partition per key range with no shuffle."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin
from tierstream.spark_adapter import register

from ..store.test_compaction import TOPIC, _oracle, _write


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
