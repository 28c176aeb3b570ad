"""The producer: batches routed by key hash, pipelined, re-sent after a reconnect and stored
once by sequence id (see ``managed_ledger/dedup.py``)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
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
    routed,
    to_batch,
)
from tierstream.client.retry import gave_up, reconnect_timeout_s
from tierstream.client.stream_io import PartitionStream, StalledError, StreamIO
from tierstream.errors import (
    ConfigError,
    ConflictError,
    FencedError,
    NotOwnerError,
    StaleRoutingError,
    TierstreamError,
    UnavailableError,
)
from tierstream.model import arguments
from tierstream.model.message_format import as_produce_batch, key_hash
from tierstream.model.names import TopicName
from tierstream.wire.flight import decode, encode, translate_errors

if TYPE_CHECKING:
    from tierstream.client.transaction import Transaction
    from tierstream.schemas.codec import Encoder

__all__ = ["Message", "Producer"]

log = logging.getLogger(__name__)


class Producer:
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

    def _ensure_stream(self, p: int, stream: PartitionStream) -> StreamIO:
        if stream.io is None:
            stream.io = StreamIO(self._client, {
                "op": "produce", "topic": self.topic, "partition": p, "producer": self.name,
                "routed": self.partitions})
        return stream.io

    def _read_ack(self, p: int, stream: PartitionStream) -> None:
        try:
            self._read_one_ack(p, stream)
        except StaleRoutingError:
            self._follow_scale(p)

    def _follow_scale(self, refusing: int) -> None:
        """The broker refused a batch of partition ``refusing`` as routed by an old count:
        the topic grew. Read the other partitions' acks up to their refusals, ask the broker
        which of the unacknowledged batches it stored before refusing (the last stored
        sequence id per partition: a stream's stored batches are always those before its
        refusal, whatever acks were lost with the connection), read the new count, and send
        the others again, routed by it, in their order."""
        stale = [refusing]
        for p, stream in self._streams.items():
            while p != refusing and stream.unacked:
                try:
                    self._read_one_ack(p, stream)
                except StaleRoutingError:
                    stale.append(p)
                    break
            self._drop(stream)  # its connection names the old count: reconnect
        stored = self._admin.action("producer-state", {"topic": self.topic,
                                                       "producer": self.name})
        refused: list[tuple[int, pa.RecordBatch, bool]] = []
        for p in stale:
            stream, last = self._streams[p], stored.get(str(p))
            for seq, batch in stream.unacked:
                if last is not None and seq <= int(last):
                    self._acks.append({"partition": p, "sequence_id": seq, "duplicate": True,
                                       "messages": batch.num_rows})
                else:
                    refused.append((p, batch, seq in stream.pinned))
            stream.unacked.clear()
            stream.pinned.clear()
        self.partitions = self._admin.get_topic(self.topic).partitions
        self._add_streams()
        for p, batch, pinned in refused:
            if pinned:
                self._send(p, batch, pinned=True)
            else:
                self._send_routed(p, batch)

    def _send_routed(self, p: int, batch: pa.RecordBatch) -> None:
        """Send the rows of ``batch`` (sent to ``p`` before) by the routing in force, also
        if the topic grows again meanwhile."""
        pending = deque([(p, batch)])
        while pending:
            p, batch = pending.popleft()
            routing = self.partitions
            parts = routed(batch, p, routing)
            for i, (q, rows) in enumerate(parts):
                if self.partitions != routing:  # it grew again while sending: route the
                    pending.extendleft(reversed(parts[i:]))  # rest by the newer count
                    break
                self._send(q, rows)

    def _read_one_ack(self, p: int, stream: PartitionStream) -> None:
        if stream.io is None:
            self._recover(p, stream)
        try:
            buf = self._ensure_stream(p, stream).read(self.send_timeout)
            if buf is None:
                self._raise_if_refused(stream, p)
                raise UnavailableError("broker closed the produce stream")
        except StalledError:  # connected, but no ack within send_timeout
            via = stream.io.url if stream.io else None
            self._drop(stream)
            now = time.monotonic()
            stream.stalled_since = stream.stalled_since or now - self.send_timeout
            # a hung broker (an owner followed, the one in use, or both) is left; reconnecting
            # goes on for reconnectTimeout after the stall, as after an unreachable broker
            followed = self._client.unfollow(self.topic, p, via)
            if (followed or len(self._client.urls) > 1) and \
                    now - stream.stalled_since < self.send_timeout + reconnect_timeout_s():
                self._leave(via, f"connected but sent no ack in {self.send_timeout:g}s")
                self._left_hung(via)
                self._recover(p, stream)
                return
            stream.stalled_since = None
            raise self._gave_up(p, stream, f"broker {self._client.url} connected but sent "
                                "no ack") from None
        except (flight.FlightError, OSError, pa.ArrowException, UnavailableError) as exc:
            self._raise_if_rejected(exc, stream.io.url if stream.io else None, p)
            # a broker that answers, but cannot take the partition yet (opening it, taking it
            # over): 50 ms between tries, doubling to 1 s; for send_timeout without an ack
            now = time.monotonic()
            stream.refused_since = stream.refused_since or now
            if now - stream.refused_since > self.send_timeout:
                stream.refused_since = None
                raise self._gave_up(p, stream, "the brokers kept refusing it ("
                                    f"{stream.refusal or exc})") from None
            stream.backoff = min(max(2 * stream.backoff, 0.05), 1.0)
            threading.Event().wait(stream.backoff)
            self._recover(p, stream)
            return
        ack = decode(buf.to_pybytes(), "ack")
        if "error" in ack:  # the broker could not store the next batch (its error, as ever)
            self._raise_if_rejected(flight.FlightServerError(str(ack["error"])),
                                    stream.io.url if stream.io else None, p)
            self._recover(p, stream)
            return
        seq, _ = stream.unacked.popleft()
        stream.pinned.discard(seq)
        stream.stalled_since = stream.refused_since = stream.refusal = None  # acks flow
        stream.backoff = 0.0
        if ack.get("sequence_id") != seq:
            raise UnavailableError(f"ack for sequence {ack.get('sequence_id')} while waiting "
                                   f"for {seq}")
        self._acks.append(ack)

    def _raise_if_refused(self, stream: PartitionStream, p: int) -> None:
        """The ack stream ended early: a broker that refused the batch (a tierstream error)
        says why when the stream is closed; raise that rather than retry."""
        io, stream.io = stream.io, None
        if io is None:
            return
        try:
            io.close(self.send_timeout)
        except (flight.FlightError, OSError, pa.ArrowException) as exc:
            try:
                self._raise_if_rejected(exc, io.url, p)
            except StaleRoutingError:
                raise  # nothing stored from the refused batch on: it is routed again
            except TierstreamError:
                # the broker stored nothing from the refused batch on: neither it nor what
                # was pipelined behind it is sent again (the call that sent them fails)
                stream.unacked.clear()
                raise

    def _raise_if_rejected(self, exc: BaseException, via: str | None = None,
                           p: int | None = None) -> None:
        """A broker that answers with a tierstream error rejected the batch: do not retry.
        One that refused it as fenced no longer serves the store (another took it over): the
        retry goes to the next broker named, and it is passed over for a while (connection.py).
        One that does not own partition ``p`` names its owner: the retry goes there."""
        try:
            with translate_errors(via or self._client.url):
                raise exc
        except NotOwnerError as refusal:
            if p is not None and refusal.owner_url:
                self._client.follow(self.topic, p, refusal.owner_url)
            elif p is not None:  # no owner to follow: said if the producer gives up
                self._streams[p].refusal = str(refusal)
        except FencedError:
            self._client.fenced(via or self._client.url)
            self._leave(via, "no longer serves the store (fenced)")
        except UnavailableError:
            return
        except TierstreamError:
            raise

    def _left_hung(self, via: str | None) -> None:
        """Every other stream to the hung broker ``via`` is dropped at once (each re-sends
        elsewhere when its ack is read) rather than waiting out a send timeout of its own,
        one partition after another."""
        for q, other in self._streams.items():
            if via is not None and other.io is not None and other.io.url == via:
                self._client.unfollow(self.topic, q, via)
                self._drop(other, 0.0)

    def _leave(self, via: str | None, why: str) -> None:
        """The next broker named, once per broker left (``via``): the other streams follow."""
        if len(self._client.urls) > 1 and via in (None, self._client.url):
            log.warning("producer %s: broker %s %s; trying %s", self.name, self._client.url,
                        why, self._client.next_broker())

    def _recover(self, p: int, stream: PartitionStream) -> None:
        """Reconnect with backoff and re-send every unacknowledged batch, in order."""
        deadline, delay = time.monotonic() + self.send_timeout, 0.05
        while True:
            self._drop(stream)
            try:
                io = self._ensure_stream(p, stream)
                for seq, batch in stream.unacked:
                    io.write(batch, pa.py_buffer(encode({"seq": seq})),
                             deadline - time.monotonic())
                return
            except (flight.FlightError, OSError, pa.ArrowException, UnavailableError) as exc:
                try:
                    self._raise_if_rejected(exc, stream.io.url if stream.io else None, p)
                except StaleRoutingError:
                    # the broker refused a batch as routed by an old count and closed the
                    # stream: its acks say which batches it stored before (dedup answers
                    # those), and the refusal comes where they end (see _follow_scale)
                    return
                if time.monotonic() + delay > deadline:
                    raise self._gave_up(p, stream, f"broker {self._client.url} unreachable"
                                        ) from None
                threading.Event().wait(delay)
                delay = min(delay * 2, 1.0)

    def _gave_up(self, p: int, stream: PartitionStream, why: str) -> UnavailableError:
        """The error for a send timeout: it names the batches whose fate is unknown."""
        return gave_up(self.name, self.topic, p, self.send_timeout, why,
                       [(seq, b.num_rows) for seq, b in stream.unacked])

    def _drop(self, stream: PartitionStream, timeout: float | None = None) -> None:
        if stream.io is not None:
            with contextlib.suppress(Exception):
                stream.io.close(self.send_timeout if timeout is None else timeout)
        stream.io = None
