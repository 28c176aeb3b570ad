"""The host's tier cache (issue 51): a window of tier files read through S3 — a moto server in
its own process behind the modelled network of ``bench remote-fs`` (10 ms per request, 100
MB/s per request) — first with no cache and into an empty one, then again from a cache as
large as the window and from one of half the window, and as a Spark backfill whose two Python
workers share the cache; each beside the same read of local files in the same run, with the
GETs each read sent to S3. Beside them, the ceilings this machine sets: the stand-in (moto in
Python) serves on the same 2 cores that decode, and a fresh VM pays for memory on first touch
(measured: the window written into new files twice, the second time into the pages the first
freed, where the reads' own writes then land).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.harness import Figure, console, cpu_seconds, report, sized, timed
from bench.s3_server import S3Server
from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.enumerator import Enumerator, Query
from tierstream.model.message_format import as_produce_batch
from tierstream.readers import ReadStats
from tierstream.runtime.local import run_splits
from tierstream.splits.split import Split, StreamCut, TierLocation, splits_to_json
from tierstream.util.units import human_bytes

TOPIC = "bench/tiercache/t"
BUCKET = "tiercache"


def _fill(store: Store, partitions: int, entries: int, per_entry: int, value_bytes: int,
          segments: int) -> None:
    """Values of random bytes (what compresses least: the most bytes over the network per
    row), ``segments`` closed segments per partition."""
    rng = np.random.default_rng(7)
    store.create_topic(TOPIC, partitions)
    for p in range(partitions):
        plog = store.partition(TOPIC, p)
        for e in range(entries):
            if e and e % (entries // segments) == 0:
                store.seal(TOPIC, p)
            raw = rng.integers(0, 256, per_entry * value_bytes, dtype=np.uint8).tobytes()
            values = pa.Array.from_buffers(
                pa.binary(), per_entry,
                [None, pa.py_buffer(np.arange(0, (per_entry + 1) * value_bytes, value_bytes,
                                              dtype=np.int32).tobytes()), pa.py_buffer(raw)])
            plog.append(as_produce_batch(pa.record_batch({
                "key": [f"user-{(e * per_entry + n) * 7919 % 1000}" for n in range(per_entry)],
                "value": values})), producer=None, sequence_id=None)
    store.seal(TOPIC)


def _read(splits: list[Split], cache: tuple[str | None, int | None],
          cpu: list[float] | None = None) -> tuple[float, int, ReadStats]:
    """Rows/s of a read, its rows and paths; with ``cpu``, the CPU seconds it used appended."""
    stats = ReadStats()
    rows = [0]

    def run() -> None:
        for batch in run_splits(splits, stats=stats, tier_cache=cache):
            rows[0] += batch.num_rows

    before = cpu_seconds()
    seconds = timed(run)
    if cpu is not None:
        cpu.append(cpu_seconds() - before)
    return rows[0] / seconds, rows[0], stats


def tier_cache(quick: bool = True) -> Path:
    """Rows/s of reads through S3 with and without the tier cache, beside local files."""
    # ~1 GB of Parquet: 10 M messages of 100 random bytes (values that do not compress: the
    # most bytes over the network per row)
    partitions, entries, per_entry, value_bytes, runs = sized(
        (4, 64, 40_000, 100, 1) if quick else (4, 64, 40_000, 100, 3), (2, 8, 2000, 100, 1))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    figures_in: dict[str, list[float]] = {}
    gets: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp, S3Server(latency_ms=10, bandwidth=100e6) as s3:
        store = Store(StoreConfig.from_options({
            "dataDir": str(Path(tmp) / "data"), "fsync": False, "deletionLag": "1h",
            "tierCheckInterval": "1h", "maxEntriesPerSegment": entries + 1}))
        try:
            _fill(store, partitions, entries, per_entry, value_bytes, segments=4)
            moved = store.offloader.offload_topic(TOPIC)
            for plog in store.partitions(TOPIC):
                for seg in plog.closed_segments():
                    store.offloader.delete_bookie_copy(plog, seg)
            cut = StreamCut.of(TOPIC, {p.partition: p.last_confirmed()[1]
                                       for p in store.partitions(TOPIC)})
        finally:
            store.close()
        with Enumerator(data_dir=Path(tmp) / "data") as enum:
            local = list(enum.plan(Query(topics=(TOPIC,), end=cut)))
        window = sum(s.tier_bytes or 0 for s in moved)
        import boto3

        client = boto3.client("s3", endpoint_url=s3.endpoint)
        client.create_bucket(Bucket=BUCKET)
        remote = []
        for split in local:  # the same files in the bucket
            path = (split.tier_url or "").removeprefix("file://")
            key = "tier/" + Path(path).name
            client.upload_file(path, BUCKET, key)
            remote.append(replace(split, tier_url=f"s3://{BUCKET}/{key}",
                                  tier=TierLocation(s3_endpoint=s3.endpoint)))
        s3.gets()
        rows_total = partitions * entries * per_entry
        _read(local, (None, 0))  # warm: the local files in the page cache, as a re-read's
        for run in range(runs):
            # fresh caches each run, in new directories: a process keeps the cache it opened,
            # and one deleted under it (rmtree) would take nothing more
            full_dir, half_dir = (str(Path(tmp) / f"cache-{k}-{run}") for k in ("full", "half"))
            local_cpu: list[float] = []
            measured = {
                "local": _read(local, (None, 0), local_cpu),
                "s3 no cache": _read(remote, (None, 0))}
            gets["s3 no cache"] = s3.gets()
            cold, warm = _page_cache_writes(Path(tmp), window)
            figures_in.setdefault("write cold", []).append(cold)
            figures_in.setdefault("write warm", []).append(warm)
            measured["s3 first"] = _read(remote, (full_dir, window))
            gets["s3 first"] = s3.gets()
            second_cpu: list[float] = []
            measured["s3 second"] = _read(remote, (full_dir, window), second_cpu)
            figures_in.setdefault("local cpu", []).append(local_cpu[0])
            figures_in.setdefault("second cpu", []).append(second_cpu[0])
            gets["s3 second"] = s3.gets()
            _read(remote, (half_dir, window // 2))  # fills half the window
            s3.gets()
            measured["s3 half"] = _read(remote, (half_dir, window // 2))
            gets["s3 half"] = s3.gets()
            for name, (rate, rows, _) in measured.items():
                assert rows == rows_total, (name, rows)
                figures_in.setdefault(name, []).append(rate)
            half_stats = measured["s3 half"][2]
            client, server = cpu_seconds(), cpu_seconds(s3.proc.pid)
            fetch_s = _fetch_all(remote, s3.endpoint)
            fetch_cpu = cpu_seconds() - client + cpu_seconds(s3.proc.pid) - server
            figures_in.setdefault("ceiling", []).append(rows_total / fetch_s)
            # A first read fetches and decodes on the same cores as the stand-in serves: at
            # best its time is the larger of either alone and their CPU spread over the cores
            local_s = rows_total / measured["local"][0]
            cores = os.cpu_count() or 1
            figures_in.setdefault("shared ceiling", []).append(rows_total / max(
                fetch_s, local_s, (fetch_cpu + local_cpu[0]) / cores))
            # into the cache, the window's bytes are also written into its files
            figures_in.setdefault("cache ceiling", []).append(rows_total / max(
                fetch_s, local_s, (fetch_cpu + local_cpu[0] + warm) / cores))
            # the half-window re-read fetches only what the cache does not hold
            fetched = half_stats.rows(path="object store") / rows_total
            figures_in.setdefault("half ceiling", []).append(rows_total / max(
                fetch_s * fetched, local_s, (fetch_cpu * fetched + local_cpu[0]) / cores))
            s3.gets()
        spark_rates, spark_gets = _spark(local, remote, tmp, s3, window, runs)
    local_rates = figures_in["local"]
    figures = [
        Figure("the S3 stand-in's ceiling: the window's bytes in 4 MiB GETs, 32 at a time, "
               "nothing decoded (rows/s of the window)", "rows/s", figures_in["ceiling"],
               "local files", local_rates),
        Figure("  a first read's ceiling here: the fetch's CPU (the stand-in's and its "
               "client's) and the decoding's (the local read's) on this machine's "
               f"{os.cpu_count()} cores", "rows/s", figures_in["shared ceiling"],
               "local files", local_rates),
        Figure("  writing the window into new files (CPU-s), into memory this VM touches "
               "for the first time: a fresh VM backs its memory on first touch (a host that "
               "has run a while does not); each first read below writes into pages freed "
               "just before", "CPU-s", figures_in["write cold"], "into pages freed before",
               figures_in["write warm"], higher_is_better=False),
        Figure("  a first read's ceiling into the cache: the above plus writing the window "
               "into the cache's files", "rows/s", figures_in["cache ceiling"],
               "local files", local_rates),
        Figure("  a half-window re-read's ceiling: decoding the window, fetching the part "
               "the cache does not hold", "rows/s", figures_in["half ceiling"], "local files",
               local_rates),
        Figure("first read through S3, no cache (rows/s)", "rows/s", figures_in["s3 no cache"],
               "local files", local_rates),
        Figure("first read through S3 into an empty cache", "rows/s", figures_in["s3 first"],
               "local files", local_rates, aim="ratio >= 0.85",
               aim_check=lambda v, r: r is not None and r >= 0.85),
        Figure("second read, cache as large as the window", "rows/s",
               figures_in["s3 second"], "local files", local_rates, aim="ratio >= 0.95",
               aim_check=lambda v, r: r is not None and r >= 0.95),
        Figure("  its cost: CPU-s of this process for the read (decoding included)", "CPU-s",
               figures_in["second cpu"], "the local read's", figures_in["local cpu"],
               higher_is_better=False, aim="ratio <= 1.05",
               aim_check=lambda v, r: r is not None and r <= 1.05),
        Figure("second read, cache of half the window", "rows/s", figures_in["s3 half"],
               "local files", local_rates, aim="ratio >= 0.9",
               aim_check=lambda v, r: r is not None and r >= 0.9),
        Figure("Spark backfill (2 workers sharing the cache), second read", "rows/s",
               spark_rates["s3 second"], "the same backfill of local files",
               spark_rates["local"], aim="ratio >= 0.9",
               aim_check=lambda v, r: r is not None and r >= 0.9),
    ]
    requests = {**gets, **spark_gets}
    console.print(f"window: {len(local)} tier files, {human_bytes(window)} of Parquet, "
                  f"{partitions * entries * per_entry:,} rows; S3 GETs per read: "
                  + ", ".join(f"{k} {v:,}" for k, v in requests.items()))
    console.print(f"half-window cache, second read: {half_stats.summary()}")
    return report("tier-cache", figures,
                  {"partitions": partitions, "rows": partitions * entries * per_entry,
                   "value_bytes": value_bytes, "window_bytes": window, "runs": runs,
                   "latency_ms": 10, "bandwidth": 100e6},
                  {"s3_gets": requests})


def _page_cache_writes(directory: Path, nbytes: int) -> tuple[float, float]:
    """CPU seconds to write ``nbytes`` into a new file, twice: first into memory the machine
    has not touched yet (the page cache grows), then into the pages the first file freed (the
    page cache recycles, as on a host that has run a while). On this VM the first is several
    times the second: its memory is backed by the host on first touch. The reads that follow
    write into the freed pages, so a first read measures the cache, not the VM's start."""
    chunk = bytes(4 << 20)
    spent = []
    for _ in range(2):
        probe = directory / "page-cache-probe"
        before = cpu_seconds()
        with probe.open("wb") as f:
            for _ in range(-(-nbytes // len(chunk))):
                f.write(chunk)
        spent.append(cpu_seconds() - before)
        probe.unlink()
    return spent[0], spent[1]


def _fetch_all(splits: list[Split], endpoint: str) -> float:
    """Seconds to fetch every byte of the splits' files in 4 MiB ranged GETs, 32 in flight,
    with the client the tier cache uses (pyarrow's): what the stand-in for S3 (moto in
    Python, and the client, on this machine's cores) delivers with no decoding and no cache."""
    from concurrent.futures import ThreadPoolExecutor

    from tierstream.tier.storage import TierStorage

    ranges_fs = TierStorage(url=f"s3://{BUCKET}/tier", s3_endpoint=endpoint).range_filesystem()
    step = 4 * 1024**2
    ranges = [((s.tier_url or "").removeprefix("s3://"), start, s.tier_bytes or 0)
              for s in splits for start in range(0, s.tier_bytes or 0, step)]
    with ThreadPoolExecutor(32) as pool:
        return timed(lambda: list(pool.map(
            lambda r: ranges_fs.read_range(r[0], r[1], min(r[1] + step, r[2])), ranges)))


def _spark(local: list[Split], remote: list[Split], tmp: str, s3: S3Server, window: int,
           runs: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """The same window as a Spark backfill (noop sink) on local[2]: two Python workers, each
    a process, sharing one cache directory."""
    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.jobs import local_spark

    os.environ["TIERSTREAM_SPARK_MASTER"] = "local[2]"
    session = local_spark("tierstream-bench-tier-cache")
    rates: dict[str, list[float]] = {}
    gets: dict[str, int] = {}
    rows = sum(_rows(s) for s in local)
    try:
        register(session)

        def backfill(splits: list[Split], cache: dict[str, str]) -> float:
            reader = session.read.format("tierstream").option("topic", TOPIC) \
                .option("dataDir", str(Path(tmp) / "data")) \
                .option("splits", splits_to_json(splits))
            for k, v in cache.items():
                reader = reader.option(k, v)
            df = reader.load()
            return rows / timed(lambda: df.write.format("noop").mode("overwrite").save())

        backfill(local, {"tierCacheSize": "0"})  # JVM and workers warm
        for run in range(runs):
            cache = {"tierCacheDir": str(Path(tmp) / f"cache-spark-{run}"),
                     "tierCacheSize": str(window)}  # a new one each run (see above)
            rates.setdefault("local", []).append(backfill(local, {"tierCacheSize": "0"}))
            s3.gets()
            rates.setdefault("s3 first", []).append(backfill(remote, cache))
            gets["spark first"] = s3.gets()
            rates.setdefault("s3 second", []).append(backfill(remote, cache))
            gets["spark second"] = s3.gets()
    finally:
        session.stop()
    return rates, gets


def _rows(split: Split) -> int:
    """Rows of a whole-segment split of a local tier file."""
    import pyarrow.parquet as pq

    return int(pq.ParquetFile((split.tier_url or "").removeprefix("file://")).metadata.num_rows)
