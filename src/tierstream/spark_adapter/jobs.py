"""Spark jobs the CLI runs: the backfill (a bounded read written as Parquet or as an Iceberg
table), and what the tail (``tail.py``) shares with it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pyarrow.parquet as pq

from tierstream.errors import ERRORS_BY_CODE, ConfigError, TierstreamError
from tierstream.model.positions import Offset, OffsetKind
from tierstream.spark_adapter.driver_output import launch_driver, mute_driver_output
from tierstream.splits.split import cuts_to_dict
from tierstream.util.threads import Worker

__all__ = ["BackfillResult", "backfill", "checkpoint_subscription", "local_spark", "query_error",
           "stop_spark"]


FORMATS = ("parquet", "iceberg")


@dataclass(frozen=True)
class BackfillResult:
    splits_by_reader: dict[str, int]
    rows: int
    bytes_read: int  # log bytes the plan covers (from segment records)
    bytes_written: int  # output data files on disk
    seconds: float
    out: str
    format: str = "parquet"
    table: str | None = None  # the Iceberg table, for format "iceberg"
    catalog_uri: str | None = None
    read_stats: Any = None  # ReadStats: rows and bytes per reader and path (readers/stats.py)


def local_spark(app_name: str = "tierstream") -> Any:
    """A SparkSession whose Python workers run this interpreter. A local master
    (``TIERSTREAM_SPARK_MASTER``, default ``local[*]``) binds the driver to loopback unless
    ``SPARK_LOCAL_IP`` names another address."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    master = os.environ.get("TIERSTREAM_SPARK_MASTER", "local[*]")
    if master.startswith("local"):
        # read by the JVM as it starts, before any config: without it Spark looks up a
        # routable address for itself (and warns that the hostname resolves to loopback)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    conf = {"spark.master": master, "spark.app.name": app_name, "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false", "spark.sql.session.timeZone": "UTC"}
    if master.startswith("local") and os.environ["SPARK_LOCAL_IP"] == "127.0.0.1":
        conf.update({"spark.driver.bindAddress": "127.0.0.1", "spark.driver.host": "127.0.0.1"})
    # the driver's stderr through tierstream, to be muted when a command stops Spark itself
    launch_driver(conf)
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def stop_spark(spark: Any) -> None:
    """Stop a session the command is done with. What the driver writes to stderr while it
    shuts down is dropped (``driver_output.py``): the command reports its own end."""
    mute_driver_output()
    spark.stop()


def check_target(out: str, *, format: str, table: str | None, catalog_uri: str | None
                 ) -> None:
    """Where a backfill writes, checked without Spark (the CLI calls this before it starts
    one): a known format, a new ``out``, and a table or catalog only for Iceberg."""
    if format not in FORMATS:
        raise ConfigError(f"invalid --format {format!r}: expected one of {', '.join(FORMATS)}")
    if os.path.exists(out):
        raise ConfigError(f"--out {out!r} exists; choose a new path (nothing was written)")
    if format == "parquet" and (table is not None or catalog_uri is not None):
        raise ConfigError("a table and a catalog are for --format iceberg only")


