"""The producer: batches routed by key hash, pipelined, re-sent after a reconnect and stored
once by sequence id (see ``managed_ledger/dedup.py``)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.client.admin import Admin
from tierstream.client.connection import BrokerClient
from tierstream.client.messages import (
    Message,
    check_sequence_ids,
    checked_schema,
    encoded_messages,
    to_batch,
)
from tierstream.client.producer_acks import PartitionAcks
from tierstream.client.stream_io import PartitionStream
from tierstream.errors import (
    ConfigError,
    ConflictError,
    UnavailableError,
)
from tierstream.model import arguments
from tierstream.model.message_format import as_produce_batch, key_hash
from tierstream.model.names import TopicName
from tierstream.wire.flight import encode

if TYPE_CHECKING:
    from tierstream.client.transaction import Transaction
    from tierstream.schemas.codec import Encoder

__all__ = ["Message", "Producer"]

log = logging.getLogger(__name__)


class Producer(PartitionAcks):
    """Sends messages to one topic, routed by key hash (round-robin for unkeyed messages).

    Each batch carries ``(name, sequence id)``; after a broker restart the producer re-sends
    every unacknowledged batch, and the broker stores each sequence id once. Up to
    ``max_in_flight`` batches per partition are pipelined before waiting for acks.

    Give a ``name`` to get that guarantee across producer restarts too: a new producer with the
    same name continues after the last stored sequence id. An unnamed producer gets a random
    name, so only its own retries are de-duplicated. When ``send_timeout`` passes without an
    ack, the UnavailableError names the sequence ids in doubt (``exc.unacknowledged``:
    partition -> ids); they stay queued, so :meth:`flush` tries again.

    When the topic grows (a scale event), the first batch the broker refuses as routed by
    the old count makes the producer read the new one and route that batch, and every batch
    behind it, again: nothing is stored by the old routing after the event, and each key's
    messages stay in order. Batches sent to a chosen partition (``send_batch(partition=)``)
    stay there.

    Typed values: ``schema=("avro", definition)`` registers that schema as a version of the
    topic (or finds it: refused if incompatible under the topic's rule); without it the
    producer uses the topic's latest schema, if it has one. Values are then encoded and
    checked (a dict for AVRO and JSON, text for STRING), every value of a call before any is
    sent, and each message records its schema version (property
    ``tierstream.schema.version``).
    """

    def __init__(self, topic: str, *, broker: str | None = None, auth_token: str | None = None,
                 tls_ca: bytes | str | None = None, name: str | None = None,
                 batch_size: int = 1000, max_in_flight: int = 8,
                 send_timeout: float = 30.0,
                 schema: tuple[str, str | None] | None = None) -> None:
        self.topic = str(TopicName.parse(topic))
        self.name = arguments.text(name, "producer name", none_ok=True) \
            or f"producer-{uuid.uuid4().hex[:12]}"
        self.batch_size = arguments.positive_int(batch_size, "batch_size")
        self.max_in_flight = arguments.positive_int(max_in_flight, "max_in_flight")
        self.send_timeout = arguments.seconds(send_timeout, "send_timeout", zero_ok=False)
        self._client = BrokerClient(broker, auth_token=auth_token, tls_ca=tls_ca)
        self._admin = Admin(self._client.broker, auth_token=auth_token, tls_ca=self._client.tls_ca)
        self.partitions = self._admin.get_topic(self.topic).partitions
        self._streams: dict[int, PartitionStream] = {}
        self._add_streams()
        self._rr = itertools.count()
        self._acks: list[dict[str, Any]] = []
        self.encoder = self._schema_encoder(checked_schema(schema))
        self._txn: Transaction | None = None

    def __repr__(self) -> str:
        return f"Producer(topic={self.topic!r}, name={self.name!r}, broker={self._client.url!r})"

    def _add_streams(self) -> None:
        """A stream for every partition that has none yet, continuing after the last
        sequence id this producer's name stored there."""
        state = self._admin.action("producer-state", {"topic": self.topic, "producer": self.name})
        # A partition where this name stored nothing yet starts at 0; note that 0 is also a
        # stored id, so test for None, not for truth.
        for p in range(self.partitions):
            if p not in self._streams:
                last = state.get(str(p))
                self._streams[p] = PartitionStream(next_seq=0 if last is None else int(last) + 1)

    def _schema_encoder(self, schema: tuple[str, str | None] | None) -> Encoder | None:
        """The topic's schema: ``schema`` (type, definition) registered (or found) as a
        version, else the topic's latest version if it has one, else none (bytes)."""
        from tierstream.errors import NotFoundError
        from tierstream.schemas.codec import Encoder

        if schema is not None:
            return Encoder(self._admin.register_schema(self.topic, schema[0], schema[1]))
        try:
            return Encoder(self._admin.get_schema(self.topic))
        except NotFoundError:
            return None

    # -- public API ---------------------------------------------------------------------------

    def send(self, value: bytes | str, *, key: str | None = None, event_time: int | None = None,
             properties: Mapping[str, str] | None = None, publish_time: int | None = None
             ) -> dict[str, Any]:
        """Send one message and wait for its ack (a dict with partition, segment_id, ...)."""
        data = value.encode() if isinstance(value, str) and self.encoder is None else value
        acks = self.send_many([Message(data, key, event_time, properties, publish_time)])
        return acks[0]

    def send_many(self, messages: Iterable[Message | Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Send messages in batches of ``batch_size``; returns one ack per batch, once all
        are acknowledged.

        Messages may carry their own increasing ``sequence_id`` (all of a call, or none), as
        a replayable input numbers them (``tierstream produce --name`` uses line numbers):
        a message whose id this producer's name already stored in its partition is not sent
        again (an ack with ``duplicate=True`` counts it), and a batch's id is its last
        message's. Messages without a key then go to partition ``sequence_id % partitions``,
        so a replay routes them as the first run did."""
        buffers: dict[int, list[Message]] = {}
        routing = self.partitions
        self._acks = []
        encoded = encoded_messages(self.encoder, self.topic, messages)
        own_ids = check_sequence_ids(encoded)
        for msg in encoded:
            p = self._route(msg.key, msg.sequence_id)
            if own_ids and msg.sequence_id is not None \
                    and msg.sequence_id < self._streams[p].next_seq:
                self._acks.append({"partition": p, "sequence_id": msg.sequence_id,
                                   "duplicate": True, "messages": 1})
                continue
            buffers.setdefault(p, []).append(msg)
            if len(buffers[p]) >= self.batch_size:
                self._send_messages(p, buffers.pop(p))
                if self.partitions != routing:  # the topic grew: route what waits again
                    buffers, routing = self._rerouted(buffers), self.partitions
        while buffers:
            p = min(buffers)
            self._send_messages(p, buffers.pop(p))
            if self.partitions != routing:
                buffers, routing = self._rerouted(buffers), self.partitions
        self.flush()
        return self._acks

    def _send_messages(self, p: int, messages: list[Message]) -> None:
        self._send(p, to_batch(messages), seq=messages[-1].sequence_id)

    def _rerouted(self, buffers: dict[int, list[Message]]) -> dict[int, list[Message]]:
        out: dict[int, list[Message]] = {}
        for p in sorted(buffers):
            for msg in buffers[p]:
                out.setdefault(p if msg.key is None else self._route(msg.key, None),
                               []).append(msg)
        return out

    def send_batch(self, batch: pa.RecordBatch | pa.Table, *, partition: int | None = None
                   ) -> list[dict[str, Any]]:
        """Send Arrow data (columns of PRODUCE_SCHEMA) to one partition as-is (no routing)."""
        p = next(self._rr) % self.partitions if partition is None else partition
        if not 0 <= p < self.partitions:
            raise ConfigError(f"invalid partition {p} for {self.topic!r}: it has "
                              f"0..{self.partitions - 1}")
        self._acks = []
        batches = batch.to_batches(self.batch_size) if isinstance(batch, pa.Table) \
            else [batch]
        if self.encoder is not None:  # every value checked before any is sent
            batches = [self._encode_batch(as_produce_batch(b), i * self.batch_size)
                       for i, b in enumerate(batches)]
        for b in batches:
            self._send(p, as_produce_batch(b), pinned=partition is not None)
        self.flush()
        return self._acks

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Inside ``with producer.transaction():`` the producer's sends are staged, not
        stored: on leaving the block they become visible all at once, in every partition
        (an error aborts them instead). Acks of sends inside say ``staged`` and the
        transaction, not a position."""
        from tierstream.client.transaction import Transaction

        if self._txn is not None:
            raise ConflictError("this producer is already in a transaction")
        self.flush()  # what was sent before the transaction is not part of it
        self._txn = Transaction(broker=self._client.broker, auth_token=self._client.auth_token,
                                tls_ca=self._client.tls_ca,
                                encoders=None if self.encoder is None else
                                {self.topic: self.encoder})
        try:
            with self._txn as txn:
                yield txn
        finally:
            self._txn = None

    def flush(self) -> None:
        """Wait until every batch sent so far is acknowledged (re-sending after failures)."""
        while any(stream.unacked for stream in self._streams.values()):
            p = next(p for p, stream in self._streams.items() if stream.unacked)
            self._read_ack(p, self._streams[p])

    def close(self) -> None:
        """Flush (waiting for every ack), then release the connections."""
        try:
            self.flush()
        finally:
            self._release()

    def _release(self) -> None:
        deadline = time.monotonic() + self.send_timeout  # for them all, hung or not
        for stream in self._streams.values():
            self._drop(stream, max(0.0, deadline - time.monotonic()))
        self._client.close()
        self._admin.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not retry for another send_timeout on the way out of an error
            self._release()

    # -- internals ----------------------------------------------------------------------------

    def _encode_batch(self, batch: pa.RecordBatch, first: int) -> pa.RecordBatch:
        assert self.encoder is not None
        values, props = self.encoder.encode_columns(batch.column("value"),
                                                    batch.column("properties"), first)
        out = batch.set_column(batch.schema.get_field_index("value"), "value", values)
        return out.set_column(out.schema.get_field_index("properties"), "properties", props)

    def _route(self, key: str | None, sequence_id: int | None) -> int:
        if key is not None:
            return key_hash(key) % self.partitions
        if sequence_id is not None:
            return sequence_id % self.partitions
        return next(self._rr) % self.partitions

    def _send(self, p: int, batch: pa.RecordBatch, *, pinned: bool = False,
              seq: int | None = None) -> None:
        """Send one batch to partition ``p`` as sequence id ``seq`` (default: the next)."""
        if self._txn is not None:  # staged: the ack says where, not at which position
            self._txn.write(self.topic, batch, partition=p,
                            routed=None if pinned else self.partitions)
            self._acks.append({"partition": p, "messages": batch.num_rows,
                               "transaction": self._txn.txn_id, "staged": True})
            return
        stream = self._streams[p]
        seq = stream.next_seq if seq is None else seq
        stream.next_seq = seq + 1
        stream.unacked.append((seq, batch))
        if pinned:
            stream.pinned.add(seq)
        try:
            self._ensure_stream(p, stream).write(batch, pa.py_buffer(encode({"seq": seq})),
                                                 self.send_timeout)
        except (flight.FlightError, OSError, pa.ArrowException, UnavailableError):
            self._recover(p, stream)
        while len(stream.unacked) >= self.max_in_flight:
            self._read_ack(p, stream)
