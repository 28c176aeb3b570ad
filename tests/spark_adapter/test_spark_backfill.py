"""The backfill job: Parquet files or an Iceberg table, all or nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tierstream as ts
from tierstream.errors import ConfigError, UnavailableError
from tierstream.spark_adapter.jobs import backfill

from ..logs import BASE, TOPIC, append, running_log

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Closed bookie segments, some offloaded, and an open tail, over 2 partitions."""
    with running_log(tmp_path_factory.mktemp("backfill") / "data",
                     maxEntriesPerSegment=3) as log:
        log.store.create_topic(TOPIC, 2)
        for i in range(10):
            for p in range(2):
                append(log.store, p, [f"{p}-{i}-{j}" for j in range(50)],
                       keys=[f"user-{j % 7}" for j in range(50)],
                       times=[BASE + (i * 100 + p * 50 + j) * 1000 for j in range(50)])
        off = log.store.offloader
        for plog in log.store.partitions(TOPIC):
            off.offload_segment(plog, plog.closed_segments()[0])
        yield log


def _options(log: Any, **more: str) -> dict[str, str]:
    return {"topic": TOPIC, "dataDir": str(log.data_dir), "broker": log.url, **more}


def _values(table: pa.Table) -> list[str]:
    return sorted(v.decode() for v in table.column("value").to_pylist())


def test_parquet_and_iceberg_hold_what_the_local_runner_reads(spark: Any, log: Any,
                                                              tmp_path: Path) -> None:
    window = {"startingTime": str(BASE + 150_000), "endingTime": str(BASE + 950_000)}
    truth = _values(ts.read(TOPIC, start=BASE + 150_000, end=BASE + 950_000, **log.kw()))
    assert len(truth) == 800

    seen: list[tuple[int, int]] = []
    files = backfill(spark, _options(log, **window), str(tmp_path / "files"),
                     progress=lambda done, total: seen.append((done, total)))
    assert files.rows == 800 and files.format == "parquet" and files.table is None
    # the job's progress watcher is stopped and joined when it ends (its owner: jobs.py)
    assert "tierstream-spark-progress" not in {t.name for t in threading.enumerate()}
    assert _values(pq.read_table(tmp_path / "files")) == truth
    assert files.bytes_read > 0 and files.bytes_written == sum(
        f.stat().st_size for f in (tmp_path / "files").glob("*.parquet"))
    assert set(files.splits_by_reader) == {"parquet-tier", "bookie-log", "tail-consumer"}

    out = tmp_path / "lake"
    result = backfill(spark, _options(log, **window), str(out), format="iceberg")
    assert result.rows == 800 and result.table == "backfill.acme_web_clicks"
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.expressions import GreaterThanOrEqual

    table = SqlCatalog("default", uri=result.catalog_uri).load_table(result.table)
    assert table.location() == f"file://{out}"
    assert _values(table.scan().to_arrow()) == truth
    assert table.current_snapshot().summary["total-records"] == "800"
    fields = {f.name: str(f.field_type) for f in table.schema().fields}
    assert fields["publish_time"] == "timestamptz" and fields["properties"].startswith("map")
    late = table.scan(row_filter=GreaterThanOrEqual(
        "publish_time", "2026-11-01T00:10:00+00:00")).to_arrow()  # BASE + 600 s
    assert _values(late) == _values(ts.read(TOPIC, start=BASE + 600_000, end=BASE + 950_000,
                                            **log.kw()))
    assert sorted(p.name for p in (out / "data").iterdir()) == sorted(
        p.name for p in (out / "data").glob("*.parquet"))  # no Hadoop markers in a table


def test_a_failed_backfill_leaves_nothing(spark: Any, log: Any, tmp_path: Path) -> None:
    # planned without a broker (the end is a cut), then the tail split cannot be read
    cut = ts.latest_cut(TOPIC, **log.kw())
    for fmt in ("parquet", "iceberg"):
        out = tmp_path / fmt
        with pytest.raises(UnavailableError, match="stayed unavailable for 1s") as info:
            backfill(spark, _options(log, broker="grpc://127.0.0.1:1", reconnectTimeout="1s",
                                     endingPosition=json.dumps(cut.to_dict())),
                     str(out), format=fmt)
        assert "\n" not in str(info.value)  # the error at the root, not Spark's pages of trace
        assert not out.exists()


def test_bad_backfill_requests_fail_before_spark_runs(spark: Any, log: Any,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "x"
    for kwargs, needle in [
        ({"format": "csv"}, "invalid --format 'csv'"),  # as the CLI names it
        ({"format": "iceberg", "table": "flat"}, "invalid table 'flat'"),
        ({"table": "a.b"}, "for --format iceberg only"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            backfill(spark, _options(log), str(out), **kwargs)
        assert not out.exists()
    catalog = f"sqlite:///{tmp_path / 'shared.db'}"
    backfill(spark, _options(log, endingTime=str(BASE + 100_000)), str(tmp_path / "one"),
             format="iceberg", table="lake.clicks", catalog_uri=catalog)
    with pytest.raises(ConfigError, match=r"Iceberg table 'lake\.clicks' exists"):
        backfill(spark, _options(log), str(out), format="iceberg", table="lake.clicks",
                 catalog_uri=catalog)
    assert not out.exists()
