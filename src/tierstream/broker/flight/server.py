"""The broker: an Arrow Flight server in front of the embedded store. It only serves.

Bound to loopback by default. Binding anywhere else requires a token, checked by middleware on
every call; a call without the right token is denied before any handler runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.broker.cluster import cluster_of
from tierstream.broker.consume_streams import ConsumeStreams, check_partition
from tierstream.broker.produce_stream import produce_stream
from tierstream.broker.store import Store
from tierstream.broker.subscriptions.registry import Subscriptions
from tierstream.broker.topic_stats import QueryLags, Streams, broker_stats, topic_stats
from tierstream.errors import (
    ConfigError,
    NotFoundError,
    NotOwnerError,
    ProducerFencedError,
    ProtocolError,
    TierstreamError,
)
from tierstream.metadata.bookie_registry import set_bookie_endpoint
from tierstream.metadata.producer_epochs import MetadataEpochs
from tierstream.metadata.schema_registry import SchemaRegistry
from tierstream.model.names import TopicName
from tierstream.model.positions import Position
from tierstream.options import DEFAULT_PORT
from tierstream.schemas.codec import named_versions
from tierstream.schemas.model import Compatibility, SchemaType
from tierstream.wire.flight import (
    action_result,
    decode,
    decode_positions,
    encode,
    put_batches,
    server_error,
)
from tierstream.wire.security import (
    TokenMiddlewareFactory,
    check_bind,
    is_loopback,
    server_tls,
    url_host,
)

__all__ = ["Broker", "is_loopback"]

log = logging.getLogger(__name__)


class Broker(ConsumeStreams, flight.FlightServerBase):
    """Serves produce (DoPut), consume (DoGet) and admin actions (DoAction) for one store."""

    def __init__(self, store: Store, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 auth_token: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        tls = server_tls(tls_cert, tls_key)
        check_bind(host, auth_token=auth_token, tls=tls is not None, what="broker")
        middleware = {"auth": TokenMiddlewareFactory(auth_token)} if auth_token else {}
        self.scheme = "grpc+tls" if tls else "grpc"
        location = f"{self.scheme}://{url_host(host)}:{port}"
        try:
            super().__init__(location, middleware=middleware, tls_certificates=tls or [])
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"cannot listen on {location}: {exc}") from None
        self.store = store
        self.host = host
        self.subscriptions = Subscriptions(store)
        # a partition another broker took: its consumers are let go, to find the owner
        store.owners.on_lost.append(self.subscriptions.let_go)
        self.schemas = SchemaRegistry(store.metadata)
        self.streams = Streams(epochs=MetadataEpochs(store.metadata))
        self.lags = QueryLags()

    def shutdown(self) -> None:
        """Stop serving, then store every subscription's last acks."""
        super().shutdown()
        self.subscriptions.close()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{url_host(self.host)}:{self.port}"

    # -- produce ------------------------------------------------------------------------------

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader,
               writer: flight.FlightMetadataWriter) -> None:
        try:
            self.store.check_serving()
            cmd = decode(descriptor.command, "produce command")
            if cmd.get("op") == "stage":
                rows = self.store.transactions.stage(
                    str(cmd["txn"]), str(cmd["topic"]), int(cmd["partition"]),
                    self._checked(str(cmd["topic"]), put_batches(reader)), sink_id=cmd.get("sink"),
                    batch_id=None if cmd.get("batch") is None else int(cmd["batch"]),
                    routed=None if cmd.get("routed") is None else int(cmd["routed"]))
                writer.write(pa.py_buffer(encode({"rows": rows})))
                return
            if cmd.get("op") != "produce":
                raise ProtocolError(f"unknown DoPut operation {cmd.get('op')!r}")
            plog = self.store.partition(cmd["topic"], int(cmd["partition"]))
            self.store.owners.serving(plog.topic, plog.partition)
            producer = cmd.get("producer")
            routed = None if cmd.get("routed") is None else int(cmd["routed"])
            with self.streams.serving("producer", plog.topic, plog.partition,
                                      producer) as stream:
                def check(batch: pa.RecordBatch) -> None:
                    self.store.check_serving()  # fenced meanwhile: not one more batch
                    self.store.owners.serving(plog.topic, plog.partition)  # or moved
                    if "fenced" in stream:  # an ExclusiveWithFencing producer took over
                        raise ProducerFencedError(stream["fenced"])
                    self.schemas.check_named_versions(plog.topic, named_versions(batch))
                    stream["messages"] += batch.num_rows
                    stream["bytes"] += batch.nbytes

                produce_stream(plog, reader, writer, producer=producer, routed=routed,
                               check=check)
        except TierstreamError as exc:
            raise server_error(exc) from None
        except (KeyError, ValueError, TypeError) as exc:
            raise server_error(ProtocolError(f"malformed produce request: {exc!r}")) from None

    def _checked(self, topic: str, batches: Iterator[pa.RecordBatch]
                 ) -> Iterator[pa.RecordBatch]:
        """``batches``, each refused if it names a schema version the topic does not have."""
        name = str(TopicName.parse(topic))
        for batch in batches:
            self.schemas.check_named_versions(name, named_versions(batch))
            yield batch

    # -- admin --------------------------------------------------------------------------------

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [(name, doc) for name, (_, doc) in _ACTIONS.items()]

    def do_action(self, context: Any, action: flight.Action) -> Iterator[bytes]:
        try:
            self.store.check_serving()
            body = decode(action.body.to_pybytes() if action.body else b"{}", "action body")
            result = self.call(action.type, body)
        except TierstreamError as exc:
            raise server_error(exc) from None
        return action_result(result)

    def call(self, action: str, body: dict[str, Any]) -> Any:
        """Run one admin action (``_ACTIONS``) on ``body``: what Flight's ``do_action`` and
        the Pulsar admin REST endpoint (``broker/pulsar/admin_http.py``) both call.
        TierstreamError on failure; a malformed body is a ProtocolError."""
        entry = _ACTIONS.get(action)
        if entry is None:
            raise ProtocolError(f"unknown action {action!r}; known: {sorted(_ACTIONS)}")
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
            self.store.owners.serving(topic, partition)
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
        self.store.owners.serving(topic, int(partition))
        return topic

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


