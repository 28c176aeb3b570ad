"""The parquet-tier reader over S3 with per-request latency (issue 6): does read-ahead hide it?

A moto S3 server on loopback, wrapped in WSGI middleware that holds every request for 0, 10
or 50 ms, serves the same tier files as a local directory; the reader's throughput over each
is compared with local files in the same run.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import Figure, console, report, sized, timed
from bench.spark_bench import _fill
from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.model.positions import Position
from tierstream.readers import open_reader
from tierstream.splits.split import ReaderKind, Split, TierLocation


class _Delay:
    """WSGI middleware: every request waits ``delay_s`` before moto answers it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.delay_s = 0.0
        self.requests = 0

    def __call__(self, environ: Any, start_response: Any) -> Any:
        self.requests += 1
        if self.delay_s:
            time.sleep(self.delay_s)  # the injected network latency
        return self.app(environ, start_response)


def _moto(delay: _Delay) -> tuple[Any, str]:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    delay.app = DomainDispatcherApplication(create_backend_app)
    server = make_server("127.0.0.1", 0, delay, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def remote(quick: bool = True) -> Path:
    """Tier reader rows/s over S3 at 0/10/50 ms per request, beside local files."""
    partitions, entries, per_entry = sized((1, 100, 2000) if quick else (1, 300, 2000),
                                            (1, 10, 100))
    delay = _Delay(None)
    server, endpoint = _moto(delay)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="remote")
    results: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            splits: dict[str, Split] = {}
            for where, opts in (("local", {}), ("s3", {"tierUrl": "s3://remote/tier",
                                                       "s3Endpoint": endpoint})):
                store = Store(StoreConfig.from_options({
                    "dataDir": str(Path(tmp) / where), "fsync": False,
                    "maxEntriesPerSegment": entries + 1, "deletionLag": "1h",
                    "tierCheckInterval": "1h", **opts}))
                try:
                    _fill(store, "bench/remote/t", partitions, entries, per_entry)
                    (seg,) = store.offloader.offload_topic("bench/remote/t")
                    splits[where] = Split(
                        topic="bench/remote/t", partition=0, segment_id=seg.segment_id,
                        start=Position(0, seg.segment_id, 0, 0),
                        end=Position(0, seg.segment_id, seg.entries, 0),
                        reader=ReaderKind.TIER, tier_url=seg.tier_url, tier_bytes=seg.tier_bytes,
                        tier=TierLocation(s3_endpoint=opts.get("s3Endpoint")))
                finally:
                    store.close()
            messages = entries * per_entry

            def rate(split: Split) -> float:
                return messages / timed(lambda: sum(b.num_rows for b in open_reader(split)))

            rate(splits["local"]), rate(splits["s3"])  # warm-up
            results["local"] = [rate(splits["local"]) for _ in range(3)]
            for ms in (0, 10, 50):
                delay.delay_s = ms / 1000
                delay.requests = 0
                results[f"s3+{ms}ms"] = [rate(splits["s3"]) for _ in range(3)]
                results[f"requests@{ms}ms"] = [delay.requests / 3]
    finally:
        server.shutdown()
    figures = []
    for ms in (0, 10, 50):
        figures.append(Figure(f"tier reader over S3, {ms} ms per request", "rows/s",
                              results[f"s3+{ms}ms"], "local files", results["local"],
                              aim="ratio >= 0.85" if ms == 10 else "",
                              aim_check=(lambda v, r: r is not None and r >= 0.85)
                              if ms == 10 else None))
    console.print(f"one segment of {entries * per_entry:,} messages; S3 requests per read: "
                  f"{results['requests@0ms'][0]:.0f}")
    return report("remote", figures, {"entries": entries, "messages_per_entry": per_entry},
                  {"requests_per_read": results["requests@0ms"][0]})
