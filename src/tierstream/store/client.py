"""Python clients of the broker: :class:`Admin`, :class:`Producer`, :func:`read` and
:class:`Consumer`. All talk Arrow Flight; all raise :mod:`tierstream.errors` types.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.errors import ConfigError, TierstreamError, UnavailableError
from tierstream.fanin import DONE, Cancel, drain, put
from tierstream.names import TopicName
from tierstream.options import parse_options
from tierstream.schema import (
    KEY_HASH_SLOTS,
    MESSAGE_SCHEMA,
    PRODUCE_SCHEMA,
    as_produce_batch,
    key_hash,
)
from tierstream.splits.positions import KeyRange, Offset, Position
from tierstream.splits.split import StreamCut
from tierstream.store.metadata import SegmentRecord, TopicRecord
from tierstream.store.protocol import decode, encode, translate_errors
from tierstream.store.retry import Backoff, reconnect_timeout_s

__all__ = ["Admin", "BrokerClient", "Consumer", "Message", "Producer", "TopicReader",
           "consume_stream", "read"]

log = logging.getLogger(__name__)


class BrokerClient:
    """A connection to one broker. ``broker``/``auth_token`` default to the option table
    (``TIERSTREAM_BROKER``, ``TIERSTREAM_AUTH_TOKEN``)."""

    def __init__(self, broker: str | None = None, *, auth_token: str | None = None,
                 timeout: float = 30.0) -> None:
        opts = parse_options({"broker": broker, "authToken": auth_token}, scope="client")
        self.url: str = opts["broker"]
        if not self.url.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            raise ConfigError(f"invalid broker URL {self.url!r}: expected grpc://HOST:PORT")
        headers = []
        if opts["authToken"]:
            headers.append((b"authorization", f"Bearer {opts['authToken']}".encode()))
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout)
        self._stream_options = flight.FlightCallOptions(headers=headers)
        with translate_errors(self.url):
            self._flight = flight.FlightClient(self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(broker={self.url!r})"

    def action(self, name: str, body: Mapping[str, Any] | None = None) -> Any:
        with translate_errors(self.url):
            results = list(self._flight.do_action(
                flight.Action(name, encode(dict(body or {}))), self._options))
        return decode(results[0].body.to_pybytes(), f"{name} result")["result"]

    def close(self) -> None:
        self._flight.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    def create_topic(self, topic: str, partitions: int, *, retention_ms: int | None = None
                     ) -> TopicRecord:
        TopicName.parse(topic)
        if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
            raise ConfigError(f"invalid partition count {partitions!r}: expected an integer >= 1")
        return TopicRecord(**self.action("create-topic", {"topic": topic, "partitions": partitions,
                                                          "retention_ms": retention_ms}))

    def delete_topic(self, topic: str) -> TopicRecord:
        """Delete a topic everywhere (metadata, bookies, tier files, Iceberg table); returns
        what it was. Readers and producers of it stop with NotFoundError."""
        return TopicRecord(**self.action("delete-topic", {"topic": str(TopicName.parse(topic))}))

    def get_topic(self, topic: str) -> TopicRecord:
        return TopicRecord(**self.action("get-topic", {"topic": str(TopicName.parse(topic))}))

    def list_topics(self, namespace: str | None = None) -> list[TopicRecord]:
        return [TopicRecord(**t) for t in self.action("list-topics", {"namespace": namespace})]

    def list_segments(self, topic: str) -> list[SegmentRecord]:
        return [_segment_record(s) for s in
                self.action("list-segments", {"topic": str(TopicName.parse(topic))})]

    def last_confirmed(self, topic: str) -> dict[int, tuple[Position | None, Position]]:
        """Per partition: (last confirmed message or None, the exclusive end after it)."""
        raw = self.action("last-confirmed", {"topic": str(TopicName.parse(topic))})
        return {int(p): (None if v["last"] is None else Position.from_dict(v["last"]),
                         Position.from_dict(v["end"])) for p, v in raw.items()}

    def latest_cut(self, topic: str) -> StreamCut:
        """The end of everything confirmed so far: each partition's exclusive end position."""
        return StreamCut.of(str(TopicName.parse(topic)),
                            {p: end for p, (_, end) in self.last_confirmed(topic).items()})

    def seal(self, topic: str, partition: int | None = None) -> list[SegmentRecord]:
        raw = self.action("seal", {"topic": str(TopicName.parse(topic)), "partition": partition})
        return [_segment_record(s) for s in raw]

    def stats(self) -> dict[str, Any]:
        return dict(self.action("stats"))

    def offload(self, topic: str, *, older_than_ms: int | None = None) -> list[SegmentRecord]:
        """Move closed segments to the tier now (those older than ``older_than_ms``)."""
        raw = self.action("offload", {"topic": str(TopicName.parse(topic)),
                                      "older_than_ms": older_than_ms})
        return [_segment_record(s) for s in raw]

    def tier_pass(self) -> dict[str, int]:
        """Apply the broker's offload, bookie-deletion and retention policies now."""
        return dict(self.action("tier-pass"))

    def set_retention(self, topic: str, retention_ms: int | None) -> TopicRecord:
        return TopicRecord(**self.action("set-retention", {"topic": str(TopicName.parse(topic)),
                                                           "retention_ms": retention_ms}))

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

    def set_cursor(self, topic: str, subscription: str, positions: dict[int, Position]) -> None:
        self.action("set-cursor", {"topic": topic, "subscription": subscription,
                                   "positions": {str(p): pos.to_dict()
                                                 for p, pos in positions.items()}})

    def subscriptions(self, topic: str) -> list[dict[str, Any]]:
        """Per subscription and partition: ``position`` (a Position: everything before it is
        acknowledged), ``backlog`` (messages after it), ``key_ranges`` (intervals the cursor
        tracks), ``consumers`` attached now and ``updated_at`` (epoch ms)."""
        raw = self.action("subscriptions", {"topic": str(TopicName.parse(topic))})
        return [{**r, "position": Position.from_dict(r["position"])} for r in raw]

    def deleted_segments(self, topic: str) -> list[dict[str, Any]]:
        """Segments removed by retention: what was lost, and when."""
        return list(self.action("deleted-segments", {"topic": str(TopicName.parse(topic))}))


