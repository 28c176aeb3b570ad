"""Tiered storage: offload to Parquet (file:// and S3 via moto), Iceberg, crashes, retention.

These run the real store in-process (real files, SQLite, Parquet, Iceberg); the broker-process
tests of the same features are in test_tier_broker.py.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.broker.topics.offload import FAULT_POINTS, Offloader
from tierstream.errors import AuthError, ConfigError, NotFoundError, UnavailableError
from tierstream.model.message_format import MESSAGE_SCHEMA, as_produce_batch
from tierstream.model.names import TopicName
from tierstream.readers.parquet_tier import leaf_column
from tierstream.tier.storage import KEY_BUCKETS, TierStorage

TOPIC = "acme/web/clicks"
BASE = 1_793_491_200_000  # 2026-11-01T00:00:00Z


def make_store(data_dir: Path, **options: Any) -> Store:
    # no background tier pass: these tests drive the offloader with their own clock
    opts = {"dataDir": str(data_dir), "maxEntriesPerSegment": 10, "deletionLag": "0s",
            "fsync": False, "tierCheckInterval": "1h", **options}
    return Store(StoreConfig.from_options(opts))


def fill(store: Store, entries: int = 35, per_entry: int = 100, partitions: int = 1) -> None:
    store.create_topic(TOPIC, partitions)
    for p in range(partitions):
        plog = store.partition(TOPIC, p)
        for e in range(entries):
            n0 = e * per_entry
            plog.append(as_produce_batch(pa.record_batch({
                "key": [f"user-{(n0 + j) % 37}" for j in range(per_entry)],
                "value": [f"{p}-{n0 + j}".encode() for j in range(per_entry)],
                "publish_time": [BASE + (n0 + j) * 1000 for j in range(per_entry)],
            })), producer=None, sequence_id=None)


def everything(store: Store) -> pa.Table:
    batches = []
    for plog in store.partitions(TOPIC):
        plog._entry_cache.clear()  # read from where the data is, not from memory
        plog._entry_cache_bytes = 0
        batches.extend(plog.read(plog.earliest(), end=plog.last_confirmed()[1]))
    return pa.Table.from_batches(batches, MESSAGE_SCHEMA)


def content_hash(table: pa.Table) -> str:
    rows = sorted(table.to_pylist(), key=lambda r: (r["partition"], r["segment_id"],
                                                    r["entry_id"], r["batch_index"]))
    return hashlib.sha256(repr(rows).encode()).hexdigest()


@pytest.fixture(params=["file", "s3"])
def tier_options(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "file":
        return {}
    bucket = request.getfixturevalue("s3_bucket")
    return {"tierUrl": f"s3://{bucket}/tier", "s3Endpoint":
            request.getfixturevalue("moto_endpoint")}


@pytest.fixture
def store(data_dir: Path, tier_options: dict[str, Any]) -> Iterator[Store]:
    s = make_store(data_dir, **tier_options)
    yield s
    s.close()


def test_parquet_file_equals_the_bookie_copy(store: Store) -> None:
    fill(store)
    bookie_copy = everything(store)
    moved = store.offloader.offload_topic(TOPIC)
    assert [s.segment_id for s in moved] == [1, 2, 3]
    tier_rows = pa.concat_tables([store.tier.read_segment(s.tier_url) for s in moved
                                  if s.tier_url is not None])
    from_bookies = bookie_copy.filter(pa.compute.is_in(bookie_copy.column("segment_id"),
                                                       pa.array([1, 2, 3], pa.int64())))
    assert tier_rows.num_rows == from_bookies.num_rows == 3000
    assert content_hash(tier_rows) == content_hash(from_bookies)
    # after the bookie copies are gone, the store reads the same log from the tier
    assert all(s.bookie_deleted_at is not None
               for s in store.partition(TOPIC, 0).closed_segments())
    assert content_hash(everything(store)) == content_hash(bookie_copy)


def test_tier_files_carry_statistics_for_time_and_key_pruning(store: Store) -> None:
    fill(store, entries=10, per_entry=2000)
    (seg,) = store.offloader.offload_topic(TOPIC)
    assert seg.tier_url is not None
    fs = store.tier.filesystem()
    meta = pq.ParquetFile(store.tier.path(seg.tier_url), filesystem=fs).metadata
    assert meta.num_row_groups >= KEY_BUCKETS
    for rg in range(meta.num_row_groups):
        group = meta.row_group(rg)
        for column in ("publish_time", "key_hash", "entry_id"):
            stats = group.column(leaf_column(meta, column)).statistics
            assert stats is not None and stats.has_min_max
        kh = group.column(leaf_column(meta, "key_hash")).statistics
        assert kh.min // 4096 == kh.max // 4096, "a row group spans two key buckets"
        assert group.column(0).compression == "ZSTD"


@pytest.mark.parametrize("fault", FAULT_POINTS)
def test_a_crash_between_any_two_steps_loses_and_duplicates_nothing(
        data_dir: Path, tier_options: dict[str, Any], fault: str) -> None:
    store = make_store(data_dir, **tier_options)
    fill(store)
    before = content_hash(everything(store))

    def crash(point: str) -> None:
        if point == fault:
            raise RuntimeError(f"injected crash at {point}")

    store._offloader = Offloader(store, store.tier, store.offloader.catalog, deletion_lag_ms=0,
                                 fault=crash)
    with pytest.raises(RuntimeError, match="injected crash"):
        store.offloader.offload_topic(TOPIC)
    store.close()  # the crashed process is gone; a new one re-runs the offloader

    store = make_store(data_dir, **tier_options)
    try:
        store.offloader.offload_topic(TOPIC)
        assert content_hash(everything(store)) == before, "messages lost or changed"
        segs = store.partition(TOPIC, 0).closed_segments()
        assert all(s.tier_url is not None and s.bookie_deleted_at is not None for s in segs)
        registered = store.offloader.catalog.registered_files(TopicName.parse(TOPIC))
        assert len(registered) == len(set(registered)) == len(segs), "a file registered twice"
        assert set(registered) == {s.tier_url for s in segs}
        # no orphan: every data file in the tier is the current location of one segment
        fs = store.tier.filesystem()
        root = store.tier.path(store.tier.url) + "/acme"
        files = {f for f in fs.find(root) if f.endswith(".parquet")}
        assert files == {store.tier.path(u) for u in registered}
    finally:
        store.close()


def test_a_topic_table_stays_small_as_segments_are_registered(
        data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstream.tier.catalog as catalog_module

    monkeypatch.setattr(catalog_module, "KEEP_SNAPSHOTS", 3)
    store = make_store(data_dir)
    try:
        fill(store, entries=205, per_entry=10)  # 20 closed segments
        catalog = store.offloader.catalog
        ident = catalog_module.iceberg_identifier(TopicName.parse(TOPIC))
        catalog._catalog.create_namespace_if_not_exists(ident[:2])
        catalog._catalog.create_table(ident, schema=MESSAGE_SCHEMA)  # as an older version did
        store.offloader.offload_topic(TOPIC)
        table = catalog.table(TopicName.parse(TOPIC))
        assert all(table.properties.get(k) == v
                   for k, v in catalog_module.TABLE_PROPERTIES.items())
        segs = store.partition(TOPIC, 0).closed_segments()
        assert len(segs) == 20
        assert sorted(catalog.registered_files(TopicName.parse(TOPIC))) == sorted(
            s.tier_url for s in segs)
        assert table.scan().to_arrow().num_rows == sum(s.messages for s in segs)
        snapshots = table.metadata.snapshots
        assert 3 <= len(snapshots) <= 6  # trimmed back to 3 whenever it passed 6
        metadata_dir = Path(table.location().removeprefix("file://")) / "metadata"
        lists = {p.name for p in metadata_dir.glob("snap-*.avro")}
        assert lists == {Path(s.manifest_list).name for s in snapshots}  # expired ones gone
        versions = [int(p.name.split("-")[0]) for p in metadata_dir.glob("*.metadata.json")]
        # 20 kept + the current one + the first, written before the properties were set
        assert len(versions) <= 22 < max(versions)
        assert len(table.current_snapshot().manifests(table.io)) <= 16  # merged
        # a retry of a registered file adds nothing
        assert not catalog.register(TopicName.parse(TOPIC), segs[0].tier_url)
    finally:
        store.close()


def test_pyiceberg_scan_with_a_time_filter_returns_exactly_the_window(store: Store) -> None:
    from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan

    fill(store)
    store.offloader.offload_topic(TOPIC)
    table = store.offloader.catalog.table(TopicName.parse(TOPIC))
    lo, hi = BASE + 1234 * 1000, BASE + 2345 * 1000
    scanned = table.scan(row_filter=And(GreaterThanOrEqual("publish_time", lo),
                                        LessThan("publish_time", hi))).to_arrow()
    values = sorted(int(v.split(b"-")[1]) for v in scanned.column("value").to_pylist())
    assert values == list(range(1234, 2345))


@pytest.mark.spark
def test_spark_reads_the_tier_files(data_dir: Path, spark: Any) -> None:
    store = make_store(data_dir)
    try:
        fill(store)
        moved = store.offloader.offload_topic(TOPIC)
        paths = [s.tier_url for s in moved]
        df = spark.read.parquet(*paths)
        assert df.count() == 3000
        assert df.schema.fieldNames() == MESSAGE_SCHEMA.names
        assert df.selectExpr("min(publish_time)").first()[0] == BASE
    finally:
        store.close()


def test_bookie_copies_stay_until_the_deletion_lag_has_passed(data_dir: Path) -> None:
    store = make_store(data_dir, deletionLag="1h")
    try:
        fill(store)
        moved = store.offloader.offload_topic(TOPIC)
        offloaded_at = min(s.offloaded_at or 0 for s in moved)
        plog = store.partition(TOPIC, 0)
        counts = store.offloader.run_policies(offload_after_ms=None, threshold_bytes=None,
                                              now=offloaded_at + 3_600_000 - 1)
        assert counts["bookie_copies_deleted"] == 0
        assert all(s.bookie_deleted_at is None for s in plog.closed_segments())
        assert all(store.bookies["bookie-0"].index(s.segment_id) for s in moved)
        counts = store.offloader.run_policies(offload_after_ms=None, threshold_bytes=None,
                                              now=max(s.offloaded_at or 0 for s in moved)
                                              + 3_600_000)
        assert counts["bookie_copies_deleted"] == 3
        with pytest.raises(NotFoundError):
            store.bookies["bookie-0"].index(moved[0].segment_id)
    finally:
        store.close()


def test_retention_deletes_everywhere_and_records_what_it_removed(store: Store) -> None:
    fill(store)
    store.offloader.offload_topic(TOPIC, older_than_ms=None)
    store.set_retention(TOPIC, 1_000)
    now = BASE + 2_500 * 1000  # segments 1 (0..999 s) and 2 (1000..1999 s) are past it
    removed = store.offloader.apply_retention(TOPIC, now=now)
    assert [r["segment_id"] for r in removed] == [1, 2]
    deleted = store.metadata.deleted_segments(TOPIC)
    assert [(d["segment_id"], d["messages"], d["reason"]) for d in deleted] == [
        (1, 1000, "retention"), (2, 1000, "retention")]
    assert [s.segment_id for s in store.partition(TOPIC, 0).closed_segments()] == [3]
    registered = store.offloader.catalog.registered_files(TopicName.parse(TOPIC))
    assert len(registered) == 1 and "/3-" in registered[0]
    remaining = everything(store)
    assert sorted(remaining.column("segment_id").unique().to_pylist()) == [3, 4]
    # a read of the deleted past fails naming the switch in each place a user sets it
    import tierstream
    from tierstream.errors import DataLossError

    with pytest.raises(DataLossError) as lost:
        tierstream.plan(TOPIC, start=BASE, end=BASE + 3_000_000,
                        data_dir=str(store.config.data_dir))
    for spelling in ("failOnDataLoss=false", "fail_on_data_loss=False", "--skip-data-loss"):
        assert spelling in str(lost.value)


def test_policy_offloads_by_age_and_by_bookie_bytes(data_dir: Path) -> None:
    store = make_store(data_dir, deletionLag="1h")
    try:
        fill(store)
        segs = store.partition(TOPIC, 0).closed_segments()
        counts = store.offloader.run_policies(offload_after_ms=1_000_000, threshold_bytes=None,
                                              now=segs[0].max_publish_time + 1_000_001)
        assert counts["offloaded"] == 1  # only the first segment is old enough
        total = sum(s.bytes for s in store.partition(TOPIC, 0).segments()
                    if s.tier_url is None)
        counts = store.offloader.run_policies(offload_after_ms=None,
                                              threshold_bytes=total - 1, now=BASE)
        assert counts["offloaded"] == 1  # the oldest remaining one brings it under
        located = [s.location for s in store.partition(TOPIC, 0).segments()]
        assert located == ["tier", "tier", "bookies", "open"]
    finally:
        store.close()


def test_a_bad_tier_is_a_clear_error_and_the_segment_stays_in_bookies(
        data_dir: Path, moto_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"tierUrl": f"s3://no-such-bucket-{s3_bucket}/t", "s3Endpoint": moto_endpoint},
         NotFoundError, "does not exist"),
        ({"tierUrl": f"s3://{s3_bucket}/t", "s3Endpoint": dead}, UnavailableError,
         "unreachable"),
    ]
    for options, error, needle in cases:
        store = make_store(data_dir, **options)
        try:
            if not store.metadata.list_topics():
                fill(store)
            before = content_hash(everything(store))
            with pytest.raises(error, match=needle):
                store.offloader.offload_topic(TOPIC)
            assert all(s.tier_url is None for s in store.partition(TOPIC, 0).closed_segments())
            assert content_hash(everything(store)) == before
        finally:
            store.close()
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(data_dir / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(data_dir / "none"))
    store = make_store(data_dir, tierUrl=f"s3://{s3_bucket}/t", s3Endpoint=moto_endpoint)
    try:
        with pytest.raises(AuthError, match="no credentials"):
            store.offloader.offload_topic(TOPIC)
        assert all(s.tier_url is None for s in store.partition(TOPIC, 0).closed_segments())
    finally:
        store.close()


@pytest.mark.parametrize(("url", "needle"), [
    ("ftp://host/tier", "expected file:///path or s3://bucket/prefix"),
    ("s3:///no-bucket", "no bucket"),
    ("gs://bucket/x", "invalid tier URL 'gs://bucket/x'"),
])
def test_a_misconfigured_tier_url_is_rejected_naming_it(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        TierStorage.from_location(url)


def test_a_plain_path_becomes_a_file_url(tmp_path: Path) -> None:
    assert TierStorage.from_location(str(tmp_path / "t")).url == (tmp_path / "t").as_uri()
    with pytest.raises(ConfigError, match="invalid tier layout"):
        TierStorage.from_location(str(tmp_path), layout="random")


def test_retention_of_a_compacted_topic_removes_only_what_a_snapshot_covers(
        store: Store) -> None:
    from tierstream.broker.topics.compaction import Compactor
    from tierstream.metadata.compactions import compactions_of, set_compaction_threshold
    from tierstream.model.compacted_view import fold_latest

    store.create_topic(TOPIC, 1)
    plog = store.partition(TOPIC, 0)
    for e in range(35):  # 35 entries, 10 per segment: keys old-0..9 only in the first
        keys = [f"old-{j}" for j in range(10)] if e == 0 else ["hot"] * 10
        plog.append(as_produce_batch(pa.record_batch({
            "key": keys, "value": [f"{e}-{j}".encode() for j in range(10)],
            "publish_time": [BASE + (e * 10 + j) * 1000 for j in range(10)]})),
            producer=None, sequence_id=None)
    store.set_retention(TOPIC, 1_000)
    set_compaction_threshold(store.metadata, TOPIC, 1 << 30)  # a compacted topic
    later = BASE + 10_000_000
    view = {r["key"]: r["value"] for r in fold_latest(everything(store)).to_pylist()}
    assert store.offloader.apply_retention(TOPIC, now=later) == []  # no snapshot covers it
    Compactor(store).start(TOPIC, wait=True)
    horizon = compactions_of(store.metadata, TOPIC)[0].horizon
    removed = store.offloader.apply_retention(TOPIC, now=later)
    assert removed and all(r["segment_id"] < horizon.segment_id for r in removed)
    snapshot = pq.read_table(store.tier.path(compactions_of(store.metadata, TOPIC)[0].url),
                             filesystem=store.tier.filesystem())
    after = everything(store)  # the log after the horizon, folded over the snapshot
    rows = pa.concat_tables([snapshot.select(MESSAGE_SCHEMA.names).cast(MESSAGE_SCHEMA),
                             after.filter(pa.compute.greater_equal(
                                 after.column("segment_id"), horizon.segment_id))])
    assert {r["key"]: r["value"] for r in fold_latest(rows).to_pylist()} == view
