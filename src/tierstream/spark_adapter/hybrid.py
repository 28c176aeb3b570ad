"""``read(spark, **options)``: a bounded read that runs tier splits on Spark's own Parquet reader.

Most bytes of a historical backfill sit in the tier, which is Parquet: a format Spark reads
natively, several times faster than rows handed over by a Python data source. So the read is
planned once, here, with the enumerator; then

- the parquet-tier splits become one ``spark.read.parquet`` of their files, filtered by the
  plan's exact bounds (publish-time window and, for the segments at either end of a
  partition's range, positions) on the raw columns, so the filters push down to row groups;
  the key ranges of the plan together cover every key, so the union needs no key filter;
- every other split (bookie-log, tail-consumer) is read by the ``tierstream`` data source,
  given exactly those splits (option ``splits``);

and the two are unioned into the one declared schema. The result is the same multiset of rows
as ``spark.read.format("tierstream")`` with the same options (tests/spark_adapter/
test_hybrid.py compares them row for row).

Spark's reader is used only where Spark can read the files: a ``file://`` tier that this
driver sees, with a local master (executors elsewhere could not see it), or any tier with
``tierReader=native``. Otherwise (e.g. ``s3://`` without an S3 filesystem on Spark's
classpath, as with plain pyspark) the tier splits go through the data source too, and the
reason is logged once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any
from urllib.parse import urlparse

from tierstream.errors import DataLossError
from tierstream.model.positions import Position
from tierstream.splits.split import ReaderKind, Split, splits_to_json

__all__ = ["NATIVE", "Hybrid", "native_tier_reason", "plan_read", "read"]

log = logging.getLogger(__name__)

#: The tier files' own schema (schema.MESSAGE_SCHEMA) as Spark DDL: read as is, converted after.
_TIER_DDL = ("key string, key_hash int, value binary, publish_time bigint, event_time bigint, "
             "properties map<string,string>, partition int, segment_id bigint, entry_id bigint, "
             "batch_index int")

#: The path name of tier splits read by Spark's own Parquet reader (readers/stats.py).
NATIVE = "spark parquet reader"

_said: set[str] = set()


@dataclass(frozen=True)
class Hybrid:
    """A planned hybrid read: its DataFrame, every split of the plan, and which tier splits
    Spark's Parquet reader reads (the rest go through the data source)."""

    df: Any
    splits: list[Split]
    native: list[Split]


def read(spark: Any, **options: str) -> Any:
    """A DataFrame of the bounded read ``options`` (the source's option keys) with the
    declared schema (``SPARK_SCHEMA``): the same rows as ``spark.read.format("tierstream")``,
    tier splits on Spark's own Parquet reader where it can read them."""
    return plan_read(spark, options).df


def plan_read(spark: Any, options: dict[str, str], *, stats: Any = None) -> Hybrid:
    """:func:`read`, with the plan. ``stats``: a Spark accumulator of ReadStats that the
    data source's splits add to (readers/stats.py)."""
    from tierstream.read_options import ReadOptions
    from tierstream.spark_adapter.source import (
        _BatchReader,
        _classic_context,
        counting_format,
        register,
    )

    context = _classic_context(spark)
    if "minPartitions" not in options and context is not None:
        # small splits are packed into Spark tasks, but never into fewer than the cores
        options = {**options, "minPartitions": str(context.defaultParallelism)}
    settings = ReadOptions.parse(options)
    splits = _BatchReader(settings).plan()
    tier = [s for s in splits if s.reader is ReaderKind.TIER]
    why = native_tier_reason(spark, tier, settings.tier_reader)
    if settings.value_format == "auto" and tier:
        why = "valueFormat=auto decodes values in the tierstream source"
    if settings.partitioning == "key-ranges" and tier:
        why = ("partitioning=key-ranges reads each key's segments in order in one Spark "
               "partition, which Spark's Parquet reader does not")
    if why is not None:
        if tier and why not in _said:
            _said.add(why)
            log.warning("reading %d tier split(s) through the tierstream source, not Spark's "
                        "Parquet reader: %s", len(tier), why)
        tier = []
    rest = [s for s in splits if s.reader is not ReaderKind.TIER or not tier]
    if stats is not None:
        fmt = counting_format(spark, stats)
    else:
        register(spark)
        fmt = "tierstream"
    parts = []
    if rest or not tier:
        parts.append(spark.read.format(fmt).options(**options).option(
            "splits", splits_to_json(rest)).load())
    if tier:
        parts.append(_native(spark, tier, splits))
    return Hybrid(reduce(lambda a, b: a.unionByName(b), parts), splits, tier)


def native_tier_reason(spark: Any, tier: Sequence[Split], choice: str | None) -> str | None:
    """None when Spark's Parquet reader can read these tier splits' files, else why not."""
    if choice == "source":
        return "option tierReader=source"
    if choice == "native" or not tier:
        return None
    schemes = {urlparse(s.tier_url or "").scheme for s in tier}
    if schemes != {"file"}:
        return (f"the tier is on {', '.join(sorted(schemes))}://, which Spark reads only with "
                "that filesystem on its classpath (set tierReader=native if it has it)")
    master = spark.sparkContext.master
    if not master.startswith("local"):
        return (f"a file:// tier on a {master} cluster: executors on other hosts cannot see "
                "it (set tierReader=native if they share it)")
    missing = next((s.tier_url for s in tier
                    if not os.path.exists(urlparse(s.tier_url or "").path)), None)
    if missing is not None:
        return f"this host cannot see the tier file {missing}"
    return None


