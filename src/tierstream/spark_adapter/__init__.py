"""The Spark adapter: tierstream splits as Spark partitions (PySpark Python Data Source API).

``register(spark)`` makes ``spark.read.format("tierstream")`` available; ``read(spark,
**options)`` is the same bounded read with tier splits on Spark's own Parquet reader.
Options are those of ``options.py`` with scope ``read`` (topic/topics/namespace,
startingTime/endingTime, startingPosition/endingPosition, keyRanges, maxSplitBytes, reader,
failOnDataLoss, broker, dataDir, authToken, tlsCa, tierReader); an unknown or malformed
option fails at ``load()`` naming it. With ``spark.sql.python.filterPushdown.enabled=true``,
batch reads push publish_time, partition and topic filters into planning.
``watch_lag(spark)`` reports how far each tierstream streaming query is behind (``lag.py``).
"""

from tierstream.spark_adapter.hybrid import read
from tierstream.spark_adapter.lag import LagListener, QueryLag, watch_lag
from tierstream.spark_adapter.source import (
    SPARK_ARROW_SCHEMA,
    SPARK_SCHEMA,
    TierstreamDataSource,
    TierstreamPushdownDataSource,
    register,
    to_spark_batch,
)

__all__ = ["SPARK_ARROW_SCHEMA", "SPARK_SCHEMA", "LagListener", "QueryLag",
           "TierstreamDataSource", "TierstreamPushdownDataSource", "read", "register",
           "to_spark_batch", "watch_lag"]
