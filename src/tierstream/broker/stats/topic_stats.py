"""What the broker is doing, as ``pulsar-admin topics stats`` and ``broker-stats`` show it:
rates in and out, storage by location, producers, subscriptions with their backlog and
unacknowledged messages; and broker-wide counts (streams, offload and deletion lag,
transactions by state, open files). The metrics endpoint (``metrics.py``) exports the same
figures.

On a cluster (``--cluster``) a topic's stats asked of one broker count every partition: the
others' are asked of their owners (``peers.py``), and those nobody answered for are named.

Rates are over the last minute (``managed_ledger/rates.py``). *In* counts every confirmed
entry; *out* counts what the broker streamed to readers and consumers: reads straight from
bookie files or the tier do not pass through it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tierstream.broker.topics.compaction import backlog_bytes
from tierstream.broker.topics.producer_access import Epochs, ProducerAccess
from tierstream.metadata.compactions import compaction_thresholds, compactions_of
from tierstream.metadata.ownership import Owner
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.transaction_records import TransactionRecords
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.broker.peers import Peers
    from tierstream.broker.store import Store
    from tierstream.broker.subscriptions.registry import Subscriptions
    from tierstream.managed_ledger.partition_log import PartitionLog
    from tierstream.metadata.store import MetadataStore

__all__ = ["LOCATIONS", "QueryLags", "Streams", "broker_stats", "merge_subscriptions",
           "storage_of", "subscription_stats", "topic_stats"]

#: Where a segment's data is: the open segment, bookies (sealed), the tier (offloaded).
LOCATIONS = ("open", "bookies", "tier")


class Streams:
    """The streams the broker serves now: producers (per partition, with their names) and
    readers (bounded reads, tails and subscription consumers)."""

    def __init__(self, epochs: Epochs | None = None) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._open: dict[int, dict[str, Any]] = {}
        self.started = time.monotonic()
        # who may produce where (Pulsar's access modes), the epochs kept in ``epochs``
        self.access = ProducerAccess(epochs)

    @contextlib.contextmanager
    def serving(self, kind: str, topic: str, partition: int, name: str | None = None
                ) -> Iterator[dict[str, Any]]:
        """Register a stream while it runs: ``kind`` is ``producer``, ``reader`` or
        ``consumer``. The entry's ``messages`` and ``bytes`` may be added to as it goes. A
        producer is a shared one (``producer_access.py``): refused while an exclusive
        producer holds the partition, and told by ``fenced`` in its entry when one that
        fences takes it over."""
        key, entry = self.open(kind, topic, partition, name)
        try:
            if kind == "producer":
                self.access.attach(topic, partition, key, name,
                                   fence=lambda reason: entry.__setitem__("fenced", reason))
            yield entry
        finally:
            self.close(key)

    def open(self, kind: str, topic: str, partition: int, name: str | None = None
             ) -> tuple[int, dict[str, Any]]:
        """Register a stream that outlives one call (a Pulsar client's producer or consumer):
        its key for :meth:`close`, and its entry to add ``messages`` and ``bytes`` to. A
        producer's access (``self.access.attach``) is its caller's to ask for."""
        entry = {"kind": kind, "topic": topic, "partition": partition, "name": name,
                 "since": now_ms(), "messages": 0, "bytes": 0}
        key = next(self._ids)
        with self._lock:
            self._open[key] = entry
        return key, entry

    def close(self, key: int) -> None:
        with self._lock:
            entry = self._open.pop(key, None)
        if entry is not None and entry["kind"] == "producer":
            self.access.detach(key, entry["topic"], entry["partition"])

    def current(self, topic: str | None = None) -> list[dict[str, Any]]:
        """Copies of the entries; a producer's says whether it waits for its partition."""
        waiting = self.access.waiting()
        with self._lock:
            return [dict(e, waiting=key in waiting) if e["kind"] == "producer" else dict(e)
                    for key, e in self._open.items() if topic is None or e["topic"] == topic]


class QueryLags:
    """What Spark queries last reported of their lag (``spark_adapter/lag.py``): messages
    between each query's last committed offsets and the latest positions, per topic and
    partition; a report not renewed for :attr:`KEEP_S` is dropped."""

    KEEP_S = 600.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, query_id: str, name: str | None, lags: dict[str, dict[str, int]]) -> None:
        with self._lock:
            self._reports[query_id] = (time.monotonic(), {"name": name, "lags": lags})

    def forget(self, query_id: str) -> None:
        with self._lock:
            self._reports.pop(query_id, None)

    def current(self) -> dict[str, dict[str, Any]]:
        """Per query id: its name and ``{topic: {partition: messages}}``."""
        now = time.monotonic()
        with self._lock:
            for query_id in [q for q, (t, _) in self._reports.items() if now - t > self.KEEP_S]:
                del self._reports[query_id]
            return {q: dict(r) for q, (_, r) in self._reports.items()}