def _segment_record(raw: dict[str, Any]) -> SegmentRecord:
    fields = {k: v for k, v in raw.items() if k != "location"}
    fields["ensemble"] = tuple(fields["ensemble"])
    return SegmentRecord(**fields)


@dataclass(frozen=True)
class Message:
    """One message as a producer sends it."""

    value: bytes
    key: str | None = None
    event_time: int | None = None
    properties: Mapping[str, str] | None = None
    publish_time: int | None = None  # requested; the broker never lets time run backwards


@dataclass
class _PartitionStream:
    writer: Any = None
    reader: Any = None
    next_seq: int = 0
    unacked: deque[tuple[int, pa.RecordBatch]] = field(default_factory=deque)


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
    """

    def __init__(self, topic: str, *, broker: str | None = None, auth_token: str | None = None,
                 name: str | None = None, batch_size: int = 1000, max_in_flight: int = 8,
                 send_timeout: float = 30.0) -> None:
        self.topic = str(TopicName.parse(topic))
        if batch_size < 1 or max_in_flight < 1:
            raise ConfigError(f"batch_size ({batch_size}) and max_in_flight ({max_in_flight}) "
                              "must be >= 1")
        self.name = name or f"producer-{uuid.uuid4().hex[:12]}"
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        self.send_timeout = send_timeout
        self._client = BrokerClient(broker, auth_token=auth_token)
        self._admin = Admin(self._client.url, auth_token=auth_token)
        self.partitions = self._admin.get_topic(self.topic).partitions
        state = self._admin.action("producer-state", {"topic": self.topic, "producer": self.name})
        # A partition where this name stored nothing yet starts at 0; note that 0 is also a
        # stored id, so test for None, not for truth.
        self._streams = {p: _PartitionStream(next_seq=0 if state.get(str(p)) is None
                                             else int(state[str(p)]) + 1)
                         for p in range(self.partitions)}
        self._rr = itertools.count()
        self._acks: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"Producer(topic={self.topic!r}, name={self.name!r}, broker={self._client.url!r})"

    # -- public API ---------------------------------------------------------------------------

    def send(self, value: bytes | str, *, key: str | None = None, event_time: int | None = None,
             properties: Mapping[str, str] | None = None, publish_time: int | None = None
             ) -> dict[str, Any]:
        """Send one message and wait for its ack (a dict with partition, segment_id, ...)."""
        data = value.encode() if isinstance(value, str) else value
        acks = self.send_many([Message(data, key, event_time, properties, publish_time)])
        return acks[0]

    def send_many(self, messages: Iterable[Message | Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Send messages in batches of ``batch_size``; returns one ack per batch, once all
        are acknowledged."""
        buffers: dict[int, list[Message]] = {p: [] for p in range(self.partitions)}
        self._acks = []
        for m in messages:
            msg = m if isinstance(m, Message) else Message(**m)
            p = self._route(msg.key)
            buffers[p].append(msg)
            if len(buffers[p]) >= self.batch_size:
                self._send(p, _to_batch(buffers[p]))
                buffers[p] = []
        for p, msgs in buffers.items():
            if msgs:
                self._send(p, _to_batch(msgs))
        self.flush()
        return self._acks

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
        for b in batches:
            self._send(p, as_produce_batch(b))
        self.flush()
        return self._acks

    def flush(self) -> None:
        """Wait until every batch sent so far is acknowledged (re-sending after failures)."""
        for p, stream in self._streams.items():
            while stream.unacked:
                self._read_ack(p, stream)

    def close(self) -> None:
        """Flush (waiting for every ack), then release the connections."""
        try:
            self.flush()
        finally:
            self._release()

    def _release(self) -> None:
        for stream in self._streams.values():
            self._drop(stream)
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

    def _route(self, key: str | None) -> int:
        if key is None:
            return next(self._rr) % self.partitions
        return key_hash(key) % self.partitions

    def _send(self, p: int, batch: pa.RecordBatch) -> None:
        stream = self._streams[p]
        seq = stream.next_seq
        stream.next_seq += 1
        stream.unacked.append((seq, batch))
        try:
            self._ensure_stream(p, stream)
            stream.writer.write_with_metadata(batch, pa.py_buffer(encode({"seq": seq})))
        except (flight.FlightError, OSError, pa.ArrowException):
            self._recover(p, stream)
        while len(stream.unacked) >= self.max_in_flight:
            self._read_ack(p, stream)

    def _ensure_stream(self, p: int, stream: _PartitionStream) -> None:
        if stream.writer is None:
            descriptor = flight.FlightDescriptor.for_command(encode({
                "op": "produce", "topic": self.topic, "partition": p, "producer": self.name}))
            with translate_errors(self._client.url):
                stream.writer, stream.reader = self._client._flight.do_put(
                    descriptor, PRODUCE_SCHEMA, self._client._stream_options)

    def _read_ack(self, p: int, stream: _PartitionStream) -> None:
        if stream.reader is None:
            self._recover(p, stream)
        try:
            buf = stream.reader.read()
            if buf is None:
                raise UnavailableError("broker closed the produce stream")
        except (flight.FlightError, OSError, pa.ArrowException, UnavailableError) as exc:
            self._raise_if_rejected(exc)
            self._recover(p, stream)
            return
        ack = decode(buf.to_pybytes(), "ack")
        seq, _ = stream.unacked.popleft()
        if ack.get("sequence_id") != seq:
            raise UnavailableError(f"ack for sequence {ack.get('sequence_id')} while waiting "
                                   f"for {seq}")
        self._acks.append(ack)

    def _raise_if_rejected(self, exc: BaseException) -> None:
        """A broker that answers with a tierstream error rejected the batch: do not retry."""
        try:
            with translate_errors(self._client.url):
                raise exc
        except UnavailableError:
            return
        except TierstreamError:
            raise

    def _recover(self, p: int, stream: _PartitionStream) -> None:
        """Reconnect with backoff and re-send every unacknowledged batch, in order."""
        deadline = time.monotonic() + self.send_timeout
        delay = 0.05
        while True:
            self._drop(stream)
            try:
                self._ensure_stream(p, stream)
                for seq, batch in stream.unacked:
                    stream.writer.write_with_metadata(batch, pa.py_buffer(encode({"seq": seq})))
                return
            except (flight.FlightError, OSError, pa.ArrowException, UnavailableError) as exc:
                self._raise_if_rejected(exc)
                if time.monotonic() + delay > deadline:
                    raise self._gave_up(p, stream) from None
                threading.Event().wait(delay)
                delay = min(delay * 2, 1.0)

    def _gave_up(self, p: int, stream: _PartitionStream) -> UnavailableError:
        """The error for a send timeout: it names the batches whose fate is unknown."""
        seqs = [seq for seq, _ in stream.unacked]
        ids = str(seqs[0]) if len(seqs) == 1 else f"{seqs[0]}..{seqs[-1]}"
        messages = sum(b.num_rows for _, b in stream.unacked)
        exc = UnavailableError(
            f"producer {self.name!r} gave up on {self.topic!r} partition {p} after "
            f"{self.send_timeout}s (broker {self._client.url} unreachable): sequence id(s) "
            f"{ids} ({messages} message(s)) were sent but never acknowledged, so they may or "
            f"may not be stored; flush() re-sends them, and a producer named {self.name!r} "
            "stores each at most once")
        exc.unacknowledged = {p: seqs}  # type: ignore[attr-defined]
        return exc

    def _drop(self, stream: _PartitionStream) -> None:
        if stream.writer is not None:
            with contextlib.suppress(Exception):
                stream.writer.close()
        stream.writer = stream.reader = None


