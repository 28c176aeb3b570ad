"""``spark.read.format("tierstream").option("compacted", "true")``: one row per live key (per
topic partition). The read is cut into key ranges (option ``keyRanges``, default the Spark
default parallelism's worth): each Spark partition reads the snapshots' rows of its keys and
the log's splits of its key range after the horizons, and folds them by the same rule as the
compactor (``model/compacted_view.py``). A key lives in one range, so no shuffle merges
anything.

A compacted stream (``spark.readStream ... .option("compacted", "true")``, ``stream.py``)
reads its first micro-batch this way, up to the cut the batch ends at — the topic's state
— and then the log after that cut as a changelog. A snapshot whose horizon is past the
batch's end (a compaction ran before Spark replayed the batch) is left out, and that
partition's log is folded from its start, so a replayed batch holds what it held."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import InputPartition

from tierstream.enumerator import Query
from tierstream.errors import ConfigError
from tierstream.model.compacted_view import fold_latest
from tierstream.model.message_format import MESSAGE_SCHEMA, with_topic
from tierstream.model.positions import KeyRange, Offset, OffsetKind
from tierstream.read_options import ReadOptions
from tierstream.readers.snapshot import read_snapshot
from tierstream.schemas.codec import Decoder, decode_batches
from tierstream.spark_adapter.partitions import spark_batches
from tierstream.splits.split import StreamCut, TierLocation, splits_from_json, splits_to_json

__all__ = ["check_compacted", "compacted_partitions", "is_compacted", "read_compacted",
           "spark_compacted"]

#: key ranges when keyRanges is left at 1: enough to spread a compacted read
DEFAULT_RANGES = 8


def check_compacted(s: ReadOptions) -> str:
    """The one topic a compacted read reads; ConfigError for a window or several topics."""
    if len(s.topics) != 1 or s.namespace is not None:
        raise ConfigError("option 'compacted' reads one topic (option 'topic')")
    if not (isinstance(s.start, Offset) and s.start.kind is OffsetKind.EARLIEST) or not (
            isinstance(s.end, Offset) and s.end.kind is OffsetKind.LATEST):
        raise ConfigError("option 'compacted' reads each key's latest value: give it no "
                          "startingPosition or endingPosition")
    return s.topics[0]


def compacted_partitions(s: ReadOptions, end: StreamCut | None = None
                         ) -> list[InputPartition]:
    """A Spark partition per key range of the one topic read, up to ``end`` (a stream's
    first micro-batch) or the latest position."""
    topic = check_compacted(s)
    k = s.key_ranges if s.key_ranges > 1 else DEFAULT_RANGES
    with s.enumerator() as enum:
        cut, snapshots = enum.compacted_start(topic, end=end)
        splits = list(enum.plan(Query(topics=(topic,), start=cut or Offset.earliest(),
                                      end=end or Offset.latest(), key_ranges=k,
                                      max_split_bytes=s.max_split_bytes,
                                      fail_on_data_loss=s.fail_on_data_loss)))
        location = enum.tier
    urls = [snap.url for _, snap in sorted(snapshots.items()) if snap.url is not None]
    out = []
    for key_range in KeyRange.split(k):
        mine = [x for x in splits if x.key_range == key_range]
        out.append(InputPartition(json.dumps({
            "topic": topic, "key_range": key_range.to_list(), "snapshots": urls,
            "s3_endpoint": location.s3_endpoint, "s3_region": location.s3_region,
            "splits": splits_to_json(mine) if mine else None})))
    return out


def is_compacted(partition: InputPartition) -> bool:
    """Whether a stream's partition is its compacted first micro-batch."""
    return isinstance(partition.value, str) and '"snapshots": ' in partition.value


def spark_compacted(options: ReadOptions, partition: InputPartition,
                    decoder: Decoder | None = None) -> Iterator[pa.RecordBatch]:
    """One key range's live keys as Spark batches (decoded when ``decoder``)."""
    batches = spark_batches(read_compacted(options, partition))
    if decoder is None:
        return batches
    return decode_batches(batches, decoder, options.mode, options.topics[0])


def read_compacted(options: ReadOptions, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """One key range's live keys (READ_SCHEMA batches)."""
    from tierstream.readers import open_reader

    job: dict[str, Any] = json.loads(partition.value)
    lo, hi = job["key_range"]
    location = TierLocation(s3_endpoint=job["s3_endpoint"], s3_region=job["s3_region"])
    tables = []
    for url in job["snapshots"]:
        rows = read_snapshot(url, location).select(MESSAGE_SCHEMA.names).cast(MESSAGE_SCHEMA)
        hashes = rows.column("key_hash")
        tables.append(rows.filter(pc.and_(pc.greater_equal(hashes, lo), pc.less(hashes, hi))))
    for split in splits_from_json(job["splits"]) if job["splits"] else []:
        for batch in open_reader(split, auth_token=options.auth_token, tls_ca=options.tls_ca,
                                 reconnect_timeout_ms=options.reconnect_timeout_ms,
                                 tier_cache=options.tier_cache):
            tables.append(pa.Table.from_batches([batch]).drop_columns(["topic"]))
    if not tables:
        return
    folded = fold_latest(pa.concat_tables(tables)).combine_chunks()
    for batch in folded.to_batches():
        yield with_topic(batch, job["topic"])
