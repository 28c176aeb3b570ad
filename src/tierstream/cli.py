"""The ``tierstream`` command line (typer + rich).

Every command that talks to a broker takes ``--broker`` (env ``TIERSTREAM_BROKER``); every
command that opens the store directly takes ``--data-dir`` (env ``TIERSTREAM_HOME``).
Errors are one line on stderr naming the bad value; exit status 2 for bad input, 1 otherwise.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from tierstream.bounds import end_cut, parse_bound, spark_bound, write_cut
from tierstream.errors import ConfigError, TierstreamError
from tierstream.options import DEFAULT_BROKER_URL, DEFAULT_DATA_DIR, DEFAULT_PORT
from tierstream.splits.positions import KeyRange, Offset, OffsetKind
from tierstream.timeutil import format_ms, parse_time_ms

app = typer.Typer(
    name="tierstream",
    help="Read a tiered, Pulsar-shaped event log with one source API for batch and stream.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
broker_app = typer.Typer(help="Run the embedded broker.", no_args_is_help=True)
topic_app = typer.Typer(help="Create, list, change and delete topics.", no_args_is_help=True)
app.add_typer(broker_app, name="broker")
app.add_typer(topic_app, name="topic")

# Tables stay readable when piped (rich would otherwise squeeze them to 80 columns).
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

BrokerOpt = Annotated[str, typer.Option(
    "--broker", envvar="TIERSTREAM_BROKER", help="Broker URL.", show_default=True)]
DataDirOpt = Annotated[Path, typer.Option(
    "--data-dir", envvar="TIERSTREAM_HOME", help="Data directory of the embedded store.")]
TokenOpt = Annotated[str | None, typer.Option(
    "--auth-token", envvar="TIERSTREAM_AUTH_TOKEN", show_envvar=True,
    help="Bearer token (required when the broker binds a non-loopback address).")]


def main(argv: list[str] | None = None) -> None:
    """Entry point. Every error is one line on stderr and an exit status: 2 for a usage error or
    bad input, 1 for a broker, storage or environment problem, 130 when interrupted. A Python
    traceback appears only with ``--debug`` (anywhere on the command line) or
    ``TIERSTREAM_DEBUG=1``."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("TIERSTREAM_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    if debug:
        os.environ["TIERSTREAM_DEBUG"] = "1"  # Spark jobs keep Spark's trace too
        logging.getLogger("tierstream").setLevel(logging.DEBUG)
    try:
        code = app(args=args, prog_name="tierstream", standalone_mode=False)
    except typer.Exit as exc:
        code = exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        err.print("interrupted")
        code = 130
    except BrokenPipeError:  # e.g. `tierstream consume ... | head`: the reader left
        sys.stderr.close()
        code = 0
    except typer.TyperException as exc:  # typer's (vendored click's) usage errors
        if debug:
            raise
        code = _usage_error(exc, args)
    except TierstreamError as exc:
        if debug:
            raise
        _error_line(str(exc))
        code = 2 if isinstance(exc, ConfigError) else 1
    except Exception as exc:  # a bug: say so in one line, the traceback is one flag away
        if debug:
            raise
        _error_line(f"unexpected {type(exc).__name__}: {exc} (run again with --debug for the "
                    "traceback, and please report it)")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


def _error_line(message: str) -> None:
    err.print(f"[red]error:[/red] {' '.join(message.split())}", markup=True, highlight=False)


