"""Reading: ``consume`` (through the broker), ``plan`` and ``read`` (the local runner); the
Spark jobs ``backfill`` and ``tail`` are in ``spark_jobs.py``."""

from __future__ import annotations

import base64
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import typer
from rich.table import Table

from tierstream.cli.bounds import end_cut, parse_bound
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
    TimeFieldOpt,
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
from tierstream.errors import AckInDoubtError, ConfigError
from tierstream.model.positions import KeyRange, Offset, OffsetKind
from tierstream.options import DEFAULT_BROKER_URL, DEFAULT_DATA_DIR
from tierstream.runtime.event_time import check_time_field, event_time_window, within_event_time
from tierstream.schemas.codec import decode_batch, decoded_schema
from tierstream.splits.split import StreamCut
from tierstream.util.timeutil import parse_duration_ms


@app.command()
def consume(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    from_: Annotated[str, typer.Option("--from", help="earliest, latest, ISO-8601, epoch ms "
                                                      "or a position p:s:e[:b].")] = "earliest",
    to: Annotated[str | None, typer.Option("--to", help="Exclusive end (same forms); default "
                                                        "latest at start.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep reading new messages "
                                                               "(no --to).")] = False,
    key_range: Annotated[list[str] | None, typer.Option("--key-range", help="Only key hashes in "
                                                        "LO:HI (repeatable).")] = None,
    partition: Annotated[int | None, typer.Option(help="Only this partition.")] = None,
    limit: Annotated[int | None, typer.Option(help="Stop after N messages.")] = None,
    value_format: ValueFormatOpt = "raw",
    mode: ModeOpt = "FAILFAST",
    time_field: TimeFieldOpt = "publish_time",
    fail_on_data_loss: LossOpt = True,
    subscription: Annotated[str | None, typer.Option(
        "--subscription", "-s", help="Consume through this durable subscription: each printed "
        "batch is acknowledged; --from is where a new subscription starts.")] = None,
    type_: Annotated[str | None, typer.Option(
        "--type", help="Subscription type: exclusive (default), failover, shared or "
                       "key_shared.")] = None,
    consumer_name: Annotated[str | None, typer.Option(
        help="This consumer's name in the subscription (default: random).")] = None,
    idle: Annotated[str, typer.Option(
        help="With --subscription and no --follow: stop once nothing arrived for this "
             "long.")] = "2s",
    quiet: QuietOpt = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Print messages as JSON lines (value as UTF-8, or value_b64 when it is not text; with
    --value-format auto, the value decoded by the topic's schema). With --subscription, read
    as a consumer of that subscription (Pulsar's types: several shared or key_shared consumers
    split the messages), acknowledging what is printed; each line also carries its
    redelivery_count.

    Example: tierstream consume acme/web/clicks --from 2026-11-01T00:00:00Z --limit 10

    Example: tierstream consume acme/web/orders -s billing --type key_shared --follow

    A window that retention cut into fails naming what is gone (--skip-data-loss: print what
    survives and say on stderr what was skipped). A position in --from or --to names its
    partition, which is then the one read.
    """
    from tierstream.client import read

    start = parse_bound(from_, "--from", topic)
    if subscription is not None or type_ is not None or consumer_name is not None:
        if isinstance(start, StreamCut):
            raise ConfigError("--from with a subscription: earliest, latest or a time (a "
                              "subscription starts every partition alike); a cut starts a "
                              "read without --subscription")
        if subscription is None:
            raise ConfigError("--type and --consumer-name are for a subscription: give "
                              "--subscription NAME")
        for given, flag in ((to, "--to"), (partition, "--partition")):
            if given is not None:
                raise ConfigError(f"{flag} reads the log directly; a subscription "
                                  "(--subscription) reads every partition from where it is")
        if check_time_field(time_field, "--time-field") != "publish_time":
            raise ConfigError("--time-field event_time needs a bounded read, not a "
                              "subscription")
        _consume_subscription(topic, subscription, type_ or "exclusive", consumer_name,
                              start, key_range or [], follow, limit,
                              parse_duration_ms(idle, what="--idle") / 1000,
                              _decoder(topic, value_format, mode, broker, auth_token),
                              mode.upper(), broker, auth_token)
        return
    if follow and to is not None:
        raise ConfigError("--follow and --to exclude each other: --follow reads without end")
    end = None if follow else parse_bound(to or "latest", "--to", topic)
    if isinstance(start, Offset) and isinstance(end, Offset) and _ends_before_start(start, end):
        raise ConfigError(f"--to {to!r} is before --from {from_!r}: the window is empty")
    window = None
    if check_time_field(time_field, "--time-field") == "event_time":
        if follow:
            raise ConfigError("--follow reads by arrival; --time-field event_time needs a "
                              "bounded read")
        window = event_time_window(start, end)
        start, end = Offset.earliest(), Offset.latest()
    ranges = [KeyRange.parse(r) for r in key_range or []]
    if limit is not None and limit < 0:
        raise ConfigError(f"invalid --limit {limit}: expected >= 0")
    printed = 0
    name = topic
    decoder = _decoder(topic, value_format, mode, broker, auth_token)
    dropped = [0]
    batches = read(name, partition=partition, start=start, end=end, key_ranges=ranges,
                   broker=broker, auth_token=auth_token, fail_on_data_loss=fail_on_data_loss)
    # a bounded read into a file or a pipe shows how far it is on the terminal (when the
    # lines themselves go to the terminal, they show it)
    bar = progress_bar(end is not None and not quiet and not sys.stdout.isatty())
    task = bar.add_task("consuming (messages)", total=None)
    try:
        with bar:
            for raw in batches if window is None else within_event_time(batches, *window):
                batch = raw if decoder is None else decode_batch(raw, decoder, mode.upper(),
                                                                 name, dropped)
                for row in _rows(batch, name):
                    if limit is not None and printed >= limit:
                        return
                    sys.stdout.write(json.dumps(row) + "\n")
                    printed += 1
                sys.stdout.flush()
                bar.update(task, completed=printed)
                if limit is not None and printed >= limit:
                    return
    finally:
        batches.close()
        if dropped[0]:
            err.print(f"dropped {dropped[0]:,} message(s) whose value could not be decoded "
                      "(--mode DROPMALFORMED)", highlight=False)


def _ends_before_start(start: Offset, end: Offset) -> bool:
    """Whether ``[start, end)`` is empty whatever the log holds (a user's mix-up, refused
    rather than answered with nothing)."""
    import time

    if end.kind is OffsetKind.EARLIEST:
        return True  # nothing lies before the first message
    if start.kind is OffsetKind.TIME and end.kind is OffsetKind.TIME:
        assert start.time_ms is not None and end.time_ms is not None
        return end.time_ms < start.time_ms
    if start.kind is OffsetKind.LATEST and end.kind is OffsetKind.TIME:
        assert end.time_ms is not None
        return end.time_ms <= time.time() * 1000  # everything before now is before latest
    if start.kind is OffsetKind.POSITION and end.kind is OffsetKind.POSITION:
        assert start.position is not None and end.position is not None
        return start.position.partition == end.position.partition \
            and end.position < start.position
    return False


def _consume_subscription(topic: str, subscription: str, kind: str, consumer_name: str | None,
                          initial: Offset, key_range: list[str], follow: bool,
                          limit: int | None, idle_s: float, decoder: Any, mode: str,
                          broker: str, auth_token: str | None) -> None:
    """``consume --subscription``: print and acknowledge batch by batch (at least once: a
    batch is acknowledged after it is printed)."""
    from tierstream.client import Consumer
    from tierstream.model.subscription_type import SubscriptionType

    kind = SubscriptionType.parse(kind, "--type")
    if key_range and kind != SubscriptionType.KEY_SHARED:
        raise ConfigError(f"--key-range is for --type key_shared, not {kind}")
    if limit is not None and limit < 0:
        raise ConfigError(f"invalid --limit {limit}: expected >= 0")
    if initial.kind is OffsetKind.POSITION:
        raise ConfigError("--from with a subscription: earliest, latest or a time (a "
                          "position names one partition)")
    printed, dropped = 0, [0]
    with Consumer(topic, subscription, mode=kind, consumer_name=consumer_name,
                  key_ranges=[KeyRange.parse(r) for r in key_range] or None, initial=initial,
                  broker=broker, auth_token=auth_token) as consumer:
        try:
            while limit is None or printed < limit:
                raw = consumer.receive(timeout=None if follow else idle_s)
                if raw is None:
                    return
                if limit is not None:
                    raw = raw.slice(0, limit - printed)  # the rest goes to the others
                batch = raw if decoder is None else decode_batch(raw, decoder, mode, topic,
                                                                 dropped)
                for row in _rows(batch, topic):
                    sys.stdout.write(json.dumps(row) + "\n")
                    printed += 1
                sys.stdout.flush()
                try:
                    consumer.ack(raw)
                except AckInDoubtError as exc:  # stored; another consumer may have them too
                    err.print(f"[yellow]warning:[/yellow] {exc}", markup=True, highlight=False)
        finally:
            if dropped[0]:
                err.print(f"dropped {dropped[0]:,} message(s) whose value could not be "
                          "decoded (--mode DROPMALFORMED)", highlight=False)


def _decoder(topic: str, value_format: str, mode: str, broker: str, auth_token: str | None
             ) -> Any:
    """The decoder for --value-format auto (None for raw); bad values of either flag fail
    here, naming them."""
    from tierstream.read_options import ReadOptions

    options = ReadOptions.parse({"topic": topic, "valueFormat": value_format, "mode": mode,
                                 "broker": broker, **({"authToken": auth_token}
                                                      if auth_token else {})})
    if options.value_format == "raw":
        return None
    from tierstream.client import Admin
    from tierstream.schemas.codec import Decoder

    with Admin(broker, auth_token=auth_token) as admin:
        versions = admin.list_schemas(topic)[1]
    if not versions:
        raise ConfigError(f"--value-format auto: topic {topic!r} has no schema "
                          "(tierstream schema set)")
    return Decoder(versions)


def _rows(batch: pa.RecordBatch, topic: str) -> Iterator[dict[str, Any]]:
    for r in batch.to_pylist():
        value = r.pop("value")
        if not isinstance(value, bytes):  # decoded (--value-format auto), or null
            r["value"] = _jsonable(value)
        else:
            text = _text(value)
            if text is not None:
                r["value"] = text
            else:
                r["value_b64"] = base64.b64encode(value).decode()
        if isinstance(r.get("_corrupt_record"), bytes):
            r["_corrupt_record"] = base64.b64encode(r["_corrupt_record"]).decode()
        r["properties"] = dict(r["properties"]) if r["properties"] is not None else None
        yield {"topic": topic, **r}


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _text(value: bytes) -> str | None:
    """``value`` as text if it is UTF-8 text a terminal shows (Avro binary is often valid
    UTF-8 made of control characters: that is printed as value_b64), else None."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if _CONTROL.search(text) else text


def _jsonable(value: Any) -> Any:
    """A decoded value as JSON: bytes as base64, times as ISO-8601."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _query_kwargs(topic: str, from_: str, to: str, key_ranges: int, max_split_bytes: str | None,
                  reader: str | None, fail_on_data_loss: bool, data_dir: Path, broker: str,
                  auth_token: str | None) -> dict[str, Any]:
    from tierstream.options import parse_size

    kwargs: dict[str, Any] = {
        "start": parse_bound(from_, "--from", topic), "end": parse_bound(to, "--to", topic),
        "key_ranges": key_ranges, "reader": reader, "fail_on_data_loss": fail_on_data_loss,
        "data_dir": str(data_dir), "broker": broker, "auth_token": auth_token}
    if max_split_bytes is not None:
        kwargs["max_split_bytes"] = parse_size(max_split_bytes, what="--max-split-bytes")
    return kwargs


@app.command()
def plan(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    from_: FromOpt = "earliest",
    to: ToOpt = "latest",
    key_ranges: KeyRangesOpt = 1,
    max_split_bytes: SplitBytesOpt = None,
    reader: ReaderOpt = None,
    fail_on_data_loss: LossOpt = True,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines of splits.")] = False,
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Show the splits of a bounded read: which reader each got, and where. --to is pinned
    to a stream cut first, exactly as read and backfill do, so the three show the same plan
    of the same window; the cut is printed.

    Example: tierstream plan acme/web/clicks --from 2026-11-01 --to 2026-11-08 --key-ranges 4
    """
    import tierstream
    from tierstream.client import Admin

    kwargs = _query_kwargs(topic, from_, to, key_ranges, max_split_bytes, reader,
                           fail_on_data_loss, data_dir, broker, auth_token)
    with Admin(broker, auth_token=auth_token) as admin:
        cut = end_cut(admin, topic, kwargs["end"], start=kwargs["start"])
    if cut is not None:
        kwargs["end"] = cut
    splits = tierstream.plan(topic, **kwargs)
    if as_json:
        for sp in splits:
            sys.stdout.write(sp.to_json() + "\n")
        report_cut(cut, None)  # stderr: stdout stays JSON lines
        return
    table = Table("split", "partition", "segment", "reader", "key range", "entries",
                  "est. bytes", title=f"plan of {topic}")
    for sp in splits:
        entries = "tail" if sp.end is None else f"{sp.start.entry_id}..{sp.end.entry_id}"
        table.add_row(sp.split_id, str(sp.partition), str(sp.segment_id), sp.reader.value,
                      str(sp.key_range), entries, human_bytes(sp.estimated_bytes))
    out.print(table)
    for kind, count, nbytes in _summary(splits):
        out.print(f"{kind}: {count} split(s), ~{human_bytes(nbytes)}", highlight=False)
    report_cut(cut, None)


def _summary(splits: list[Any]) -> list[tuple[str, int, int]]:
    from tierstream.splits.split import ReaderKind

    return [(k.value, sum(1 for s in splits if s.reader is k),
             sum(s.estimated_bytes for s in splits if s.reader is k)) for k in ReaderKind]


@app.command("read")
def read_cmd(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    out_path: Annotated[Path, typer.Option("--out", help="Parquet file to write (new).")],
    from_: FromOpt = "earliest",
    to: ToOpt = "latest",
    key_ranges: KeyRangesOpt = 1,
    max_split_bytes: SplitBytesOpt = None,
    reader: ReaderOpt = None,
    fail_on_data_loss: LossOpt = True,
    cut_out: CutOutOpt = None,
    value_format: ValueFormatOpt = "raw",
    mode: ModeOpt = "FAILFAST",
    time_field: TimeFieldOpt = "publish_time",
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    quiet: QuietOpt = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tier_cache_size: TierCacheOpt = None,  # applied by its callback
    compacted: Annotated[bool, typer.Option(
        "--compacted", help="Each key's latest message (per partition), from the topic's "
                            "compaction snapshots and the log after them; a message with an "
                            "empty value removes its key. Takes no --from.")] = False,
) -> None:
    """Read a bounded window with the local runner into one new Parquet file (written
    atomically; times as UTC timestamps, as backfill writes them). Prints the end cut, from
    which `tail --from` or `read --from` continue with no gap and no duplicate; with
    --compacted, each key's latest value instead (and no cut).

    Example: tierstream read acme/web/clicks --from 2026-11-01 --to 2026-11-02 --out day1.parquet
    """
    import time

    import pyarrow.parquet as pq

    import tierstream
    from tierstream.client import Admin
    from tierstream.model.message_format import OUTPUT_SCHEMA, as_output_batch
    from tierstream.readers.stats import ReadStats
    from tierstream.runtime.local import run_splits

    if out_path.suffix != ".parquet":
        raise ConfigError(f"--out {str(out_path)!r} must end in .parquet")
    if out_path.exists():
        raise ConfigError(f"--out {str(out_path)!r} exists; choose a new file (nothing was "
                          "written)")
    check_output_path(out_path, "--out")
    check_output_path(cut_out, "--cut-out")
    ca = use_tls_ca(tls_ca)
    kwargs = _query_kwargs(topic, from_, to, key_ranges, max_split_bytes, reader,
                           fail_on_data_loss, data_dir, broker, auth_token)
    if compacted:
        from tierstream.cli.compaction import read_compacted

        if from_ != "earliest" or time_field != "publish_time" or cut_out is not None:
            raise ConfigError("--compacted reads each key's latest value: it takes no --from, "
                              "--time-field or --cut-out")
        read_compacted(topic, out_path, kwargs, _decoder(topic, value_format, mode, broker,
                                                         auth_token), mode.upper(), quiet)
        return
    window = None
    if check_time_field(time_field, "--time-field") == "event_time":
        window = event_time_window(kwargs["start"], kwargs["end"])
        kwargs["start"], kwargs["end"] = Offset.earliest(), Offset.latest()
    with Admin(broker, auth_token=auth_token, tls_ca=ca) as admin:
        cut = end_cut(admin, topic, kwargs["end"], start=kwargs["start"])
    if cut is not None:
        kwargs["end"] = cut  # planned up to exactly the cut this command reports
    decoder = _decoder(topic, value_format, mode, broker, auth_token)
    schema = OUTPUT_SCHEMA if decoder is None else decoded_schema(OUTPUT_SCHEMA, decoder,
                                                                  mode.upper())
    dropped = [0]
    splits = tierstream.plan(topic, **kwargs)
    stats = ReadStats()
    t0 = time.perf_counter()
    rows = nbytes = 0
    tmp = out_path.with_name(f".{out_path.name}.partial")
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer, \
                progress_bar(not quiet) as progress:
            task = progress.add_task("reading", total=sum(s.estimated_bytes for s in splits))
            batches = run_splits(splits, auth_token=auth_token, tls_ca=ca, stats=stats)
            if window is not None:
                batches = within_event_time(batches, *window)
            for raw in batches:
                batch = raw if decoder is None else decode_batch(raw, decoder, mode.upper(),
                                                                 topic, dropped)
                writer.write_batch(as_output_batch(batch, schema))
                rows += batch.num_rows
                nbytes += batch.nbytes
                progress.update(task, completed=min(nbytes, progress.tasks[0].total or 0))
        tmp.replace(out_path)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    for kind, count, _ in _summary(splits):
        if count:
            err.print(f"{kind}: {count} split(s)", highlight=False)
    err.print(f"read paths: {stats.summary()}", highlight=False)
    if dropped[0]:
        err.print(f"dropped {dropped[0]:,} message(s) whose value could not be decoded "
                  "(--mode DROPMALFORMED)", highlight=False)
    err.print(f"wrote {rows:,} rows ({human_bytes(nbytes)} in memory) to {out_path} in "
              f"{seconds:.2f}s", highlight=False)
    report_cut(cut, cut_out)
