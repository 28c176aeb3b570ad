"""A streaming query in its own process, for the kill-and-restart test.

usage: python -m tests.spark_adapter.stream_job DATA_DIR BROKER OUT CHECKPOINT (run|available-now)
"""

from __future__ import annotations

import sys

from tierstream.spark_adapter import register
from tierstream.spark_adapter.jobs import local_spark


def main() -> None:
    data_dir, broker, out, checkpoint, mode = sys.argv[1:6]
    spark = local_spark("tierstream-stream-test")
    register(spark)
    stream = (spark.readStream.format("tierstream").option("topic", "acme/web/clicks")
              .option("dataDir", data_dir).option("broker", broker)
              .option("maxRecordsPerTrigger", "300").load())
    writer = stream.writeStream.format("parquet").option("checkpointLocation", checkpoint)
    if mode == "available-now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="100 milliseconds")
    query = writer.start(out)
    print("started", flush=True)
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
