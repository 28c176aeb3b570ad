"""The exactly-once sink (issue 15): a Spark batch write through two-phase commit beside the
Python producer sending the same rows, and the commit latency of one micro-batch."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.harness import Figure, console, report, timed
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer, Transaction
from tierstream.message_format import key_hashes

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


def sink(quick: bool = True) -> Path:
    """Rows/s of ``df.write.format("tierstream")`` (stage, prepare, commit) beside the
    Python producer on the same rows, same broker (fsync on); and ms per micro-batch commit
    (two task transactions of 5,000 rows over 4 partitions)."""
    rows, runs, commits = (200_000, 3, 10) if quick else (1_000_000, 3, 30)
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
                for name in ("producer", "spark", "commit"):
                    admin.create_topic(f"bench/sink/{name}", PARTITIONS)
            df = spark.range(rows, numPartitions=2).selectExpr(
                f"concat('k', cast(id % {KEYS} as string)) as key",
                "cast(concat(repeat('x', 90), lpad(cast(id as string), 10, '0')) as binary) "
                "as value").cache()
            df.count()
            console.print(f"{rows:,} rows of a 100-byte value, {PARTITIONS} partitions")
            produce = [rows / timed(lambda: _produce(url, "bench/sink/producer", table))
                       for _ in range(runs)]
            def spark_write() -> None:
                df.write.format("tierstream").mode("append").option(
                    "topic", "bench/sink/spark").option("broker", url).save()

            spark_write()  # warm-up: Python workers start, the source class is shipped
            write = [rows / timed(spark_write) for _ in range(runs)]
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
               "Python producer, same rows", produce, aim=">= 0.5 of produce",
               aim_check=lambda v, r: r is not None and r >= 0.5),
        Figure("commit of one micro-batch (2 x 5,000 rows)", "ms", latency,
               higher_is_better=False),
    ]
    return report("sink", figures, {"rows": rows, "partitions": PARTITIONS,
                                    "value_bytes": 100, "fsync": True, "commits": commits})