_ACTIONS = {
    "ping": (Broker._ping, "Check that the broker is up."),
    "create-topic": (Broker._create_topic, "Create a topic: {topic, partitions}."),
    "set-partitions": (Broker._set_partitions, "Grow {topic} at a scale event: {partitions}."),
    "delete-topic": (Broker._delete_topic, "Delete {topic} everywhere (crash-safe)."),
    "get-topic": (Broker._get_topic, "One topic's record: {topic}."),
    "list-topics": (Broker._list_topics, "All topics, or those of {namespace}."),
    "list-segments": (Broker._list_segments, "Segment records of {topic}, live stats."),
    "last-confirmed": (Broker._last_confirmed, "Last confirmed position per partition."),
    "ends": (Broker._ends, "Exclusive end position per partition of {topic} (no data read); "
                           "[owners]: those served here, and the owner of each other one."),
    "seal": (Broker._seal, "Seal the open segment(s) of {topic[, partition]}."),
    "unload": (Broker._unload, "Move {topic[, partition]} to other brokers (--cluster)."),
    "drain": (Broker._drain, "Move every partition served here to other brokers."),
    "stats": (Broker._stats, "Broker and store counters: streams, offload lag, "
                             "transactions by state, open files."),
    "topic-stats": (Broker._topic_stats, "Rates, storage by location, producers and "
                                         "subscriptions of {topic} [per_partition] "
                                         "[here_only: not asking the other owners]."),
    "lag": (Broker._lag, "Per partition of {topic}: messages after {positions}."),
    "query-lag": (Broker._query_lag, "A Spark query's lag {query_id, name, lags} for the "
                                     "metrics ({forget}: it ended)."),
    "ack": (Broker._ack, "Acknowledge the given messages of a subscription (individually); "
                         "with {retry}, say how many may have been delivered again."),
    "ack-cumulative": (Broker._ack_cumulative, "Acknowledge up to and including {position} "
                                               "(exclusive and failover only)."),
    "nack": (Broker._nack, "Redeliver the given messages after {delay_s}."),
    "flow": (Broker._flow, "Give a consumer {permits} more messages."),
    "close-consumer": (Broker._close_consumer, "Detach {consumer} now: what it holds goes to "
                                               "the others."),
    "producer-state": (Broker._producer_state, "Last stored id of {producer} [, its message]."),
    "plan-segments": (Broker._plan_segments, "Per partition: segments in a time window, "
                                             "first segment id (planning off-host)."),
    "bookie-endpoints": (Broker._bookie_endpoints, "Advertised address of each bookie."),
    "register-bookie": (Broker._register_bookie, "Record {bookie, address} (bookie serve)."),
    "offload": (Broker._offload, "Offload closed segments of {topic[, older_than_ms, "
                                 "segment_ids]}."),
    "tier-pass": (Broker._tier_pass, "Apply offload, bookie deletion and retention now."),
    "set-retention": (Broker._set_retention, "Set {topic, retention_ms} (null: keep all)."),
    "deleted-segments": (Broker._deleted_segments, "Segments removed by retention."),
    "advance": (Broker._advance, "Position N messages after {start}, bounded by {bound}."),
    "position-at-time": (Broker._position_at_time, "First position at or after a time."),
    "set-cursor": (Broker._set_cursor, "Store a subscription's positions (a cut)."),
    "subscriptions": (Broker._subscriptions, "Cursors of {topic}: position, backlog, consumers."),
    "delete-subscription": (Broker._delete_subscription,
                            "Remove {subscription} of {topic} (no consumer may be attached)."),
    "txn-prepare": (Broker._txn_prepare, "Check {txn}'s staged rows ({parts}); PREPARED."),
    "txn-commit": (Broker._txn_commit, "Commit {txns} at once (idempotent by {sink, batch})."),
    "txn-abort": (Broker._txn_abort, "Abort {txn} and remove its staged rows."),
    "txn-here": (Broker._txn_here, "{op} staged|apply|end: {txns} in {parts} (a peer asks)."),
    "transactions": (Broker._transactions, "Transactions and their states."),
    "sink-state": (Broker._sink_state, "The last batch id committed by {sink}."),
    "schema-register": (Broker._schema_register, "Add {type, definition} as {topic}'s next "
                                                 "schema version (if compatible)."),
    "schema-get": (Broker._schema_get, "A schema version of {topic} (default: latest)."),
    "schema-list": (Broker._schema_list, "Every schema version of {topic}, and its rule."),
    "schema-check": (Broker._schema_check, "Would {type, definition} be compatible?"),
    "schema-compatibility": (Broker._schema_compatibility, "Set {topic}'s compatibility."),
}


def _topic(body: dict[str, Any]) -> str:
    """The topic of a consumer's action, read without the metadata store: acks and flows are
    the hot path, and the metadata lock is held through each cursor write's fsync. An unknown
    topic has no dispatcher, and loading one looks the topic up."""
    return str(TopicName.parse(body["topic"]))
