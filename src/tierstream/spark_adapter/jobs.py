"""Spark jobs the CLI runs: the backfill (a bounded read written to Parquet)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tierstream.errors import ConfigError
from tierstream.splits.positions import Offset, OffsetKind

__all__ = ["BackfillResult", "backfill", "local_spark", "tail"]


@dataclass(frozen=True)
class BackfillResult:
    splits_by_reader: dict[str, int]
    rows: int
    seconds: float
    out: str


def local_spark(app_name: str = "tierstream") -> Any:
    """A local SparkSession whose Python workers run this interpreter."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(os.environ.get("TIERSTREAM_SPARK_MASTER", "local[*]"))
             .appName(app_name).config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def backfill(spark: Any, options: dict[str, str], out: str, *, progress: Any = None
             ) -> BackfillResult:
    """Read ``options`` (the data source's) with Spark and write Parquet to ``out``.

    ``progress(done, total)`` is called about twice a second with Spark's task counts.
    """
    import tierstream
    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.source import _Settings

    if os.path.exists(out):
        raise ConfigError(f"--out {out!r} exists; choose a new path (nothing was written)")
    options = dict(options)
    settings = _Settings(options)
    if isinstance(settings.end, Offset) and settings.end.kind is OffsetKind.LATEST \
            and len(settings.topics) == 1:
        # Pin "latest" to a cut now, so Spark reads exactly what is planned and counted here.
        cut = tierstream.latest_cut(settings.topics[0], data_dir=settings.data_dir,
                                    broker=settings.broker, auth_token=settings.auth_token)
        options["endingPosition"] = cut.to_json()
        settings = _Settings(options)
    splits = tierstream.plan(list(settings.topics) or None, namespace=settings.namespace,
                             start=settings.start, end=settings.end,
                             key_ranges=settings.key_ranges,
                             max_split_bytes=settings.max_split_bytes, reader=settings.reader,
                             fail_on_data_loss=settings.fail_on_data_loss,
                             data_dir=settings.data_dir, broker=settings.broker,
                             auth_token=settings.auth_token)
    register(spark)
    reader = spark.read.format("tierstream")
    for k, v in options.items():
        reader = reader.option(k, v)
    df = reader.load()
    stop = threading.Event()

    def watch() -> None:
        tracker = spark.sparkContext.statusTracker()
        while not stop.wait(0.5):
            done = total = 0
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    total += info.numTasks
            if progress is not None and total:
                progress(done, total)

    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    watcher.start()
    try:
        df.write.parquet(out)
    finally:
        stop.set()
        watcher.join()
    seconds = time.perf_counter() - t0
    rows = spark.read.parquet(out).count()
    kinds = Counter(s.reader.value for s in splits)
    return BackfillResult(dict(kinds), rows, seconds, out)


def tail(spark: Any, options: dict[str, str], out: str, checkpoint: str, *,
         available_now: bool, on_batch: Any = None) -> int:
    """Run the streaming read into a Parquet sink until stopped (Ctrl-C / SIGTERM) or, with
    ``available_now``, until what was there at the start is written. Returns the number of
    micro-batches that read rows. Restarting with the same checkpoint continues exactly
    where the last committed micro-batch ended."""
    import signal

    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.source import _Settings

    _Settings(dict(options))  # bad options fail here, before Spark starts anything
    register(spark)
    reader = spark.readStream.format("tierstream")
    for k, v in options.items():
        reader = reader.option(k, v)
    writer = reader.load().writeStream.format("parquet") \
        .option("checkpointLocation", checkpoint)
    writer = writer.trigger(availableNow=True) if available_now \
        else writer.trigger(processingTime="1 second")
    query = writer.start(out)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = 0
    try:
        while query.isActive and not stop.is_set():
            query.awaitTermination(0.5)
            progress = [p for p in query.recentProgress if p.get("numInputRows")]
            if on_batch is not None and len(progress) > seen:
                for p in progress[seen:]:
                    on_batch(p["batchId"], p["numInputRows"])
                seen = len(progress)
        if query.isActive:
            query.stop()
        exc = query.exception()
        if exc is not None:
            raise RuntimeError(f"streaming query failed: {exc}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return len([p for p in query.recentProgress if p.get("numInputRows")])
