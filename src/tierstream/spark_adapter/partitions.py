"""Spark partitions of a plan, and reading one: what the batch source (``source.py``) and
the stream (``stream.py``) share. A partition carries its split, or a chain of splits read in
log order, as JSON; reading it opens the reader where each split's data lives and hands
Spark batches of about :data:`SPARK_BATCH_ROWS` rows in the declared schema.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from tierstream.model.message_format import as_output_batch
from tierstream.model.positions import KeyRange, cut_entries
from tierstream.read_options import ReadOptions
from tierstream.readers.stats import ReadStats
from tierstream.schemas.codec import Decoder, decode_batches
from tierstream.splits.split import ReaderKind, Split, chains, splits_from_json, splits_to_json

__all__ = ["SPARK_BATCH_ROWS", "SPLIT_OPEN_COST", "by_entries", "packed", "partition_splits",
           "read_partition", "spark_batches", "spark_partitions"]

#: Rows per batch handed to Spark: readers yield what they decode (a tier row group can be
#: 1,024 rows), and Spark pays per batch, so small ones are joined up to this.
SPARK_BATCH_ROWS = 8192


def spark_batches(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Reader batches as Spark batches of about SPARK_BATCH_ROWS rows, in order."""
    pending: list[pa.RecordBatch] = []
    rows = 0
    for batch in batches:
        if batch.num_rows >= SPARK_BATCH_ROWS and not pending:
            yield as_output_batch(batch)
            continue
        pending.append(batch)
        rows += batch.num_rows
        if rows >= SPARK_BATCH_ROWS:
            yield as_output_batch(pa.concat_batches(pending))
            pending, rows = [], 0
    if pending:
        yield as_output_batch(pa.concat_batches(pending))


def read_partition(options: ReadOptions, partition: InputPartition, stats: Any = None,
                   decoder: Decoder | None = None) -> Iterator[pa.RecordBatch]:
    """One Spark partition's rows (batch or stream): its split, read where it lives. With
    ``stats`` (a Spark accumulator of ReadStats), what went which way is added to it; with
    ``decoder`` (valueFormat=auto), values are decoded as the declared schema says."""
    from tierstream.readers import open_reader

    if partition.value is None:  # Spark's stand-in when the plan has no split
        return
    counts = ReadStats() if stats is not None else None

    def batches() -> Iterator[pa.RecordBatch]:
        for split in partition_splits(partition.value):  # a chain: in log order
            yield from open_reader(split, auth_token=options.auth_token, tls_ca=options.tls_ca,
                                   reconnect_timeout_ms=options.reconnect_timeout_ms,
                                   stats=counts, tier_cache=options.tier_cache)

    if decoder is None:
        yield from spark_batches(batches())
    else:
        yield from decode_batches(spark_batches(batches()), decoder, options.mode,
                                  options.topics[0])
    if stats is not None:
        stats.add(counts)


def spark_partitions(splits: list[Split], partitioning: str, *,
                     max_bytes: int = 128 * 1024**2, min_partitions: int | None = None
                     ) -> list[InputPartition]:
    """Spark partitions of a plan: its splits packed into partitions of up to ``max_bytes``
    (``splits``, see :func:`packed`), or one per chain of splits of a (topic, partition, key
    range) in log order (``key-ranges``: every key in one Spark partition per topic partition,
    its messages in order; see splits.split.chains)."""
    if partitioning == "key-ranges":
        return [InputPartition(splits_to_json(chain)) for chain in chains(splits)]
    bins = packed(by_entries(splits), max_bytes, min_partitions or os.cpu_count() or 1)
    return [InputPartition(b[0].to_json() if len(b) == 1 else splits_to_json(b))
            for b in bins]


#: what opening a split costs, counted in bytes read (Spark's spark.sql.files.openCostInBytes)
SPLIT_OPEN_COST = 4 * 1024**2


def packed(splits: list[Split], max_bytes: int, min_partitions: int) -> list[list[Split]]:
    """The splits in groups that one Spark task reads in turn, as Spark packs small files:
    largest first, each group filled up to a target size counting every split
    :data:`SPLIT_OPEN_COST` more. The target is ``max_bytes``, or less when that would give
    fewer than ``min_partitions`` groups (the cores: a small read stays parallel). Each split
    keeps its reader; a group's splits are in log order."""
    if not splits:
        return []
    total = sum(s.estimated_bytes + SPLIT_OPEN_COST for s in splits)
    target = min(max_bytes, max(SPLIT_OPEN_COST, total // min_partitions))
    bins: list[list[Split]] = []
    current: list[Split] = []
    size = 0
    for split in sorted(splits, key=lambda s: s.estimated_bytes, reverse=True):
        if current and size + split.estimated_bytes > target:
            bins.append(current)
            current, size = [], 0
        current.append(split)
        size += split.estimated_bytes + SPLIT_OPEN_COST
    bins.append(current)
    return [sorted(b, key=lambda s: (s.topic, s.partition, s.start)) for b in bins]


def by_entries(splits: list[Split]) -> list[Split]:
    """The plan with the key ranges of each bookie chunk made entry ranges of it.

    A key-range split of a bookie chunk reads and verifies every entry of it (the ledger is in
    log order, not by key), so its k key ranges cost k whole reads. With one Spark partition
    per split, nothing asks that a partition hold whole keys: k entry ranges of the chunk,
    each with every key, give the same parallelism for one read of the chunk in total. Only
    chunks whose ranges are all in the plan and together every key are cut; the rest (tier
    files, whose key buckets make a range read cheap; the open segment) stay as planned."""
    members: dict[Split, list[Split]] = {}
    for split in splits:
        if split.reader is ReaderKind.BOOKIE and split.end is not None:
            members.setdefault(split.whole(), []).append(split)
    out: list[Split] = []
    for split in splits:
        whole = split.whole()
        group = members.get(whole)
        if group is None or len(group) < 2 or not KeyRange.tile([s.key_range for s in group]):
            out.append(split)
        elif group[0] is split:  # the chunk's first range stands for all of them
            assert whole.end is not None
            pieces = cut_entries(whole.start, whole.end, len(group))
            out.extend(replace(whole, start=a, end=b,
                               estimated_bytes=sum(s.estimated_bytes for s in group)
                               // len(pieces)) for a, b in pieces)
    return out


def partition_splits(value: str) -> list[Split]:
    """The splits of one Spark partition's value: one split, or a chain (a JSON list)."""
    if value.startswith("["):
        return splits_from_json(value, what="Spark partition")
    return [Split.from_json(value)]
