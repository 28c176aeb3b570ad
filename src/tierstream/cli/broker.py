"""``tierstream broker start``: the embedded broker in the foreground."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from tierstream.cli.common import (
    DataDirOpt,
    TokenOpt,
    broker_app,
)
from tierstream.options import DEFAULT_DATA_DIR, DEFAULT_PORT


@broker_app.command("start")
def broker_start(
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = DEFAULT_PORT,
    auth_token: TokenOpt = None,
    bookies: Annotated[int, typer.Option(help="Number of bookies.")] = 1,
    write_quorum: Annotated[int | None, typer.Option(help="Bookies per entry.")] = None,
    ack_quorum: Annotated[int | None, typer.Option(help="Bookies that must fsync.")] = None,
    max_entries_per_segment: Annotated[int | None, typer.Option(help="Rollover by entries.")]
        = None,
    max_segment_bytes: Annotated[str | None, typer.Option(help="Rollover by size, e.g. 128MiB.")]
        = None,
    segment_rollover_time: Annotated[str | None, typer.Option(help="Rollover by age, e.g. 4h.")]
        = None,
    fsync: Annotated[bool, typer.Option(help="fsync before acknowledging.")] = True,
    max_partitions_per_topic: Annotated[int | None, typer.Option(
        help="Most partitions a topic may have (default 1024).")] = None,
    max_open_ledgers: Annotated[int | None, typer.Option(
        help="Per bookie: ledgers holding open files at a time (default 512).")] = None,
    tier_url: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_TIER_URL", help="Tier for offloaded segments: a path, file:// or "
        "s3://bucket/prefix (default: DATA_DIR/tier).")] = None,
    s3_endpoint: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_S3_ENDPOINT", help="S3 endpoint (MinIO, moto); default AWS.")] = None,
    s3_region: Annotated[str | None, typer.Option(envvar="AWS_REGION", help="S3 region.")]
        = None,
    catalog_uri: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_CATALOG_URI", help="Iceberg SQL catalog URL (default: "
        "sqlite:///DATA_DIR/catalog.db).")] = None,
    offload_after: Annotated[str | None, typer.Option(
        help="Offload segments whose newest message is older than this, e.g. 1d.")] = None,
    offload_threshold: Annotated[str | None, typer.Option(
        help="Offload oldest segments while a topic's bookie bytes exceed this, e.g. 1GiB.")]
        = None,
    deletion_lag: Annotated[str | None, typer.Option(
        help="Keep bookie copies this long after offload (default 10m).")] = None,
    tier_check_interval: Annotated[str | None, typer.Option(
        help="How often to apply offload/deletion/retention (default 30s).")] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "INFO",
) -> None:
    """Start the broker in the foreground; SIGTERM or Ctrl-C stops it cleanly.

    Example: tierstream broker start --data-dir ./tierstream-data --port 6651
    """
    from tierstream.store.broker import run_broker
    from tierstream.store.config import StoreConfig

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = StoreConfig.from_options({
        "dataDir": str(data_dir), "bookies": bookies, "writeQuorum": write_quorum,
        "ackQuorum": ack_quorum, "maxEntriesPerSegment": max_entries_per_segment,
        "maxSegmentBytes": max_segment_bytes, "segmentRolloverTime": segment_rollover_time,
        "fsync": fsync, "maxPartitionsPerTopic": max_partitions_per_topic,
        "maxOpenLedgers": max_open_ledgers,
        "tierUrl": tier_url, "s3Endpoint": s3_endpoint, "s3Region": s3_region,
        "catalogUri": catalog_uri, "offloadAfter": offload_after,
        "offloadThreshold": offload_threshold, "deletionLag": deletion_lag,
        "tierCheckInterval": tier_check_interval,
    })

    def ready(url: str) -> None:
        print(f"tierstream broker listening on {url} (data dir {config.data_dir})", flush=True)

    run_broker(config, host=host, port=port, auth_token=auth_token, ready=ready)