def _to_batch(messages: list[Message]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({
        "key": [m.key for m in messages],
        "value": [m.value for m in messages],
        "publish_time": [m.publish_time for m in messages],
        "event_time": [m.event_time for m in messages],
        "properties": [None if m.properties is None else list(m.properties.items())
                       for m in messages],
    }, schema=PRODUCE_SCHEMA)


def _check_ranges(key_ranges: Iterable[KeyRange] | None) -> list[list[int]]:
    ranges = list(key_ranges or [])
    for r in ranges:
        if not isinstance(r, KeyRange):
            raise ConfigError(f"invalid key range {r!r}: expected a KeyRange")
    return [r.to_list() for r in ranges]


def read(topic: str, *, partition: int | None = None, start: Offset | None = None,
         end: Offset | None = None, key_ranges: Iterable[KeyRange] | None = None,
         broker: str | None = None, auth_token: str | None = None) -> TopicReader:
    """Read a topic through the broker (every partition, or one ``partition``).

    The partition streams are opened before this returns, so ``latest`` (as start or end) is
    pinned at call time for all partitions. ``end=None`` follows the tail until the reader is
    closed; a bounded ``end`` finishes. Batches have :data:`~tierstream.schema.MESSAGE_SCHEMA`
    and keep each partition's order.
    """
    return TopicReader(topic, partition=partition, start=start, end=end, key_ranges=key_ranges,
                       broker=broker, auth_token=auth_token)


class TopicReader:
    """Iterator of record batches over open partition streams; see :func:`read`."""

    def __init__(self, topic: str, *, partition: int | None, start: Offset | None,
                 end: Offset | None, key_ranges: Iterable[KeyRange] | None,
                 broker: str | None, auth_token: str | None) -> None:
        name = str(TopicName.parse(topic))
        ranges = _check_ranges(key_ranges)
        self._client = BrokerClient(broker, auth_token=auth_token)
        self._readers: list[Any] = []
        self._cancel = Cancel()
        try:
            with Admin(self._client.url, auth_token=auth_token) as admin:
                count = admin.get_topic(name).partitions
            if partition is not None and not 0 <= partition < count:
                raise ConfigError(f"invalid partition {partition} for {name!r}: it has "
                                  f"0..{count - 1}")
            parts = [partition] if partition is not None else list(range(count))
            ticket = {"op": "consume", "topic": name, "key_ranges": ranges,
                      "start": (start or Offset.earliest()).to_dict(),
                      "end": None if end is None else end.to_dict()}
            with translate_errors(self._client.url):
                for p in parts:
                    reader = self._client._flight.do_get(
                        flight.Ticket(encode({**ticket, "partition": p})),
                        self._client._stream_options)
                    reader.schema  # noqa: B018 - waits for the broker to resolve the offsets
                    self._readers.append(reader)
        except BaseException:
            self.close()
            raise
        if end is None:  # following: each partition rides out broker restarts
            streams = [consume_stream(self._client, {**ticket, "partition": p}, first=r,
                                      cancel=self._cancel)
                       for p, r in zip(parts, self._readers, strict=True)]
            self._iter = (_merge(streams, self._cancel) if len(streams) > 1
                          else iter(streams[0]))
        else:
            self._iter = _chain(self._client.url, self._readers)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return self

    def __next__(self) -> pa.RecordBatch:
        return next(self._iter)

    def close(self) -> None:
        self._cancel.set()
        for r in self._readers:
            r.cancel()
        close = getattr(getattr(self, "_iter", None), "close", None)
        if close is not None:
            close()
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chain(url: str, readers: list[Any]) -> Iterator[pa.RecordBatch]:
    with translate_errors(url):
        for reader in readers:
            for chunk in reader:
                if chunk.data is not None and chunk.data.num_rows:
                    yield chunk.data


def _batches(url: str, reader: Any) -> Iterator[pa.RecordBatch]:
    """The non-empty batches of one Flight stream, errors as tierstream errors."""
    with translate_errors(url):
        for chunk in reader:
            if chunk.data is not None and chunk.data.num_rows:
                yield chunk.data


def consume_stream(client: BrokerClient, ticket: dict[str, Any], *, first: Any = None,
                   cancel: Cancel | None = None, reconnect_timeout_ms: int | None = None
                   ) -> Iterator[pa.RecordBatch]:
    """One partition's consume stream (``ticket`` as the broker takes it) that rides out broker
    restarts: when the broker goes away it reconnects with backoff from the position after the
    last batch it delivered, so nothing is skipped or repeated, for up to
    ``reconnect_timeout_ms`` (the ``reconnectTimeout`` option) without progress; then it raises
    one UnavailableError. ``first`` is an already open stream for the ticket; setting
    ``cancel`` ends the stream at once."""
    ticket = dict(ticket)
    reader = first
    backoff: Backoff | None = None
    while True:
        unregister = None
        try:
            if reader is None:
                with translate_errors(client.url):
                    reader = client._flight.do_get(flight.Ticket(encode(ticket)),
                                                   client._stream_options)
            if cancel is not None:
                unregister = cancel.register(reader.cancel)
            for batch in _batches(client.url, reader):
                backoff = None
                i = batch.num_rows - 1
                ticket["start"] = Offset.at_position(Position(
                    batch.column("partition")[i].as_py(), batch.column("segment_id")[i].as_py(),
                    batch.column("entry_id")[i].as_py(),
                    batch.column("batch_index")[i].as_py() + 1)).to_dict()
                yield batch
            if ticket.get("end") is not None or (cancel is not None and cancel.is_set()):
                return  # a bounded stream that reached its end
            # A following stream has no end: the broker closed it (a clean shutdown).
            raise UnavailableError(f"the broker at {client.url} closed the stream")
        except UnavailableError as exc:
            if cancel is not None and cancel.is_set():
                return  # cancelled by the consumer: not an outage
            if backoff is None:
                backoff = Backoff(reconnect_timeout_s(reconnect_timeout_ms), cancel=cancel)
                log.info("%s partition %s: broker unavailable, reconnecting for up to %gs "
                            "(%s)", ticket.get("topic"), ticket.get("partition"),
                            backoff.timeout_s, exc)
            if not backoff.wait():
                if cancel is not None and cancel.is_set():
                    return
                raise UnavailableError(
                    f"lost the broker at {client.url} while reading {ticket.get('topic')!r} "
                    f"partition {ticket.get('partition')}: it stayed unavailable for "
                    f"{backoff.timeout_s:g}s (option reconnectTimeout); resume from "
                    f"{Offset.from_dict(ticket['start'])}") from None
        finally:
            if unregister is not None:
                unregister()
            if reader is not None:
                reader.cancel()
            reader = None


def _pump(batches: Iterable[pa.RecordBatch], out: queue.Queue[Any],
          stop: threading.Event | Cancel) -> None:
    """Put ``batches`` on ``out`` until they end or ``stop`` is set; an error is put there
    too, for the consuming thread to raise."""
    try:
        for batch in batches:
            if not put(out, batch, stop):
                return
    except Exception as exc:
        if not stop.is_set():
            put(out, exc, stop)


def _merge(streams: list[Iterator[pa.RecordBatch]], stop: Cancel) -> Iterator[pa.RecordBatch]:
    """Several unbounded partition streams, merged as batches arrive (per-partition order)."""
    out: queue.Queue[Any] = queue.Queue(maxsize=64)

    def pump(stream: Iterator[pa.RecordBatch]) -> None:
        try:
            _pump(stream, out, stop)
        finally:
            put(out, DONE, stop)

    threads = [threading.Thread(target=pump, args=(st,), name=f"tierstream-merge-{i}",
                                daemon=True) for i, st in enumerate(streams)]
    for t in threads:
        t.start()
    try:
        yield from drain(out, len(threads))
    finally:
        stop.set()


class Consumer:
    """A durable subscription on a topic: Exclusive, or Key_Shared with sticky key ranges.

    :meth:`receive` returns record batches (each from one partition, in log order);
    :meth:`ack` acknowledges cumulatively, per partition, within this consumer's key ranges.
    A consumer that reconnects with the same ranges resumes after its last ack.
    """

    def __init__(self, topic: str, subscription: str, *, mode: str = "exclusive",
                 key_ranges: Iterable[KeyRange] | None = None, initial: Offset | None = None,
                 broker: str | None = None, auth_token: str | None = None,
                 consumer_name: str | None = None) -> None:
        self.topic = str(TopicName.parse(topic))
        if not subscription or not isinstance(subscription, str):
            raise ConfigError(f"invalid subscription name {subscription!r}")
        self.subscription = subscription
        self.key_ranges = list(key_ranges or [KeyRange(0, KEY_HASH_SLOTS)])
        self.name = consumer_name or f"consumer-{uuid.uuid4().hex[:12]}"
        self._client = BrokerClient(broker, auth_token=auth_token)
        self._admin = Admin(self._client.url, auth_token=auth_token)
        partitions = self._admin.get_topic(self.topic).partitions
        sub = {"name": subscription, "mode": mode, "consumer": self.name,
               "initial": (initial or Offset.latest()).to_dict()}
        tickets = [{"op": "consume", "topic": self.topic, "partition": p,
                    "key_ranges": _check_ranges(self.key_ranges), "subscription": sub}
                   for p in range(partitions)]
        # Open every stream before returning, so attach errors (a second exclusive consumer,
        # overlapping ranges) surface here.
        self._readers = []
        with translate_errors(self._client.url):
            for ticket in tickets:
                reader = self._client._flight.do_get(flight.Ticket(encode(ticket)),
                                                     self._client._stream_options)
                reader.schema  # noqa: B018 - forces the call, raising attach errors now
                self._readers.append(reader)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=64)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._pump, args=(r,), daemon=True,
                                          name=f"tierstream-consumer-{self.name}-p{i}")
                         for i, r in enumerate(self._readers)]
        for t in self._threads:
            t.start()

    def _pump(self, reader: Any) -> None:
        _pump(_batches(self._client.url, reader), self._queue, self._stop)

    @property
    def buffered(self) -> int:
        """Batches received from the broker that :meth:`receive` has not returned yet (at
        most 64: the broker waits while the buffer is full)."""
        return self._queue.qsize()

    def receive(self, timeout: float | None = None) -> pa.RecordBatch | None:
        """The next batch, or None if none arrived within ``timeout`` seconds."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def ack(self, batch_or_position: pa.RecordBatch | Position) -> None:
        """Acknowledge everything up to the last message of ``batch`` (or ``position``)."""
        if isinstance(batch_or_position, Position):
            pos = batch_or_position
        else:
            b = batch_or_position
            if b.schema != MESSAGE_SCHEMA or b.num_rows == 0:
                raise ConfigError("ack needs a non-empty batch received from this consumer")
            i = b.num_rows - 1
            pos = Position(b.column("partition")[i].as_py(), b.column("segment_id")[i].as_py(),
                           b.column("entry_id")[i].as_py(), b.column("batch_index")[i].as_py())
        self._admin.action("ack", {"topic": self.topic, "subscription": self.subscription,
                                   "partition": pos.partition, "position": pos.to_dict(),
                                   "key_ranges": [r.to_list() for r in self.key_ranges]})

    def close(self) -> None:
        """Detach at once, whatever the buffer holds: streams are cancelled and the pump
        threads end (a pump waiting on a full buffer sees the stop within 0.1 s)."""
        self._stop.set()
        for r in self._readers:
            r.cancel()
        for t in self._threads:
            t.join(timeout=5)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._client.close()
        self._admin.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
