"""The parquet-tier reader on S3 (a moto server on loopback): requests per read, counted from
s3fs's own call log, and a file gone after planning. These are the reader's own requests, with
the host's tier cache off (tests/readers/test_tier_cache.py reads through it)."""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tierstream.broker.store import Store
from tierstream.enumerator import Enumerator, Query
from tierstream.errors import DataLossError
from tierstream.readers import open_reader, parquet_tier
from tierstream.splits.split import ReaderKind, Split, StreamCut

from ..store.test_tier import TOPIC, fill, make_store


@pytest.fixture(autouse=True)
def _no_tier_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTREAM_TIER_CACHE_SIZE", "0")


def _tier_split(store: Store) -> Split:
    cut = StreamCut.of(TOPIC, {p.partition: p.last_confirmed()[1]
                               for p in store.partitions(TOPIC)})
    with Enumerator(data_dir=store.config.data_dir,
                    s3_endpoint=store.config.s3_endpoint) as enum:
        (split,) = [s for s in enum.plan(Query(topics=(TOPIC,), end=cut))
                    if s.reader is ReaderKind.TIER]
    return split


def _calls(caplog: pytest.LogCaptureFixture, split: Split) -> tuple[int, list[str]]:
    """Rows read, and the S3 calls s3fs made for them."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="s3fs"):
        rows = sum(b.num_rows for b in open_reader(split))
    calls = [r.getMessage().split(" - ")[0].removeprefix("CALL: ") for r in caplog.records
             if r.name == "s3fs" and r.getMessage().startswith("CALL: ")]
    return rows, calls


def test_the_planned_file_size_spares_the_head_request(
        s3_store: Store, caplog: pytest.LogCaptureFixture) -> None:
    split = _tier_split(s3_store)
    assert split.tier_bytes == s3_store.tier.size(split.tier_url or "") > 0
    rows, calls = _calls(caplog, split)
    assert rows == 1000
    assert calls == ["get_object"]  # a small file: one GET of the whole object
    # a segment offloaded before sizes were recorded: a HEAD, then the same GET
    assert _calls(caplog, replace(split, tier_bytes=None)) == (1000, ["head_object",
                                                                     "get_object"])


def test_a_small_file_arrives_in_parallel_ranged_gets_put_together_in_order(
        s3_store: Store, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parquet_tier, "MIN_RANGE", 1024)  # a small test file, several ranges
    split = _tier_split(s3_store)
    assert split.tier_bytes is not None
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="s3fs"):
        got = pa.Table.from_batches(list(open_reader(split)))
    ranges = sorted((int(a), int(b)) for a, b in re.findall(
        r"'Range': 'bytes=(\d+)-(\d+)'", "\n".join(r.getMessage() for r in caplog.records
                                                   if r.name == "s3fs")))
    assert len(ranges) == parquet_tier.READ_AHEAD  # the file in READ_AHEAD parts at once
    assert ranges[0][0] == 0 and ranges[-1][1] == split.tier_bytes - 1
    assert all(b + 1 == c for (_, b), (c, _) in itertools.pairwise(ranges))  # no gap
    assert got.num_rows == 1000
    assert sorted(got.column("value").to_pylist()) == sorted(f"0-{i}".encode()
                                                             for i in range(1000))


def test_a_large_file_of_known_size_is_read_in_ranges_without_a_head(
        s3_store: Store, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parquet_tier, "SMALL_FILE", 0)  # every file is "large"
    rows, calls = _calls(caplog, _tier_split(s3_store))
    assert rows == 1000
    assert calls and set(calls) == {"get_object"}


@pytest.mark.parametrize("small", [True, False])
def test_a_tier_file_of_known_size_gone_after_planning_is_data_loss(
        s3_store: Store, small: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not small:
        monkeypatch.setattr(parquet_tier, "SMALL_FILE", 0)
    split = _tier_split(s3_store)
    s3_store.tier.delete(split.tier_url or "")
    with pytest.raises(DataLossError, match=rf"tier file of segment {split.segment_id} .* gone"):
        list(open_reader(split))


def test_a_large_file_is_fetched_once_not_once_per_read_ahead_worker(
        data_dir: Path, s3_bucket: str, moto_endpoint: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Row groups are read by up to READ_AHEAD threads, each with its own handle. With
    s3fs's default read-ahead cache, each handle fetched from its first read to the end of a
    50 MiB block: every worker the rest of the file (6.3x the file's bytes in bench
    remote-fs, 4.1x here)."""
    monkeypatch.setattr(parquet_tier, "SMALL_FILE", 0)  # every file is "large"
    store = make_store(data_dir, tierUrl=f"s3://{s3_bucket}/tier", s3Endpoint=moto_endpoint,
                       maxEntriesPerSegment=200)
    try:
        fill(store, entries=40, per_entry=500)
        store.seal(TOPIC)
        store.offloader.offload_topic(TOPIC)
        split = _tier_split(store)
        groups = pq.ParquetFile(s3_store_path(store, split)).metadata.num_row_groups
        assert groups > 2 * parquet_tier.READ_AHEAD  # several chunks: several workers
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="s3fs"):
            rows = sum(b.num_rows for b in open_reader(split))
        assert rows == 20_000
        fetched = 0
        for record in caplog.records:
            m = re.search(r"'Range': 'bytes=(\d+)-(\d+)'", record.getMessage())
            if record.name == "s3fs" and m:
                fetched += int(m.group(2)) - int(m.group(1)) + 1
        # 1.21x here: the footer read (64 KiB) overlaps the last row groups of this small
        # file; 4.1x before, when every worker fetched the rest of the file
        assert split.tier_bytes and fetched <= 1.5 * split.tier_bytes, (fetched,
                                                                       split.tier_bytes)
    finally:
        store.close()


def s3_store_path(store: Store, split: Split) -> Any:
    """The tier file of ``split``, opened through the store's own filesystem."""
    return store.tier.filesystem().open(store.tier.path(split.tier_url or ""), "rb")
