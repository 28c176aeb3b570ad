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

from tierstream.broker.admin_actions import ACTIONS, AdminActions
from tierstream.broker.flight.consume_streams import ConsumeStreams
from tierstream.broker.flight.produce_stream import produce_stream
from tierstream.broker.stats.topic_stats import QueryLags, Streams
from tierstream.broker.store import Store
from tierstream.broker.subscriptions.registry import Subscriptions
from tierstream.broker.topics.compaction import Compactor
from tierstream.errors import (
    ConfigError,
    ProducerFencedError,
    ProtocolError,
    TierstreamError,
)
from tierstream.metadata.producer_epochs import MetadataEpochs
from tierstream.metadata.schema_registry import SchemaRegistry
from tierstream.model.message_format import may_have_property
from tierstream.model.names import TopicName
from tierstream.options import DEFAULT_PORT
from tierstream.schemas.codec import named_versions
from tierstream.schemas.model import VERSION_PROPERTY
from tierstream.wire.flight import (
    action_result,
    decode,
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


class Broker(ConsumeStreams, AdminActions, flight.FlightServerBase):
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
        self.compactor = Compactor(store)
        self.compactor.start_policy(store.config.tier_check_interval_ms / 1000)

    def shutdown(self) -> None:
        """Stop serving, then store every subscription's last acks."""
        super().shutdown()
        self.subscriptions.close()
        self.compactor.stop()

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
                    self.schemas.check_named_versions(plog.topic, _named_versions(batch))
                    stream["messages"] += batch.num_rows
                    stream["bytes"] += batch.get_total_buffer_size()  # (its own buffers)

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
            self.schemas.check_named_versions(name, _named_versions(batch))
            yield batch

    # -- admin --------------------------------------------------------------------------------

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [(name, doc) for name, (_, doc) in ACTIONS.items()]

    def do_action(self, context: Any, action: flight.Action) -> Iterator[bytes]:
        try:
            self.store.check_serving()
            body = decode(action.body.to_pybytes() if action.body else b"{}", "action body")
            result = self.call(action.type, body)
        except TierstreamError as exc:
            raise server_error(exc) from None
        return action_result(result)


def _named_versions(batch: pa.RecordBatch) -> set[str]:
    """The schema versions ``batch`` names: most batches name none, and one search of their
    properties' key bytes says so, where the lookup in every message's map costs ~300
    instructions a message."""
    at = batch.schema.get_field_index("properties")  # (a name costs pyarrow an exception)
    if at < 0 or not may_have_property(batch.column(at), VERSION_PROPERTY):
        return set()
    return named_versions(batch)