def _native(spark: Any, splits: list[Split], plan: list[Split]) -> Any:
    """The tier splits' rows through Spark's Parquet reader, converted to the source schema.
    Only the first and the last segment of a partition's plan can be read in part."""
    from pyspark.sql import functions as F

    ends: dict[tuple[str, int], tuple[int, int]] = {}
    for s in plan:
        key = (s.topic, s.partition)
        lo, hi = ends.get(key, (s.segment_id, s.segment_id))
        ends[key] = (min(lo, s.segment_id), max(hi, s.segment_id))

    by_file: dict[str, list[Split]] = {}
    for s in splits:
        by_file.setdefault(s.tier_url or "", []).append(s)
    paths = sorted(by_file)
    df = spark.read.schema(_TIER_DDL).option("recursiveFileLookup", "true").parquet(*paths)
    condition = None
    t0, t1 = splits[0].start_time, splits[0].end_time  # one window for the whole plan
    if t0 is not None:
        condition = F.col("publish_time") >= F.lit(t0)
    if t1 is not None:
        c = F.col("publish_time") < F.lit(t1)
        condition = c if condition is None else condition & c
    edges = [c for c in (_position_bounds(f, ends[(f[0].topic, f[0].partition)], url)
                         for url, f in by_file.items()) if c is not None]
    if edges:
        ids = [seg for seg, _ in edges]
        inside = ~F.col("segment_id").isin(ids)
        for _, c in edges:
            inside = inside | c
        condition = inside if condition is None else condition & inside
    if condition is not None:
        df = df.where(condition)
    topic = {s.segment_id: s.topic for s in splits}
    topics = set(topic.values())
    if len(topics) == 1:
        topic_col = F.lit(next(iter(topics)))
    else:  # segment ids are unique in a store: map each to its topic
        mapping = F.create_map(*[x for seg, t in sorted(topic.items())
                                 for x in (F.lit(seg), F.lit(t))])
        topic_col = mapping[F.col("segment_id")]
    def required(name: str, empty: Any) -> Any:
        # Spark reads every Parquet column as nullable; the declared schema (and an Iceberg
        # table made from the output) has these as required. Never null in a tier file, so
        # the coalesce only tells Spark so.
        return F.coalesce(F.col(name), F.lit(empty))

    return df.select(
        F.coalesce(topic_col, F.lit("")).alias("topic"), required("partition", 0).alias(
            "partition"), "key", required("key_hash", 0).alias("key_hash"),
        required("value", bytearray()).alias("value"),
        F.timestamp_millis(required("publish_time", 0)).alias("publish_time"),
        F.timestamp_millis("event_time").alias("event_time"),
        "properties", required("segment_id", 0).alias("segment_id"),
        required("entry_id", 0).alias("entry_id"),
        required("batch_index", 0).alias("batch_index"))


def _position_bounds(splits: list[Split], first_last: tuple[int, int], url: str
                     ) -> tuple[int, Any] | None:
    """(segment id, condition) when the plan may read only part of this segment's positions:
    its start bound if it is the partition's first segment, its end bound if the last (a
    segment in between is read whole: the time window alone bounds its rows)."""
    from pyspark.sql import functions as F

    seg = splits[0].segment_id
    start = min(s.start for s in splits)
    ends = [s.end for s in splits]
    end = None if any(e is None for e in ends) else max(e for e in ends if e is not None)
    whole_start = seg != first_last[0] or start == Position(start.partition, seg, 0, 0)
    whole_end = seg != first_last[1] or end is None or (
        end.batch_index == 0 and end.entry_id > _last_entry(url))
    if whole_start and whole_end:
        return None
    entry, index = F.col("entry_id"), F.col("batch_index")
    c = F.col("segment_id") == F.lit(seg)
    if not whole_start:
        c = c & ((entry > start.entry_id) | ((entry == start.entry_id) &
                                             (index >= start.batch_index)))
    if end is not None and not whole_end:
        c = c & ((entry < end.entry_id) | ((entry == end.entry_id) &
                                           (index < end.batch_index)))
    return seg, c


def _last_entry(url: str) -> float:
    """The last entry id in a tier file, from its footer's statistics, when this host sees the
    file (a read to the segment's end needs no per-row end bound); else infinity."""
    import pyarrow.parquet as pq

    from tierstream.readers.parquet_tier import leaf_column

    parsed = urlparse(url)
    if parsed.scheme != "file":
        return float("inf")
    try:
        meta = pq.read_metadata(parsed.path)
    except FileNotFoundError:  # gone: Spark's read fails with the clear error
        return float("inf")
    column = leaf_column(meta, "entry_id")
    last = -1
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(column).statistics
        if stats is None or not stats.has_min_max:
            return float("inf")
        last = max(last, stats.max)
    return last


def missing_tier_file(message: str) -> DataLossError | None:
    """Spark's error for a tier file removed after planning, as the reader's own error."""
    import re

    m = re.search(r"(?:FILE_NOT_EXIST|FileNotFoundException|does not exist)[^\n]*?"
                  r"(file:\S+?\.parquet)", message)
    if m is None:
        return None
    return DataLossError(f"data loss: the tier file {m.group(1)} is gone (deleted by retention "
                         "after planning?)")