def _usage_error(exc: Any, args: list[str]) -> int:
    """One line for a usage error, naming the bad value where the parser did not."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "tierstream"
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
        text = ctx.get_help()  # a bare group: show what it offers (typer prints it itself)
        if text:
            out.print(text, highlight=False)
        return 2
    message = exc.format_message()
    if type(exc).__name__ == "NoSuchOption":
        import difflib

        close = difflib.get_close_matches(str(exc.option_name), list(exc.possibilities or []), 1)
        message = f"no such option {exc.option_name}" + (
            f"; did you mean {close[0]}?" if close else "")
    param = getattr(exc, "param", None)
    if type(exc).__name__ == "BadParameter" and param is not None:
        given = _given(args, list(getattr(param, "opts", [])))
        if given is not None:
            message = f"{message} (got {given!r})"
    _error_line(f"{message} (see '{command} --help')")
    return int(getattr(exc, "exit_code", 2) or 2)


def _given(args: list[str], opts: list[str]) -> str | None:
    for i, a in enumerate(args):
        for opt in opts:
            if a == opt and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(opt + "="):
                return a[len(opt) + 1:]
    return None


def _version(value: bool) -> None:
    if value:
        from tierstream import __version__

        out.print(f"tierstream {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Read a tiered, Pulsar-shaped event log with one source API for batch and stream.

    Errors are one line; add --debug anywhere for a traceback.
    """


# -- broker -----------------------------------------------------------------------------------

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


# -- topics -----------------------------------------------------------------------------------