def backfill(spark: Any, options: dict[str, str], out: str, *, format: str = "parquet",
             table: str | None = None, catalog_uri: str | None = None, progress: Any = None
             ) -> BackfillResult:
    """Read ``options`` (the data source's) with Spark and write them to the new directory
    ``out``: Parquet files, or an Iceberg table there (data files under ``out/data``, table
    metadata under ``out/metadata``, registered in the catalog at ``catalog_uri``, by default
    a SQLite catalog in ``out/catalog.db``, as ``table``, by default ``backfill.<topic>``).

    Everything is checked before Spark starts. On failure ``out`` is removed again and no
    table is created, so nothing is left half-written. ``progress(done, total)`` is called
    about twice a second with Spark's task counts.
    """
    from tierstream.read_options import ReadOptions
    from tierstream.readers.stats import ReadStats
    from tierstream.spark_adapter.hybrid import NATIVE, plan_read
    from tierstream.spark_adapter.source import StatsParam

    check_target(out, format=format, table=table, catalog_uri=catalog_uri)
    options = dict(options)
    settings = ReadOptions.parse(options)
    if format == "iceberg":
        if table is None:
            if len(settings.topics) != 1:
                raise ConfigError("--format iceberg over several topics needs a table name")
            table = "backfill." + _table_name(settings.topics[0])
        catalog_uri = catalog_uri or "sqlite:///" + os.path.join(os.path.abspath(out),
                                                                  "catalog.db")
        sink: _IcebergSink | None = _IcebergSink(catalog_uri, table, os.path.abspath(out))
    else:
        sink = None
    if isinstance(settings.end, Offset) and settings.end.kind is OffsetKind.LATEST:
        # Pin "latest" to cuts now, so Spark reads exactly what is planned and counted here.
        options["endingPosition"] = json.dumps(_latest_cuts(settings))
        settings = ReadOptions.parse(options)
    stats = spark.sparkContext.accumulator(ReadStats(), StatsParam())
    planned = plan_read(spark, options, stats=stats)
    splits, df = planned.splits, planned.df
    data_dir = out if sink is None else os.path.join(out, "data")
    t0 = time.perf_counter()
    try:
        with _watch(spark, progress), _conf(spark, _PARQUET_CONF):
            df.write.parquet(data_dir)
        files = sorted(glob.glob(os.path.join(glob.escape(data_dir), "*.parquet")))
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        if sink is not None:
            _tidy(data_dir)
            sink.commit(files, _table_schema(settings))
    except (TierstreamError, KeyboardInterrupt):
        shutil.rmtree(out, ignore_errors=True)
        raise
    except Exception as exc:  # Spark's wrapping of the real error: pages of trace
        shutil.rmtree(out, ignore_errors=True)
        if os.environ.get("TIERSTREAM_DEBUG"):
            raise
        raise query_error(exc) from None
    seconds = time.perf_counter() - t0
    counts = stats.value
    if planned.native:  # rows Spark's own reader read: the rest of what was written
        tier_files = {s.tier_url for s in planned.native}
        counts.add("parquet-tier", NATIVE, rows - counts.rows(),
                   sum(os.path.getsize(urlparse(u or "").path) for u in tier_files))
    kinds = Counter(s.reader.value for s in splits)
    return BackfillResult(dict(kinds), rows, sum(s.estimated_bytes for s in splits),
                          sum(os.path.getsize(f) for f in files), seconds, out, format,
                          table, catalog_uri, counts)


def _table_schema(settings: Any) -> Any:
    """The Arrow schema of what a backfill writes: the source's, with decoded values for
    valueFormat=auto."""
    from tierstream.schemas.codec import decoded_schema
    from tierstream.spark_adapter.source import SPARK_ARROW_SCHEMA

    decoder = settings.decoder()
    return SPARK_ARROW_SCHEMA if decoder is None else decoded_schema(
        SPARK_ARROW_SCHEMA, decoder, settings.mode)


def _latest_cuts(settings: Any) -> dict[str, Any]:
    """The broker's latest cut of every topic the read covers, as an ``endingPosition``."""
    from tierstream.enumerator import Query

    with settings.enumerator() as enum:
        topics = [t.name for t in enum.topics(Query(topics=settings.topics,
                                                    namespace=settings.namespace))]
        cuts = {t: enum.latest_cut(t) for t in topics}
    return cuts_to_dict(cuts, single=len(cuts) == 1 and settings.namespace is None)


# Parquet that Iceberg and every other reader take as is: UTC instants as INT64 microseconds
# (Spark's default is the legacy INT96).
_PARQUET_CONF = {"spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS"}


@contextmanager
def _conf(spark: Any, settings: dict[str, str]) -> Iterator[None]:
    before = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


