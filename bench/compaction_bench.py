"""Compacted topics: a Spark read of each key's latest value from the compaction snapshot
beside reading every message and keeping each key's last in Spark (a window over the key), and
the compactor's throughput beside ``pq.write_table`` of the same messages."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

import tierstream
from bench.harness import Figure, free_port, report, sized, timed
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer

TOPIC = "bench/compaction/prices"
EMPTY = "bench/compaction/empty"
VALUE = b"x" * 60


def compaction(quick: bool = True) -> Path:
    """``messages`` over ``keys`` keys (``messages / keys`` versions each), one partition."""
    messages, keys, runs = sized((1_000_000, 10_000, 3) if quick else (10_000_000, 100_000, 3),
                                 (5_000, 200, 1))
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.jobs import local_spark

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        broker = BrokerProcess(Path(tmp) / "data", args=["--pulsar-port", str(port),
                                                         "--admin-port", "0"]).start()
        session = local_spark("tierstream-bench-compaction")
        try:
            assert broker.url is not None
            with Admin(broker.url) as admin:
                admin.create_topic(TOPIC, 1)
            with Producer(TOPIC, broker=broker.url, batch_size=1000, max_in_flight=16) as p:
                p.send_many({"key": f"k{i % keys}", "value": VALUE} for i in range(messages))
            compactor_rates, write_rates = [], []
            rows = tierstream.read(TOPIC, broker=broker.url).drop_columns(["topic"])
            for run in range(runs):  # the compactor from nothing each time, then the baseline
                with Admin(broker.url) as admin:
                    if run:  # a new topic holds the same messages: the run starts over
                        admin.delete_topic(TOPIC)
                        admin.create_topic(TOPIC, 1)
                        with Producer(TOPIC, broker=broker.url, batch_size=1000,
                                      max_in_flight=16) as p:
                            p.send_many({"key": f"k{i % keys}", "value": VALUE}
                                        for i in range(messages))
                    started = time.perf_counter()
                    admin.compact(TOPIC)
                    compactor_rates.append(messages / (time.perf_counter() - started))
                path = Path(tmp) / f"baseline-{run}.parquet"
                write_rates.append(messages / timed(lambda p=path: pq.write_table(
                    rows, p, compression="zstd")))
            register(session)

            def compacted() -> float:
                df = session.read.format("tierstream").option("topic", TOPIC) \
                    .option("broker", broker.url).option("compacted", "true").load()
                return timed(lambda: df.count())

            def everything() -> float:
                df = session.read.format("tierstream").option("topic", TOPIC) \
                    .option("broker", broker.url).load()
                last = Window.partitionBy("partition", "key").orderBy(
                    F.col("segment_id").desc(), F.col("entry_id").desc(),
                    F.col("batch_index").desc())
                latest = df.withColumn("n", F.row_number().over(last)).where("n = 1")
                return timed(lambda: latest.count())

            with Admin(broker.url) as admin:  # Spark's fixed cost of such a read
                admin.create_topic(EMPTY, 1)

            def floor() -> float:
                df = session.read.format("tierstream").option("topic", EMPTY) \
                    .option("broker", broker.url).option("compacted", "true").load()
                return timed(lambda: df.count())

            if sized(True, False):  # the JVM and Python workers warmed up, for both alike
                everything()
            ours, theirs, floors = [], [], []
            for _ in range(runs):
                ours.append(compacted())
                theirs.append(everything())
                floors.append(floor())
        finally:
            session.stop()
            broker.stop()
    figures = [
        Figure(f"Spark: each key's latest value, {messages:,} messages over {keys:,} keys, "
               "from the compaction snapshot", "s", ours,
               "reading every message and keeping each key's last (a window in Spark)", theirs,
               aim="<= 0.2 of reading everything", higher_is_better=False,
               aim_check=lambda v, r: r is not None and r <= 0.2),
        Figure("Spark's floor: the same compacted read of an empty topic (as many key "
               "ranges; the quick profile's figure cannot go below it)", "s", floors,
               "reading every message and keeping each key's last", theirs,
               higher_is_better=False),
        Figure(f"compactor from nothing: {messages:,} messages (read, fold, write, commit)",
               "msg/s", compactor_rates, "pq.write_table of the same messages (zstd)",
               write_rates, aim=">= 0.5 of pq.write_table",
               aim_check=lambda v, r: r is not None and r >= 0.5),
    ]
    return report("compaction", figures, {"messages": messages, "keys": keys, "runs": runs,
                                          "value_bytes": len(VALUE)})
