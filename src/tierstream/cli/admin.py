"""Looking at and managing the store: ``segments``, ``subscriptions``, ``transactions``,
``seal``, ``offload`` and the ``demo``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tierstream.cli.common import (
    BrokerOpt,
    DataDirOpt,
    QuietOpt,
    TlsCaOpt,
    TokenOpt,
    app,
    human_bytes,
    human_duration,
    out,
    progress_bar,
)
from tierstream.cli.tables import fitted_table, hidden_note
from tierstream.errors import ConfigError
from tierstream.options import DEFAULT_BROKER_URL, DEFAULT_DATA_DIR
from tierstream.util.timeutil import format_ms


@app.command()
def segments(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Show the segments of a topic: from the metadata store when --data-dir has one here,
    else from the broker, as plan and read do (the open segment's stats lag by at most a
    second).

    Example: tierstream segments acme/web/clicks
    """
    from tierstream.metadata.store import MetadataStore
    from tierstream.model.layout import DataDir
    from tierstream.model.names import TopicName

    name = TopicName.parse(topic)
    local = DataDir.at(data_dir).metadata
    if local.is_file():
        meta = MetadataStore(local, read_only=True)
        try:
            record = meta.get_topic(name)
            records = meta.segments(str(name))
        finally:
            meta.close()
    else:
        from tierstream.client import Admin
        from tierstream.errors import UnavailableError

        try:
            with Admin(broker, auth_token=auth_token) as admin:
                record = admin.get_topic(str(name))
                records = admin.list_segments(str(name))
        except UnavailableError as exc:
            raise UnavailableError(f"no metadata store under --data-dir {str(data_dir)!r} "
                                   f"here, and {exc}") from None
    if as_json:
        sys.stdout.write(json.dumps([r.to_dict() for r in records], indent=2) + "\n")
        return
    table, hidden = fitted_table(
        out, ("partition", "segment", "state", "entries", "messages", "bytes",
              "min publish time", "max publish time", "lives in", "bookies"),
        [(str(r.partition), str(r.segment_id), r.state, str(r.entries), str(r.messages),
          human_bytes(r.bytes), format_ms(r.min_publish_time), format_ms(r.max_publish_time),
          r.location, ",".join(r.ensemble) if r.bookie_deleted_at is None else "-")
         for r in records],
        drop_first=("bookies", "entries", "min publish time", "bytes"), title=str(name))
    out.print(table)
    if (note := hidden_note(hidden)) is not None:
        out.print(note)
    for e in record.scale_events:
        out.print(f"{format_ms(e.at)}  {e.describe()}: segments {e.first_segment_id} and "
                  f"later were written after it", highlight=False)


