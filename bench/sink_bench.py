"""The exactly-once sink (issue 15): a Spark batch write through two-phase commit beside the
Python producer sending the same rows, and the commit latency of one micro-batch."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench.harness import Figure, console, report, sized, timed
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer, Transaction
from tierstream.model.message_format import key_hashes

PARTITIONS = 4
KEYS = 100


def _rows(n: int) -> pa.Table:
    """Rows as the Spark job makes them: key ``k<i % 100>``, a 100-byte value."""
    return pa.table({"key": [f"k{i % KEYS}" for i in range(n)],
                     "value": [b"x" * 90 + str(i).zfill(10).encode() for i in range(n)]})


def _produce(url: str, topic: str, table: pa.Table) -> None:
    """The producer's fastest path for routed rows: per partition, batches of 1,000,
    pipelined (what send_many does, without building a Message per row)."""
    target = np.asarray(key_hashes(table.column("key").combine_chunks())) % PARTITIONS
    with Producer(topic, broker=url, batch_size=1000, max_in_flight=16) as producer:
        for p in range(PARTITIONS):
            producer.send_batch(table.filter(pa.array(target == p)), partition=p)


def _transaction(url: str, topic: str, table: pa.Table) -> None:
    """The rows through one Python transaction, handed over as a Spark task's (batches of
    10,000 rows), committed."""
    with Transaction(broker=url) as txn:
        for batch in table.to_batches(max_chunksize=10_000):
            txn.write(topic, batch)


def _handover_sink() -> Any:
    """A Python data source writer that writes nothing: its tasks take Spark's Arrow batches
    and drop them, and its commit does nothing. Its rows/s is what PySpark's hand-over of
    rows to a Python writer costs alone: about the most any Python sink can reach. Defined
    in a function so that Spark pickles it by value to its Python workers."""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class Writer(DataSourceArrowWriter):
        def write(self, iterator: Any) -> WriterCommitMessage:
            for _ in iterator:
                pass
            return WriterCommitMessage()

    class Handover(DataSource):
        @classmethod
        def name(cls) -> str:
            return "tierstream-bench-handover-sink"

        def writer(self, schema: Any, overwrite: bool) -> Writer:
            return Writer()

    return Handover


def sink(quick: bool = True) -> Path:
    """Rows/s of ``df.write.format("tierstream")`` (stage, prepare, commit) beside the
    Python producer on the same rows, same broker (fsync on); and ms per micro-batch commit
    (two task transactions of 5,000 rows over 4 partitions)."""
    rows, runs, commits = sized((200_000, 3, 10) if quick else (1_000_000, 3, 30),
                                 (2_000, 1, 2))
    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.jobs import local_spark

    table = _rows(rows)
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data").start()
        spark = local_spark("bench-sink")
        register(spark)
        try:
            url = broker.url
            assert url is not None
            with Admin(url) as admin:
                for name in ("producer", "spark", "commit", "txn"):
                    admin.create_topic(f"bench/sink/{name}", PARTITIONS)
            df = spark.range(rows, numPartitions=2).selectExpr(
                f"concat('k', cast(id % {KEYS} as string)) as key",
                "cast(concat(repeat('x', 90), lpad(cast(id as string), 10, '0')) as binary) "
                "as value").cache()
            df.count()
            console.print(f"{rows:,} rows of a 100-byte value, {PARTITIONS} partitions")
            produce, staged = [], []
            for _ in range(runs):  # interleaved
                produce.append(rows / timed(lambda: _produce(url, "bench/sink/producer",
                                                             table)))
                staged.append(rows / timed(lambda: _transaction(url, "bench/sink/txn",
                                                                table)))
            def spark_write() -> None:
                df.write.format("tierstream").mode("append").option(
                    "topic", "bench/sink/spark").option("broker", url).save()

            spark.dataSource.register(_handover_sink())

            def handover() -> None:
                df.write.format("tierstream-bench-handover-sink").mode("append").save()

            spark_write()  # warm-up: Python workers start, the source class is shipped
            handover()
            write, ceiling = [], []
            for _ in range(runs):  # interleaved
                write.append(rows / timed(spark_write))
                ceiling.append(rows / timed(handover))
            part = _rows(5_000)
            latency = []
            for batch in range(commits):
                txns = []
                for _ in range(2):
                    txn = Transaction(broker=url, sink="bench", batch=batch)
                    txn.write("bench/sink/commit", part)
                    txn.prepare()
                    txns.append(txn.txn_id)
                    txn.close()
                with Admin(url) as admin:
                    t0 = time.perf_counter()
                    admin.commit_transactions(txns, sink="bench", batch=batch)
                    latency.append((time.perf_counter() - t0) * 1000)
        finally:
            spark.stop()
            broker.stop()
    figures = [
        Figure("Spark batch write, exactly once (rows/s)", "rows/s", write,
               "Python producer, same rows", produce, aim=">= 1.0 of produce",
               aim_check=lambda v, r: r is not None and r >= 1.0),
        Figure("Python Transaction, no Spark: stage, prepare, commit (rows/s)", "rows/s",
               staged, "Python producer, same rows", produce),
        Figure("a Python writer that writes nothing (PySpark's hand-over alone)", "rows/s",
               ceiling, "Python producer, same rows", produce),
        Figure("Spark batch write, exactly once (rows/s)", "rows/s", write,
               "the hand-over alone, same run", ceiling),
        Figure("commit of one micro-batch (2 x 5,000 rows)", "ms", latency,
               higher_is_better=False),
    ]
    return report("sink", figures, {"rows": rows, "partitions": PARTITIONS,
                                    "value_bytes": 100, "fsync": True, "commits": commits})
