"""Row-group selection of the parquet-tier reader against a brute-force check, on a real file
written by the tier: every row group with a row of the split is kept, and groups whose
statistics rule them out are skipped."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tierstream.model.message_format import MESSAGE_SCHEMA, key_hashes
from tierstream.model.positions import KeyRange, Position
from tierstream.readers.parquet_tier import selected_row_groups
from tierstream.readers.trim import trim
from tierstream.splits.split import ReaderKind, Split
from tierstream.tier.storage import TierStorage


@pytest.fixture(scope="module")
def tier_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, pa.Table]:
    n = 4000
    keys = pa.array([f"k{i % 37}" for i in range(n)], pa.string())
    rows = pa.table({
        "key": keys, "key_hash": key_hashes(keys), "value": [b"v"] * n,
        "publish_time": pa.array(range(1000, 1000 + n), pa.int64()),
        "event_time": pa.nulls(n, pa.int64()),
        "properties": pa.nulls(n, MESSAGE_SCHEMA.field("properties").type),
        "partition": pa.array([0] * n, pa.int32()),
        "segment_id": pa.array([5] * n, pa.int64()),
        "entry_id": pa.array([i // 10 for i in range(n)], pa.int64()),
        "batch_index": pa.array([i % 10 for i in range(n)], pa.int32())}, schema=MESSAGE_SCHEMA)
    root: Path = tmp_path_factory.mktemp("tier")
    tier = TierStorage.from_location(str(root))
    url = tier.segment_url(__import__("tierstream").TopicName.parse("a/b/c"), 0, 5)
    tier.write_segment(url, rows)
    return tier.path(url), rows


@pytest.mark.parametrize(("start", "end", "key_range", "t0", "t1"), [
    (0, None, KeyRange.full(), None, None),
    (0, None, KeyRange(0, 16384), None, None),
    (100, 150, KeyRange.full(), None, None),
    (0, None, KeyRange.full(), 2000, 2100),
    (50, 300, KeyRange(32768, 49152), 1500, 3500),
])
def test_selected_row_groups_keep_every_group_with_a_row_of_the_split(
        tier_file: tuple[str, pa.Table], start: int, end: int | None, key_range: KeyRange,
        t0: int | None, t1: int | None) -> None:
    path, _ = tier_file
    split = Split(topic="a/b/c", partition=0, segment_id=5, start=Position(0, 5, start, 0),
                  end=None if end is None else Position(0, 5, end, 0),
                  reader=ReaderKind.TIER, key_range=key_range, start_time=t0, end_time=t1)
    pf = pq.ParquetFile(path)
    chosen = set(selected_row_groups(pf.metadata, split))
    needed = {g for g in range(pf.num_row_groups)
              if trim(pf.read_row_group(g), split).num_rows}
    assert needed <= chosen  # nothing of the split is skipped
    if not key_range.is_full:
        # key-bucket files (the default layout) group rows by key hash: a key range skips
        # the other buckets. In this small file each bucket is one row group spanning the
        # whole segment (a bucket is cut into time-ordered groups of >= 1,024 rows only in
        # larger files), so time and position bounds alone prune nothing here.
        assert len(chosen) < pf.num_row_groups
    assert pc.sum(pa.array([pf.metadata.row_group(g).num_rows for g in chosen])).as_py() > 0
