"""``tierstream tail``: a Structured Streaming read of topics into Parquet (Spark's file sink)
or an Iceberg table (a catalog commit per micro-batch) until stopped. A stop (Ctrl-C,
SIGTERM) that cuts a micro-batch short removes what it wrote, quietly: nothing is left that a
reader would count, and the next run redoes that batch from the checkpoint."""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from tierstream.errors import ConfigError
from tierstream.spark_adapter.driver_output import mute_driver_output
from tierstream.spark_adapter.jobs import (
    _PARQUET_CONF,
    FORMATS,
    _conf,
    _IcebergSink,
    _table_name,
    _tidy,
    checkpoint_subscription,
    query_error,
)

__all__ = ["TailResult", "tail"]


@dataclass(frozen=True)
class TailResult:
    batches: int  # micro-batches that read rows
    interrupted: bool  # stopped by Ctrl-C or SIGTERM (not ended by --available-now)
    removed: int  # files (Parquet) or batch folders (Iceberg) of a batch the stop cut short


def tail(spark: Any, options: dict[str, str], out: str, checkpoint: str, *,
         available_now: bool, format: str = "parquet",
         table: str | None = None, catalog_uri: str | None = None) -> TailResult:
    """Run the streaming read into ``out`` until stopped (Ctrl-C / SIGTERM) or, with
    ``available_now``, until what was there at the start is written. Restarting with the
    same checkpoint continues exactly where the last committed micro-batch ended.

    ``format="parquet"``: Spark's file sink (its ``_spark_metadata`` log says which files
    count; a reader that ignores it may count a killed batch's files twice).
    ``format="iceberg"``: an Iceberg table at ``out`` (catalog ``catalog_uri``, default a
    SQLite catalog in ``out/catalog.db``; ``table``, default ``tail.<topic>``) with one
    catalog commit per micro-batch, idempotent by batch id: any Iceberg reader sees each
    message once."""
    from tierstream.read_options import ReadOptions
    from tierstream.spark_adapter import register
    from tierstream.util.signals import stop_requested

    if format not in FORMATS:
        raise ConfigError(f"invalid format {format!r}: expected one of {', '.join(FORMATS)}")
    if format == "parquet" and (table is not None or catalog_uri is not None):
        raise ConfigError("a table and a catalog are for --format iceberg only")
    settings = ReadOptions.parse(options)  # bad options fail here, before Spark starts
    # from here on Ctrl-C asks the query to stop, also while Spark starts it
    with stop_requested() as stop:
        register(spark)
        stream = spark.readStream.format("tierstream").options(**options).load()
        sink: _IcebergTail | None = None
        if format == "iceberg":
            if table is None:
                if len(settings.topics) != 1:
                    raise ConfigError("--format iceberg over several topics needs a table "
                                      "name")
                table = "tail." + _table_name(settings.topics[0])
            location = os.path.abspath(out)
            sink = _IcebergTail(catalog_uri or "sqlite:///" + os.path.join(location,
                                                                           "catalog.db"),
                                table, location, checkpoint_subscription(checkpoint))
            writer = stream.writeStream.foreachBatch(sink.write_batch) \
                .option("checkpointLocation", checkpoint)
        else:
            writer = stream.writeStream.format("parquet") \
                .option("checkpointLocation", checkpoint)
        writer = writer.trigger(availableNow=True) if available_now \
            else writer.trigger(processingTime="1 second")
        with _conf(spark, _PARQUET_CONF):
            query = writer.start() if sink is not None else writer.start(out)
            while query.isActive and not stop.is_set():
                try:
                    query.awaitTermination(0.5)
                except Exception as exc:  # the query failed: its error, not Spark's trace
                    if os.environ.get("TIERSTREAM_DEBUG"):
                        raise
                    raise query_error(exc) from None
            if query.isActive:
                if not os.environ.get("TIERSTREAM_DEBUG"):
                    # stopping aborts a running micro-batch, which Spark logs as an error
                    # with a Java trace: the stop was asked for, and is reported as such
                    spark.sparkContext.setLogLevel("OFF")
                    mute_driver_output()  # and PySpark's workers, whose sockets it closes
                query.stop()
            failure = query.exception()
            if failure is not None and not stop.is_set():
                raise query_error(failure)
        removed = 0
        if stop.is_set():
            removed = sink.drop_uncommitted() if sink is not None \
                else _drop_uncommitted_files(out)
    batches = len([p for p in query.recentProgress if p.get("numInputRows")])
    return TailResult(batches, stop.is_set(), removed)


