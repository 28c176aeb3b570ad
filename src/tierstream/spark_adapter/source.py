"""The data source: options in (strings, parsed once through ``options.py``), splits out as
``InputPartition``s carrying their JSON, Arrow batches of exactly the declared schema back."""

from __future__ import annotations

import itertools
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyspark
from pyspark.accumulators import AccumulatorParam
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from tierstream.errors import ConfigError
from tierstream.model.message_format import OUTPUT_DDL, OUTPUT_SCHEMA, as_output_batch, spark_ddl
from tierstream.model.positions import Offset
from tierstream.read_options import ReadOptions
from tierstream.readers.stats import ReadStats
from tierstream.schemas.codec import Decoder, decoded_schema
from tierstream.spark_adapter.partitions import read_partition, spark_partitions
from tierstream.splits.split import Cuts, Split, StreamCut

__all__ = [
    "PUSHDOWN_CONF",
    "SPARK_ARROW_SCHEMA",
    "SPARK_SCHEMA",
    "StatsParam",
    "TierstreamDataSource",
    "TierstreamPushdownDataSource",
    "register",
    "to_spark_batch",
]

log = logging.getLogger(__name__)

_PYSPARK_VERSION = pyspark.__version__
# Through 4.3, Spark stores the read plan a pushdown produced on the relation, and later
# scans of the same DataFrame that push no filter reuse it (reproduced here: 30 of 100 rows;
# apache/spark#57752 moves the plan into the scan).
_PUSHDOWN_LEAKS = tuple(int(x) for x in _PYSPARK_VERSION.split(".")[:2] if x.isdigit()) <= (4, 3)

#: Spark's switch for Python data sources' filter pushdown (off by default in Spark).
PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"

#: The DataFrame schema: publish/event time as Spark timestamps, the rest as in message_format.py.
SPARK_SCHEMA = OUTPUT_DDL

#: Spark's Arrow schema is the output schema every command writes (message_format.py).
SPARK_ARROW_SCHEMA = OUTPUT_SCHEMA
to_spark_batch = as_output_batch


class TierstreamDataSource(DataSource):
    """``spark.read.format("tierstream")``."""

    #: A Spark accumulator of ReadStats that batch reads add to (see :func:`counting_format`).
    _stats: Any = None

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self._settings: ReadOptions | None = None
        self._decoder: Decoder | None = None

    @property
    def settings(self) -> ReadOptions:
        """The read options, parsed on first use (a write has other options: sink.py)."""
        if self._settings is None:
            self._settings = ReadOptions.parse(self.options)
            self._settings.check_exists()
        return self._settings

    @classmethod
    def name(cls) -> str:
        return "tierstream"

    def schema(self) -> str:
        settings = self.settings  # bad read options fail here, at load()
        decoder = self.decoder
        if decoder is not None:  # valueFormat=auto: the topic's latest schema, as columns
            return spark_ddl(decoded_schema(OUTPUT_SCHEMA, decoder, settings.mode))
        return SPARK_SCHEMA

    @property
    def decoder(self) -> Decoder | None:
        """valueFormat=auto: the topic's schema versions, read once on the driver."""
        if self._decoder is None and self.settings.value_format == "auto":
            self._decoder = self.settings.decoder()
        return self._decoder

    def writer(self, schema: Any, overwrite: bool) -> Any:
        from tierstream.spark_adapter.sink import TierstreamBatchWriter

        return TierstreamBatchWriter(self._sink_options(schema, overwrite))

    def streamWriter(self, schema: Any, overwrite: bool) -> Any:
        from tierstream.spark_adapter.sink import TierstreamStreamWriter

        return TierstreamStreamWriter(self._sink_options(schema, overwrite))

    def _sink_options(self, schema: Any, overwrite: bool) -> Any:
        from tierstream.spark_adapter.sink import SinkOptions, check_sink_schema, check_sink_topic

        if overwrite:
            raise ConfigError("tierstream topics are append-only: write with mode('append') "
                              "(outputMode 'append' for streams), not overwrite")
        options = SinkOptions.parse(dict(self.options))
        check_sink_schema(schema, options)
        check_sink_topic(schema, options)
        return options

    def streamReader(self, schema: Any) -> Any:
        from tierstream.spark_adapter.stream import TierstreamStreamReader

        return TierstreamStreamReader(self.settings, self.decoder)

    def reader(self, schema: Any) -> DataSourceReader:
        # Spark refuses a reader that implements pushFilters while its pushdown switch is
        # off, so this one does not; register() picks the pushdown source when it is on.
        return _BatchReader(self.settings, self._stats, self.decoder)


