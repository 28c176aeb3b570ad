"""``tierstream topic create|delete|get|set|list``."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from tierstream.cli.common import (
    BrokerOpt,
    TlsCaOpt,
    TokenOpt,
    human_bytes,
    out,
    say_moved,
    topic_app,
)
from tierstream.errors import ConfigError
from tierstream.options import DEFAULT_BROKER_URL
from tierstream.util.timeutil import format_ms


@topic_app.command("create")
def topic_create(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    partitions: Annotated[int, typer.Option(help="Number of partitions (>= 1).")] = 1,
    retention: Annotated[str | None, typer.Option(
        help="Delete segments whose newest message is older than this, e.g. 30d.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Create a topic.

    Example: tierstream topic create acme/web/clicks --partitions 4 --retention 30d
    """
    from tierstream.client import Admin
    from tierstream.model.topic_rules import check_retention

    retention_ms = None if retention is None else check_retention(retention,
                                                                     what="--retention")
    with Admin(broker, auth_token=auth_token) as admin:
        record = admin.create_topic(topic, partitions, retention_ms=retention_ms)
    out.print(f"created {record.name} with {record.partitions} partition(s); "
              f"{_retention_words(record.retention_ms)}", highlight=False)


def _retention_words(retention_ms: int | None) -> str:
    """A topic's retention as a sentence a user can check against what they meant."""
    from tierstream.util.timeutil import describe_duration

    if retention_ms is None:
        return "retention: none (every message is kept)"
    return (f"retention: {describe_duration(retention_ms)} (closed segments whose newest "
            "message is older are deleted everywhere: bookies, tier, Iceberg table)")


