"""A read-process-write streaming query in its own process: topic A, values uppercased, into
topic B through the tierstream sink; for the kill-and-restart and task-failure tests.

usage: python -m tests.spark_adapter.sink_job DATA_DIR BROKER SOURCE SINK CHECKPOINT MODE
MODE: run | available-now | flaky (available-now; every task's first attempt fails in a
UDF: set TIERSTREAM_SPARK_MASTER to a master that retries, local[2,3])
"""

from __future__ import annotations

import sys

from pyspark.sql import functions as F
from pyspark.sql.types import StringType

from tierstream.spark_adapter import register
from tierstream.spark_adapter.jobs import local_spark

_seen: dict[tuple[int, int], int] = {}


def _fail_first_attempts(value: str) -> str:
    """Upper-case; but the first attempt of every task fails at its 150th row."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is not None and context.attemptNumber() == 0:
        key = (context.stageId(), context.partitionId())
        _seen[key] = _seen.get(key, 0) + 1
        if _seen[key] == 150:
            raise RuntimeError("injected: the first attempt of every task fails")
    return value.upper()


def main() -> None:
    data_dir, broker, source, sink, checkpoint, mode = sys.argv[1:7]
    spark = local_spark("tierstream-sink-test")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "20")  # stage in pieces
    register(spark)
    stream = (spark.readStream.format("tierstream").option("topic", source)
              .option("dataDir", data_dir).option("broker", broker)
              .option("maxRecordsPerTrigger", "400" if mode == "run" else "100000").load())
    value = F.col("value").cast("string")
    flaky = F.udf(_fail_first_attempts, StringType())
    upper = flaky(value) if mode == "flaky" else F.upper(value)
    out = stream.select(F.col("key"), upper.alias("value"))
    writer = (out.writeStream.format("tierstream").option("topic", sink)
              .option("broker", broker).option("checkpointLocation", checkpoint))
    if mode in ("available-now", "flaky"):
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="100 milliseconds")
    query = writer.start()
    print("started", flush=True)
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
