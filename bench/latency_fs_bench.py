"""The parquet-tier reader over an object store modelled without moto (issue 14).

moto answers every request with Python on the same two cores the reader runs on, so the
``remote`` benchmark measures moto's CPU as much as the reader. Here the tier's files are
local, and the filesystem in front of them adds what a network object store adds per request:
a fixed latency (0, 10, 50 ms) and a bandwidth cap per request (100 MB/s, about one S3
connection), with s3fs's file defaults (50 MiB read-ahead blocks). The reader's throughput
over it is compared with plain local files in the same run, with the requests per read and
the bytes fetched per byte of the file.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from bench.harness import Figure, console, report, sized, timed
from bench.spark_bench import _fill
from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.model.positions import Position
from tierstream.readers import open_reader
from tierstream.splits.split import ReaderKind, Split
from tierstream.tier import storage as tier_module

BANDWIDTH = 100e6  # bytes/s per request


class LatencyFS(LocalFileSystem):
    """Local files behind a modelled network: every ranged read is one request that waits
    ``latency_s`` and then transfers at ``BANDWIDTH``."""

    protocol = ("latency",)  # not local: the reader takes its remote path
    latency_s = 0.0
    requests = 0
    fetched = 0
    lock = threading.Lock()  # guards the request counters

    def info(self, path: str, **kwargs: Any) -> Any:  # a HEAD request
        with LatencyFS.lock:
            LatencyFS.requests += 1
        time.sleep(LatencyFS.latency_s)
        return super().info(path, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:  # one GET, like s3fs's
        with open(self._strip_protocol(path), "rb") as f:
            f.seek(start or 0)
            data = f.read() if end is None else f.read(end - (start or 0))
        _request(len(data))
        return data

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        # a size given spares the HEAD, as with s3fs
        return _SlowFile(self, path, mode=mode, block_size=block_size or 50 * 2**20,
                         cache_type=kwargs.get("cache_type", "readahead"),
                         size=kwargs.get("size"))


def _request(nbytes: int) -> None:
    with LatencyFS.lock:
        LatencyFS.requests += 1
        LatencyFS.fetched += nbytes
    time.sleep(LatencyFS.latency_s + nbytes / BANDWIDTH)  # the modelled network


class _SlowFile(AbstractBufferedFile):
    def _fetch_range(self, start: int, end: int) -> bytes:
        _request(end - start)
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)


def _tier_split(store: Store, topic: str, entries: int, per_entry: int) -> tuple[Split, int]:
    """One offloaded segment of ``entries`` x ``per_entry`` messages: its split and file size."""
    _fill(store, topic, 1, entries, per_entry)
    (seg,) = store.offloader.offload_topic(topic)
    split = Split(topic=topic, partition=0, segment_id=seg.segment_id,
                  start=Position(0, seg.segment_id, 0, 0),
                  end=Position(0, seg.segment_id, seg.entries, 0),
                  reader=ReaderKind.TIER, tier_url=seg.tier_url, tier_bytes=seg.tier_bytes)
    return split, Path((seg.tier_url or "").removeprefix("file://")).stat().st_size


def _measure(split: Split, messages: int, size: int, latencies: tuple[int, ...], runs: int
             ) -> tuple[dict[str, list[float]], dict[int, tuple[float, float]]]:
    """rows/s of local reads and of reads behind each latency, interleaved; and per read at
    each latency, the requests and the bytes fetched per byte of the file."""
    def rate() -> float:
        return messages / timed(lambda: sum(b.num_rows for b in open_reader(split)))

    plain = tier_module.TierStorage.filesystem
    results: dict[str, list[float]] = {"local": [], **{f"{ms}": [] for ms in latencies}}
    requests = {ms: 0 for ms in latencies}
    fetched = {ms: 0 for ms in latencies}
    rate()
    for _ in range(runs):  # interleaved: drift on a shared 2-core VM hits all alike
        results["local"].append(rate())
        try:
            # the tier's file:// URLs, served through the modelled network
            tier_module.TierStorage.filesystem = lambda self: LatencyFS()
            for ms in latencies:
                LatencyFS.latency_s = ms / 1000
                LatencyFS.requests = LatencyFS.fetched = 0
                results[f"{ms}"].append(rate())
                requests[ms] += LatencyFS.requests
                fetched[ms] += LatencyFS.fetched
        finally:
            tier_module.TierStorage.filesystem = plain
    return results, {ms: (requests[ms] / runs, fetched[ms] / runs / size) for ms in latencies}


def remote_fs(quick: bool = True) -> Path:
    """A small tier file (one read: latency-bound) at 0, 10 and 50 ms, and a file above
    SMALL_FILE (read as footer, then row groups, 8 requests in flight) at 10 ms."""
    entries, per_entry = sized((100, 2000) if quick else (300, 2000), (10, 100))
    large_entries = 3000  # ~21 MB of Parquet: above the reader's 16 MiB whole-file limit
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(StoreConfig.from_options({
            "dataDir": str(Path(tmp) / "data"), "fsync": False,
            "maxEntriesPerSegment": large_entries + 1, "maxSegmentBytes": "2GiB",
            "deletionLag": "1h",
            "tierCheckInterval": "1h"}))
        try:
            small, size = _tier_split(store, "bench/remote/small", entries, per_entry)
            large, large_size = _tier_split(store, "bench/remote/large", large_entries,
                                            per_entry)
        finally:
            store.close()
        messages = entries * per_entry
        results, per_read = _measure(small, messages, size, (0, 10, 50), 5)
        large_results, large_per_read = _measure(large, large_entries * per_entry, large_size,
                                                 (10,), 3)
    figures = [Figure(f"tier reader, {size / 1e6:.1f} MB file, {ms} ms + 100 MB/s per request",
                      "rows/s", results[str(ms)], "local files", results["local"],
                      aim="ratio >= 0.85" if ms == 10 else "",
                      aim_check=(lambda v, r: r is not None and r >= 0.85) if ms == 10
                      else None) for ms in (0, 10, 50)]
    figures.append(Figure(f"tier reader, {large_size / 1e6:.0f} MB file, 10 ms + 100 MB/s per "
                          "request", "rows/s", large_results["10"], "local files",
                          large_results["local"]))
    for name, file_size, n, reads in (("small", size, messages, per_read),
                                      ("large", large_size, large_entries * per_entry,
                                       large_per_read)):
        console.print(f"{name}: one {file_size / 1e6:.1f} MB tier file of {n:,} messages; per "
                      "read: " + "; ".join(f"{ms} ms: {req:.0f} requests, {ratio:.2f} bytes "
                                          "fetched per byte of the file"
                                          for ms, (req, ratio) in reads.items()))
    return report("remote-fs", figures, {"entries": entries, "messages_per_entry": per_entry,
                                         "large_entries": large_entries,
                                         "bandwidth_bytes_per_s": BANDWIDTH},
                  {"per_read": {str(k): {"requests": r, "bytes_per_byte": b}
                                for k, (r, b) in per_read.items()},
                   "per_read_large": {str(k): {"requests": r, "bytes_per_byte": b}
                                      for k, (r, b) in large_per_read.items()}})
