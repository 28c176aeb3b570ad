"""Benchmarks of the tier (issue 3): offload throughput, bytes on disk, and the row layout.

The layout figures are computed from the Parquet footers with the pruning a tier reader does
(skip a row group whose publish_time or key_hash range misses the query): exactly the bytes a
read must fetch, per layout, for the same segment.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bench.harness import Figure, console, fill_clicks, report, sized, timed
from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.model.names import TopicName
from tierstream.model.positions import KeyRange, Position
from tierstream.readers.parquet_tier import selected_row_groups
from tierstream.splits.split import ReaderKind, Split
from tierstream.tier.storage import TierStorage

TOPIC = "bench/tier/t"
BASE = 1_793_491_200_000


def _store(root: Path, entries: int, per_entry: int, keys: int, **options: Any) -> Store:
    store = Store(StoreConfig.from_options({
        "dataDir": str(root), "maxEntriesPerSegment": entries, "deletionLag": "1h",
        **options}))
    # ~100-byte JSON clicks with a random-looking session id, so compression is realistic
    # rather than flattered by padding
    fill_clicks(store, TOPIC, partitions=1, entries=entries, per_entry=per_entry, t0=BASE,
                keys=keys, seal=False, value=lambda n, p: (
                    f'{{"n":{n},"page":"/p/{n % 50}","session":"'
                    f'{hashlib.blake2b(str(n // 20).encode(), digest_size=16).hexdigest()}'
                    f'","ua":"Mozilla/5.0"}}').encode())
    return store


def offload(quick: bool = True) -> Path:
    """MB/s of segment (bookie) bytes offloaded, to file:// and to a moto S3 server."""
    entries, per_entry, runs = sized((50, 2000, 3) if quick else (100, 5000, 5), (5, 100, 1))
    figures: list[Figure] = []
    sizes: dict[str, Any] = {}
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    try:
        for target in ("file", "s3"):
            ours, baseline = [], []
            for run in range(runs + 1):  # the first run warms up
                with tempfile.TemporaryDirectory() as tmp:
                    opts = {} if target == "file" else {
                        "tierUrl": f"s3://bench/run{run}", "s3Endpoint": endpoint}
                    store = _store(Path(tmp), entries + 1, per_entry, 1000, **opts)
                    try:
                        plog = store.partition(TOPIC, 0)
                        store.seal(TOPIC)
                        (seg,) = plog.closed_segments()
                        # the catalog and the topic's table exist before the timing: made once
                        # per topic, they are not what a segment's offload costs
                        store.offloader.catalog.table(TopicName.parse(TOPIC))
                        rows = store.offloader.segment_rows(plog, seg)
                        offloader = store.offloader
                        seconds = timed(lambda: offloader.offload_segment(plog, seg))  # noqa: B023
                        moved = plog.closed_segments()[0]
                        tier = store.tier
                        plain_url = f"{tier.url}/plain-{run}.parquet"

                        def plain_write(tier: TierStorage = tier, url: str = plain_url,
                                        rows: pa.Table = rows) -> None:
                            with tier.filesystem().open(tier.path(url), "wb") as f:
                                pq.write_table(rows, f, compression="zstd")

                        base_seconds = timed(plain_write)
                        if run:
                            ours.append(seg.bytes / seconds / 1e6)
                            baseline.append(seg.bytes / base_seconds / 1e6)
                        assert moved.tier_url is not None
                        sizes[target] = {
                            "bookie_bytes": seg.bytes,
                            "parquet_bytes": int(tier.filesystem().size(
                                tier.path(moved.tier_url))),
                            "messages": seg.messages,
                        }
                    finally:
                        store.close()
            figures.append(Figure(f"offload MB/s to {target}:// (segment bytes)", "MB/s", ours,
                                  "pq.write_table of the same rows", baseline))
    finally:
        moto.stop()
    s = sizes["file"]
    figures.append(Figure("Parquet bytes / bookie bytes (same segment)", "x",
                          [s["parquet_bytes"] / s["bookie_bytes"]], higher_is_better=False))
    console.print(f"segment: {s['messages']:,} messages, bookie copy {s['bookie_bytes']:,} B, "
                  f"Parquet {s['parquet_bytes']:,} B")
    return report("offload", figures, {"entries": entries, "messages_per_entry": per_entry,
                                       "runs": runs}, {"sizes": sizes})


def _fetched_fraction(path: str, *, key_range: KeyRange | None = None,
                      window: tuple[int, int] | None = None) -> float:
    """Compressed bytes of the row groups the tier reader selects, over the file's: the
    reader's own pruning (``selected_row_groups``) on a split covering the whole segment."""
    meta = pq.ParquetFile(path).metadata
    split = Split(topic=TOPIC, partition=0, segment_id=1, start=Position(0, 1, 0, 0),
                  end=Position(0, 1, 1 << 40, 0), reader=ReaderKind.TIER,
                  key_range=key_range or KeyRange.full(),
                  start_time=None if window is None else window[0],
                  end_time=None if window is None else window[1], tier_url=path)

    def size(i: int) -> int:
        rg = meta.row_group(i)
        return sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))

    total = sum(size(i) for i in range(meta.num_row_groups))
    return sum(size(i) for i in selected_row_groups(meta, split)) / total


