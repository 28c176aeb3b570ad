"""Topic, segment and subscription administration through the broker."""

from __future__ import annotations

import threading
import time
from typing import Any

from tierstream.client.connection import BrokerClient
from tierstream.errors import AlreadyExistsError, ConfigError, ConflictError, UnavailableError
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.model import arguments
from tierstream.model.names import TopicName
from tierstream.model.positions import Position
from tierstream.model.topic_rules import check_new_topic, check_partition_count, check_retention
from tierstream.options import parse_size
from tierstream.schemas.model import SchemaInfo
from tierstream.splits.split import StreamCut

__all__ = ["Admin", "compaction_threshold", "segment_record"]



class Admin(BrokerClient):
    """Topic and segment administration through the broker."""

    def ping(self) -> bool:
        return bool(self.action("ping")["ok"])

    def wait_until_ready(self, timeout: float = 30.0) -> None:
        """Return once the broker answers, or raise UnavailableError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.ping()
                return
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                threading.Event().wait(0.05)

    def create_topic(self, topic: str, partitions: int, *,
                     retention_ms: int | str | None = None, exist_ok: bool = False
                     ) -> TopicRecord:
        """Create ``topic``; AlreadyExistsError if it exists, unless ``exist_ok``: then the
        existing topic is returned if it has ``partitions`` (ConflictError if not).
        ``retention_ms``: milliseconds, a duration with a unit (``"30d"``), or None to keep
        every message; anything else is refused (here and by the broker) naming the value."""
        check_partition_count(partitions, check_new_topic(topic))
        retention_ms = check_retention(retention_ms)
        arguments.flag(exist_ok, "exist_ok")
        try:
            return TopicRecord.from_dict(self.action("create-topic", {
                "topic": topic, "partitions": partitions, "retention_ms": retention_ms}))
        except AlreadyExistsError:
            if not exist_ok:
                raise
        existing = self.get_topic(topic)
        if existing.partitions != partitions:
            raise ConflictError(f"topic {existing.name!r} exists with {existing.partitions} "
                                f"partition(s), not {partitions}")
        return existing

    def delete_topic(self, topic: str) -> TopicRecord:
        """Delete a topic everywhere (metadata, bookies, tier files, Iceberg table); returns
        what it was. Readers and producers of it stop with NotFoundError."""
        return self._topic("delete-topic", topic)

    def get_topic(self, topic: str) -> TopicRecord:
        return self._topic("get-topic", topic)

    def set_partitions(self, topic: str, partitions: int) -> TopicRecord:
        """Grow ``topic`` to ``partitions`` (a multiple of its count) at one scale event,
        while it is written and read; every reader keeps each key's order across it. The
        same count again changes nothing; fewer is refused (ConfigError)."""
        check_partition_count(partitions, topic)
        return self._topic("set-partitions", topic, partitions=partitions)

    def _topic(self, action: str, topic: str, **body: Any) -> TopicRecord:
        return TopicRecord.from_dict(self.action(action, {"topic": str(TopicName.parse(topic)),
                                                          **body}))

    def list_topics(self, namespace: str | None = None) -> list[TopicRecord]:
        return [TopicRecord.from_dict(t)
                for t in self.action("list-topics", {"namespace": namespace})]

    def list_segments(self, topic: str) -> list[SegmentRecord]:
        return [segment_record(s) for s in
                self.action("list-segments", {"topic": str(TopicName.parse(topic))})]

    def last_confirmed(self, topic: str) -> dict[int, tuple[Position | None, Position]]:
        """Per partition: (last confirmed message or None, the exclusive end after it)."""
        raw = self.action("last-confirmed", {"topic": str(TopicName.parse(topic))})
        return {int(p): (None if v["last"] is None else Position.from_dict(v["last"]),
                         Position.from_dict(v["end"])) for p, v in raw.items()}

    def ends(self, topic: str) -> dict[int, Position]:
        """Per partition: the exclusive end after its last confirmed message. The broker
        answers it from memory, also while its tier is away."""
        name = str(TopicName.parse(topic))
        raw = self.follow_owners(name)
        if "ends" not in raw:  # a broker from before several brokers: it serves them all
            return {int(p): Position.from_dict(v) for p, v in raw.items()}
        ends = {int(p): Position.from_dict(v) for p, v in raw["ends"].items()}
        for p in raw["owners"]:  # each asked of its owner
            one = self.action("ends", {"topic": name, "partition": int(p)})
            ends[int(p)] = Position.from_dict(one[p])
        return dict(sorted(ends.items()))

    def follow_owners(self, topic: str) -> dict[str, Any]:
        """Follow the owner of each partition of ``topic`` that the broker in use does not
        serve (several brokers): its calls and streams go there. The broker's answer: the
        ends of the partitions it serves, and the owner of each other one."""
        raw: dict[str, Any] = self.action("ends", {"topic": topic, "owners": True})
        for p, url in (raw.get("owners") or {}).items():
            if url:
                self.follow(topic, int(p), url)
        return raw

    def latest_cut(self, topic: str) -> StreamCut:
        """The end of everything confirmed so far: each partition's exclusive end position."""
        return StreamCut.of(str(TopicName.parse(topic)), self.ends(topic))

    def seal(self, topic: str, partition: int | None = None) -> list[SegmentRecord]:
        raw = self.action("seal", {"topic": str(TopicName.parse(topic)), "partition": partition})
        return [segment_record(s) for s in raw]

    def unload(self, topic: str, partition: int | None = None) -> dict[str, str]:
        """Move a partition (or every one) of ``topic`` from the broker serving it to other
        brokers of the cluster, gracefully: ``{"topic/partition": new owner}``."""
        name = str(TopicName.parse(topic))
        parts = [partition] if partition is not None else range(self.get_topic(name).partitions)
        moved: dict[str, str] = {}
        for p in parts:  # each asked of its owner
            moved.update(self.action("unload", {"topic": name, "partition": int(p)}))
        return moved

    def drain(self) -> dict[str, str]:
        """Move every partition the broker in use serves to the other brokers."""
        return dict(self.action("drain"))

    def stats(self) -> dict[str, Any]:
        """The broker-wide view: topics, streams, offload and deletion lag, transactions by
        state, open files, and store counters (``tierstream broker stats``)."""
        return dict(self.action("stats"))

    def lag(self, topic: str, positions: dict[int, Position]) -> dict[int, int]:
        """Per partition of ``topic``: messages after ``positions`` (a partition not given
        counts from its beginning) up to the last confirmed one."""
        raw = self.action("lag", {"topic": str(TopicName.parse(topic)), "positions": {
            str(p): pos.to_dict() for p, pos in positions.items()}})
        return {int(p): int(n) for p, n in raw.items()}

    def report_query_lag(self, query_id: str, name: str | None,
                         lags: dict[str, dict[int, int]] | None) -> None:
        """Give the broker a Spark query's lag for its metrics (None: the query ended)."""
        self.action("query-lag", {"query_id": query_id, "name": name, "forget": lags is None,
                                  "lags": {t: {str(p): n for p, n in parts.items()}
                                           for t, parts in (lags or {}).items()}})

    def topic_stats(self, topic: str, *, per_partition: bool = False) -> dict[str, Any]:
        """A topic's rates in and out (last minute), storage by location, producers and
        subscriptions (backlog, consumers, unacknowledged messages, the oldest one's age),
        as ``pulsar-admin topics stats`` shows them (``tierstream topic stats``). Any broker of
        a cluster answers for every partition, asking their owners; ``unanswered`` names
        the partitions whose owner did not answer, and why."""
        return dict(self.action("topic-stats", {"topic": str(TopicName.parse(topic)),
                                                "per_partition": per_partition}))

    def offload(self, topic: str, *, older_than_ms: int | None = None,
                segment_ids: list[int] | None = None) -> list[SegmentRecord]:
        """Move closed segments to the tier now (those older than ``older_than_ms``; only
        ``segment_ids``, if given)."""
        raw = self.action("offload", {"topic": str(TopicName.parse(topic)),
                                      "older_than_ms": older_than_ms,
                                      "segment_ids": segment_ids})
        return [segment_record(s) for s in raw]

    def compact(self, topic: str, *, wait: bool = True) -> dict[str, Any]:
        """Compact ``topic`` (on a cluster, each partition by the broker that owns it): per
        partition, the latest message of each key up to now becomes its snapshot.
        ``wait=False`` starts the run and returns; :meth:`compaction` tells how it went."""
        arguments.flag(wait, "wait")
        return dict(self.action("compact", {"topic": str(TopicName.parse(topic)),
                                            "wait": wait}))

    def compaction(self, topic: str) -> dict[str, Any]:
        """``topic``'s compaction: the last run's status (NOT_RUN, RUNNING, SUCCESS, ERROR
        with its error) and each partition's snapshot (horizon, keys, bytes)."""
        return dict(self.action("compaction", {"topic": str(TopicName.parse(topic))}))

    def set_compaction_threshold(self, topic: str, threshold: int | str | None
                                 ) -> dict[str, Any]:
        """Compact ``topic`` whenever one of its partitions has ``threshold`` (bytes, or a
        size such as ``'100MB'``) written after its snapshot's horizon; None: only on
        demand."""
        size = compaction_threshold(threshold, "compaction threshold")
        return dict(self.action("set-compaction-threshold", {
            "topic": str(TopicName.parse(topic)), "threshold_bytes": size}))

    def tier_pass(self) -> dict[str, int]:
        """Apply the broker's offload, bookie-deletion and retention policies now."""
        return dict(self.action("tier-pass"))

    def set_retention(self, topic: str, retention_ms: int | str | None) -> TopicRecord:
        """Keep closed segments this long (as ``create_topic``'s ``retention_ms``)."""
        return self._topic("set-retention", topic, retention_ms=check_retention(retention_ms))

    def advance(self, topic: str, start: Position, max_messages: int, bound: Position
                ) -> tuple[Position, int]:
        """The position ``max_messages`` after ``start`` (at most ``bound``), and the count."""
        raw = self.action("advance", {"topic": topic, "partition": start.partition,
                                      "start": start.to_dict(), "bound": bound.to_dict(),
                                      "max_messages": max_messages})
        return Position.from_dict(raw["end"]), int(raw["messages"])

    def position_at_time(self, topic: str, partition: int, time_ms: int) -> Position:
        return Position.from_dict(self.action("position-at-time", {
            "topic": topic, "partition": partition, "time_ms": time_ms}))

    def set_cursor(self, topic: str, subscription: str, positions: dict[int, Position], *,
                   label: str | None = None) -> None:
        """Store a subscription's positions (a stream's commit); ``label`` says whose it is
        in ``subscriptions``."""
        self.action("set-cursor", {"topic": topic, "subscription": subscription,
                                   "positions": {str(p): pos.to_dict()
                                                 for p, pos in positions.items()},
                                   **({"label": label} if label else {})})

    def subscriptions(self, topic: str) -> list[dict[str, Any]]:
        """Per subscription and partition: ``type`` (None for a Spark stream's cursor),
        ``position`` (a Position: everything before it is acknowledged), ``acked_ranges``
        (acknowledged ranges after it), ``backlog`` (messages not acknowledged),
        ``updated_at`` (epoch ms) and ``consumers``: per consumer ``name``, ``assignment``
        (key_shared: its hash ranges; failover: active or standby; shared: any), ``unacked``,
        ``delivered``, ``redelivered`` and ``permits``."""
        raw = self.action("subscriptions", {"topic": str(TopicName.parse(topic))})
        return [{**r, "position": Position.from_dict(r["position"])} for r in raw]

    def delete_subscription(self, topic: str, subscription: str) -> int:
        """Remove an abandoned subscription of ``topic``: its durable cursor on every
        partition (returns how many). ConflictError while consumers are attached,
        NotFoundError if the topic has no such subscription."""
        raw = self.action("delete-subscription", {"topic": str(TopicName.parse(topic)),
                                                  "subscription": subscription})
        return int(raw["cursors"])

    def bookie_endpoints(self) -> dict[str, str]:
        """bookie id -> the address its endpoint is advertised at (for readers elsewhere)."""
        return dict(self.action("bookie-endpoints"))

    def register_bookie(self, bookie: str, address: str) -> None:
        """Advertise ``address`` as bookie ``bookie``'s endpoint (``tierstream bookie serve``)."""
        self.action("register-bookie", {"bookie": bookie, "address": address})

    def commit_transactions(self, txns: list[str], *, sink: str | None = None,
                            batch: int | None = None) -> dict[str, Any]:
        """Make prepared transactions visible at once; with ``sink``/``batch``, idempotent
        (a batch at or below the sink's last committed one is a no-op). Returns
        ``{"status": "committed" | "already-committed", "messages": n, "aborted": [...]}``."""
        return dict(self.action("txn-commit", {"txns": list(txns), "sink": sink,
                                               "batch": batch}))

    def abort_transaction(self, txn: str, reason: str = "aborted by its writer") -> bool:
        """Discard an open or prepared transaction; False if it had already ended."""
        return bool(self.action("txn-abort", {"txn": txn, "reason": reason})["aborted"])

    def transactions(self) -> list[dict[str, Any]]:
        """Every transaction the broker remembers, with its state and staged messages."""
        return list(self.action("transactions"))

    def last_committed_batch(self, sink: str) -> int | None:
        """The last batch id ``sink`` committed, or None."""
        last = self.action("sink-state", {"sink": sink})["last_batch"]
        return None if last is None else int(last)

    def register_schema(self, topic: str, type: str, definition: str | None = None
                        ) -> SchemaInfo:
        """Add a schema version to ``topic`` (or return the version it already is); an
        incompatible one is refused with ConfigError naming the field and the rule."""
        return SchemaInfo.from_dict(self.action("schema-register", {
            "topic": str(TopicName.parse(topic)), "type": type, "definition": definition}))

    def get_schema(self, topic: str, version: int | None = None) -> SchemaInfo:
        return SchemaInfo.from_dict(self.action("schema-get", {
            "topic": str(TopicName.parse(topic)), "version": version}))

    def list_schemas(self, topic: str) -> tuple[str, list[SchemaInfo]]:
        """(compatibility rule, every version in order) of ``topic``."""
        raw = self.action("schema-list", {"topic": str(TopicName.parse(topic))})
        return raw["compatibility"], [SchemaInfo.from_dict(v) for v in raw["versions"]]

    def check_schema(self, topic: str, type: str, definition: str | None = None
                     ) -> str | None:
        """Why this schema would be refused as ``topic``'s next version, or None."""
        raw = self.action("schema-check", {"topic": str(TopicName.parse(topic)),
                                           "type": type, "definition": definition})
        return None if raw["compatible"] else str(raw["reason"])

    def set_schema_compatibility(self, topic: str, compatibility: str) -> None:
        self.action("schema-compatibility", {"topic": str(TopicName.parse(topic)),
                                             "compatibility": compatibility})

    def deleted_segments(self, topic: str) -> list[dict[str, Any]]:
        """Segments removed by retention: what was lost, and when."""
        return list(self.action("deleted-segments", {"topic": str(TopicName.parse(topic))}))


def segment_record(raw: dict[str, Any]) -> SegmentRecord:
    fields = {k: v for k, v in raw.items() if k != "location"}
    fields["ensemble"] = tuple(fields["ensemble"])
    fields["skipped"] = tuple((int(lo), int(hi)) for lo, hi in fields.get("skipped") or ())
    return SegmentRecord(**fields)


def compaction_threshold(raw: int | str | None, what: str) -> int | None:
    """A compaction threshold as given (bytes, or a size such as ``'100MB'``; None or
    ``'none'``: no threshold), in bytes: above 0 and below 2**63."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() == "none"):
        return None
    size = parse_size(raw, what=what)
    if not 0 < size < 2**63:
        raise ConfigError(f"invalid {what} {raw!r}: expected a size above 0 and below 8 EiB, "
                          "e.g. 100MB, or none")
    return size
