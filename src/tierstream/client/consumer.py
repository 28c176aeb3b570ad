"""Durable subscriptions from Python: Exclusive and Key_Shared consumers with cumulative acks."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from tierstream.client.admin import Admin
from tierstream.client.connection import BrokerClient
from tierstream.client.reading import check_ranges, flight_batches, pump_batches
from tierstream.errors import ConfigError
from tierstream.message_format import (
    KEY_HASH_SLOTS,
    MESSAGE_SCHEMA,
)
from tierstream.names import TopicName
from tierstream.protocol import translate_errors
from tierstream.splits.positions import KeyRange, Offset, Position

__all__ = ["Consumer"]



class Consumer:
    """A durable subscription on a topic: Exclusive, or Key_Shared with sticky key ranges.

    :meth:`receive` returns record batches (each from one partition, in log order);
    :meth:`ack` acknowledges cumulatively, per partition, within this consumer's key ranges.
    A consumer that reconnects with the same ranges resumes after its last ack.
    """

    def __init__(self, topic: str, subscription: str, *, mode: str = "exclusive",
                 key_ranges: Iterable[KeyRange] | None = None, initial: Offset | None = None,
                 broker: str | None = None, auth_token: str | None = None,
                 tls_ca: bytes | str | None = None,
                 consumer_name: str | None = None) -> None:
        self.topic = str(TopicName.parse(topic))
        if not subscription or not isinstance(subscription, str):
            raise ConfigError(f"invalid subscription name {subscription!r}")
        self.subscription = subscription
        self.key_ranges = list(key_ranges or [KeyRange(0, KEY_HASH_SLOTS)])
        self.name = consumer_name or f"consumer-{uuid.uuid4().hex[:12]}"
        self._client = BrokerClient(broker, auth_token=auth_token, tls_ca=tls_ca)
        self._admin = Admin(self._client.url, auth_token=auth_token, tls_ca=self._client.tls_ca)
        partitions = self._admin.get_topic(self.topic).partitions
        sub = {"name": subscription, "mode": mode, "consumer": self.name,
               "initial": (initial or Offset.latest()).to_dict()}
        tickets = [{"op": "consume", "topic": self.topic, "partition": p,
                    "key_ranges": check_ranges(self.key_ranges), "subscription": sub}
                   for p in range(partitions)]
        # Open every stream before returning, so attach errors (a second exclusive consumer,
        # overlapping ranges) surface here.
        self._readers = []
        for ticket in tickets:
            reader = self._client.consume(ticket)
            with translate_errors(self._client.url):
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
        pump_batches(flight_batches(self._client.url, reader), self._queue, self._stop)

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