class TierstreamPushdownDataSource(TierstreamDataSource):
    """``spark.read.format("tierstream")`` when ``spark.sql.python.filterPushdown.enabled``:
    publish_time, partition and topic filters are applied by planning (pushdown.py)."""

    def reader(self, schema: Any) -> DataSourceReader:
        return _PushdownBatchReader(self.settings, self._stats, self.decoder)


class _BatchReader(DataSourceReader):
    """Driver: ``partitions()`` is the enumerator's plan. Executor: ``read()`` runs a split."""

    def __init__(self, settings: ReadOptions, stats: Any = None,
                 decoder: Decoder | None = None) -> None:
        from tierstream.spark_adapter.pushdown import Pushed

        self.settings = settings
        self.stats = stats
        self.decoder = decoder  # made on the driver, pickled with the reader
        self.pushed = Pushed()

    def partitions(self) -> Sequence[InputPartition]:
        s = self.settings
        if s.compacted:
            from tierstream.spark_adapter.compacted import compacted_partitions

            return compacted_partitions(s)
        return spark_partitions(self.plan(), s.partitioning or "splits",
                                max_bytes=s.max_split_bytes, min_partitions=s.min_partitions)

    def plan(self) -> list[Split]:
        from tierstream.enumerator import Query

        s, f = self.settings, self.pushed
        if s.splits is not None:  # planned by the caller (spark_adapter.read): exactly these
            return list(s.splits)
        base = Query(topics=s.topics, namespace=s.namespace,
                     start=Offset.earliest() if isinstance(s.start, dict) else s.start,
                     end=Offset.latest() if isinstance(s.end, dict) else s.end,
                     key_ranges=s.key_ranges, max_split_bytes=s.max_split_bytes,
                     reader=s.reader, fail_on_data_loss=s.fail_on_data_loss,
                     time_from=f.time_from, time_to=f.time_to)
        per_topic = isinstance(s.start, (dict, StreamCut)) or isinstance(s.end, (dict, StreamCut))
        with s.enumerator() as enum:
            if not per_topic and f.topics is None and not f.restricts_partitions \
                    and not f.nothing:
                return list(enum.plan(base))
            splits: list[Split] = []
            for topic in enum.topics(base):  # unknown topics still fail, filtered or not
                chosen = f.allowed_partitions(topic.partitions) \
                    if f.allows_topic(topic.name) else []
                if chosen:
                    splits.extend(enum.plan(replace(
                        base, topics=(topic.name,), namespace=None, partitions=tuple(chosen),
                        start=_bound_of(s.start, topic.name, "startingPosition"),
                        end=_bound_of(s.end, topic.name, "endingPosition"))))
            return splits

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if self.settings.compacted:
            from tierstream.spark_adapter.compacted import spark_compacted

            return spark_compacted(self.settings, partition, self.decoder)
        return read_partition(self.settings, partition, self.stats, self.decoder)


def _bound_of(bound: Offset | StreamCut | Cuts, topic: str, name: str) -> Offset | StreamCut:
    """The bound for one topic of a multi-topic read: its cut, or where it has none, earliest
    for a start (the topic is new) and an error for an end."""
    if isinstance(bound, dict):
        cut = bound.get(topic)
        if cut is not None:
            return cut
        if name == "startingPosition":
            return Offset.earliest()
        raise ConfigError(f"invalid option {name!r}: it has no cut of {topic!r}")
    if isinstance(bound, StreamCut) and bound.topic != topic:
        return Offset.earliest() if name == "startingPosition" else Offset.latest()
    return bound