@app.command()
def subscriptions(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    delete: Annotated[str | None, typer.Option(
        help="Remove this abandoned subscription (its cursor on every partition); refused "
             "while a consumer is attached.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Show each subscription per partition: its type, where it is (everything before the
    position is acknowledged, and the acked ranges after it), its backlog (messages not
    acknowledged), and its consumers: which keys or partitions each has, what it holds
    unacknowledged, how many were redelivered, its permits. A Spark stream commits to its
    own subscription (tierstream tail: derived from --checkpoint).

    Example: tierstream subscriptions acme/web/orders [--delete old-job]
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        if delete is not None:
            n = admin.delete_subscription(topic, delete)
            out.print(f"deleted subscription {delete!r} of {topic} ({n} partition cursor(s))",
                      highlight=False)
            return
        rows = admin.subscriptions(topic)
    if as_json:
        sys.stdout.write(json.dumps([{**r, "position": str(r["position"])} for r in rows],
                                    indent=2) + "\n")
        return
    if not rows:
        out.print(f"{topic} has no subscriptions")
        return
    cells = []
    for r in rows:
        consumers = "\n".join(
            f"{c['name']} [{c['assignment']}]: {c['unacked']:,}, {c['redelivered']:,}, "
            f"{c['permits']:,}" for c in r["consumers"]) or "-"
        cells.append((r["subscription"], r["type"] or "stream", str(r["partition"]),
                      str(r["position"]), f"{r['acked_ranges']:,}", f"{r['backlog']:,}",
                      consumers, format_ms(r["updated_at"])))
    table, hidden = fitted_table(
        out, ("subscription", "type", "partition", "position", "acked ranges", "backlog",
              "consumers (keys/role: unacked, redelivered, permits)", "updated"), cells,
        drop_first=("updated", "acked ranges", "position"), title=str(topic))
    out.print(table)
    if (note := hidden_note(hidden)) is not None:
        out.print(note)
    streams = {r["subscription"]: r.get("label") for r in rows if not r["type"]}
    for name, label in sorted(streams.items()):
        out.print(f"{name}: the cursor of {label or 'a Spark stream'}", highlight=False)
    if streams:
        out.print("A stream's cursor outlives its query: once the query is gone for good, "
                  "its backlog grows until tierstream subscriptions "
                  f"{topic} --delete {min(streams)} removes it.", highlight=False)


@app.command()
def transactions(
    abort: Annotated[str | None, typer.Option(
        help="Abort this open or prepared transaction and remove its staged rows.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Show the broker's transactions (staged writes of sinks and producers): state, sink
    and batch, staged messages, age; or abort one that is stuck (the broker also aborts
    what nobody commits within --transaction-timeout).

    Example: tierstream transactions --abort 3f2c9a...
    """
    from tierstream.client import Admin
    from tierstream.util.timeutil import now_ms

    with Admin(broker, auth_token=auth_token) as admin:
        if abort is not None:
            from tierstream.errors import NotFoundError
            from tierstream.model.names import check_txn_id

            check_txn_id(abort)
            if all(str(t.get("txn_id")) != abort for t in admin.transactions()):
                raise NotFoundError(f"the broker knows no transaction {abort!r} (never begun, "
                                    "or ended and forgotten): tierstream transactions lists "
                                    "those it knows")
            done = admin.abort_transaction(abort, "aborted with tierstream transactions")
            out.print(f"transaction {abort} " + ("aborted" if done else
                                                 "had already ended (nothing to abort)"),
                      highlight=False)
            return
        rows = admin.transactions()
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table("transaction", "state", "sink", "batch", "messages", "age", "reason",
                  title="transactions")
    now = now_ms()
    for r in rows:
        table.add_row(r["txn_id"], r["state"], r["sink_id"] or "-",
                      "-" if r["batch_id"] is None else str(r["batch_id"]),
                      f"{r['messages']:,}", human_duration(now - r["created_at"]),
                      r["reason"] or "")
    out.print(table if rows else "no transactions")


@app.command()
def seal(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    partition: Annotated[int | None, typer.Option(help="Only this partition.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Seal the open segment(s) now (a new one opens).

    Example: tierstream seal acme/web/clicks --partition 0
    """
    from tierstream.client import Admin

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
    run(data_dir, messages, console=out)


@app.command()
def offload(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    older_than: Annotated[str | None, typer.Option(
        help="Only segments whose newest message is older than this, e.g. 2d.")] = None,
    quiet: QuietOpt = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Move closed segments to the tier (Parquet + Iceberg) now.

    Example: tierstream offload acme/web/clicks --older-than 2d
    """
    from tierstream.client import Admin
    from tierstream.util.timeutil import describe_duration, now_ms, parse_duration_ms

    older_ms = None if older_than is None else parse_duration_ms(older_than, what="--older-than")
    with Admin(broker, auth_token=auth_token) as admin:
        before = admin.list_segments(topic)
        due = [s for s in before if s.state == "CLOSED" and s.tier_url is None and (
            older_ms is None or (s.max_publish_time or 0) < now_ms() - older_ms)]
        # one segment at a time: the bar moves as each reaches the tier (with none due, one
        # pass still finishes due bookie deletions)
        moved = [] if due else admin.offload(topic, older_than_ms=older_ms)
        with progress_bar(not quiet and bool(due)) as progress:
            task = progress.add_task("offloading (bookie bytes)", total=sum(s.bytes for s in due))
            for seg in due:
                moved += admin.offload(topic, older_than_ms=older_ms,
                                       segment_ids=[seg.segment_id])
                progress.advance(task, seg.bytes)
    total = sum(s.bytes for s in moved)
    scope = "" if older_ms is None else \
        f" whose newest message is older than {describe_duration(older_ms)}"
    out.print(f"offloaded {len(moved)} closed segment(s){scope}, {human_bytes(total)} of "
              "bookie data", highlight=False)
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
            age = human_duration(now - s.max_publish_time)
            why = f"its newest message is {age} old, younger than --older-than {older_than}"
        else:
            why = "not moved by the broker (see its log)"
        out.print(f"  partition {s.partition} segment {s.segment_id}: {why}", highlight=False)