def storage_of(segments: list[SegmentRecord]) -> dict[str, dict[str, int]]:
    """Messages, bytes and segments by location. A tiered segment counts its Parquet
    file's bytes where they are known, else its bookie bytes."""
    out = {loc: {"messages": 0, "bytes": 0, "segments": 0} for loc in LOCATIONS}
    for seg in segments:
        loc = seg.location
        out[loc]["messages"] += seg.messages
        out[loc]["bytes"] += seg.tier_bytes if loc == "tier" and seg.tier_bytes else seg.bytes
        out[loc]["segments"] += 1
    return out


def _rates(plogs: list[PartitionLog]) -> dict[str, float]:
    rin = [p.rate_in.rate() for p in plogs]
    rout = [p.rate_out.rate() for p in plogs]
    return {"msg_rate_in": sum(r[0] for r in rin), "byte_rate_in": sum(r[1] for r in rin),
            "msg_rate_out": sum(r[0] for r in rout), "byte_rate_out": sum(r[1] for r in rout)}


_RATES = ("msg_rate_in", "byte_rate_in", "msg_rate_out", "byte_rate_out")
#: what passed through the broker since it opened the partition (Pulsar's counters)
_COUNTERS = ("messages_in", "bytes_in", "messages_out", "bytes_out", "restamped")


