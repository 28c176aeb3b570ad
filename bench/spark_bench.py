"""The Spark adapter (issue 5): backfill throughput beside spark.read.parquet, filter
pushdown on a time window, and keyRanges on one partition."""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harness import Figure, console, fill_clicks, report, sized, timed
from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.splits.split import StreamCut

T0 = 1_700_000_000_000


def _fill(store: Store, topic: str, partitions: int, entries: int, per_entry: int,
          segment_entries: int | None = None) -> None:
    fill_clicks(store, topic, partitions=partitions, entries=entries, per_entry=per_entry,
                t0=T0, segment_entries=segment_entries,
                value=lambda n, p: f'{{"n":{n},"p":{p}}}'.encode() + b"." * 80)


def _ts(ms: int) -> str:
    t = datetime.fromtimestamp(ms / 1000, UTC)
    return "timestamp'" + t.strftime("%Y-%m-%d %H:%M:%S.%f") + "+00:00'"


def _handover_source(batch_file: str, partitions: int, batches: int) -> Any:
    """A Python data source that reads nothing: each of ``partitions`` partitions yields the
    same in-memory Arrow batch of the tierstream source's schema ``batches`` times (8,192 rows
    of ``batch_file``, a tier file). Its rows/s is what PySpark's hand-over alone costs for a
    Python data source of this schema (Arrow to the JVM, converted to rows there): about the
    most any Python source can reach (batch sizes and contents move it by ~20%). Defined in a
    function so that Spark pickles it by value to its Python workers."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from tierstream.spark_adapter.source import SPARK_SCHEMA

    class Reader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            return [InputPartition(i) for i in range(partitions)]

        def read(self, partition: InputPartition) -> Any:
            import pyarrow.parquet as pq

            from tierstream.model.message_format import as_output_batch, with_topic

            rows = pq.read_table(batch_file).slice(0, 8192).combine_chunks().to_batches()[0]
            batch = as_output_batch(with_topic(rows, "bench/spark/ceiling"))
            for _ in range(batches):
                yield batch

    class Handover(DataSource):
        @classmethod
        def name(cls) -> str:
            return "tierstream-bench-handover"

        def schema(self) -> str:
            return str(SPARK_SCHEMA)

        def reader(self, schema: Any) -> DataSourceReader:
            return Reader()

    return Handover


def spark(quick: bool = True) -> Path:
    """Backfill rows/s (noop sink) over tiered and bookie-resident data, beside
    spark.read.parquet of the same tier files; and keyRanges on one partition."""
    partitions, entries, per_entry, runs = sized(
        (4, 50, 2000, 3) if quick else (4, 150, 2000, 5), (2, 5, 100, 1))
    # the backfill figures at >= 10 M rows in the full profile (5 segments per partition),
    # the window and key-range figures at the smaller size
    backfill_entries = entries if quick else 1250
    warmups = sized(1, 0)
    # the many-small-splits figure: one task per split is ~30 ms of Spark each, so the tiny
    # profile keeps it to a few dozen tasks
    small_parts, small_entries, small_segment = sized((16, 125, 40), (4, 20, 10))
    from tierstream.spark_adapter import read as hybrid_read
    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.jobs import local_spark
    from tierstream.spark_adapter.source import PUSHDOWN_CONF

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(StoreConfig.from_options({
            "dataDir": str(Path(tmp) / "data"), "fsync": False,
            "maxEntriesPerSegment": backfill_entries + 1, "deletionLag": "1h",
            "tierCheckInterval": "1h"}))
        try:
            for topic in ("bench/spark/tiered", "bench/spark/bookies"):
                _fill(store, topic, partitions, backfill_entries, per_entry,
                      segment_entries=None if quick else backfill_entries // 5)
            _fill(store, "bench/spark/one", 1, entries * 2, per_entry)
            # many small segments (normal profile: 16 partitions x 1,250 messages in 40-entry
            # segments)
            _fill(store, "bench/spark/small", small_parts, small_entries, 10,
                  segment_entries=small_segment)
            _fill(store, "bench/spark/window", partitions, entries, per_entry,
                  segment_entries=entries // 10)  # 10 segments per partition
            moved = store.offloader.offload_topic("bench/spark/tiered")
            for plog in store.partitions("bench/spark/tiered"):
                for seg in plog.closed_segments():
                    store.offloader.delete_bookie_copy(plog, seg)
            files = [s.tier_url for s in moved]
            cuts = {t: StreamCut.of(t, {p.partition: p.last_confirmed()[1]
                                        for p in store.partitions(t)}).to_json()
                    for t in ("bench/spark/tiered", "bench/spark/bookies", "bench/spark/one",
                              "bench/spark/window", "bench/spark/small")}
            data_dir = str(store.config.data_dir)
        finally:
            store.close()
        session = local_spark("tierstream-bench")
        try:
            register(session)
            messages = partitions * backfill_entries * per_entry

            def ours(topic: str, **extra: str) -> float:
                reader = session.read.format("tierstream").option("topic", topic) \
                    .option("dataDir", data_dir).option("endingPosition", cuts[topic])
                for k, v in extra.items():
                    reader = reader.option(k, v)
                df = reader.load()
                return messages / timed(lambda: df.write.format("noop").mode("overwrite")
                                        .save())

            def hybrid(topic: str) -> float:
                df = hybrid_read(session, topic=topic, dataDir=data_dir,
                                 endingPosition=cuts[topic])
                return messages / timed(lambda: df.write.format("noop").mode("overwrite")
                                        .save())

            # as many Spark partitions as the source makes of the tiered read
            n_parts = session.read.format("tierstream").option("topic", "bench/spark/tiered") \
                .option("dataDir", data_dir).option("endingPosition", cuts["bench/spark/tiered"]) \
                .load().rdd.getNumPartitions()
            n_parts = int(n_parts)
            per_part = max(1, messages // n_parts // 8192)
            session.dataSource.register(_handover_source(
                (files[0] or "").removeprefix("file://"), n_parts, per_part))

            def handover() -> float:
                df = session.read.format("tierstream-bench-handover").load()
                return per_part * 8192 * n_parts / timed(
                    lambda: df.write.format("noop").mode("overwrite").save())

            def native() -> float:
                df = session.read.parquet(*files)
                return messages / timed(lambda: df.write.format("noop").mode("overwrite")
                                        .save())

            for _ in range(warmups):  # JVM, Python workers
                ours("bench/spark/tiered"), native()
                hybrid("bench/spark/tiered"), handover()
            tiered, bookies, parquet, tiered_hybrid, ceiling = [], [], [], [], []
            for _ in range(runs):  # interleaved
                tiered_hybrid.append(hybrid("bench/spark/tiered"))
                tiered.append(ours("bench/spark/tiered"))
                bookies.append(ours("bench/spark/bookies"))
                parquet.append(native())
                ceiling.append(handover())
            # a 10% publish-time window, filtered by Spark after reading or pushed into
            # planning (a fresh DataFrame per query: see register())
            span_ms = entries * per_entry * 10
            where = (f"publish_time >= {_ts(T0 + span_ms * 45 // 100)} and "
                     f"publish_time < {_ts(T0 + span_ms * 55 // 100)}")
            in_window = partitions * (entries * per_entry // 10)

            def windowed() -> float:
                df = session.read.format("tierstream").option("topic", "bench/spark/window") \
                    .option("dataDir", data_dir) \
                    .option("endingPosition", cuts["bench/spark/window"]).load().where(where)
                return in_window / timed(lambda: df.write.format("noop").mode("overwrite")
                                         .save())

            messages = partitions * entries * per_entry
            pushed, filtered = [], []
            for _ in range(warmups):
                windowed()
            for _ in range(runs):
                filtered.append(windowed())
                session.conf.set(PUSHDOWN_CONF, "true")
                register(session)
                pushed.append(windowed())
                session.conf.unset(PUSHDOWN_CONF)
                register(session)
            # small splits packed into Spark tasks (the default) or one task per split
            def small(**extra: str) -> tuple[float, int]:
                reader = session.read.format("tierstream").option("topic", "bench/spark/small") \
                    .option("dataDir", data_dir).option("keyRanges", "4") \
                    .option("endingPosition", cuts["bench/spark/small"])
                for k, v in extra.items():
                    reader = reader.option(k, v)
                df = reader.load()
                tasks = int(df.rdd.getNumPartitions())
                rows = small_parts * small_entries * 10
                return rows / timed(lambda: df.write.format("noop").mode("overwrite")
                                        .save()), tasks

            unpacked_opt = {"minPartitions": "1000000"}
            for _ in range(warmups):
                small(), small(**unpacked_opt)
            packed_rates, unpacked_rates = [], []
            for _ in range(runs):
                rate, packed_tasks = small()
                packed_rates.append(rate)
                rate, unpacked_tasks = small(**unpacked_opt)
                unpacked_rates.append(rate)
            one: dict[int, list[float]] = {1: [], 2: [], 4: []}
            messages = entries * 2 * per_entry
            for _ in range(sized(5, 1)):  # interleaved: drift hits every k alike
                for k in one:
                    one[k].append(ours("bench/spark/one", keyRanges=str(k)))
        finally:
            session.stop()
    figures = [
        Figure("tierstream.spark_adapter.read rows/s, tiered data", "rows/s", tiered_hybrid,
               "spark.read.parquet, same files", parquet, aim="ratio >= 0.9",
               aim_check=lambda v, r: r is not None and r >= 0.9),
        Figure("Spark source rows/s, tiered data", "rows/s", tiered,
               "spark.read.parquet, same files", parquet, aim="ratio >= 0.5",
               aim_check=lambda v, r: r is not None and r >= 0.5),
        Figure("Spark backfill rows/s, bookie-resident data", "rows/s", bookies,
               "spark.read.parquet (tiered copy)", parquet, aim="ratio >= 0.8",
               aim_check=lambda v, r: r is not None and r >= 0.8),
        Figure("a Python data source that reads nothing (in-memory batches, same schema)",
               "rows/s", ceiling, "spark.read.parquet, same rows", parquet),
        Figure("Spark source rows/s, tiered data, vs the hand-over alone", "rows/s", tiered,
               "Python data source reading nothing", ceiling),
        Figure("Spark backfill rows/s, bookie-resident data, vs the hand-over alone",
               "rows/s", bookies, "Python data source reading nothing", ceiling),
        Figure("10% time window of 10 segments/partition, pushdown on (window rows/s)",
               "rows/s", pushed,
               "pushdown off (Spark filters)", filtered),
    ]
    figures.append(Figure(
        f"{small_parts * small_entries * 10:,} rows in {small_segment}-entry segments, "
        f"{small_parts} partitions, keyRanges=4: splits packed into "
        f"{packed_tasks} Spark tasks", "rows/s", packed_rates,
        f"one task per split ({unpacked_tasks} tasks)", unpacked_rates, aim="ratio >= 2",
        aim_check=lambda v, r: r is not None and r >= 2))
    for k, rates in one.items():
        figures.append(Figure(f"one partition, keyRanges={k} (bookie-resident)", "rows/s",
                              rates, "keyRanges=1", one[1],
                              **({"aim": "ratio >= 0.9",
                                  "aim_check": lambda v, r: r is not None and r >= 0.9}
                                 if k == 4 else {})))
    console.print(f"backfills: {partitions} partitions x {backfill_entries * per_entry:,} "
                  f"messages; window: {partitions} x {entries * per_entry:,}; noop sink; "
                  "local[*] on this machine")
    return report("spark", figures, {"partitions": partitions, "entries": entries,
                                     "backfill_entries": backfill_entries,
                                     "messages_per_entry": per_entry, "runs": runs})