@contextmanager
def _watch(spark: Any, progress: Any) -> Iterator[None]:
    """Report Spark's task counts to ``progress(done, total)`` while the block runs."""
    def watch() -> None:
        tracker = spark.sparkContext.statusTracker()
        while not watcher.stopping.wait(0.5):
            done = total = 0
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    total += info.numTasks
            if progress is not None and total:
                progress(done, total)

    # an error in it (Spark stopping under it) is logged once; the job goes on without bars
    watcher = Worker("tierstream-spark-progress", watch).start()
    try:
        yield
    finally:
        watcher.stop()


def _tidy(data_dir: str) -> None:
    """Leave only data files in an Iceberg table's data directory (no Hadoop markers)."""
    for name in os.listdir(data_dir):
        if name.startswith(("_", ".")):
            os.remove(os.path.join(data_dir, name))


def _table_name(topic: str) -> str:
    from tierstream.model.names import TopicName
    from tierstream.tier.catalog import iceberg_identifier

    return "_".join(iceberg_identifier(TopicName.parse(topic))).replace("-", "_")


class _IcebergSink:
    """Creates the backfill's Iceberg table with all its files in one catalog commit."""

    def __init__(self, catalog_uri: str, table: str, location: str) -> None:
        self._open_catalog(catalog_uri, table, location, example="backfill.clicks_week")
        inside = catalog_uri.startswith("sqlite:///" + location + os.sep)
        if not inside and self.catalog().table_exists(self.ident):  # an existing catalog
            raise ConfigError(f"Iceberg table {table!r} exists in {catalog_uri!r}; choose "
                              "another --table (nothing was written)")

    def _open_catalog(self, catalog_uri: str, table: str, location: str, *, example: str
                      ) -> None:
        """Where the table goes; its name checked (the catalog opens on first use)."""
        parts = tuple(table.split("."))
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"invalid table {table!r}: expected namespace.name, e.g. "
                              f"{example}")
        self.ident, self.location, self.catalog_uri = parts, location, catalog_uri
        self._catalog: Any = None

    def catalog(self) -> Any:
        if self._catalog is None:
            from pyiceberg.catalog.sql import SqlCatalog

            try:
                self._catalog = SqlCatalog(
                    "default", uri=self.catalog_uri,
                    warehouse="file://" + os.path.dirname(self.location))
            except Exception as exc:
                raise ConfigError(f"cannot open the Iceberg catalog {self.catalog_uri!r}: "
                                  f"{exc}") from None
        return self._catalog

    def commit(self, files: list[str], schema: Any = None) -> None:
        import warnings

        from tierstream.spark_adapter.source import SPARK_ARROW_SCHEMA

        schema = SPARK_ARROW_SCHEMA if schema is None else schema
        catalog = self.catalog()
        catalog.create_namespace_if_not_exists(self.ident[:-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tx = catalog.create_table_transaction(self.ident, schema=schema,
                                                  location="file://" + self.location)
            if files:
                tx.add_files(["file://" + f for f in files])
            tx.commit_transaction()


def checkpoint_subscription(checkpoint: str) -> str:
    """The subscription of a stream with this checkpoint: its own durable cursor, the same
    across restarts of the query, different for another query."""
    import hashlib

    digest = hashlib.sha256(os.path.abspath(checkpoint).encode()).hexdigest()[:12]
    return f"spark-{digest}"


def query_error(exc: BaseException) -> TierstreamError:
    """A failed Spark query as the tierstream error at its root, in one line: Spark wraps a
    Python source's error in pages of Java and Python trace."""
    import re

    from tierstream.spark_adapter.hybrid import missing_tier_file

    text = str(exc)
    gone = missing_tier_file(text)
    if gone is not None:
        return gone
    found = re.findall(r"tierstream\.errors\.(\w+): ([^\n]+)", text)
    if found:
        name, message = found[-1]
        cls = {c.__name__: c for c in ERRORS_BY_CODE.values()}.get(name, TierstreamError)
        return cls(message.strip())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return TierstreamError(f"the Spark query failed: {lines[0] if lines else type(exc).__name__}"
                           " (run with --debug for Spark's trace)")
