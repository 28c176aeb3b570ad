"""The broker's admin actions, one table for both serving surfaces: Flight's ``do_action``
(``flight/server.py``) and Pulsar's admin REST (``pulsar/admin_http.py``) run them through
:meth:`AdminActions.call`, with the same checks and errors. A mixin over the serving broker's
state, as ``flight/consume_streams.py`` is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tierstream.broker.cluster.compaction_owners import with_owners
from tierstream.broker.cluster.membership import cluster_of
from tierstream.broker.stats.topic_stats import QueryLags, Streams, broker_stats, topic_stats
from tierstream.broker.store import Store
from tierstream.broker.subscriptions.registry import Subscriptions
from tierstream.errors import (
    ConfigError,
    NotFoundError,
    NotOwnerError,
    ProtocolError,
    TierstreamError,
)
from tierstream.metadata.bookie_registry import set_bookie_endpoint
from tierstream.metadata.compactions import set_compaction_threshold
from tierstream.metadata.schema_registry import SchemaRegistry
from tierstream.model.names import TopicName
from tierstream.model.positions import Position
from tierstream.schemas.model import Compatibility, SchemaType
from tierstream.wire.flight import (
    decode_positions,
)

if TYPE_CHECKING:
    from tierstream.broker.topics.compaction import Compactor
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["ACTIONS", "AdminActions", "check_partition"]

log = logging.getLogger(__name__)


class AdminActions:
    """Topic, segment, subscription, transaction and schema administration (``ACTIONS``)."""

    store: Store
    subscriptions: Subscriptions
    schemas: SchemaRegistry
    streams: Streams
    lags: QueryLags
    compactor: Compactor

    def call(self, action: str, body: dict[str, Any]) -> Any:
        """Run one admin action (``ACTIONS``) on ``body``: what Flight's ``do_action`` and
        the Pulsar admin REST endpoint (``broker/pulsar/admin_http.py``) both call.
        TierstreamError on failure; a malformed body is a ProtocolError."""
        entry = ACTIONS.get(action)
        if entry is None:
            raise ProtocolError(f"unknown action {action!r}; known: {sorted(ACTIONS)}")
        try:
            return entry[0](self, body)
        except TierstreamError:
            raise
        except (KeyError, ValueError, TypeError) as exc:
            raise ProtocolError(f"malformed {action} request: {exc!r}") from None

    def _ping(self, body: dict[str, Any]) -> Any:  # the lease's age: cluster.py asks it
        return {"ok": True, "lease_silent_s": self.store.owners.silence()}

    def _create_topic(self, body: dict[str, Any]) -> Any:
        return self.store.create_topic(body["topic"], body["partitions"],
                                       retention_ms=body.get("retention_ms")).to_dict()

    def _set_partitions(self, body: dict[str, Any]) -> Any:
        return self.store.set_partitions(body["topic"], body["partitions"]).to_dict()

    def _delete_topic(self, body: dict[str, Any]) -> Any:
        deleted = self.store.delete_topic(body["topic"]).to_dict()
        self.schemas.forget(str(TopicName.parse(body["topic"])))
        self.subscriptions.forget_topic(str(TopicName.parse(body["topic"])))
        return deleted

    def _get_topic(self, body: dict[str, Any]) -> Any:
        return self.store.topic(body["topic"]).to_dict()

    def _list_topics(self, body: dict[str, Any]) -> Any:
        return [t.to_dict() for t in self.store.topics(body.get("namespace"))]

    def _list_segments(self, body: dict[str, Any]) -> Any:
        return [s.to_dict() for s in self.store.segments(body["topic"])]

    def _last_confirmed(self, body: dict[str, Any]) -> Any:
        return {
            str(p): {"last": None if last is None else last.to_dict(), "end": end.to_dict()}
            for p, (last, end) in self.store.last_confirmed(body["topic"]).items()
        }

    def _ends(self, body: dict[str, Any]) -> Any:
        """Each partition's end. With ``owners`` (clients since issue 52): only those served
        here, and the owner's address of each other one, whose end only its owner knows;
        with ``partition``, that one's (refused here when another broker owns it)."""
        topic = _topic(body)
        ends = self.store.ends(topic)
        if body.get("partition") is not None:
            partition = int(body["partition"])
            self._check_served(topic, partition)
            ends = self.store.ends(topic)
            if partition not in ends:  # not served here (several brokers)
                raise self.store.not_served(topic, partition)
            return {str(partition): ends[partition].to_dict()}
        if not body.get("owners"):
            return {str(p): end.to_dict() for p, end in ends.items()}
        served: dict[str, Any] = {}
        owners: dict[str, str | None] = {}
        for p in range(self.store.topic(topic).partitions):
            if p not in ends:  # another broker's, or nobody's while it is taken over
                owner = self.store.owner_elsewhere(topic, p)
                owners[str(p)] = None if owner is None else owner.url
        for p, end in ends.items():
            try:
                self.store.owners.serving(topic, p)
                served[str(p)] = end.to_dict()
            except NotOwnerError as exc:
                owners[str(p)] = exc.owner_url
        return {"ends": served, "owners": owners}

    def _seal(self, body: dict[str, Any]) -> Any:
        return [s.to_dict() for s in self.store.seal(body["topic"], body.get("partition"))]

    def _unload(self, body: dict[str, Any]) -> Any:
        return cluster_of(self.store).unload_topic(_topic(body), body.get("partition"),
                                                   body.get("to"))

    def _drain(self, body: dict[str, Any]) -> Any:
        return cluster_of(self.store).drain()

    def _stats(self, body: dict[str, Any]) -> Any:
        writer = self.subscriptions.writer
        return {**self.store.stats(), **broker_stats(self.store, self.streams),
                "cursor_writes": writer.writes, "cursor_snapshots": writer.snapshots,
                "dead_letters": self.subscriptions.dead_letters.written}

    def _lag(self, body: dict[str, Any]) -> Any:
        """Per partition: messages from the position given (or its start) to its end."""
        topic = self.store.topic(body["topic"]).name
        given = {int(p): Position.from_dict(v) for p, v in (body.get("positions") or {}).items()}
        out = {}
        for p, end in self.store.ends(topic).items():
            plog = self.store.partition(topic, p)
            start = given.get(p) or plog.earliest()
            out[str(p)] = plog.backlog(check_partition(start, plog), end) if start < end else 0
        return out

    def _query_lag(self, body: dict[str, Any]) -> Any:
        if body.get("forget"):
            self.lags.forget(str(body["query_id"]))
        else:
            self.lags.report(str(body["query_id"]), body.get("name"), {
                str(TopicName.parse(t)): {str(p): int(n) for p, n in parts.items()}
                for t, parts in (body.get("lags") or {}).items()})
        return {"ok": True}

    def _topic_stats(self, body: dict[str, Any]) -> Any:
        return topic_stats(self.store, self.subscriptions, self.streams, body["topic"],
                           per_partition=bool(body.get("per_partition")),
                           here_only=bool(body.get("here_only")))

    def _served(self, body: dict[str, Any]) -> str:
        """A subscription action's topic, once its partition is served here: one another
        broker owns is refused (NotOwnerError, naming the owner), as its streams are."""
        topic = _topic(body)
        partition = body["partition"] if "partition" in body else \
            body["position"]["partition"]
        self._check_served(topic, int(partition))
        return topic

    def _check_served(self, topic: str, partition: int) -> None:
        """NotOwnerError unless the partition is served here. The refusal comes from the
        view of the last lease renewal, which a partition handed here since (an unload, a
        drain) is not in yet: the metadata says, as it does for a stream (``serve_if_placed``
        opens it). Trusted alone, that view sent a consumer's acks back to the former owner,
        which sent them here again, until the client gave up."""
        try:
            self.store.owners.serving(topic, partition)
        except NotOwnerError:
            cluster = self.store.cluster
            if cluster is None or not cluster.serve_if_placed(topic, partition):
                raise

    def _ack(self, body: dict[str, Any]) -> Any:
        topic = self._served(body)
        segment, entry, index = decode_positions(body)
        doubt = self.subscriptions.ack(topic, str(body["subscription"]), int(body["partition"]),
                                       str(body.get("consumer") or ""), segment, entry, index,
                                       retry=bool(body.get("retry")))
        return {"ok": True, "in_doubt": doubt}

    def _ack_cumulative(self, body: dict[str, Any]) -> Any:
        topic = self._served(body)
        doubt = self.subscriptions.ack_cumulative(topic, str(body["subscription"]),
                                                  str(body.get("consumer") or ""),
                                                  Position.from_dict(body["position"]),
                                                  retry=bool(body.get("retry")))
        return {"ok": True, "in_doubt": doubt}

    def _nack(self, body: dict[str, Any]) -> Any:
        topic = self._served(body)
        segment, entry, index = decode_positions(body)
        self.subscriptions.nack(topic, str(body["subscription"]), int(body["partition"]),
                                str(body["consumer"]), segment, entry, index,
                                float(body.get("delay_s") or 0.0))
        return {"ok": True}

    def _flow(self, body: dict[str, Any]) -> Any:
        topic = self._served(body)
        self.subscriptions.flow(topic, str(body["subscription"]), int(body["partition"]),
                                str(body["consumer"]), int(body["permits"]))
        return {"ok": True}

    def _consumer_keepalive(self, body: dict[str, Any]) -> Any:
        topic = self._served(body)
        return {"attached": self.subscriptions.keepalive(
            topic, str(body["subscription"]), int(body["partition"]), str(body["consumer"]))}

    def _close_consumer(self, body: dict[str, Any]) -> Any:
        topic = self._served(body)
        self.subscriptions.close_consumer(topic, str(body["subscription"]),
                                          int(body["partition"]), str(body["consumer"]))
        return {"ok": True}

    def _offload(self, body: dict[str, Any]) -> Any:
        ids = body.get("segment_ids")
        moved = self.store.offloader.offload_topic(
            body["topic"], older_than_ms=body.get("older_than_ms"),
            segment_ids=None if ids is None else {int(i) for i in ids})
        return [s.to_dict() for s in moved]

    def _compact(self, body: dict[str, Any]) -> Any:
        here = self.compactor.start(body["topic"], wait=bool(body.get("wait", True)))
        return with_owners(self.store, here, "compact", body)

    def _compaction(self, body: dict[str, Any]) -> Any:
        return with_owners(self.store, self.compactor.status(body["topic"]), "compaction",
                           body)

    def _set_compaction_threshold(self, body: dict[str, Any]) -> Any:
        name = self.store.topic(body["topic"]).name
        threshold = body.get("threshold_bytes")
        set_compaction_threshold(self.store.metadata, name,
                                 None if threshold is None else int(threshold))
        return self.compactor.status(name)

    def _tier_pass(self, body: dict[str, Any]) -> Any:
        return self.store.tier_pass()

    def _set_retention(self, body: dict[str, Any]) -> Any:
        return self.store.set_retention(body["topic"], body.get("retention_ms")).to_dict()

    def _deleted_segments(self, body: dict[str, Any]) -> Any:
        name = self.store.topic(body["topic"]).name
        return self.store.metadata.deleted_segments(name, body.get("partition"))

    def _advance(self, body: dict[str, Any]) -> Any:
        plog = self.store.partition(body["topic"], int(body["partition"]))
        start = check_partition(Position.from_dict(body["start"]), plog)
        bound = check_partition(Position.from_dict(body["bound"]), plog)
        end, counted = plog.advance(start, int(body["max_messages"]), bound)
        return {"end": end.to_dict(), "messages": counted}

    def _position_at_time(self, body: dict[str, Any]) -> Any:
        plog = self.store.partition(body["topic"], int(body["partition"]))
        return plog.position_at_time(int(body["time_ms"])).to_dict()

    def _set_cursor(self, body: dict[str, Any]) -> Any:
        """Store a subscription's position per partition (a streaming query's commit)."""
        topic = self.store.topic(body["topic"]).name
        for p, raw in dict(body["positions"]).items():
            self.subscriptions.set_position(topic, str(body["subscription"]), int(p),
                                            Position.from_dict(raw), label=body.get("label"))
        return {"ok": True}

    def _delete_subscription(self, body: dict[str, Any]) -> Any:
        topic = self.store.topic(body["topic"]).name
        return {"cursors": self.subscriptions.delete(topic, str(body["subscription"]))}

    def _subscriptions(self, body: dict[str, Any]) -> Any:
        """Per subscription and partition: type, position, backlog, consumers."""
        return self.subscriptions.listing(self.store.topic(body["topic"]).name)

    def _plan_segments(self, body: dict[str, Any]) -> Any:
        """What a planner on another host needs of one topic, in one round trip: per
        partition, the segments that may hold publish times in ``[start_time, end_time)``
        (searched here, by SQLite's indexes: O(log S)) and the first live segment id."""
        topic = self.store.topic(body["topic"])
        t0, t1 = body.get("start_time"), body.get("end_time")
        meta = self.store.metadata
        windows = meta.segments_in_windows(topic.name, range(topic.partitions), t0, t1)
        return {str(p): {"window": [s.to_dict() for s in window],
                         "first": meta.first_segment_id(topic.name, p)}
                for p, window in windows.items()}

    def _bookie_endpoints(self, body: dict[str, Any]) -> Any:
        return self.store.metadata.bookie_endpoints()

    def _register_bookie(self, body: dict[str, Any]) -> Any:
        bookie, address = str(body["bookie"]), str(body["address"])
        if bookie not in self.store.bookies:
            raise NotFoundError(f"no bookie {bookie!r} in this store; its bookies are "
                                f"{', '.join(sorted(self.store.bookies))}")
        if not address.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            raise ConfigError(f"invalid bookie address {address!r}: expected grpc://HOST:PORT "
                              "or grpc+tls://HOST:PORT")
        set_bookie_endpoint(self.store.metadata, bookie, address)
        return {"bookie": bookie, "address": address}

    def _txn_prepare(self, body: dict[str, Any]) -> Any:
        expected = {(str(t), int(p)): int(n) for t, p, n in body.get("parts") or []}
        return self.store.transactions.prepare(str(body["txn"]), expected).to_dict()

    def _txn_commit(self, body: dict[str, Any]) -> Any:
        batch = body.get("batch")
        return self.store.transactions.commit(
            [str(t) for t in body.get("txns") or []], sink_id=body.get("sink"),
            batch_id=None if batch is None else int(batch))

    def _txn_abort(self, body: dict[str, Any]) -> Any:
        return {"aborted": self.store.transactions.abort(
            str(body["txn"]), str(body.get("reason") or "aborted by its writer"))}

    def _txn_here(self, body: dict[str, Any]) -> Any:  # another broker of the cluster asks
        return self.store.transactions.here(str(body["op"]), body["txns"], body["parts"])

    def _transactions(self, body: dict[str, Any]) -> Any:
        return self.store.transactions.list()

    def _sink_state(self, body: dict[str, Any]) -> Any:
        return {"sink": body["sink"], "last_batch": self.store.transactions.records.last_batch(
            str(body["sink"]))}

    def _schema_register(self, body: dict[str, Any]) -> Any:
        return self.schemas.register(body["topic"], SchemaType.parse(body["type"]),
                                     body.get("definition")).to_dict()

    def _schema_get(self, body: dict[str, Any]) -> Any:
        version = body.get("version")
        return self.schemas.get(body["topic"], None if version is None
                                else int(version)).to_dict()

    def _schema_list(self, body: dict[str, Any]) -> Any:
        return {"compatibility": self.schemas.compatibility(body["topic"]).value,
                "versions": [v.to_dict() for v in self.schemas.versions(body["topic"])]}

    def _schema_check(self, body: dict[str, Any]) -> Any:
        why = self.schemas.check(body["topic"], SchemaType.parse(body["type"]),
                                 body.get("definition"))
        return {"compatible": why is None, "reason": why}

    def _schema_compatibility(self, body: dict[str, Any]) -> Any:
        rule = Compatibility.parse(body["compatibility"])
        self.schemas.set_compatibility(body["topic"], rule)
        return {"compatibility": rule.value}

    def _producer_state(self, body: dict[str, Any]) -> Any:  # with messages: partition_log.py
        return {str(p.partition): (p.last_stored if body.get("messages") else p.producer_state)(
            str(body["producer"])) for p in self.store.partitions(body["topic"])}