def _drop_uncommitted_files(out: str) -> int:
    """Remove the data files in Spark's file-sink folder ``out`` that its ``_spark_metadata``
    log does not list (a micro-batch that was stopped or killed before its commit): Spark
    ignores them, pyarrow and DuckDB would count them. Returns how many."""
    log = os.path.join(out, "_spark_metadata")
    if not os.path.isdir(log):
        return 0  # not a file sink's folder (or nothing started): leave it as it is
    committed: set[str] = set()
    for name in os.listdir(log):
        if name.startswith("."):
            continue  # Hadoop's checksum files
        with open(os.path.join(log, name), encoding="utf-8") as f:
            for line in f:
                if line.startswith("{"):
                    committed.add(os.path.basename(unquote(urlparse(
                        json.loads(line)["path"]).path)))
    stray = [p for p in glob.glob(os.path.join(glob.escape(out), "part-*"))
             if os.path.basename(p) not in committed]
    for path in stray:
        os.remove(path)
        crc = os.path.join(out, f".{os.path.basename(path)}.crc")
        if os.path.exists(crc):
            os.remove(crc)
    return len(stray)


class _IcebergTail(_IcebergSink):
    """A stream's micro-batches appended to an Iceberg table: each batch's files in one
    catalog commit that also records the batch id (table property ``tierstream.batch.<query>``),
    so a batch Spark runs again after a crash is not added twice. Files of a batch that was
    written but never committed are removed when the tail starts again and when it stops."""

    def __init__(self, catalog_uri: str, table: str, location: str, query: str) -> None:
        self._open_catalog(catalog_uri, table, location, example="tail.clicks")
        self.query = query
        self.property = f"tierstream.batch.{query}"
        os.makedirs(location, exist_ok=True)
        self._table = self._open()
        self.drop_uncommitted()

    def drop_uncommitted(self) -> int:
        """Remove the folders of batches written but never committed; how many."""
        last = self.last_batch()
        data = os.path.join(self.location, "data")
        dropped = 0
        for name in os.listdir(data) if os.path.isdir(data) else []:
            batch = name[len(self.query) + 1:].split("-")[0]
            if name.startswith(f"{self.query}-") and batch.isdigit() and int(batch) > last:
                shutil.rmtree(os.path.join(data, name), ignore_errors=True)
                dropped += 1
        return dropped

    def _open(self) -> Any:
        import warnings

        from tierstream.spark_adapter.source import SPARK_ARROW_SCHEMA

        catalog = self.catalog()
        if catalog.table_exists(self.ident):
            return catalog.load_table(self.ident)
        catalog.create_namespace_if_not_exists(self.ident[:-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return catalog.create_table(self.ident, schema=SPARK_ARROW_SCHEMA,
                                        location="file://" + self.location)

    def last_batch(self) -> int:
        self._table = self.catalog().load_table(self.ident)
        return int(self._table.properties.get(self.property, "-1"))

    def write_batch(self, df: Any, batch_id: int) -> None:
        """foreachBatch: write the batch's files, then add them and the batch id in one
        commit; a batch at or below the recorded one was committed already."""
        import uuid
        import warnings

        if batch_id <= self.last_batch():
            return
        folder = os.path.join(self.location, "data", f"{self.query}-{batch_id}-{uuid.uuid4().hex}")
        df.write.parquet(folder)
        files = sorted(glob.glob(os.path.join(glob.escape(folder), "*.parquet")))
        _tidy(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tx = self._table.transaction()
            if files:
                tx.add_files(["file://" + f for f in files])
            tx.set_properties({self.property: str(batch_id)})
            tx.commit_transaction()
