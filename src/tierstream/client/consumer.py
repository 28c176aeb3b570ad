"""Durable subscriptions from Python, as Pulsar's consumers: exclusive, failover, shared and
key_shared; individual and cumulative acks, nacks, ack timeout, dead letters."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from tierstream.client.admin import Admin
from tierstream.client.connection import BrokerClient
from tierstream.client.reading import check_ranges, flight_batches
from tierstream.client.retry import Backoff, reconnect_timeout_s, with_reconnect
from tierstream.errors import AckInDoubtError, ConfigError, TierstreamError, UnavailableError
from tierstream.model import arguments
from tierstream.model.message_format import CONSUMER_SCHEMA
from tierstream.model.names import TopicName
from tierstream.model.positions import KeyRange, Offset, Position
from tierstream.model.subscription_type import SubscriptionType
from tierstream.splits.split import as_bound
from tierstream.util.fanin import put, start_reader
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker
from tierstream.wire.flight import encode_positions

__all__ = ["Consumer"]

log = logging.getLogger(__name__)

_TAG = b"tierstream.consumer"
_EPOCH = b"tierstream.epoch"
#: How often a consumer looks for partitions a scale event added.
_WATCH_S = 1.0
#: How long an ack that raced a re-attach filters what arrives (the broker sends a re-attached
#: consumer its share at once; an ack stuck in retries longer than this is not a race).
_DOUBT_S = 30.0


class Consumer:
    """A consumer of a durable subscription (Pulsar's four types: ``mode`` is ``exclusive``,
    ``failover``, ``shared`` or ``key_shared``).

    :meth:`receive` returns record batches of
    :data:`~tierstream.model.message_format.CONSUMER_SCHEMA` (each from one partition, with each
    message's ``redelivery_count``); :meth:`ack` acknowledges exactly the messages of a batch
    (or a slice of it), :meth:`ack_cumulative` everything up to a message (exclusive and
    failover), :meth:`nack` asks for a batch again after ``nack_delay``.

    ``key_shared`` without ``key_ranges`` splits the key hashes among the connected consumers
    by consistent hashing; with them, the consumer owns exactly those ranges (sticky).
    ``receiver_queue_size`` bounds the messages the broker sends ahead of :meth:`receive`.
    ``ack_timeout`` (off by default) redelivers what is held unacknowledged longer;
    after ``max_redeliveries`` redeliveries a message goes to ``dead_letter_topic`` (default
    ``<topic>-<subscription>-DLQ``). Durations are seconds, or text with a unit (``"30s"``).
    A consumer rides out a broker restart: what it had not acknowledged is delivered again.
    Every ``keepalive`` (30 s, Pulsar's keepAliveInterval) it tells its brokers it is there:
    a broker lets go of a consumer silent for twice that (what it held goes to the others),
    and a consumer whose keepalive goes unanswered attaches again.
    """

    def __init__(self, topic: str, subscription: str, *, mode: str = "exclusive",
                 key_ranges: Iterable[KeyRange] | None = None,
                 consumer_name: str | None = None, initial: Offset | None = None,
                 receiver_queue_size: int = 1000, ack_timeout: float | str | None = None,
                 nack_delay: float | str = 1.0, max_redeliveries: int | None = None,
                 dead_letter_topic: str | None = None, keepalive: float | str = 30.0,
                 broker: str | None = None, auth_token: str | None = None,
                 tls_ca: bytes | str | None = None) -> None:
        self.topic = str(TopicName.parse(topic))
        self.subscription = arguments.text(subscription, "subscription name")
        self.mode = SubscriptionType.parse(mode, "mode")
        if key_ranges is not None and self.mode != SubscriptionType.KEY_SHARED:
            raise ConfigError(f"key_ranges are for mode='key_shared', not {self.mode!r}")
        ranges = None if key_ranges is None else check_ranges(key_ranges)
        self.key_ranges = None if ranges is None else [KeyRange(*r) for r in ranges]
        if ranges == []:
            raise ConfigError("key_ranges is empty: give at least one KeyRange, or None to "
                              "split keys among the consumers")
        arguments.positive_int(receiver_queue_size, "receiver_queue_size")
        self.ack_timeout = arguments.seconds(ack_timeout, "ack_timeout", none_ok=True,
                                             zero_ok=False)
        self.nack_delay = arguments.seconds(nack_delay, "nack_delay")
        self.keepalive = arguments.seconds(keepalive, "keepalive", zero_ok=False)
        arguments.positive_int(max_redeliveries, "max_redeliveries", none_ok=True)
        start = as_bound(initial, "initial")
        if start is not None and not isinstance(start, Offset):
            raise ConfigError(f"invalid initial {initial!r}: expected an Offset, a time or "
                              "'earliest'/'latest' (a subscription starts at one position "
                              "in every partition)")
        if dead_letter_topic is not None and max_redeliveries is None:
            raise ConfigError("dead_letter_topic needs max_redeliveries (after how many "
                              "redeliveries a message goes there)")
        if max_redeliveries is not None:
            dlq = dead_letter_topic or f"{self.topic}-{subscription}-DLQ"
            try:
                dead_letter_topic = str(TopicName.parse(dlq))
            except ConfigError as exc:
                raise ConfigError(f"invalid dead-letter topic {dlq!r} ({exc}); pass "
                                  "dead_letter_topic=") from None
        self.name = arguments.text(consumer_name, "consumer_name", none_ok=True) \
            or f"consumer-{uuid.uuid4().hex[:12]}"
        self._id = f"{self.name}/{uuid.uuid4().hex}".encode()
        self._client = BrokerClient(broker, auth_token=auth_token, tls_ca=tls_ca)
        self._admin = Admin(self._client.broker, auth_token=auth_token, tls_ca=self._client.tls_ca)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._readers: dict[int, Any] = {}
        self._threads: list[threading.Thread] = []
        self._epoch: dict[int, int] = {}
        self._attaching: dict[int, bool] = {}
        self._taken: dict[int, int] = {}
        # positions acknowledged while a re-attach may have had the broker send them
        # again: dropped from later batches (position -> when the ack started)
        self._in_doubt: dict[int, dict[tuple[int, int, int], float]] = {}
        # acks under way (id -> batch): put in doubt only if a re-attach comes meanwhile
        self._acking: dict[int, dict[int, pa.RecordBatch]] = {}
        self._ack_ids = itertools.count()
        self._doubt_lock = threading.Lock()
        self._tickets: dict[int, dict[str, Any]] = {}
        try:
            partitions = self._admin.get_topic(self.topic).partitions
            self._permits = max(1, receiver_queue_size // partitions)
            self._sub: dict[str, Any] = {
                "name": subscription, "type": self.mode, "consumer": self.name,
                "initial": (start or Offset.latest()).to_dict(), "permits": self._permits,
                "ack_timeout_s": self.ack_timeout, "max_redeliveries": max_redeliveries,
                "dead_letter_topic": dead_letter_topic, "keepalive_s": self.keepalive,
                "instance": self._id.decode(), "ranges": ranges}
            # every stream opens before this returns: attach errors (a second exclusive
            # consumer, overlapping ranges, another type) surface here
            self._add_partitions(range(partitions), self._sub["initial"])
        except BaseException:
            self.close()
            raise
        self._watcher = Worker(f"tierstream-consumer-{self.name}-watch", self._watch,
                               on_error=self._watch_failed).start()
        self._keeper = Worker(f"tierstream-consumer-{self.name}-keepalive",
                              self._keep_alive).start()

    def _add_partitions(self, partitions: Iterable[int], initial: dict[str, Any] | None
                        ) -> None:
        """Attach to ``partitions`` (a cursor made there starts at ``initial``) and pump
        each into the queue; later re-attaches start where the subscription is."""
        sub = {k: v for k, v in self._sub.items() if k != "ranges"}
        attached = []
        try:
            for p in partitions:
                self._epoch[p], self._attaching[p], self._taken[p] = 0, False, 0
                self._in_doubt[p], self._acking[p] = {}, {}
                ticket = {"op": "consume", "topic": self.topic, "partition": p,
                          "key_ranges": self._sub["ranges"],
                          "subscription": {**sub, "initial": initial}}
                self._readers[p] = self._open(ticket)
                self._tickets[p] = {**ticket, "subscription": {**sub, "initial": None}}
                attached.append(p)
        finally:
            # each partition attached is pumped, also when a later one's attach failed (the
            # watcher tries that one again): the broker delivers to an attached consumer, and
            # a stream nobody read held those messages, unacknowledged, for good
            for p in attached:
                self._threads.append(start_reader(
                    self._pump, p, name=f"tierstream-consumer-{self.name}-p{p}"))

    def _watch(self) -> None:
        """Attach to the partitions a scale event adds, from their beginning (the broker
        holds a key's messages there until its earlier ones are acknowledged)."""
        while not self._stop.wait(_WATCH_S):
            fault_point("consumer.watch")
            try:
                partitions = self._admin.get_topic(self.topic).partitions
                grown = [p for p in range(partitions) if p not in self._tickets]
                if grown:
                    self._add_partitions(grown, Offset.earliest().to_dict())
            except UnavailableError:
                continue  # a broker restart: the pumps ride it out, and so does this
            except TierstreamError as exc:  # e.g. the topic was deleted
                put(self._queue, (-1, exc), self._stop)
                return

    def _keep_alive(self) -> None:
        """Tell each partition's broker, every ``keepalive``, that this consumer is there
        (a broker lets go of a consumer silent for twice that: what it held goes to the
        others). A keepalive unanswered in time means the connection is lost without a word
        (a host cut off), and "not attached" that the broker let this consumer go: either
        way the partition's stream is dropped and its pump attaches again (replacing what
        is left of it there), rather than waiting on a stream nothing comes through."""
        while not self._stop.wait(self.keepalive):
            lost: set[str] = set()  # brokers that did not answer in time, this round
            for p, reader in list(self._readers.items()):
                ticket = self._tickets.get(p)  # (set just after the first attach returns)
                if ticket is None or self._attaching.get(p) or self._stop.is_set():
                    continue
                url = self._client.url_for(ticket)
                why = f"the broker at {url} did not answer its keepalive in time"
                if url not in lost:
                    try:
                        if self._client.action("consumer-keepalive", {
                                "topic": self.topic, "subscription": self.subscription,
                                "partition": p, "consumer": self.name},
                                timeout=self.keepalive)["attached"]:
                            continue
                        why = f"the broker at {url} let it go"
                    except UnavailableError:
                        lost.add(url)
                    except TierstreamError:
                        continue  # (the partition's pump hears of it)
                if self._stop.is_set():
                    return
                if self._readers.get(p) is reader and reader is not None \
                        and not self._attaching.get(p):
                    log.warning("consumer %s partition %d: %s; attaching again", self.name,
                                p, why)
                    reader.cancel()

    def _watch_failed(self, exc: BaseException) -> None:
        """The watcher met an error nobody foresaw (logged with its stack): the next
        ``receive`` says so, rather than the consumer silently missing new partitions."""
        put(self._queue, (-1, TierstreamError(
            f"consumer {self.name} of {self.topic} stopped watching for new partitions: "
            f"{exc!r} (see the log); close it and subscribe again")), self._stop)

    def _open(self, ticket: dict[str, Any]) -> Any:
        return self._client.consume(ticket)  # attach errors are raised here

    def _pump(self, partition: int) -> None:
        """Partition ``partition``'s stream into the queue, re-attaching after a broker
        restart (batches of the lost connection are dropped: they come again)."""
        reader = self._readers.get(partition)
        backoff: Backoff | None = None
        while not self._stop.is_set():
            try:
                if reader is None:
                    self._attaching[partition] = True
                    with self._doubt_lock:
                        for acking in self._acking[partition].values():
                            self._put_in_doubt(partition, acking)
                    reader = self._readers[partition] = self._open(self._tickets[partition])
                    self._attaching[partition] = False  # (until then, also after a failure)
                    self._taken[partition] = 0
                    backoff = None  # the broker answered: the outage is over
                epoch = str(self._epoch[partition]).encode()
                for batch in flight_batches(self._client.url, reader):
                    backoff = None
                    tagged = batch.replace_schema_metadata({_TAG: self._id, _EPOCH: epoch})
                    if not put(self._queue, (partition, tagged), self._stop):
                        return
                if self._stop.is_set():
                    return
                raise UnavailableError(f"the broker at {self._client.url} closed the stream")
            except UnavailableError as exc:
                if reader is not None:
                    reader.cancel()
                    # what the lost connection sent and receive() has not returned is
                    # dropped now, not once we are back: the broker sends it again, maybe
                    # to another consumer, which may acknowledge it before we re-attach
                    self._epoch[partition] += 1
                reader = None
                # to attach again (the keepalive leaves the partition to this pump, which
                # knows the stream is gone: it warned again every keepalive of an outage)
                self._attaching[partition] = True
                if self._stop.is_set():
                    return
                if backoff is None:
                    backoff = Backoff(reconnect_timeout_s())
                    log.info("consumer %s partition %d: broker unavailable, reconnecting for "
                             "up to %gs (%s)", self.name, partition, backoff.timeout_s, exc)
                if not backoff.wait():
                    put(self._queue, (partition, UnavailableError(
                        f"consumer {self.name} lost the broker at {self._client.url}: it "
                        f"stayed unavailable for {backoff.timeout_s:g}s (option "
                        "reconnectTimeout)")), self._stop)
                    return
            except TierstreamError as exc:
                put(self._queue, (partition, exc), self._stop)
                return

    @property
    def buffered(self) -> int:
        """Batches received from the broker that :meth:`receive` has not returned yet."""
        return self._queue.qsize()

    def receive(self, timeout: float | None = None) -> pa.RecordBatch | None:
        """The next batch, or None if none arrived within ``timeout`` seconds."""
        timeout = arguments.seconds(timeout, "timeout", none_ok=True)
        while True:
            try:
                partition, item = self._queue.get(timeout=timeout)
            except queue.Empty:
                return None
            if isinstance(item, BaseException):
                raise item
            if int(item.schema.metadata[_EPOCH]) != self._epoch[partition]:
                continue  # from a connection that was lost: the broker sends it again
            # every message this stream sent used one of its permits, also the copies
            # dropped below: counted before dropping, or the broker runs out of permits
            # while this side thinks it has not used half, and the stream stops for good
            self._taken[partition] += item.num_rows
            if self._taken[partition] * 2 >= self._permits:
                self._flow(partition)
            if self._in_doubt[partition]:
                item = self._drop_acknowledged(partition, item)
                if item.num_rows == 0:
                    continue
            return item

    def _drop_acknowledged(self, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` without the messages an ack that raced a re-attach acknowledged."""
        with self._doubt_lock:
            doubt = self._in_doubt[partition]
            old = time.monotonic() - _DOUBT_S
            for pos in [p for p, t in doubt.items() if t < old]:
                del doubt[pos]
            keys = zip(batch.column("segment_id").to_pylist(),
                       batch.column("entry_id").to_pylist(),
                       batch.column("batch_index").to_pylist(), strict=True)
            keep = [k not in doubt for k in keys]
        return batch if all(keep) else batch.filter(pa.array(keep))

    def _flow(self, partition: int) -> None:
        n, self._taken[partition] = self._taken[partition], 0
        with contextlib.suppress(UnavailableError):  # a re-attach starts with every permit
            self._client.action("flow", {"topic": self.topic, "subscription": self.subscription,
                                         "partition": partition, "consumer": self.name,
                                         "permits": n})

    def _positions(self, batch: Any, what: str) -> tuple[int, dict[str, str]]:
        if not isinstance(batch, pa.RecordBatch) or not batch.schema.equals(CONSUMER_SCHEMA):
            raise ConfigError(f"{what} needs a batch this consumer received (a pyarrow "
                              f"RecordBatch from receive()), got {type(batch).__name__}")
        tag = (batch.schema.metadata or {}).get(_TAG)
        if tag != self._id:
            who = "another consumer" if tag else "no consumer"
            raise ConfigError(f"{what}: this batch was not received by consumer {self.name} "
                              f"of subscription {self.subscription!r} (it came from {who})")
        partitions = set(batch.column("partition").to_pylist())
        return (partitions.pop() if partitions else -1), encode_positions(batch)

    def ack(self, batch: pa.RecordBatch) -> None:
        """Acknowledge exactly the messages of ``batch`` (a received batch or a slice of one).
        Returns once the broker has stored it: they are not delivered again, even after a
        broker crash. An ack that a broker outage made resend is stored too, but if the
        restarted broker may have delivered some of its messages to another consumer before
        it came, :class:`~tierstream.errors.AckInDoubtError` says so (they may be processed
        twice; they are not delivered again after it)."""
        partition, positions = self._positions(batch, "ack")
        if batch.num_rows == 0:
            return
        body = {"topic": self.topic, "subscription": self.subscription,
                "partition": partition, "consumer": self.name, **positions}
        # A re-attach during the ack (or since the batch came) may have the broker send these
        # again before it applies the ack: such copies are dropped on receive. The re-attach
        # puts the acks under way in doubt; an ack that ends unsettled puts itself there.
        epoch = self._epoch[partition]
        ack_id = next(self._ack_ids)
        with self._doubt_lock:
            self._acking[partition][ack_id] = batch
            if int(batch.schema.metadata[_EPOCH]) != epoch or self._attaching[partition]:
                self._put_in_doubt(partition, batch)  # sent again already, or about to be
        settled = False
        attempts = [0]

        def send() -> Any:
            # a resent ack, or one of messages from a connection lost since (the broker
            # may have sent them to another consumer), asks which messages are in doubt
            attempts[0] += 1
            late = attempts[0] > 1 or self._from_lost_connection(batch, partition)
            return self._client.action("ack", {**body, "retry": late})

        try:
            answer = with_reconnect(send, what=f"ack of {self.name}")
            settled = int(batch.schema.metadata[_EPOCH]) == epoch == self._epoch[partition] \
                and not self._attaching[partition]
        finally:
            with self._doubt_lock:
                self._acking[partition].pop(ack_id, None)
                if not settled:
                    self._put_in_doubt(partition, batch)
        self._raise_if_in_doubt(answer, f"this ack of {batch.num_rows} message(s) of "
                                        f"{self.topic!r} partition {partition}")

    def _put_in_doubt(self, partition: int, batch: pa.RecordBatch) -> None:
        """``batch``'s positions may come again from the broker: drop them then (lock held)."""
        keys = zip(batch.column("segment_id").to_pylist(), batch.column("entry_id").to_pylist(),
                   batch.column("batch_index").to_pylist(), strict=True)
        self._in_doubt[partition].update(dict.fromkeys(keys, time.monotonic()))

    def ack_cumulative(self, batch_or_position: pa.RecordBatch | Position) -> None:
        """Acknowledge every message up to and including the last of ``batch`` (or
        ``position``) in its partition. For exclusive and failover subscriptions."""
        if self.mode not in SubscriptionType.CUMULATIVE:
            raise ConfigError(f"ack_cumulative is for exclusive and failover subscriptions; "
                              f"this consumer is {self.mode}: acknowledge each batch with ack()")
        if isinstance(batch_or_position, Position):
            pos = batch_or_position
        else:
            b = batch_or_position
            self._positions(b, "ack_cumulative")
            if b.num_rows == 0:
                return
            i = b.num_rows - 1
            pos = Position(b.column("partition")[i].as_py(), b.column("segment_id")[i].as_py(),
                           b.column("entry_id")[i].as_py(), b.column("batch_index")[i].as_py())
        body = {"topic": self.topic, "subscription": self.subscription, "consumer": self.name,
                "partition": pos.partition, "position": pos.to_dict()}
        late = isinstance(batch_or_position, pa.RecordBatch) \
            and self._from_lost_connection(batch_or_position, pos.partition)
        attempts = [0]

        def send() -> Any:  # as ack(): a resent ack asks what is in doubt
            attempts[0] += 1
            return self._client.action("ack-cumulative",
                                       {**body, "retry": late or attempts[0] > 1})

        answer = with_reconnect(send, what=f"ack_cumulative of {self.name}")
        self._raise_if_in_doubt(answer, f"this cumulative ack up to {pos} of {self.topic!r}")

    def _from_lost_connection(self, batch: pa.RecordBatch, partition: int) -> bool:
        """Whether ``batch`` came on a connection to ``partition`` that is gone (or going)."""
        return self._attaching.get(partition, False) \
            or int(batch.schema.metadata[_EPOCH]) != self._epoch[partition]

    def _raise_if_in_doubt(self, answer: Any, what: str) -> None:
        """AckInDoubtError if the broker says the ack's messages may have gone elsewhere."""
        doubt = int((answer or {}).get("in_doubt") or 0)
        if doubt:
            raise AckInDoubtError(
                f"consumer {self.name}: its connection to the broker was lost before {what} "
                f"was stored; it is stored now, but {doubt} of its message(s) may have been "
                f"delivered to another consumer of {self.subscription!r} meanwhile (they may "
                "be processed twice)", messages=doubt)

    def nack(self, batch: pa.RecordBatch) -> None:
        """Have the messages of ``batch`` delivered again after ``nack_delay`` (their
        redelivery count goes up; past ``max_redeliveries`` they go to the dead letters)."""
        partition, positions = self._positions(batch, "nack")
        if batch.num_rows == 0:
            return
        self._client.action("nack", {"topic": self.topic, "subscription": self.subscription,
                                     "partition": partition, "consumer": self.name,
                                     "delay_s": self.nack_delay, **positions})

    def close(self) -> None:
        """Detach at once: what this consumer held unacknowledged goes to the others, and
        another exclusive consumer may attach as soon as this returns."""
        if self._stop.is_set():
            return
        self._stop.set()
        for worker in (getattr(self, "_watcher", None), getattr(self, "_keeper", None)):
            if worker is not None:
                worker.join(timeout=5)
        for p in self._readers:
            with contextlib.suppress(TierstreamError):  # a broker that is down detached us
                self._client.action("close-consumer", {
                    "topic": self.topic, "subscription": self.subscription, "partition": p,
                    "consumer": self.name})
        for r in list(self._readers.values()):
            r.cancel()
        for t in self._threads:
            t.join(timeout=5)
        for r in list(self._readers.values()):
            r.cancel()  # opened by a pump while we were closing
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