@topic_app.command("delete")
def topic_delete(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Delete a topic and all its data: segments on the bookies, tier files, its Iceberg
    table, cursors. Crash-safe: an interrupted deletion finishes when the broker restarts.

    Example: tierstream topic delete acme/web/huge --yes
    """
    from tierstream.client import Admin

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
    retention: Annotated[str | None, typer.Option(
        help="Delete segments whose newest message is older than this, e.g. 30d; 'none' "
             "keeps everything.")] = None,
    partitions: Annotated[int | None, typer.Option(
        help="Grow the topic to this many partitions (a multiple of its count) at one scale "
             "event, while it is written and read; every reader keeps each key's order.",
        show_default=False)] = None,
    compaction_threshold: Annotated[str | None, typer.Option(
        help="Compact the topic whenever a partition has this much written after its last "
             "compaction, e.g. 100MB; 'none': only with tierstream topic compact.",
        show_default=False)] = None,
    yes: Annotated[bool, typer.Option(
        "--yes", help="Confirm a retention under an hour (it deletes the closed segments "
                      "older than that within a tier pass, about 30 s).")] = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Change a topic's settings: its retention, its partition count, its compaction
    threshold.

    Example: tierstream topic set acme/web/clicks --partitions 8
    """
    from tierstream.client import Admin
    from tierstream.errors import ConfigError
    from tierstream.model.topic_rules import check_retention

    if retention is None and partitions is None and compaction_threshold is None:
        raise ConfigError("nothing to set: give --retention, --partitions and/or "
                          "--compaction-threshold")
    from tierstream.client.admin import compaction_threshold as checked_threshold

    threshold = checked_threshold(compaction_threshold, "--compaction-threshold")
    retention_ms = None if retention is None or retention.strip().lower() == "none" \
        else check_retention(retention, what="--retention")
    if retention_ms is not None and retention_ms < 3_600_000 and not yes:
        from tierstream.util.timeutil import describe_duration

        raise ConfigError(f"--retention {retention!r} ({describe_duration(retention_ms)}) "
                          "deletes every closed segment whose newest message is older, at the "
                          "next tier pass (within about 30 s): give --yes to confirm")
    with Admin(broker, auth_token=auth_token) as admin:
        if partitions is not None:
            before = admin.get_topic(topic).partitions
            record = admin.set_partitions(topic, partitions)
            if record.announced is not None:
                out.print(f"{record.name}: growing {before} -> {record.announced} partitions: "
                          "its Pulsar clients route its keys, and see the new partitions at "
                          "once; tierstream's readers see them once every client has looked "
                          "again (broker option --client-refresh-wait)", highlight=False)
            elif record.partitions == before:
                out.print(f"{record.name}: already has {before} partitions", highlight=False)
            else:
                out.print(f"{record.name}: {record.scale_events[-1].describe()}; keys route "
                          f"by {record.partitions} from now on", highlight=False)
        if compaction_threshold is not None:
            status = admin.set_compaction_threshold(topic, threshold)
            out.print(f"{status['topic']}: " + (
                f"compacted whenever a partition has {human_bytes(threshold)} after its last "
                "compaction" if threshold is not None else
                "compacted only with tierstream topic compact"), highlight=False)
        if retention is not None:
            record = admin.set_retention(topic, retention_ms)
            out.print(f"{record.name}: {_retention_words(record.retention_ms)}",
                      highlight=False)


@topic_app.command("get")
def topic_get(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Show a topic's settings: partitions, retention, creation time, schema, key routing.

    Example: tierstream topic get acme/web/clicks
    """
    from tierstream.client import Admin
    from tierstream.errors import NotFoundError

    with Admin(broker, auth_token=auth_token) as admin:
        record = admin.get_topic(topic)
        try:
            info = admin.get_schema(topic)
            schema = f"{info.type.value}, version {info.version}"
        except NotFoundError:
            schema = "none (values are bytes)"
    grown = "".join(f"\n            {format_ms(e.at)}  {e.describe()}, first segment "
                    f"{e.first_segment_id}" for e in record.scale_events)
    if record.announced is not None and record.announced_at is not None:
        grown += (f"\n            {format_ms(record.announced_at)}  growing to "
                  f"{record.announced} partitions: announced to its Pulsar clients")
    out.print(f"topic:      {record.name}\n"
              f"partitions: {record.partitions}{grown}\n"
              f"created:    {format_ms(record.created_at)}\n"
              f"{_retention_words(record.retention_ms).replace(': ', ':  ', 1)}\n"
              f"schema:     {schema}\n"
              f"keys:       {_routing_words(record.key_routing)}", highlight=False)


def _routing_words(routing: str) -> str:
    if routing == "client":
        return ("where its Pulsar clients route them (a producer stored a key elsewhere than "
                "tierstream's hash): it grows in two steps (docs/pulsar.md)")
    return "by tierstream's hash (murmur3_32 % 65536 % partitions)"


@topic_app.command("list")
def topic_list(
    namespace: Annotated[str | None, typer.Option(help="Only topics of tenant/namespace.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """List topics.

    Example: tierstream topic list --namespace acme/web
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        topics = admin.list_topics(namespace)
    from tierstream.util.timeutil import describe_duration

    table = Table("topic", "partitions", "retention", "created")
    for t in topics:
        table.add_row(t.name, str(t.partitions), "none" if t.retention_ms is None
                      else describe_duration(t.retention_ms), format_ms(t.created_at))
    out.print(table)


@topic_app.command("unload")
def topic_unload(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic, or "
                                              "tenant/namespace/topic/PARTITION")],
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Move a topic's partitions (or one) from the brokers serving them to other brokers of
    the cluster (brokers started with --cluster): each is sealed and handed over to the
    least-loaded other broker, and its clients follow it.

    Example: tierstream topic unload acme/web/clicks/3
    """
    from tierstream.client import Admin

    name, partition = topic, None
    parts = topic.strip("/").split("/")
    if len(parts) == 4:
        if not parts[3].isdigit():
            raise ConfigError(f"invalid partition {parts[3]!r} in {topic!r}: expected "
                              "tenant/namespace/topic/N with N >= 0")
        name, partition = "/".join(parts[:3]), int(parts[3])
    with Admin(broker, auth_token=auth_token) as admin:
        moved = admin.unload(name, partition)
    say_moved(moved)