def subscription_stats(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per subscription, over ``Subscriptions.listing`` rows (one per subscription and
    partition): type, backlog, unacked messages, consumer names, the oldest unacked age, and
    each consumer's share (``shares``, the rows' consumers: Pulsar's per-consumer stats)."""
    return merge_subscriptions([{row["subscription"]: {
        "type": row["type"], "backlog": row["backlog"],
        "delayed": row.get("delayed", 0),  # held until their delivery time
        "unacked": sum(c["unacked"] for c in row["consumers"]),
        "consumers": [c["name"] for c in row["consumers"]],
        "oldest_unacked_s": row.get("oldest_unacked_s"), "shares": list(row["consumers"]),
    }} for row in rows])


def merge_subscriptions(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """:func:`subscription_stats` of several partitions as one."""
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, one in part.items():
            sub = out.setdefault(name, {
                "type": one["type"], "backlog": 0, "unacked": 0, "consumers": set(),
                "oldest_unacked_s": None, "delayed": 0, "shares": []})
            for field in ("backlog", "unacked", "delayed"):
                sub[field] += one.get(field, 0)
            sub["consumers"].update(one["consumers"])
            sub["shares"] += one.get("shares", [])
            oldest = one.get("oldest_unacked_s")
            if oldest is not None and (sub["oldest_unacked_s"] is None
                                       or oldest > sub["oldest_unacked_s"]):
                sub["oldest_unacked_s"] = oldest
    for sub in out.values():
        sub["consumers"] = sorted(sub["consumers"])
    return dict(sorted(out.items()))


def _producers(streams: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": s["name"], "partition": s["partition"], "since": s["since"],
             "messages": s["messages"], "bytes": s["bytes"],
             "access": s.get("access", "Shared") + (" (waiting)" if s.get("waiting") else ""),
             # Pulsar's names: the mode alone, and whether it waits for the topic
             "mode": s.get("access", "Shared"), "waiting": bool(s.get("waiting"))}
            for s in sorted(streams, key=lambda s: (s["partition"], s["name"] or ""))
            if s["kind"] == "producer"]


def topic_stats(store: Store, subscriptions: Subscriptions, streams: Streams, topic: str, *,
                per_partition: bool = False, here_only: bool = False) -> dict[str, Any]:
    """One topic's stats (``Admin.topic_stats``); with ``per_partition``, each partition's
    too, under ``partitions``. On a cluster the partitions other brokers own are asked of
    their owners (side by side) unless ``here_only``; those nobody answered for
    are listed under ``unanswered``, each group with its owner and why."""
    record = store.topic(topic)
    name = record.name
    plogs = store.partitions(name, serving=True)  # what is stored, announced partitions too
    rows = subscriptions.listing(name)
    live = streams.current(name)
    owners = store.owners.of_topic(name)
    parts: list[dict[str, Any]] = [{
        "partition": p.partition, **_rates([p]),
        "messages_in": p.rate_in.messages_total, "bytes_in": p.rate_in.bytes_total,
        "messages_out": p.rate_out.messages_total, "bytes_out": p.rate_out.bytes_total,
        "restamped": p.restamped, "rate_window_s": p.rate_in.window_s(),
        "storage": storage_of(p.segments()),
        "producers": _producers([s for s in live if s["partition"] == p.partition]),
        "readers": sum(1 for s in live if s["kind"] != "producer"
                       and s["partition"] == p.partition),
        "subscriptions": subscription_stats([r for r in rows if r["partition"] == p.partition]),
        "owner": owners[p.partition].as_dict() if p.partition in owners else None,
    } for p in plogs]
    unanswered: list[dict[str, Any]] = []
    if store.cluster is not None and not here_only:
        unanswered = _gather(name, record.serving, parts, owners, store.cluster.peers)
    out: dict[str, Any] = {
        "topic": name, "partition_count": record.partitions, "announced": record.announced,
        **{field: sum(p[field] for p in parts) for field in (*_RATES, *_COUNTERS, "readers")},
        "storage": {loc: {field: sum(p["storage"][loc][field] for p in parts)
                          for field in ("messages", "bytes", "segments")}
                    for loc in LOCATIONS},
        "producers": [prod for p in parts for prod in p["producers"]],
        "subscriptions": merge_subscriptions([p["subscriptions"] for p in parts]),
        "owners": _owners(owners), "unanswered": unanswered,
        "rate_window_s": min((float(p.get("rate_window_s", 60)) for p in parts), default=60),
    }
    compaction = compaction_stats(store.metadata, name, plogs)
    if compaction is not None:
        out["compaction"] = compaction
    if per_partition or here_only:
        out["partitions"] = parts
    return out


def compaction_stats(metadata: MetadataStore, topic: str, plogs: list[PartitionLog]
                     ) -> dict[str, Any] | None:
    """A compacted topic's snapshots (every partition's: they are in the metadata), and
    what the partitions served here hold after their horizons; None for a topic never
    compacted and without a threshold."""
    snaps = compactions_of(metadata, topic)
    threshold = compaction_thresholds(metadata).get(topic)
    if not snaps and threshold is None:
        return None
    return {"threshold_bytes": threshold, "keys": sum(s.keys for s in snaps.values()),
            "bytes": sum(s.bytes for s in snaps.values()),
            "snapshots": [s.to_dict() for s in snaps.values()],
            "last_duration_ms": max((s.duration_ms for s in snaps.values()), default=None),
            "backlog_bytes": sum(backlog_bytes(p, snaps.get(p.partition)) for p in plogs)}


def _gather(topic: str, count: int, parts: list[dict[str, Any]], owners: dict[int, Owner],
            peers: Peers) -> list[dict[str, Any]]:
    """Add to ``parts`` the partitions of ``topic`` (``count`` of them) served elsewhere, as
    their owners answer them; what nobody answered for, grouped by owner and reason."""
    have = {p["partition"] for p in parts}
    asked: dict[str, list[int]] = {}
    missing: dict[tuple[str | None, str], list[int]] = {}
    for partition in range(count):
        owner = owners.get(partition)
        if partition in have:
            continue
        if owner is None:
            missing.setdefault((None, "no broker owns it now (it is being taken over)"),
                               []).append(partition)
        elif owner.url is None:
            missing.setdefault((owner.broker_id, "its owner has not said where it is "
                                "reached yet"), []).append(partition)
        else:
            asked.setdefault(owner.url, []).append(partition)
    answers = peers.call_each({url: ("topic-stats", {"topic": topic, "here_only": True})
                               for url in asked})
    by_url = {o.url: o.broker_id for o in owners.values()}
    for url, answer in answers.items():
        if isinstance(answer, Exception):
            missing.setdefault((by_url[url], str(answer)), []).extend(asked[url])
            continue
        theirs = {p["partition"]: p for p in answer["partitions"]}
        parts += [theirs[p] for p in asked[url] if p in theirs]
        moved = [p for p in asked[url] if p not in theirs]
        if moved:
            missing.setdefault((by_url[url], "moved while it was asked"), []).extend(moved)
    parts.sort(key=lambda p: p["partition"])
    return [{"broker": broker, "partitions": sorted(partitions), "reason": reason}
            for (broker, reason), partitions in missing.items()]


def broker_stats(store: Store, streams: Streams) -> dict[str, Any]:
    """The broker-wide view: topics and partitions, streams by kind, offload and deletion
    lag, transactions by state, open file descriptors, uptime."""
    now = now_ms()
    live = streams.current()
    plogs = store.all_partitions()
    closed = [s for p in plogs for s in p.closed_segments()]
    to_offload = [s for s in closed if s.tier_url is None and s.state == SegmentState.CLOSED]
    to_delete = [s for s in closed if s.tier_url is not None and s.bookie_deleted_at is None]
    policy = store.config.offload_after_ms is not None or \
        store.config.offload_threshold_bytes is not None
    return {
        "topics": len(store.topics()), "partitions": len(plogs),
        "broker": {"id": store.owners.broker_id, "epoch": store.epoch,
                   "partitions_owned": store.owners.owned(),
                   "lease_renewed_s_ago": None if store.owners.renewed_at is None else
                   round(time.monotonic() - store.owners.renewed_at, 3)},
        "brokers": store.owners.brokers(),
        "streams": {kind: sum(1 for s in live if s["kind"] == kind)
                    for kind in ("producer", "reader", "consumer")},
        "offload": {
            "policy": policy,
            "segments_waiting": len(to_offload) if policy else 0,
            "oldest_waiting_s": _age(now, [s.sealed_at for s in to_offload]) if policy else None,
            "bookie_copies_to_delete": len(to_delete),
            "oldest_to_delete_s": _age(now, [s.offloaded_at for s in to_delete]),
            "deletion_lag_s": store.config.deletion_lag_ms / 1000,
        },
        "transactions": TransactionRecords(store.metadata).counts(),
        "open_files": _open_files(),
        "uptime_s": time.monotonic() - streams.started,
    }


def _owners(owners: dict[int, Owner]) -> list[dict[str, Any]]:
    """The brokers owning a topic's partitions, with how many each owns."""
    counts = Counter(o.broker_id for o in owners.values())
    first = {o.broker_id: o for o in owners.values()}
    return [{**{k: v for k, v in first[b].as_dict().items() if k != "since"}, "partitions": n}
            for b, n in sorted(counts.items())]


def _age(now: int, times: list[int | None]) -> float | None:
    known = [t for t in times if t is not None]
    return None if not known else max(0.0, (now - min(known)) / 1000)


def _open_files() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return None
