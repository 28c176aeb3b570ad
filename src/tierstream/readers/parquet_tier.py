"""The parquet-tier reader: an offloaded segment from its Parquet file (pyarrow + fsspec).

It opens the footer, keeps only the row groups whose statistics (publish_time, key_hash,
entry_id) can hold rows of the split, and reads them in order. On a remote store it reads up
to ``READ_AHEAD`` row groups concurrently, so request latency overlaps decoding; memory stays
bounded by that many row groups.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tierstream.errors import DataLossError, NotFoundError
from tierstream.readers.trim import trim
from tierstream.schema import with_topic
from tierstream.splits.split import Split
from tierstream.store.tier import TierStorage

__all__ = ["READ_AHEAD", "leaf_column", "read_tier_split", "selected_row_groups"]

READ_AHEAD = 4


def leaf_column(meta: pq.FileMetaData, name: str) -> int:
    """The Parquet leaf column index of a top-level primitive column. Not the Arrow field
    index: the ``properties`` map expands into two leaf columns."""
    for i in range(meta.num_columns):
        if meta.schema.column(i).path == name:
            return i
    raise KeyError(f"no column {name!r} in the Parquet schema")


def selected_row_groups(meta: pq.FileMetaData, split: Split) -> list[int]:
    """Row groups that may hold rows of ``split``, judged by their min/max statistics."""
    kh, pt, en = (leaf_column(meta, c) for c in ("key_hash", "publish_time", "entry_id"))
    first_entry = split.start.entry_id
    last_entry = None if split.end is None else split.end.entry_id  # inclusive (batch_index)
    keep = []
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        k, t, e = (rg.column(c).statistics for c in (kh, pt, en))
        if k is not None and k.has_min_max and not split.key_range.is_full and (
                k.max < split.key_range.lo or k.min >= split.key_range.hi):
            continue
        if t is not None and t.has_min_max and (
                (split.start_time is not None and t.max < split.start_time)
                or (split.end_time is not None and t.min >= split.end_time)):
            continue
        if e is not None and e.has_min_max and (
                e.max < first_entry or (last_entry is not None and e.min > last_entry)):
            continue
        keep.append(i)
    return keep


def read_tier_split(split: Split) -> Iterator[pa.RecordBatch]:
    if split.tier_url is None:
        raise NotFoundError(f"split {split.split_id} has no tier URL")
    tier = TierStorage(url=split.tier_url, s3_endpoint=split.tier.s3_endpoint,
                       s3_region=split.tier.s3_region)
    fs = tier.filesystem()
    path = tier._path(split.tier_url)
    try:
        handle = fs.open(path, "rb")
    except FileNotFoundError:
        raise DataLossError(
            f"data loss in {split.topic!r} partition {split.partition}: the tier file of "
            f"segment {split.segment_id} ({split.tier_url}) is gone (deleted by retention "
            "after planning?)") from None
    with handle:
        meta = pq.ParquetFile(handle).metadata
        groups = selected_row_groups(meta, split)
        remote = tier.scheme != "file"
        for table in _row_groups(fs, path, handle, groups, remote):
            # a row group spans many entries and (in a bucket) several keys: always trim
            out = trim(table, split)
            for batch in out.to_batches():
                if batch.num_rows:
                    yield with_topic(batch, split.topic)


def _row_groups(fs: Any, path: str, handle: Any, groups: list[int], remote: bool
                ) -> Iterator[pa.Table]:
    if not remote or len(groups) <= 1:
        pf = pq.ParquetFile(handle)
        for i in groups:
            yield pf.read_row_group(i)
        return
    local = threading.local()

    def load(i: int) -> pa.Table:
        pf = getattr(local, "pf", None)
        if pf is None:  # one open file per worker thread: ParquetFile is not thread-safe
            local.pf = pf = pq.ParquetFile(fs.open(path, "rb"))
        return pf.read_row_group(i)

    with ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="tier-read") as pool:
        pending: deque[Future[pa.Table]] = deque()
        it = iter(groups)
        for i in it:
            pending.append(pool.submit(load, i))
            if len(pending) >= READ_AHEAD:
                break
        while pending:
            table = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(load, nxt))
            yield table
