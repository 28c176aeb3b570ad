"""``tierstream topic compact`` and ``tierstream topic compaction``: a topic's latest value
per key, as snapshots (``broker/topics/compaction.py``); ``tierstream read --compacted``
reads it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tierstream.cli.common import (
    BrokerOpt,
    QuietOpt,
    TlsCaOpt,
    TokenOpt,
    err,
    human_bytes,
    out,
    progress_bar,
    topic_app,
)
from tierstream.errors import TierstreamError
from tierstream.options import DEFAULT_BROKER_URL
from tierstream.util.timeutil import format_ms

_POLL_S = 0.2


@topic_app.command("compact")
def topic_compact(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    wait: Annotated[bool, typer.Option(
        "--wait", help="Wait until every partition is compacted, with a bar on a "
                       "terminal.")] = False,
    quiet: QuietOpt = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Compact a topic: per partition, the latest message of each key up to now becomes its
    snapshot (a message with an empty value removes its key; messages without a key are not
    in the compacted view). Readers with --compacted read the snapshot, then the log after it.

    Example: tierstream topic compact acme/web/prices --wait
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        status = admin.compact(topic, wait=False)
        if not wait:
            out.print(f"compaction of {status['topic']} started; "
                      f"tierstream topic compaction {status['topic']} tells how it goes",
                      highlight=False)
            return
        partitions = admin.get_topic(topic).partitions
        with progress_bar(not quiet) as progress:
            task = progress.add_task("compacting (partitions)", total=partitions)
            while status["status"] == "RUNNING":
                progress.update(task, completed=len(status["run"]))
                time.sleep(_POLL_S)
                status = admin.compaction(topic)
    if status["status"] == "ERROR":
        raise TierstreamError(f"compaction of {status['topic']} failed: {status['error']}")
    _say(status)


@topic_app.command("compaction")
def topic_compaction(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """A topic's compaction: the last run's status and each partition's snapshot.

    Example: tierstream topic compaction acme/web/prices
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        status = admin.compaction(topic)
    out.print(f"{status['topic']}: {status['status']}"
              + (f" ({status['error']})" if status.get("error") else ""), highlight=False)
    _say(status)


def _say(status: dict[str, Any]) -> None:
    for snap in status["snapshots"]:
        seg, entry, index = snap["horizon"]
        out.print(f"  partition {snap['partition']}: {snap['keys']:,} live key(s), "
                  f"{human_bytes(snap['bytes'])}, up to ({seg}, {entry}, {index}), "
                  f"compacted {format_ms(snap['compacted_at'])} in {snap['duration_ms']} ms",
                  highlight=False)
    if not status["snapshots"]:
        out.print("  no snapshot yet", highlight=False)


def read_compacted(topic: str, out_path: Path, kwargs: dict[str, Any], decoder: Any,
                   mode: str, quiet: bool) -> None:
    """``tierstream read --compacted``: the topic's live keys into ``out_path`` (a new
    Parquet file, written whole or not at all)."""
    import pyarrow.parquet as pq

    import tierstream
    from tierstream.model.message_format import OUTPUT_SCHEMA, as_output_batch
    from tierstream.schemas.codec import decode_batch, decoded_schema

    schema = OUTPUT_SCHEMA if decoder is None else decoded_schema(OUTPUT_SCHEMA, decoder, mode)
    wanted = {k: kwargs[k] for k in ("end", "data_dir", "broker", "auth_token", "key_ranges")}
    started = time.perf_counter()
    if wanted["end"] not in (None, "latest"):
        err.print(f"--to {wanted['end']}: the compaction snapshots may hold later versions, so "
                  "the log up to there is read and folded instead", highlight=False)
    rows, dropped = 0, [0]
    tmp = out_path.with_name(f".{out_path.name}.partial")
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer, \
                progress_bar(not quiet) as progress:
            progress.add_task("reading each key's latest value", total=None)
            for raw in tierstream.scan(topic, compacted=True, **wanted):
                batch = raw if decoder is None else decode_batch(raw, decoder, mode, topic,
                                                                 dropped)
                writer.write_batch(as_output_batch(batch, schema))
                rows += batch.num_rows
        tmp.replace(out_path)
    finally:
        tmp.unlink(missing_ok=True)
    if dropped[0]:
        err.print(f"dropped {dropped[0]:,} message(s) whose value could not be decoded "
                  "(--mode DROPMALFORMED)", highlight=False)
    err.print(f"wrote {rows:,} live key(s) to {out_path} in "
              f"{time.perf_counter() - started:.2f}s", highlight=False)
