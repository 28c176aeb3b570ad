"""The hybrid batch read (tier splits on Spark's Parquet reader) returns exactly the rows of
the pure data-source read, over random logs, windows, cuts and key ranges."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tierstream.errors import DataLossError
from tierstream.model.positions import Position
from tierstream.spark_adapter import read
from tierstream.spark_adapter.hybrid import plan_read
from tierstream.spark_adapter.source import register
from tierstream.splits.split import ReaderKind, StreamCut

from ..logs import BASE, TOPIC, append, running_log

pytestmark = pytest.mark.spark

COLUMNS = ["topic", "partition", "key", "key_hash", "value", "publish_time", "event_time",
           "segment_id", "entry_id", "batch_index"]


def _rows(df: Any) -> list[tuple[Any, ...]]:
    rows = [tuple(r) for r in df.select(*COLUMNS).collect()]
    return sorted(rows, key=lambda r: (r[0], r[1], r[7], r[8], r[9]))  # by position


def _plan_text(df: Any) -> str:
    return str(df._jdf.queryExecution().executedPlan().toString())


def _random_log(log: Any, rng: random.Random) -> list[tuple[int, int, int]]:
    """Random appends to 1-3 partitions, some closed segments offloaded; every message's
    (partition, segment, entry) for picking cuts."""
    partitions = rng.randint(1, 3)
    log.store.create_topic(TOPIC, partitions)
    t = 0
    for _ in range(rng.randint(8, 20)):
        p = rng.randrange(partitions)
        n = rng.randint(1, 30)
        append(log.store, p, [f"{p}-{t + i}" for i in range(n)],
               keys=[rng.choice([None, *[f"k{j}" for j in range(40)]]) for _ in range(n)],
               times=[BASE + (t + i) * 1000 for i in range(n)])
        t += n
    for plog in log.store.partitions(TOPIC):
        closed = plog.closed_segments()
        for seg in closed[:rng.randint(0, len(closed))]:  # the oldest ones go to the tier
            log.store.offloader.offload_segment(plog, seg)
    return [(p.partition, s.segment_id, s.entries) for p in log.store.partitions(TOPIC)
            for s in p.segments()]


@pytest.mark.parametrize("seed", range(12))
def test_the_hybrid_read_returns_exactly_the_rows_of_the_source(spark: Any, tmp_path: Path,
                                                                seed: int) -> None:
    rng = random.Random(seed)
    with running_log(tmp_path / "data", maxEntriesPerSegment=rng.randint(1, 4)) as log:
        segments = _random_log(log, rng)
        options = {"topic": TOPIC, "dataDir": str(log.data_dir), "broker": log.url,
                   "keyRanges": str(rng.choice([1, 1, 2, 4])),
                   "maxSplitBytes": str(rng.choice([200, 10_000_000]))}
        if rng.random() < 0.5:
            options["startingTime"] = str(BASE + rng.randint(0, 200) * 1000)
        elif rng.random() < 0.7:  # a cut: a position inside some segment of each partition
            cut = {}
            for p in sorted({p for p, _, _ in segments}):
                p_segs = [(s, e) for q, s, e in segments if q == p and e]
                seg, entries = rng.choice(p_segs) if p_segs else (0, 0)
                cut[p] = Position(p, seg, rng.randint(0, max(0, entries - 1)),
                                  rng.randint(0, 3))
            options["startingPosition"] = StreamCut.of(TOPIC, cut).to_json()
        if rng.random() < 0.5:
            options["endingTime"] = str(BASE + rng.randint(150, 400) * 1000)
        elif "startingPosition" not in options and rng.random() < 0.7:
            # an end cut: inside a segment, or at its very end (for a tiered segment, the
            # hybrid read then drops the per-row end bound, knowing the file's last entry)
            end = {}
            for p in sorted({p for p, _, _ in segments}):
                p_segs = [(s, e) for q, s, e in segments if q == p and e]
                seg, entries = rng.choice(p_segs) if p_segs else (0, 0)
                end[p] = Position(p, seg, entries, 0) if rng.random() < 0.5 else Position(
                    p, seg, rng.randint(0, max(0, entries - 1)), rng.randint(0, 3))
            options["endingPosition"] = StreamCut.of(TOPIC, end).to_json()
        register(spark)
        try:
            expected = _rows(spark.read.format("tierstream").options(**options).load())
        except Exception as exc:  # a time start after the end cut: refused by both paths
            assert "before it starts" in str(exc), json.dumps(options)
            with pytest.raises(Exception, match="before it starts"):
                read(spark, **options)
            return
        hybrid = read(spark, **options)
        assert _rows(hybrid) == expected, json.dumps(options)
        source_schema = spark.read.format("tierstream").options(**options).load().schema
        assert hybrid.schema == source_schema  # names, types and nullability
        planned = plan_read(spark, options)  # the tier splits it plans go to Spark's reader
        tier = [s for s in planned.splits if s.reader is ReaderKind.TIER]
        assert planned.native == tier
        if tier:
            assert "parquet" in _plan_text(planned.df).lower()


def test_the_hybrid_read_takes_the_source_path_for_a_tier_spark_cannot_read(
        spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=2) as log:
        rng = random.Random(3)
        _random_log(log, rng)
        options = {"topic": TOPIC, "dataDir": str(log.data_dir), "broker": log.url,
                   "tierReader": "source"}
        df = read(spark, **options)
        assert "FileScan parquet" not in _plan_text(df)
        register(spark)
        plain = {k: v for k, v in options.items() if k != "tierReader"}
        assert _rows(df) == _rows(spark.read.format("tierstream").options(**plain).load())


def test_a_tier_file_removed_after_planning_is_a_clear_data_loss_error(
        spark: Any, tmp_path: Path) -> None:
    from tierstream.spark_adapter.jobs import query_error

    with running_log(tmp_path / "data", maxEntriesPerSegment=2) as log:
        log.store.create_topic(TOPIC, 1)
        for i in range(6):
            append(log.store, 0, [f"v{i}"], keys=[None], times=[BASE + i])
        plog = log.store.partitions(TOPIC)[0]
        moved = log.store.offloader.offload_segment(plog, plog.closed_segments()[0])
        df = read(spark, topic=TOPIC, dataDir=str(log.data_dir), broker=log.url)
        Path((moved.tier_url or "").removeprefix("file://")).unlink()
        with pytest.raises(Exception) as info:
            df.collect()
        error = query_error(info.value)
        assert isinstance(error, DataLossError) and "is gone" in str(error), error


@pytest.mark.parametrize(("entry", "bounded"), [(3, False), (2, True)])
def test_an_end_at_a_tier_files_last_entry_needs_no_per_row_bound(
        spark: Any, tmp_path: Path, entry: int, bounded: bool) -> None:
    """An end cut at the end of the partition's last tier file (entry 3 of a 3-entry
    segment) drops the end filter, known from the file's footer; one entry earlier keeps
    it. Both read exactly the source's rows."""
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        log.store.create_topic(TOPIC, 1)
        for i in range(7):
            append(log.store, 0, [f"v{i}-{j}" for j in range(4)], keys=[None] * 4,
                   times=[BASE + i * 10 + j for j in range(4)])
        plog = log.store.partitions(TOPIC)[0]
        first, second = plog.closed_segments()[:2]
        for seg in (first, second):
            log.store.offloader.offload_segment(plog, seg)
        options = {"topic": TOPIC, "dataDir": str(log.data_dir), "broker": log.url,
                   "endingPosition": StreamCut.of(
                       TOPIC, {0: Position(0, second.segment_id, entry, 0)}).to_json()}
        hybrid = read(spark, **options)
        register(spark)
        expected = _rows(spark.read.format("tierstream").options(**options).load())
        assert _rows(hybrid) == expected and len(expected) == 4 * (3 + entry)
        plan = _plan_text(hybrid)  # no time window: a pushed filter is the end bound
        assert ("PushedFilters: []" not in plan) is bounded, plan