@topic_app.command("create")
def topic_create(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    partitions: Annotated[int, typer.Option(help="Number of partitions (>= 1).")] = 1,
    retention: Annotated[str | None, typer.Option(
        help="Delete segments whose newest message is older than this, e.g. 30d.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Create a topic.

    Example: tierstream topic create acme/web/clicks --partitions 4 --retention 30d
    """
    from tierstream.store.client import Admin
    from tierstream.timeutil import parse_duration_ms

    retention_ms = None if retention is None else parse_duration_ms(retention,
                                                                     what="--retention")
    with Admin(broker, auth_token=auth_token) as admin:
        record = admin.create_topic(topic, partitions, retention_ms=retention_ms)
    out.print(f"created {record.name} with {record.partitions} partition(s)", highlight=False)


@topic_app.command("delete")
def topic_delete(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Delete a topic and all its data: segments on the bookies, tier files, its Iceberg
    table, cursors. Crash-safe: an interrupted deletion finishes when the broker restarts.

    Example: tierstream topic delete acme/web/huge --yes
    """
    from tierstream.store.client import Admin

    if not yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"deleting {topic!r} removes all its data: add --yes to confirm")
        typer.confirm(f"Delete {topic} and all its data?", abort=True)
    with Admin(broker, auth_token=auth_token) as admin:
        record = admin.delete_topic(topic)
    out.print(f"deleted {record.name} ({record.partitions} partition(s))", highlight=False)


@topic_app.command("set")
def topic_set(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    retention: Annotated[str, typer.Option(
        help="Delete segments whose newest message is older than this, e.g. 30d; 'none' "
             "keeps everything.")],
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Change a topic's settings.

    Example: tierstream topic set acme/web/clicks --retention 30d
    """
    from tierstream.store.client import Admin
    from tierstream.timeutil import parse_duration_ms

    retention_ms = None if retention.strip().lower() == "none" else parse_duration_ms(
        retention, what="--retention")
    with Admin(broker, auth_token=auth_token) as admin:
        record = admin.set_retention(topic, retention_ms)
    shown = "none (keep everything)" if record.retention_ms is None else retention
    out.print(f"{record.name}: retention {shown}", highlight=False)


@topic_app.command("list")
def topic_list(
    namespace: Annotated[str | None, typer.Option(help="Only topics of tenant/namespace.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """List topics.

    Example: tierstream topic list --namespace acme/web
    """
    from tierstream.store.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        topics = admin.list_topics(namespace)
    table = Table("topic", "partitions", "created")
    for t in topics:
        table.add_row(t.name, str(t.partitions), format_ms(t.created_at))
    out.print(table)


# -- produce ----------------------------------------------------------------------------------

@app.command()
def produce(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    generate: Annotated[int | None, typer.Option(help="Generate N synthetic messages instead "
                                                      "of reading JSON lines from stdin.")] = None,
    keys: Annotated[int, typer.Option(help="Distinct keys for --generate.")] = 100,
    start_time: Annotated[str | None, typer.Option(help="Publish time of the first generated "
                                                        "message (ISO-8601 or epoch ms).")] = None,
    step_ms: Annotated[int, typer.Option(help="Publish-time step between generated "
                                              "messages.")] = 0,
    value_size: Annotated[int, typer.Option(help="Approximate bytes per generated value.")] = 100,
    batch_size: Annotated[int, typer.Option(help="Messages per batch (entry).")] = 1000,
    producer_name: Annotated[str | None, typer.Option("--name", help="Producer name (for "
                                                                     "de-duplication).")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Produce messages: JSON lines from stdin, or --generate N synthetic clicks.

    A stdin line is {"value": "...", "key": "...", "event_time": ms, "properties": {...},
    "publish_time": ms} (only value is required; "value_b64" for binary values). Lines are
    sent as they arrive (batched for up to 50 ms or --batch-size lines), so a live source can
    be piped in. Each line is checked: at a bad one, everything before it has been sent and
    nothing after it is, and the error names the line.

    Example: tierstream produce acme/web/clicks --generate 100000 --keys 50
    --start-time 2026-11-01T00:00:00Z --step-ms 60
    """
    from tierstream.store.client import Producer

    if generate is not None and generate < 0:
        raise ConfigError(f"invalid --generate {generate}: expected a count >= 0")
    if keys < 1:
        raise ConfigError(f"invalid --keys {keys}: expected >= 1")
    if step_ms < 0:
        raise ConfigError(f"invalid --step-ms {step_ms}: expected >= 0")
    t0 = parse_time_ms(start_time, what="--start-time") if start_time is not None else None
    if batch_size < 1:
        raise ConfigError(f"invalid --batch-size {batch_size}: expected >= 1")
    total: int | None
    if generate is None:
        total = None
        stdin = _stdin_batches(batch_size, linger_s=0.05)
        first = next(stdin, None)  # the first lines are read and checked before connecting
        chunks: Iterator[list[dict[str, Any]]] = itertools.chain(
            [first] if first is not None else [], stdin)
    else:
        total = generate
        chunks = _chunked(_generated(generate, keys, t0, step_ms, value_size), batch_size * 8)
    sent = 0
    with Producer(topic, broker=broker, auth_token=auth_token, name=producer_name,
                  batch_size=batch_size) as producer, \
            _progress(total is not None and total > 50_000) as progress:
        task = progress.add_task("producing", total=total)
        try:
            for chunk in chunks:
                producer.send_many(chunk)
                sent += len(chunk)
                progress.update(task, completed=sent)
        except ConfigError as exc:
            if generate is None:
                raise ConfigError(f"{exc}; the {sent} message(s) before it were sent to "
                                  f"{topic}, none after it") from None
            raise
    err.print(f"produced {sent} message(s) to {topic}", highlight=False)


def _stdin_batches(batch_size: int, *, linger_s: float) -> Iterator[list[dict[str, Any]]]:
    """Checked messages from stdin lines as they arrive: a batch goes out when it has
    ``batch_size`` lines or its first line waited ``linger_s``. A bad line ends it, after the
    lines before it were handed out."""
    import queue
    import threading
    import time

    lines: queue.Queue[tuple[int, str] | None] = queue.Queue(maxsize=4 * batch_size)

    def read() -> None:  # a thread, so that lingering does not wait on a blocking readline
        try:
            for lineno, line in enumerate(sys.stdin, 1):
                lines.put((lineno, line))
        finally:
            lines.put(None)

    threading.Thread(target=read, name="tierstream-stdin", daemon=True).start()
    batch: list[dict[str, Any]] = []
    deadline = 0.0
    while True:
        try:
            item = lines.get(timeout=max(0.0, deadline - time.monotonic()) if batch else None)
        except queue.Empty:
            yield batch
            batch = []
            continue
        if item is None:
            if batch:
                yield batch
            return
        try:
            message = _stdin_message(*item)
        except ConfigError:
            if batch:
                yield batch
            raise
        if message is None:
            continue
        if not batch:
            deadline = time.monotonic() + linger_s
        batch.append(message)
        if len(batch) >= batch_size:
            yield batch
            batch = []


def _stdin_message(lineno: int, line: str) -> dict[str, Any] | None:
    """One stdin line as a message (None for a blank line); ConfigError naming the line."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        raise ConfigError(f"stdin line {lineno} is not JSON: {line.strip()[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"stdin line {lineno}: expected a JSON object, got {line[:80]!r}")
    unknown = set(obj) - {"value", "value_b64", "key", "event_time", "properties",
                          "publish_time"}
    if unknown:
        raise ConfigError(f"stdin line {lineno}: unknown field(s) {sorted(unknown)}")
    if "value_b64" in obj:
        try:
            value = base64.b64decode(obj["value_b64"], validate=True)
        except (ValueError, TypeError):
            raise ConfigError(f"stdin line {lineno}: value_b64 is not base64") from None
    elif isinstance(obj.get("value"), str):
        value = obj["value"].encode()
    else:
        raise ConfigError(f"stdin line {lineno}: needs a string 'value' (or 'value_b64')")
    key = obj.get("key")
    if key is not None and not isinstance(key, str):
        raise ConfigError(f"stdin line {lineno}: key must be a string, got {key!r}")
    props = obj.get("properties")
    if props is not None and not (isinstance(props, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in props.items())):
        raise ConfigError(f"stdin line {lineno}: properties must map strings to strings")
    times = {}
    for f in ("event_time", "publish_time"):
        if obj.get(f) is not None:
            times[f] = parse_time_ms(obj[f], what=f"{f} on stdin line {lineno}")
    return {"value": value, "key": key, "properties": props, **times}


def _generated(n: int, keys: int, t0: int | None, step_ms: int, value_size: int
               ) -> Iterator[dict[str, Any]]:
    pages = ["/", "/search", "/product", "/cart", "/checkout", "/help"]
    pad = "x" * max(0, value_size - 60)
    for i in range(n):
        t = None if t0 is None else t0 + i * step_ms
        user = f"user-{(i * 7919) % keys:05d}"
        value = json.dumps({"user": user, "page": pages[i % len(pages)], "n": i, "pad": pad})
        yield {"value": value.encode(), "key": user, "publish_time": t, "event_time": t,
               "properties": {"source": "generator"}}


def _chunked(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in it:
        chunk.append(item)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _progress(show: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=err, disable=not show or not err.is_terminal,
                    transient=True)


# -- consume ----------------------------------------------------------------------------------

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
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Print messages as JSON lines (value as UTF-8, or value_b64 when it is not text).

    Example: tierstream consume acme/web/clicks --from 2026-11-01T00:00:00Z --limit 10
    """
    from tierstream.store.client import read

    start = Offset.parse(from_, what="--from")
    if follow and to is not None:
        raise ConfigError("--follow and --to exclude each other: --follow reads without end")
    end = None if follow else Offset.parse(to or "latest", what="--to")
    if start.kind is OffsetKind.TIME and end is not None and end.kind is OffsetKind.TIME \
            and end.time_ms is not None and start.time_ms is not None \
            and end.time_ms < start.time_ms:
        raise ConfigError(f"--to {to!r} is before --from {from_!r}")
    ranges = [KeyRange.parse(r) for r in key_range or []]
    if limit is not None and limit < 0:
        raise ConfigError(f"invalid --limit {limit}: expected >= 0")
    printed = 0
    name = topic
    batches = read(name, partition=partition, start=start, end=end, key_ranges=ranges,
                   broker=broker, auth_token=auth_token)
    try:
        for batch in batches:
            for row in _rows(batch, name):
                if limit is not None and printed >= limit:
                    return
                sys.stdout.write(json.dumps(row) + "\n")
                printed += 1
            sys.stdout.flush()
            if limit is not None and printed >= limit:
                return
    finally:
        batches.close()


def _rows(batch: pa.RecordBatch, topic: str) -> Iterator[dict[str, Any]]:
    for r in batch.to_pylist():
        value = r.pop("value")
        try:
            r["value"] = value.decode("utf-8")
        except UnicodeDecodeError:
            r["value_b64"] = base64.b64encode(value).decode()
        r["properties"] = dict(r["properties"]) if r["properties"] is not None else None
        yield {"topic": topic, **r}


# -- segments ---------------------------------------------------------------------------------

@app.command()
def segments(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
) -> None:
    """Show the segments of a topic, read from the metadata store (the open segment's stats
    lag by at most a second).

    Example: tierstream segments acme/web/clicks --data-dir ./tierstream-data
    """
    from tierstream.names import TopicName
    from tierstream.store.metadata import MetadataStore

    name = TopicName.parse(topic)
    meta = MetadataStore(Path(data_dir) / "metadata.db", read_only=True)
    try:
        meta.get_topic(name)
        records = meta.segments(str(name))
    finally:
        meta.close()
    if as_json:
        sys.stdout.write(json.dumps([r.to_dict() for r in records], indent=2) + "\n")
        return
    table = Table("partition", "segment", "state", "entries", "messages", "bytes",
                  "min publish time", "max publish time", "lives in", title=str(name))
    for r in records:
        table.add_row(str(r.partition), str(r.segment_id), r.state, str(r.entries),
                      str(r.messages), _human_bytes(r.bytes), format_ms(r.min_publish_time),
                      format_ms(r.max_publish_time), r.location)
    out.print(table)


@app.command()
def subscriptions(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Show each subscription's durable cursor per partition: where it is (everything before
    it is acknowledged), its backlog (messages after it), and who is attached. A Spark stream
    commits to its own subscription (tierstream tail: derived from --checkpoint).

    Example: tierstream subscriptions acme/web/clicks
    """
    from tierstream.store.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        rows = admin.subscriptions(topic)
    if as_json:
        sys.stdout.write(json.dumps([{**r, "position": str(r["position"])} for r in rows],
                                    indent=2) + "\n")
        return
    table = Table("subscription", "partition", "cursor", "backlog", "key ranges", "consumers",
                  "updated", title=str(topic))
    for r in rows:
        table.add_row(r["subscription"], str(r["partition"]), str(r["position"]),
                      f"{r['backlog']:,}", str(r["key_ranges"]),
                      ", ".join(r["consumers"]) or "-", format_ms(r["updated_at"]))
    out.print(table if rows else f"{topic} has no subscriptions")


@app.command()
def seal(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    partition: Annotated[int | None, typer.Option(help="Only this partition.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Seal the open segment(s) now (a new one opens).

    Example: tierstream seal acme/web/clicks --partition 0
    """
    from tierstream.store.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        sealed = admin.seal(topic, partition)
    out.print(f"sealed {len(sealed)} segment(s)", highlight=False)


@app.command()
def demo(
    data_dir: Annotated[Path | None, typer.Option(help="Keep the demo's data here (default: a "
                                                       "fresh temporary directory).")] = None,
    messages: Annotated[int, typer.Option(help="Messages to produce.")] = 200_000,
) -> None:
    """Run the end-to-end tour on a fresh embedded store (what `make demo` runs).

    Example: tierstream demo --messages 50000
    """
    from tierstream.demo import run

    if data_dir is not None and data_dir.exists() and any(data_dir.iterdir()):
        raise ConfigError(f"--data-dir {str(data_dir)!r} is not empty; the demo needs a fresh one")
    if messages < 1000:
        raise ConfigError(f"invalid --messages {messages}: expected >= 1000")
    run(data_dir, messages)


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


FromOpt = Annotated[str, typer.Option("--from", help="earliest, latest, ISO-8601, epoch ms, "
                                                     "p:s:e or a stream cut (JSON or @FILE).")]
ToOpt = Annotated[str, typer.Option("--to", help="Exclusive end: latest (at planning), a time, "
                                                 "a position or a stream cut.")]
CutOutOpt = Annotated[Path | None, typer.Option(
    "--cut-out", help="Also write the end cut to this file (for a later --from @FILE).")]
KeyRangesOpt = Annotated[int, typer.Option(help="Split every partition into K key ranges.")]
SplitBytesOpt = Annotated[str | None, typer.Option(help="Target split size, e.g. 64MiB.")]
ReaderOpt = Annotated[str | None, typer.Option(help="Force a reader: parquet-tier, bookie-log "
                                                    "or tail-consumer.")]
LossOpt = Annotated[bool, typer.Option("--fail-on-data-loss/--skip-data-loss",
                                       help="Fail (default) or skip when data is gone.")]


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
    auth_token: TokenOpt = None,
) -> None:
    """Show the splits of a bounded read: which reader each got, and where.

    Example: tierstream plan acme/web/clicks --from 2026-11-01 --to 2026-11-08 --key-ranges 4
    """
    import tierstream

    splits = tierstream.plan(topic, **_query_kwargs(topic, from_, to, key_ranges,
                                                    max_split_bytes,
                                                    reader, fail_on_data_loss, data_dir,
                                                    broker, auth_token))
    if as_json:
        for sp in splits:
            sys.stdout.write(sp.to_json() + "\n")
        return
    table = Table("split", "partition", "segment", "reader", "key range", "entries",
                  "est. bytes", title=f"plan of {topic}")
    for sp in splits:
        entries = "tail" if sp.end is None else f"{sp.start.entry_id}..{sp.end.entry_id}"
        table.add_row(sp.split_id, str(sp.partition), str(sp.segment_id), sp.reader.value,
                      str(sp.key_range), entries, _human_bytes(sp.estimated_bytes))
    out.print(table)
    for kind, count, nbytes in _summary(splits):
        out.print(f"{kind}: {count} split(s), ~{_human_bytes(nbytes)}", highlight=False)


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
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Read a bounded window with the local runner into one new Parquet file (written
    atomically; times as UTC timestamps, as backfill writes them). Prints the end cut, from
    which `tail --from` or `read --from` continue with no gap and no duplicate.

    Example: tierstream read acme/web/clicks --from 2026-11-01 --to 2026-11-02 --out day1.parquet
    """
    import time

    import pyarrow.parquet as pq

    import tierstream
    from tierstream.local import run_splits
    from tierstream.schema import OUTPUT_SCHEMA, as_output_batch
    from tierstream.store.client import Admin

    if out_path.suffix != ".parquet":
        raise ConfigError(f"--out {str(out_path)!r} must end in .parquet")
    if out_path.exists():
        raise ConfigError(f"--out {str(out_path)!r} exists; choose a new file (nothing was "
                          "written)")
    if not out_path.parent.exists():
        raise ConfigError(f"--out directory {str(out_path.parent)!r} does not exist")
    kwargs = _query_kwargs(topic, from_, to, key_ranges, max_split_bytes, reader,
                           fail_on_data_loss, data_dir, broker, auth_token)
    with Admin(broker, auth_token=auth_token) as admin:
        cut = end_cut(admin, topic, kwargs["end"])
    if cut is not None:
        kwargs["end"] = cut  # planned up to exactly the cut this command reports
    splits = tierstream.plan(topic, **kwargs)
    t0 = time.perf_counter()
    rows = nbytes = 0
    tmp = out_path.with_name(f".{out_path.name}.partial")
    try:
        with pq.ParquetWriter(tmp, OUTPUT_SCHEMA, compression="zstd") as writer, \
                _progress(True) as progress:
            task = progress.add_task("reading", total=sum(s.estimated_bytes for s in splits))
            for batch in run_splits(splits, auth_token=auth_token):
                writer.write_batch(as_output_batch(batch))
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
    err.print(f"wrote {rows:,} rows ({_human_bytes(nbytes)} in memory) to {out_path} in "
              f"{seconds:.2f}s", highlight=False)
    _report_cut(cut, cut_out)


def _report_cut(cut: Any, cut_out: Path | None) -> None:
    """Print the end cut (and write it to ``cut_out``): where a next read starts."""
    if cut is None:
        return
    if cut_out is not None:
        write_cut(cut, cut_out)
        err.print(f"end cut written to {cut_out} (continue with --from @{cut_out})",
                  highlight=False)
    err.print(f"end cut: {cut.to_json()}", highlight=False, soft_wrap=True)


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
        help="Iceberg table name, namespace.name [default: backfill.<topic>].")] = None,
    catalog_uri: Annotated[str | None, typer.Option(
        help="Iceberg catalog (SQLAlchemy URI) [default: sqlite in --out/catalog.db].")]
        = None,
    key_ranges: KeyRangesOpt = 1,
    max_split_bytes: SplitBytesOpt = None,
    reader: ReaderOpt = None,
    fail_on_data_loss: LossOpt = True,
    cut_out: CutOutOpt = None,
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Run the backfill on Spark: a bounded read of the topic, written as Parquet files or
    as an Iceberg table. Nothing is left behind if it fails. Prints the end cut, from which
    `tail --from` continues with no gap and no duplicate.

    Example: tierstream backfill acme/web/clicks --from 2026-11-01 --to 2026-11-08
    --out ./clicks-week --key-ranges 4 --format iceberg
    """
    from tierstream.spark_adapter.jobs import backfill as run_backfill
    from tierstream.spark_adapter.jobs import local_spark

    options = {"topic": topic, "dataDir": str(data_dir), "broker": broker,
               "keyRanges": str(key_ranges),
               "failOnDataLoss": "true" if fail_on_data_loss else "false"}
    from tierstream.store.client import Admin

    start = parse_bound(from_, "--from", topic)
    end = parse_bound(to, "--to", topic)
    with Admin(broker, auth_token=auth_token) as admin:
        cut = end_cut(admin, topic, end)
    options.update(spark_bound(start, "--from", "starting", "backfill"))
    options.update(spark_bound(end if cut is None else cut, "--to", "ending", "backfill"))
    if max_split_bytes is not None:
        from tierstream.options import parse_size

        options["maxSplitBytes"] = str(parse_size(max_split_bytes, what="--max-split-bytes"))
    if reader is not None:
        options["reader"] = reader
    if auth_token:
        options["authToken"] = auth_token
    from tierstream.spark_adapter.jobs import FORMATS

    if format_ not in FORMATS:
        raise ConfigError(f"invalid --format {format_!r}: expected one of {', '.join(FORMATS)}")
    spark = local_spark("tierstream-backfill")
    try:
        with _progress(True) as progress:
            task = progress.add_task("spark tasks", total=None)
            result = run_backfill(spark, options, out_path, format=format_, table=table,
                                  catalog_uri=catalog_uri,
                                  progress=lambda d, t: progress.update(task, completed=d,
                                                                        total=t))
    finally:
        spark.stop()
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(result.splits_by_reader.items()))
    rate = result.rows / result.seconds if result.seconds else 0.0
    out.print(f"backfill of {topic}: {result.rows:,} rows in {result.seconds:.1f}s "
              f"({rate:,.0f} rows/s); splits {summary or 'none'}; read "
              f"~{_human_bytes(result.bytes_read)} of log, wrote "
              f"{_human_bytes(result.bytes_written)} -> {result.out}", highlight=False)
    if result.table is not None:
        out.print(f"Iceberg table {result.table} in {result.catalog_uri}; read it with "
                  f"SqlCatalog('default', uri='{result.catalog_uri}').load_table('{result.table}')"
                  f" or spark.read.parquet('{result.out}/data')", highlight=False)
    _report_cut(cut, cut_out)


@app.command("tail")
def tail_cmd(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    out_path: Annotated[str, typer.Option("--out", help="Output directory (Parquet sink).")],
    checkpoint: Annotated[str, typer.Option(help="Checkpoint directory (restarts continue "
                                                 "exactly from it).")],
    from_: FromOpt = "latest",
    available_now: Annotated[bool, typer.Option(
        "--available-now", help="Write what is there now (in micro-batches), then stop.")]
        = False,
    max_records_per_trigger: Annotated[int | None, typer.Option(
        help="At most this many messages per micro-batch.")] = None,
    subscription: Annotated[str | None, typer.Option(
        help="Durable cursor the stream advances [default: derived from --checkpoint, so "
             "each query has its own].")] = None,
    key_ranges: KeyRangesOpt = 1,
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Run a Structured Streaming read of the topic into Parquet until stopped (Ctrl-C).

    Example: tierstream tail acme/web/clicks --out ./clicks-live --checkpoint ./ckpt
    """
    from tierstream.spark_adapter.jobs import checkpoint_subscription, local_spark
    from tierstream.spark_adapter.jobs import tail as run_tail

    options = {"topic": topic, "dataDir": str(data_dir), "broker": broker,
               "keyRanges": str(key_ranges),
               "subscription": subscription or checkpoint_subscription(checkpoint),
               **spark_bound(parse_bound(from_, "--from", topic), "--from", "starting", "tail")}
    if max_records_per_trigger is not None:
        options["maxRecordsPerTrigger"] = str(max_records_per_trigger)
    if auth_token:
        options["authToken"] = auth_token
    from tierstream.store.client import Admin

    def on_batch(batch_id: int, rows: int, progress: dict[str, Any]) -> None:
        err.print(f"micro-batch {batch_id}: {rows:,} rows; {_lag(admin, topic, sub)}",
                  highlight=False)

    sub = options["subscription"]
    spark = local_spark("tierstream-tail")
    try:
        with Admin(broker, auth_token=auth_token) as admin:
            batches = run_tail(spark, options, out_path, checkpoint,
                               available_now=available_now, on_batch=on_batch)
    finally:
        spark.stop()
    out.print(f"tail of {topic}: {batches} micro-batch(es) with rows -> {out_path}",
              highlight=False)


def _lag(admin: Any, topic: str, subscription: str) -> str:
    """How far the stream's cursor is behind the log, per partition (from the broker)."""
    try:
        rows = [r for r in admin.subscriptions(topic) if r["subscription"] == subscription]
    except TierstreamError as exc:
        return f"lag unknown ({exc})"
    behind = sum(r["backlog"] for r in rows)
    parts = ", ".join(f"p{r['partition']} {r['backlog']:,}" for r in rows)
    return f"behind: {behind:,} message(s) ({parts or 'no cursor yet'})"


@app.command()
def offload(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    older_than: Annotated[str | None, typer.Option(
        help="Only segments whose newest message is older than this, e.g. 2d.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    auth_token: TokenOpt = None,
) -> None:
    """Move closed segments to the tier (Parquet + Iceberg) now.

    Example: tierstream offload acme/web/clicks --older-than 2d
    """
    from tierstream.store.client import Admin
    from tierstream.timeutil import now_ms, parse_duration_ms

    older_ms = None if older_than is None else parse_duration_ms(older_than, what="--older-than")
    with Admin(broker, auth_token=auth_token) as admin:
        before = admin.list_segments(topic)
        moved = admin.offload(topic, older_than_ms=older_ms)
    total = sum(s.bytes for s in moved)
    out.print(f"offloaded {len(moved)} segment(s), {_human_bytes(total)} of bookie data",
              highlight=False)
    for s in moved:
        out.print(f"  partition {s.partition} segment {s.segment_id} -> {s.tier_url}",
                  highlight=False)
    moved_ids = {s.segment_id for s in moved}
    stayed = [s for s in before if s.segment_id not in moved_ids]
    if stayed:
        out.print(f"kept {len(stayed)} segment(s) where they are:", highlight=False)
    now = now_ms()
    for s in stayed:
        if s.tier_url is not None:
            why = "already in the tier"
        elif s.state == "OPEN":
            why = ("open: still being written (empty)" if not s.entries else
                   "open: still being written (`tierstream seal` closes it)")
        elif older_ms is not None and s.max_publish_time is not None \
                and s.max_publish_time > now - older_ms:
            age = _human_duration(now - s.max_publish_time)
            why = f"its newest message is {age} old, younger than --older-than {older_than}"
        else:
            why = "not moved by the broker (see its log)"
        out.print(f"  partition {s.partition} segment {s.segment_id}: {why}", highlight=False)


def _human_duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:.1f}{unit}"
    return f"{ms}ms"


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


if __name__ == "__main__":
    main()