def layout(quick: bool = True) -> Path:
    """Bytes a k=4 key-range read and a 10% time-window read fetch, for each layout."""
    entries, per_entry = sized((50, 2000) if quick else (100, 5000), (5, 100))
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = _store(Path(tmp) / "data", entries + 1, per_entry, 1000)
        try:
            store.seal(TOPIC)
            plog = store.partition(TOPIC, 0)
            (seg,) = plog.closed_segments()
            rows = store.offloader.segment_rows(plog, seg)
        finally:
            store.close()
        lo_t = rows.column("publish_time")[0].as_py()
        hi_t = rows.column("publish_time")[rows.num_rows - 1].as_py()
        span = hi_t - lo_t
        mid = lo_t + span // 2  # a window in the middle: the boundary segment of a query
        window = (mid, mid + span // 10)
        for name in ("key-buckets", "log"):
            tier = TierStorage.from_location(str(Path(tmp) / name), layout=name)
            tier.check()
            url = f"{tier.url}/seg.parquet"
            tier.write_segment(url, rows)
            path = tier.path(url)
            ranges = KeyRange.split(4)
            results[name] = {
                "key_range_k4_max": max(_fetched_fraction(path, key_range=r) for r in ranges),
                "key_range_k4_sum": sum(_fetched_fraction(path, key_range=r) for r in ranges),
                "time_window_10pct": _fetched_fraction(path, window=window),
                "row_groups": pq.ParquetFile(path).metadata.num_row_groups,
                "bytes": os.path.getsize(path),
            }
    kb, lg = results["key-buckets"], results["log"]
    figures = [
        Figure("k=4 key-range read: fraction of file (worst range)", "", [kb["key_range_k4_max"]],
               "log-order layout", [lg["key_range_k4_max"]], aim="<= 1.5/k = 0.375",
               higher_is_better=False, aim_check=lambda v, r: v <= 0.375),
        Figure("all 4 key ranges together: read amplification", "x", [kb["key_range_k4_sum"]],
               "log-order layout", [lg["key_range_k4_sum"]], aim="<= 1.5",
               higher_is_better=False, aim_check=lambda v, r: v <= 1.5),
        Figure("10% time window: fraction of file", "", [kb["time_window_10pct"]],
               "log-order layout", [lg["time_window_10pct"]], higher_is_better=False),
    ]
    console.print(f"one segment of {entries * per_entry:,} messages, 1,000 keys; row groups: "
                  f"key-buckets {kb['row_groups']}, log {lg['row_groups']}; file bytes: "
                  f"key-buckets {kb['bytes']:,}, log {lg['bytes']:,}")
    return report("layout", figures, {"entries": entries, "messages_per_entry": per_entry},
                  {"layouts": results})


def catalog(quick: bool = True) -> Path:
    """Milliseconds to register one more offloaded file in a topic's Iceberg table, early and
    after N files: TierCatalog (merged manifests, trimmed history, no scan on a first attempt)
    beside pyiceberg's add_files with its defaults on a plain table."""
    import warnings

    from pyiceberg.catalog.sql import SqlCatalog

    from tierstream.model.message_format import MESSAGE_SCHEMA
    from tierstream.model.names import TopicName
    from tierstream.tier.catalog import TierCatalog

    n = sized(200 if quick else 1000, 20)
    window = 10
    topic = TopicName.parse(TOPIC)
    with tempfile.TemporaryDirectory() as tmp:
        tier = TierStorage.from_location(str(Path(tmp) / "tier"))
        empty = pa.Table.from_pylist([], MESSAGE_SCHEMA)
        ours_cat = TierCatalog("sqlite:///" + str(Path(tmp) / "ours.db"), tier)
        # the baseline: pyiceberg's own catalog and add_files, as a user would call them
        plain_cat = SqlCatalog("plain", uri="sqlite:///" + str(Path(tmp) / "plain.db"),
                               warehouse=tier.warehouse_url(), **tier.iceberg_properties())
        plain_cat.create_namespace_if_not_exists(("plain",))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = plain_cat.create_table(("plain", "t"), schema=MESSAGE_SCHEMA)
        ours_ms: list[float] = []
        plain_ms: list[float] = []
        for i in range(n):
            url = tier.segment_url(topic, 0, i)
            tier.write_segment(url, empty)
            ours_ms.append(timed(lambda u=url: ours_cat.register(topic, u, retry=False)) * 1e3)
            plain_ms.append(timed(lambda u=url: plain.add_files([u])) * 1e3)
    mid = n // 2

    def files(ms: list[float], last: int) -> list[float]:
        return ms[last - window:last]

    figures = [Figure(f"register files {last - window + 1}..{last}", "ms", files(ours_ms, last),
                      "pyiceberg add_files, defaults", files(plain_ms, last),
                      higher_is_better=False) for last in (window, mid)]
    figures.append(Figure(
        f"register files {n - window + 1}..{n}", "ms", files(ours_ms, n),
        "pyiceberg add_files, defaults", files(plain_ms, n), higher_is_better=False,
        aim=f"flat: <= 1.5x files {mid - window + 1}..{mid}",
        aim_check=lambda v, r: v <= 1.5 * sorted(files(ours_ms, mid))[window // 2]))
    console.print(f"{n} empty segment files registered one by one in each table, file:// tier")
    return report("catalog", figures, {"files": n, "window": window})