class _PushdownBatchReader(_BatchReader):
    def pushFilters(self, filters: list[Any]) -> Iterator[Any]:
        if self.settings.splits is not None:  # planned already: Spark applies every filter
            yield from filters
            return
        yield from self.pushed.push(filters)


class StatsParam(AccumulatorParam):  # type: ignore[type-arg]
    """Adds up the ReadStats (readers/stats.py) of Spark tasks on the driver."""

    def zero(self, value: ReadStats) -> ReadStats:
        return ReadStats()

    def addInPlace(self, a: ReadStats, b: ReadStats) -> ReadStats:
        return a.merge(b)


def counting_format(spark: Any, stats: Any) -> str:
    """Register a copy of the source whose batch reads add, per split, the rows and bytes
    read per reader and path to ``stats`` (a Spark accumulator of ReadStats, see
    readers/stats.py); returns its format name. The copy is a class made here, so Spark's
    pickling carries it (and the accumulator) by value to the Python workers."""
    register(spark)  # same checks and pushdown choice as the plain source
    pushdown = str(spark.conf.get(PUSHDOWN_CONF, "false")).strip().lower() == "true"
    base = TierstreamPushdownDataSource if pushdown else TierstreamDataSource
    name = f"tierstream_counted_{next(_COUNTED)}"
    cls = type(f"_Counted_{name}", (base,), {
        "__module__": __name__, "_stats": stats, "name": classmethod(lambda c: name)})
    spark.dataSource.register(cls)
    return name


_COUNTED = itertools.count(1)


def register(spark: Any) -> None:
    """Register format ``"tierstream"`` on ``spark`` (driver side), and make Spark's Python
    workers run this interpreter when nothing else was configured.

    The interpreter is fixed where it matters: a classic SparkContext took ``PYSPARK_PYTHON``
    (default ``python3`` from PATH) when it was created, and Spark's workers run what the data
    source's registration carries, so this sets the context's interpreter too, also for a
    session created before this call (a job run as ``.venv/bin/python job.py``, unactivated).
    A set ``PYSPARK_PYTHON`` or ``spark.pyspark.python`` is left alone. On Spark Connect the
    server's workers run the server's Python: tierstream must be installed there.

    With ``spark.sql.python.filterPushdown.enabled=true`` set before this call, batch reads push
    publish_time, partition and topic filters into planning; call it again after changing
    that setting.
    """
    if not os.environ.get("PYSPARK_PYTHON") and not spark.conf.get("spark.pyspark.python", None):
        os.environ["PYSPARK_PYTHON"] = sys.executable  # contexts created from now on
        context = _classic_context(spark)
        if context is not None and context.pythonExec != sys.executable:
            log.info("Spark's Python workers will run %s (was %s; set PYSPARK_PYTHON to "
                     "choose another)", sys.executable, context.pythonExec)
            context.pythonExec = sys.executable  # carried by every registration from now on
    pushdown = str(spark.conf.get(PUSHDOWN_CONF, "false")).strip().lower() == "true"
    if pushdown and _PUSHDOWN_LEAKS:
        log.warning(
            "filter pushdown on pyspark %s: Spark keeps a pushed-down read plan on the "
            "DataFrame it came from, so load() a new DataFrame for each differently filtered "
            "query (apache/spark#57752)", _PYSPARK_VERSION)
    spark.dataSource.register(TierstreamPushdownDataSource if pushdown else TierstreamDataSource)


def _classic_context(spark: Any) -> Any:
    """The SparkContext of a classic session, None on Spark Connect (which has none)."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return None
    try:
        return spark.sparkContext
    except Exception:  # a session type without a local context
        return None