_A = AdminActions
ACTIONS: dict[str, tuple[Any, str]] = {
    "ping": (_A._ping, "Check that the broker is up."),
    "create-topic": (_A._create_topic, "Create a topic: {topic, partitions}."),
    "set-partitions": (_A._set_partitions, "Grow {topic} at a scale event: {partitions}."),
    "delete-topic": (_A._delete_topic, "Delete {topic} everywhere (crash-safe)."),
    "get-topic": (_A._get_topic, "One topic's record: {topic}."),
    "list-topics": (_A._list_topics, "All topics, or those of {namespace}."),
    "list-segments": (_A._list_segments, "Segment records of {topic}, live stats."),
    "last-confirmed": (_A._last_confirmed, "Last confirmed position per partition."),
    "ends": (_A._ends, "Exclusive end position per partition of {topic} (no data read); "
                       "[owners]: those served here, and the owner of each other one."),
    "seal": (_A._seal, "Seal the open segment(s) of {topic[, partition]}."),
    "unload": (_A._unload, "Move {topic[, partition]} to other brokers (--cluster)."),
    "drain": (_A._drain, "Move every partition served here to other brokers."),
    "stats": (_A._stats, "Broker and store counters: streams, offload lag, "
                         "transactions by state, open files."),
    "topic-stats": (_A._topic_stats, "Rates, storage by location, producers and "
                                     "subscriptions of {topic} [per_partition] "
                                     "[here_only: not asking the other owners]."),
    "lag": (_A._lag, "Per partition of {topic}: messages after {positions}."),
    "query-lag": (_A._query_lag, "A Spark query's lag {query_id, name, lags} for the "
                                 "metrics ({forget}: it ended)."),
    "ack": (_A._ack, "Acknowledge the given messages of a subscription (individually); "
                     "with {retry}, say how many may have been delivered again."),
    "ack-cumulative": (_A._ack_cumulative, "Acknowledge up to and including {position} "
                                           "(exclusive and failover only)."),
    "nack": (_A._nack, "Redeliver the given messages after {delay_s}."),
    "flow": (_A._flow, "Give a consumer {permits} more messages."),
    "consumer-keepalive": (_A._consumer_keepalive, "{consumer} is there: whether it is "
                                                   "attached here."),
    "close-consumer": (_A._close_consumer, "Detach {consumer} now: what it holds goes to "
                                           "the others."),
    "producer-state": (_A._producer_state, "Last stored id of {producer} [, its message]."),
    "plan-segments": (_A._plan_segments, "Per partition: segments in a time window, "
                                         "first segment id (planning off-host)."),
    "bookie-endpoints": (_A._bookie_endpoints, "Advertised address of each bookie."),
    "register-bookie": (_A._register_bookie, "Record {bookie, address} (bookie serve)."),
    "offload": (_A._offload, "Offload closed segments of {topic[, older_than_ms, "
                             "segment_ids]}."),
    "compact": (_A._compact, "Compact {topic}'s partitions (on a cluster each by its owner): "
                             "the latest message per key up to now, as a snapshot [wait, "
                             "here_only]."),
    "compaction": (_A._compaction, "{topic}'s compaction: the last run's status and each "
                                   "partition's snapshot."),
    "set-compaction-threshold": (_A._set_compaction_threshold, "Compact {topic} whenever a "
                                 "partition has {threshold_bytes} after its horizon (null: "
                                 "on demand only)."),
    "tier-pass": (_A._tier_pass, "Apply offload, bookie deletion and retention now."),
    "set-retention": (_A._set_retention, "Set {topic, retention_ms} (null: keep all)."),
    "deleted-segments": (_A._deleted_segments, "Segments removed by retention."),
    "advance": (_A._advance, "Position N messages after {start}, bounded by {bound}."),
    "position-at-time": (_A._position_at_time, "First position at or after a time."),
    "set-cursor": (_A._set_cursor, "Store a subscription's positions (a cut)."),
    "subscriptions": (_A._subscriptions, "Cursors of {topic}: position, backlog, consumers."),
    "delete-subscription": (_A._delete_subscription,
                            "Remove {subscription} of {topic} (no consumer may be attached)."),
    "txn-prepare": (_A._txn_prepare, "Check {txn}'s staged rows ({parts}); PREPARED."),
    "txn-commit": (_A._txn_commit, "Commit {txns} at once (idempotent by {sink, batch})."),
    "txn-abort": (_A._txn_abort, "Abort {txn} and remove its staged rows."),
    "txn-here": (_A._txn_here, "{op} staged|apply|end: {txns} in {parts} (a peer asks)."),
    "transactions": (_A._transactions, "Transactions and their states."),
    "sink-state": (_A._sink_state, "The last batch id committed by {sink}."),
    "schema-register": (_A._schema_register, "Add {type, definition} as {topic}'s next "
                                             "schema version (if compatible)."),
    "schema-get": (_A._schema_get, "A schema version of {topic} (default: latest)."),
    "schema-list": (_A._schema_list, "Every schema version of {topic}, and its rule."),
    "schema-check": (_A._schema_check, "Would {type, definition} be compatible?"),
    "schema-compatibility": (_A._schema_compatibility, "Set {topic}'s compatibility."),
}


def _topic(body: dict[str, Any]) -> str:
    """The topic of a consumer's action, read without the metadata store: acks and flows are
    the hot path, and the metadata lock is held through each cursor write's fsync. An unknown
    topic has no dispatcher, and loading one looks the topic up."""
    return str(TopicName.parse(body["topic"]))


def check_partition(position: Position, plog: PartitionLog) -> Position:
    """``position``, if it is one of ``plog``'s partition."""
    if position.partition != plog.partition:
        raise ConfigError(f"position {position} is not in partition {plog.partition}")
    return position
