"""``tierstream topic stats`` and ``tierstream broker stats``: what the broker is doing, as
``pulsar-admin topics stats`` and ``broker-stats`` show it (``broker/stats/topic_stats.py``)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tierstream.cli.common import (
    BrokerOpt,
    TlsCaOpt,
    TokenOpt,
    broker_app,
    human_bytes,
    out,
    topic_app,
)
from tierstream.errors import ConfigError
from tierstream.options import DEFAULT_BROKER_URL
from tierstream.util.timeutil import format_ms, now_ms, parse_duration_ms

__all__ = ["render_broker_stats", "render_topic_stats"]


@topic_app.command("stats")
def topic_stats_cmd(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the stats as JSON.")] = False,
    per_partition: Annotated[bool, typer.Option(
        "--per-partition", help="Each partition's stats too.")] = False,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Refresh until Ctrl-C: in place on a terminal, one frame "
        "per interval into a file or a pipe.")] = False,
    interval: Annotated[str, typer.Option(help="--watch: how often to refresh.")] = "2s",
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """A topic's rates in and out (last minute), storage by location (open segment,
    bookies, tier), producers, and per subscription its type, backlog, consumers and
    unacknowledged messages (with the oldest one's age).

    Example: tierstream topic stats acme/web/clicks --per-partition --watch
    """
    from tierstream.client import Admin

    every_s = parse_duration_ms(interval, what="--interval") / 1000
    if watch and as_json:
        raise ConfigError("--watch refreshes a table; --json prints once: give one of them")
    if every_s <= 0:
        raise ConfigError(f"invalid --interval {interval!r}: expected a duration > 0")
    with Admin(broker, auth_token=auth_token) as admin:
        stats = admin.topic_stats(topic, per_partition=per_partition)
        if as_json:
            out.print_json(json.dumps(stats))
            return
        if not watch:
            out.print(render_topic_stats(stats))
            return
        _watch(lambda: render_topic_stats(admin.topic_stats(topic, per_partition=per_partition)),
               render_topic_stats(stats), every_s)


def _watch(frame: Any, first: Any, every_s: float) -> None:
    """Redraw ``frame()`` every ``every_s`` until Ctrl-C: in place on a terminal; into a file
    or a pipe, one frame after another, each under the time it was taken."""
    from rich.live import Live

    try:
        if not out.is_terminal:
            while True:
                out.print(Text(f"-- {format_ms(now_ms())}"), first)
                out.file.flush()
                time.sleep(every_s)  # the refresh period, not synchronisation
                first = frame()
        with Live(first, console=out, auto_refresh=False) as live:
            while True:
                time.sleep(every_s)  # the refresh period, not synchronisation
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return


@broker_app.command("stats")
def broker_stats_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print the stats as JSON.")] = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """The broker-wide view: topics, streams (producers, readers, consumers), offload and
    bookie-deletion lag, transactions by state, open files, recovery and checksum counters.

    Example: tierstream broker stats --json
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        stats = admin.stats()
    if as_json:
        out.print_json(json.dumps(stats))
    else:
        out.print(render_broker_stats(stats))


def _rate(messages: float, nbytes: float) -> str:
    return f"{messages:,.1f} msg/s, {human_bytes(int(nbytes))}/s"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def _storage_table(storage: dict[str, dict[str, int]]) -> Table:
    table = Table("stored in", "messages", "bytes", "segments", box=None, pad_edge=False)
    for where, s in storage.items():
        table.add_row(where, f"{s['messages']:,}", human_bytes(s["bytes"]), str(s["segments"]))
    return table


def _subscriptions_table(subs: dict[str, dict[str, Any]]) -> Table | Text:
    if not subs:
        return Text("subscriptions: none")
    table = Table("subscription", "type", "backlog", "delayed", "consumers", "unacked",
                  "oldest unacked", box=None, pad_edge=False)
    for name, s in subs.items():
        table.add_row(name, s["type"], f"{s['backlog']:,}", f"{s.get('delayed', 0):,}",
                      ", ".join(s["consumers"]) or "-", f"{s['unacked']:,}",
                      _age(s["oldest_unacked_s"]))
    return table


def _producers_line(producers: list[dict[str, Any]]) -> Text:
    if not producers:
        return Text("producers: none")
    names = ", ".join(f"{p['name'] or '(unnamed)'} p{p['partition']}"
                      + ("" if p.get("access", "Shared") == "Shared" else f" ({p['access']})")
                      + f" since {format_ms(p['since'])}" for p in producers)
    return Text(f"producers: {len(producers)}: {names}")


def render_topic_stats(stats: dict[str, Any]) -> Group:
    """``Admin.topic_stats`` as tables (``topic stats`` and its ``--watch``)."""
    growing = f", growing to {stats['announced']}" if stats.get("announced") else ""
    parts: list[Any] = [
        Text(f"{stats['topic']} ({stats['partition_count']} partition(s){growing}), "
             f"{_window(stats)}: in "
             f"{_rate(stats['msg_rate_in'], stats['byte_rate_in'])}; out "
             f"{_rate(stats['msg_rate_out'], stats['byte_rate_out'])}; "
             f"{stats['readers']} partition stream(s) to readers and consumers"),
        _storage_table(stats["storage"]), _producers_line(stats["producers"]),
        _subscriptions_table(stats["subscriptions"])]
    if stats.get("owners"):
        parts.insert(1, Text("owned by " + ", ".join(
            f"{_owner(o)}: {o['partitions']} partition(s)" for o in stats["owners"])))
    head = 2 if stats.get("owners") else 1
    if stats.get("restamped"):  # a gap in what time windows find, worth a line of its own
        parts.insert(head, Text(f"{stats['restamped']:,} message(s) since the broker started "
                                "asked for a publish time before their partition's newest "
                                "and were stamped with that newer time", style="yellow"))
    if stats.get("compaction"):
        parts.insert(head, Text(_compaction_line(stats["compaction"])))
    for gap in reversed(stats.get("unanswered") or []):  # figures left out, and why
        whose = f"owned by {gap['broker']}" if gap["broker"] else "owned by no broker"
        numbers = ", ".join(map(str, gap["partitions"]))
        parts.insert(head, Text(f"not counted: partition(s) {numbers} ({whose}): "
                                f"{gap['reason']}", style="yellow"))
    for p in stats.get("partitions") or []:
        owner = f"; owned by {_owner(p['owner'])}" if p.get("owner") else ""
        parts += [Text(""), Text(f"partition {p['partition']}: in "
                                 f"{_rate(p['msg_rate_in'], p['byte_rate_in'])}; out "
                                 f"{_rate(p['msg_rate_out'], p['byte_rate_out'])}{owner}"),
                  _storage_table(p["storage"]), _producers_line(p["producers"]),
                  _subscriptions_table(p["subscriptions"])]
    return Group(*parts)


def _compaction_line(c: dict[str, Any]) -> str:
    """A compacted topic's snapshots, what was written since, and its threshold."""
    if c["snapshots"]:
        horizons = ", ".join(f"{s['partition']}: ({', '.join(map(str, s['horizon']))})"
                             for s in c["snapshots"])
        said = (f"compacted: {c['keys']:,} live key(s) in {human_bytes(c['bytes'])} "
                f"(horizons {horizons}; longest last run {c['last_duration_ms']} ms)")
    else:
        said = "not compacted yet"
    said += f"; {human_bytes(c['backlog_bytes'])} written since"
    if c.get("threshold_bytes") is not None:
        said += f"; compacted again at {human_bytes(c['threshold_bytes'])}"
    return said


def _window(stats: dict[str, Any]) -> str:
    """What the rates average over: the last minute, or the seconds since the broker started
    counting (a rate of a broker up 5 s is 5 s's)."""
    seconds = float(stats.get("rate_window_s", 60))
    return "last minute" if seconds >= 60 else f"last {seconds:.0f} s (since the broker started)"


def _owner(owner: dict[str, Any]) -> str:
    """A partition's owner as the stats say it: its id, where it is reached, its epoch."""
    where = f" at {owner['url']}" if owner.get("url") else ""
    heard = owner.get("heard_ms_ago")
    lease = "" if heard is None else f", lease renewed {max(0, heard) / 1000:.1f} s ago"
    return f"{owner['broker']}{where} (epoch {owner['epoch']}{lease})"


def render_broker_stats(stats: dict[str, Any]) -> Table:
    """``Admin.stats`` as one table (``broker stats``)."""
    table = Table("", "", box=None, pad_edge=False, show_header=False)
    streams = stats.get("streams", {})
    offload = stats.get("offload", {})
    txns = stats.get("transactions", {})
    me = stats.get("broker") or {}
    rows = [
        ("broker", f"{me.get('id')} (epoch {me.get('epoch')}), owns "
                   f"{me.get('partitions_owned')} partition(s), lease renewed "
                   f"{_age(me.get('lease_renewed_s_ago'))} ago"),
        *[("brokers" if i == 0 else "",
           f"{_owner(b)}: {b['partitions']} partition(s){' (this one)' if b['this'] else ''}")
          for i, b in enumerate(stats.get("brokers") or [])],
        ("topics, partitions", f"{stats.get('topics')}, {stats.get('partitions')}"),
        ("streams", ", ".join(f"{v} {k}(s)" for k, v in streams.items())),
        ("offload", "no policy (tierstream offload moves segments)"
         if not offload.get("policy") else
         f"{offload.get('segments_waiting')} segment(s) waiting, oldest sealed "
         f"{_age(offload.get('oldest_waiting_s'))} ago"),
        ("bookie copies to delete", f"{offload.get('bookie_copies_to_delete')}, oldest "
         f"offloaded {_age(offload.get('oldest_to_delete_s'))} ago (lag "
         f"{_age(offload.get('deletion_lag_s'))})"),
        ("transactions", ", ".join(f"{v} {k.lower()}" for k, v in txns.items())),
        ("open files", f"{stats.get('open_files')}" + "".join(
            f"; {b}: {s['read_files']} ledger file(s) for reads (at most "
            f"{s['read_files_limit']} kept)" for b, s in (stats.get("bookies") or {}).items()
            if "read_files" in s)),
        ("uptime", _age(stats.get("uptime_s"))),
        ("recovered segments", str(len(stats.get("recovered_segments") or []))),
        ("replica failures", str(stats.get("replica_failures"))),
        ("checksum failures", ", ".join(f"{b}: {n}" for b, n in
                                        (stats.get("checksum_failures") or {}).items())),
        ("cursor writes", str(stats.get("cursor_writes"))),
    ]
    replication = stats.get("replication") or {}
    if replication:
        audit = replication.get("last_audit") or {}
        rows.append(("replication", f"{replication.get('under_replicated')} segment(s) "
                     f"lacking a copy ({replication.get('one_copy', 0)} down to one, "
                     f"{replication.get('no_copy', 0)} to none), "
                     f"{replication.get('re_replicated')} re-replicated"
                     + (f"; last audit: {audit.get('segments')} segment(s), "
                        f"{audit.get('found')} found short ({audit.get('why')})"
                        if audit else "")))
    for bookie, state in (stats.get("bookies") or {}).items():
        where = state.get("where", "")
        host = state.get("host")
        up = "available" if state.get("available") else \
            f"UNAVAILABLE ({state.get('unavailable_because', '')})"
        failures = state.get("failures")
        rows.append((f"bookie {bookie}", f"{where}" + (f" on {host}" if host and host != "local"
                                                        else "") + f", {up}"
                     + (f", {failures} failure(s)" if failures else "")))
    for name, value in rows:
        table.add_row(name, value)
    return table
