"""The Spark jobs of the CLI: ``backfill`` (a bounded read written as Parquet or Iceberg) and
``tail`` (a Structured Streaming read until stopped)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierstream.cli.bounds import end_cut, parse_bound, spark_bound
from tierstream.cli.common import (
    BrokerOpt,
    CutOutOpt,
    DataDirOpt,
    FromOpt,
    KeyRangesOpt,
    LossOpt,
    ModeOpt,
    QuietOpt,
    ReaderOpt,
    SplitBytesOpt,
    TierCacheOpt,
    TlsCaOpt,
    TokenOpt,
    ToOpt,
    ValueFormatOpt,
    app,
    check_output_path,
    err,
    human_bytes,
    out,
    progress_bar,
    report_cut,
    use_tls_ca,
)
from tierstream.options import DEFAULT_BROKER_URL, DEFAULT_DATA_DIR


@app.command()
def backfill(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    out_path: Annotated[str, typer.Option("--out", help="Output directory, new.")],
    from_: FromOpt = "earliest",
    to: ToOpt = "latest",
    format_: Annotated[str, typer.Option(
        "--format", help="parquet (files in --out) or iceberg (a table at --out).")]
        = "parquet",
    table: Annotated[str | None, typer.Option(
        help="Iceberg table name, namespace.name \\[default: backfill.<topic>].")] = None,
    catalog_uri: Annotated[str | None, typer.Option(
        help="Iceberg catalog (SQLAlchemy URI) \\[default: sqlite in --out/catalog.db].")]
        = None,
    key_ranges: KeyRangesOpt = 1,
    max_split_bytes: SplitBytesOpt = None,
    reader: ReaderOpt = None,
    fail_on_data_loss: LossOpt = True,
    cut_out: CutOutOpt = None,
    value_format: ValueFormatOpt = "raw",
    mode: ModeOpt = "FAILFAST",
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    quiet: QuietOpt = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tier_cache_size: TierCacheOpt = None,
) -> None:
    """Run the backfill on Spark: a bounded read of the topic, written as Parquet files or
    as an Iceberg table. Nothing is left behind if it fails. Prints the end cut, from which
    `tail --from` continues with no gap and no duplicate.

    Example: tierstream backfill acme/web/clicks --from 2026-11-01 --to 2026-11-08
    --out ./clicks-week --key-ranges 4 --format iceberg
    """
    from tierstream.spark_adapter.jobs import backfill as run_backfill
    from tierstream.spark_adapter.jobs import check_target, local_spark, stop_spark

    check_target(out_path, format=format_, table=table, catalog_uri=catalog_uri)
    check_output_path(out_path, "--out")
    check_output_path(cut_out, "--cut-out")
    options = {"topic": topic, "dataDir": str(data_dir), "broker": broker,
               "keyRanges": str(key_ranges),
               "failOnDataLoss": "true" if fail_on_data_loss else "false",
               "valueFormat": value_format, "mode": mode}
    from tierstream.client import Admin

    ca = use_tls_ca(tls_ca)
    if tls_ca is not None:
        options["tlsCa"] = tls_ca
    start = parse_bound(from_, "--from", topic)
    end = parse_bound(to, "--to", topic)
    with Admin(broker, auth_token=auth_token, tls_ca=ca) as admin:
        cut = end_cut(admin, topic, end, start=start)
    options.update(spark_bound(start, "--from", "starting", "backfill"))
    options.update(spark_bound(end if cut is None else cut, "--to", "ending", "backfill"))
    if max_split_bytes is not None:
        from tierstream.options import parse_size

        options["maxSplitBytes"] = str(parse_size(max_split_bytes, what="--max-split-bytes"))
    if reader is not None:
        options["reader"] = reader
    if auth_token:
        options["authToken"] = auth_token
    if tier_cache_size:  # each executor's cache (one on a cluster's other hosts too)
        options["tierCacheSize"] = tier_cache_size
    spark = local_spark("tierstream-backfill")
    try:
        with progress_bar(not quiet) as progress:
            task = progress.add_task("spark tasks", total=None)
            result = run_backfill(spark, options, out_path, format=format_, table=table,
                                  catalog_uri=catalog_uri,
                                  progress=lambda d, t: progress.update(task, completed=d,
                                                                        total=t))
    finally:
        stop_spark(spark)
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(result.splits_by_reader.items()))
    rate = result.rows / result.seconds if result.seconds else 0.0
    out.print(f"backfill of {topic}: {result.rows:,} rows in {result.seconds:.1f}s "
              f"({rate:,.0f} rows/s); splits {summary or 'none'}; read "
              f"~{human_bytes(result.bytes_read)} of log, wrote "
              f"{human_bytes(result.bytes_written)} -> {result.out}", highlight=False)
    err.print(f"read paths: {result.read_stats.summary()}", highlight=False)
    if result.table is not None:
        out.print(f"Iceberg table {result.table} in {result.catalog_uri}; read it with "
                  f"SqlCatalog('default', uri='{result.catalog_uri}').load_table('{result.table}')"
                  f" or spark.read.parquet('{result.out}/data')", highlight=False)
    report_cut(cut, cut_out)


@app.command("tail")
def tail_cmd(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    out_path: Annotated[str, typer.Option(
        "--out", help="Output directory: Parquet files, or the Iceberg table's location.")],
    checkpoint: Annotated[str, typer.Option(help="Checkpoint directory (restarts continue "
                                                 "exactly from it).")],
    format_: Annotated[str, typer.Option(
        "--format", help="parquet (Spark's file sink) or iceberg (one table commit per "
                         "micro-batch, idempotent by batch id).")] = "parquet",
    table: Annotated[str | None, typer.Option(
        help="Iceberg table name, namespace.name \\[default: tail.<topic>].")] = None,
    catalog_uri: Annotated[str | None, typer.Option(
        help="Iceberg catalog (SQLAlchemy URI) \\[default: sqlite in --out/catalog.db].")]
        = None,
    from_: FromOpt = "latest",
    available_now: Annotated[bool, typer.Option(
        "--available-now", help="Write what is there now (in micro-batches), then stop.")]
        = False,
    max_records_per_trigger: Annotated[int | None, typer.Option(
        help="At most this many messages per micro-batch.")] = None,
    subscription: Annotated[str | None, typer.Option(
        help="Durable cursor the stream advances \\[default: derived from --checkpoint, so "
             "each query has its own].")] = None,
    key_ranges: KeyRangesOpt = 1,
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
) -> None:
    """Run a Structured Streaming read of the topic into Parquet or Iceberg until stopped.

    Ctrl-C stops it after the last committed micro-batch (exit 130) and removes what a batch
    it cut short had written. With --format parquet, only readers that honour Spark's
    _spark_metadata log (Spark) see each message once after a crash: a batch killed
    mid-write leaves files that pyarrow or DuckDB count. --format iceberg commits each
    micro-batch to the table once, so every Iceberg reader sees each message once.

    Example: tierstream tail acme/web/clicks --out ./clicks-live --checkpoint ./ckpt
    """
    from tierstream.client import Admin
    from tierstream.errors import ConfigError
    from tierstream.spark_adapter.jobs import (
        FORMATS,
        checkpoint_subscription,
        local_spark,
        stop_spark,
    )
    from tierstream.spark_adapter.tail import tail as run_tail

    # everything a user can get wrong is checked before Spark starts (a typo costs a JVM)
    if format_ not in FORMATS:
        raise ConfigError(f"invalid --format {format_!r}: expected one of {', '.join(FORMATS)}")
    if format_ == "parquet" and (table is not None or catalog_uri is not None):
        raise ConfigError("--table and --catalog-uri are for --format iceberg only")
    check_output_path(out_path, "--out")
    check_output_path(checkpoint, "--checkpoint")
    with Admin(broker, auth_token=auth_token, tls_ca=use_tls_ca(tls_ca)) as admin:
        admin.get_topic(topic)  # NotFoundError naming it
    options = {"topic": topic, "dataDir": str(data_dir), "broker": broker,
               "keyRanges": str(key_ranges),
               "subscription": subscription or checkpoint_subscription(checkpoint),
               "cursorLabel": f"tierstream tail --checkpoint {Path(checkpoint).absolute()}",
               **spark_bound(parse_bound(from_, "--from", topic), "--from", "starting", "tail")}
    if max_records_per_trigger is not None:
        options["maxRecordsPerTrigger"] = str(max_records_per_trigger)
    if auth_token:
        options["authToken"] = auth_token
    if use_tls_ca(tls_ca) is not None:
        options["tlsCa"] = str(tls_ca)
    from tierstream.spark_adapter.lag import QueryLag, watch_lag

    def on_lag(lag: QueryLag) -> None:
        if lag.rows:
            err.print(f"micro-batch {lag.batch_id}: {lag.rows:,} rows; {lag.describe()}",
                      highlight=False)

    spark = local_spark("tierstream-tail")
    # the query's lag after each micro-batch: on this console, in the log, and in the
    # broker's metrics (tierstream_query_lag_messages)
    listener = watch_lag(spark, broker=broker, auth_token=auth_token,
                         tls_ca=use_tls_ca(tls_ca), on_lag=on_lag)
    try:
        result = run_tail(spark, options, out_path, checkpoint, available_now=available_now,
                          format=format_, table=table, catalog_uri=catalog_uri)
    finally:
        listener.close()
        stop_spark(spark)
    out.print(f"tail of {topic}: {result.batches} micro-batch(es) with rows -> {out_path}",
              highlight=False)
    if result.interrupted:
        cut = f"; removed what the micro-batch it cut short had written ({result.removed} " \
            "file(s))" if result.removed else ""
        err.print(f"interrupted: stopped after the last committed micro-batch{cut}; the same "
                  f"command with --checkpoint {checkpoint} continues from there",
                  highlight=False)
        raise typer.Exit(130)
