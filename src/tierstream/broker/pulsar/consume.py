"""The consume half of a Pulsar connection: SUBSCRIBE, FLOW, MESSAGE, ACK, redelivery.

A Pulsar consumer is a consumer of the broker's own subscriptions (``broker/subscriptions/``):
the same dispatcher, cursors, key holds, redelivery counts and dead letters as tierstream's
``Consumer``, so the two share a subscription.

Message ids: ``message_ids.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tierstream.broker.pulsar.delivered import Delivered
from tierstream.broker.pulsar.produce import Link
from tierstream.broker.subscriptions.attached import Attached, ConsumerSettings
from tierstream.broker.subscriptions.compacted_source import last_compacted
from tierstream.broker.subscriptions.cursor_state import NON_DURABLE
from tierstream.errors import ConflictError, TierstreamError
from tierstream.model.positions import KeyRange, Position
from tierstream.model.subscription_type import SubscriptionType
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.message_ids import (
    NO_LEDGER,
    id_before,
    last_message_id,
    no_message,
    start_position,
)
from tierstream.pulsar_protocol.replies import Refused, error_code
from tierstream.pulsar_protocol.schemas import check_consumer_schema
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker

if TYPE_CHECKING:
    from tierstream.broker.stats.topic_stats import Streams
    from tierstream.broker.store import Store
    from tierstream.broker.subscriptions.registry import Subscriptions
    from tierstream.metadata.schema_registry import SchemaRegistry

__all__ = ["ConsumePath", "ConsumerLink"]

log = logging.getLogger(__name__)

_Cmd = api.BaseCommand
_TYPES = {api.CommandSubscribe.Exclusive: SubscriptionType.EXCLUSIVE,
          api.CommandSubscribe.Shared: SubscriptionType.SHARED,
          api.CommandSubscribe.Failover: SubscriptionType.FAILOVER,
          api.CommandSubscribe.Key_Shared: SubscriptionType.KEY_SHARED}
#: the most messages a consumer may have on its way: Pulsar's permits come from the client's
#: receiver queue (FLOW); this caps what a client may ask for
MAX_PERMITS = 10_000
class ConsumerLink(Link, Protocol):
    """What the consume path needs of its connection beside what the produce path does."""

    def write_frames(self, frames: list[bytes]) -> None: ...


@dataclass
class _Consumer:
    id: int
    topic: str
    partition: int
    subscription: str
    name: str
    type: str
    partitioned: bool  # the client named a partition of a partitioned topic
    attached: Attached
    durable: bool = True  # False: a reader's, deleted when it leaves
    compacted: bool = False  # it reads the compaction snapshot, then the log
    worker: Worker | None = None  # its delivery thread
    stream: int = -1  # its key in the broker's Streams
    counts: dict[str, Any] = field(default_factory=dict)  # its Streams entry
    sent: Delivered = field(init=False)

    def __post_init__(self) -> None:
        self.sent = Delivered(self.id, self.partition, self.wire_partition,
                              reader=not self.durable, cumulative=self.type in (
                                  SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER))

    @property
    def wire_partition(self) -> int:
        """The partition in its message ids: -1 for a topic of one partition, as Pulsar's."""
        return self.partition if self.partitioned else -1


class ConsumePath:
    """The consumers of one connection, a delivery thread each. ``consumers`` changes from the
    connection's thread and from delivery threads (a consumer the broker let go): under
    ``_lock``."""

    def __init__(self, link: ConsumerLink, store: Store, subscriptions: Subscriptions,
                 streams: Streams, schemas: SchemaRegistry) -> None:
        self.link, self.store, self.subscriptions = link, store, subscriptions
        self.streams, self.schemas = streams, schemas
        self.consumers: dict[int, _Consumer] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._unstored = 0  # the write generation that stores this connection's acks so far

    def _stored(self, *partitions: tuple[str, int]) -> TierstreamError | None:
        """Wait until this connection's acks so far are on disk (None), or say why not (those
        of one of ``partitions`` were not stored: another broker owns it now)."""
        try:
            self.subscriptions.stored(self._unstored, partitions)
        except TierstreamError as exc:
            return exc
        return None

    # -- subscribing --------------------------------------------------------------------------

    def subscribe(self, req: api.CommandSubscribe) -> None:
        try:
            self._subscribe(req)
        except TierstreamError as exc:
            log.warning("pulsar client %s: subscription %r on %s refused: %s", self.link.peer,
                        req.subscription, req.topic, exc)
            self.link.error(req.request_id, _subscribe_code(exc), str(exc))

    def _subscribe(self, req: api.CommandSubscribe) -> None:
        if self.consumers.get(req.consumer_id) is not None:
            raise Refused(f"consumer id {req.consumer_id} is already in use on this connection")
        kind = _TYPES[req.subType]
        if not req.durable and kind != SubscriptionType.EXCLUSIVE:
            raise Refused("a non-durable subscription (a reader) is exclusive")
        if req.read_compacted and kind not in (SubscriptionType.EXCLUSIVE,
                                                SubscriptionType.FAILOVER):
            raise Refused("Read compacted can only be used with exclusive or failover "
                          "persistent subscriptions")
        topic, count, partition = self.link.partition_of(
            req.topic, create=req.force_topic_creation, verb="subscribe")
        if req.HasField("schema"):
            check_consumer_schema(self.schemas, topic, req.schema)
        sticky = None
        if kind == SubscriptionType.KEY_SHARED and req.HasField("keySharedMeta") \
                and req.keySharedMeta.keySharedMode == api.STICKY:
            # Pulsar's ranges end inclusive; tierstream's exclusive
            sticky = tuple(KeyRange(r.start, r.end + 1) for r in req.keySharedMeta.hashRanges)
        name = req.consumer_name or f"pulsar-{id(self):x}-{req.consumer_id}"
        settings = ConsumerSettings(name=name, type=kind, sticky=sticky, permits=MAX_PERMITS,
                                    initial_permits=0, whole_entries=True)
        plog = self.store.partition(topic, partition)
        # compacted, the earliest is the snapshot's first, which may come before the log's
        earliest = Position(partition, 0, 0, 0) if req.read_compacted else plog.earliest()
        if req.HasField("start_message_id"):
            initial = start_position(req.start_message_id, plog, reader=not req.durable)
            if req.start_message_id.ledgerId == NO_LEDGER:
                initial = earliest
        elif req.initialPosition == api.CommandSubscribe.Earliest:
            initial = earliest
        else:
            initial = plog.end()
        gone = self._closing.is_set
        attached = self.subscriptions.attach(topic, req.subscription, partition, settings,
                                             initial=initial, gone=gone,
                                             label=None if req.durable else NON_DURABLE,
                                             compacted=req.read_compacted)
        consumer = _Consumer(req.consumer_id, topic, partition, req.subscription, name, kind,
                             count > 1, attached, durable=req.durable,
                             compacted=req.read_compacted)
        consumer.stream, consumer.counts = self.streams.open("consumer", topic, partition, name)
        with self._lock:
            self.consumers[req.consumer_id] = consumer
        self.link.write(_Cmd(type=_Cmd.SUCCESS, success=api.CommandSuccess(
            request_id=req.request_id)))
        consumer.worker = Worker("tierstream-pulsar-consumer",
                                 functools.partial(self._deliver, consumer),
                                 on_error=functools.partial(self._delivery_failed, consumer))
        consumer.worker.start()

    # -- delivery -----------------------------------------------------------------------------

    def _deliver(self, c: _Consumer) -> None:
        plog = self.store.partition(c.topic, c.partition)
        told: bool | None = None  # what the client was last told of its being active
        try:
            while not c.attached.detached and not self._closing.is_set():
                active = c.attached.active
                if active is not None and active != told:  # failover: ACTIVE_CONSUMER_CHANGE
                    self.link.write(_Cmd(
                        type=_Cmd.ACTIVE_CONSUMER_CHANGE, active_consumer_change=(
                            api.CommandActiveConsumerChange(consumer_id=c.id,
                                                            is_active=active))))
                    told = active
                batch = c.attached.next_batch(0.2)
                if batch is None:
                    continue
                fault_point("pulsar.delivery")
                frames = c.sent.frames(batch)
                self.link.write_frames(frames)
                size = sum(map(len, frames))  # the bytes sent, as Pulsar counts them
                plog.rate_out.add(batch.num_rows, size)
                c.counts["messages"] += batch.num_rows
                c.counts["bytes"] += size
            if c.attached.detached and not self._closing.is_set() and self._take(c):
                # the broker let it go (a seek elsewhere, the subscription deleted): the
                # client is told, and subscribes again if it still wants to
                self.streams.close(c.stream)
                self._tell_closed(c.id)
        except OSError:
            pass  # the connection is gone: its close detaches the consumer
        except TierstreamError as exc:
            log.warning("pulsar client %s: delivery to consumer %s stopped: %s",
                        self.link.peer, c.name, exc)

    def _delivery_failed(self, c: _Consumer, exc: BaseException) -> None:
        """The delivery thread died of an error nobody foresaw (logged with its stack): the
        consumer is let go — what it held goes back to the subscription — and its client
        told, so it subscribes again and is served by a new thread."""
        if self._take(c):
            self._detach(c)
            self._tell_closed(c.id)

    def _take(self, c: _Consumer) -> bool:
        """Remove ``c`` from the connection's consumers if it is still there."""
        with self._lock:
            if self.consumers.get(c.id) is not c:
                return False
            del self.consumers[c.id]
            return True

    def _all(self) -> list[_Consumer]:
        with self._lock:
            return list(self.consumers.values())

    # -- flow and acks --------------------------------------------------------------------------

    def flow(self, req: api.CommandFlow) -> None:
        c = self.consumers.get(req.consumer_id)
        if c is not None:
            self.subscriptions.flow(c.topic, c.subscription, c.partition, c.name,
                                    int(req.messagePermits))

    def ack(self, req: api.CommandAck) -> None:
        c = self.consumers.get(req.consumer_id)
        error: TierstreamError | None = None
        if c is None:
            error = Refused(f"no consumer {req.consumer_id} on this connection")
        else:
            try:
                self._ack(c, req)
            except TierstreamError as exc:
                log.warning("pulsar client %s: ack of %s refused: %s", self.link.peer, c.name,
                            exc)
                error = exc
        if req.HasField("request_id"):  # the client asked for a receipt: once it is stored
            reply = api.CommandAckResponse(consumer_id=req.consumer_id,
                                           request_id=req.request_id)
            if error is None and c is not None:
                error = self._stored((c.topic, c.partition))
            if error is not None:
                reply.error, reply.message = error_code(error), str(error)
            self.link.write(_Cmd(type=_Cmd.ACK_RESPONSE, ackResponse=reply))

    def _ack(self, c: _Consumer, req: api.CommandAck) -> None:
        """Take the ack at once and store it with the next group commit (``_unstored``): the
        frames after it are not held up by a commit each. What answers the client waits for
        it: a receipt, a close, a seek, an unsubscribe (``_stored``)."""
        if not req.message_id:
            return
        if req.ack_type == api.CommandAck.Cumulative:
            if c.type not in SubscriptionType.CUMULATIVE:
                raise Refused(f"a {c.type} subscription takes no cumulative acks")
            last = c.sent.acked_through(req.message_id)
            if last is not None:
                self._unstored = max(self._unstored, self.subscriptions.ack_cumulative(
                    c.topic, c.subscription, c.name, last, wait=False))
            return
        segment, entry, index = c.sent.acked(req.message_id)
        if len(segment):
            self._unstored = max(self._unstored, self.subscriptions.ack_later(
                c.topic, c.subscription, c.partition, c.name, segment, entry, index))

    def redeliver(self, req: api.CommandRedeliverUnacknowledgedMessages) -> None:
        """The client's negative acks and ack timeouts (ids), or a reset (no ids: everything
        it holds): those messages are delivered again, their redelivery count raised."""
        c = self.consumers.get(req.consumer_id)
        if c is None:
            return
        segment, entry, index = c.sent.taken_back(req.message_ids)
        if len(segment):
            self.subscriptions.nack(c.topic, c.subscription, c.partition, c.name, segment,
                                    entry, index, 0.0)

    def seek(self, req: api.CommandSeek) -> None:
        """Move the consumer's subscription to a message id or a publish time. As Pulsar's
        broker does, its consumers here are closed first (CLOSE_CONSUMER: the client
        completes the seek once it has subscribed again, so no message from before the seek
        reaches it after), then the cursor is reset, then the seek answered."""
        c = self.consumers.get(req.consumer_id)
        try:
            if c is None:
                raise Refused(f"no consumer {req.consumer_id} on this connection")
            plog = self.store.partition(c.topic, c.partition)
            if req.HasField("message_id"):
                position = start_position(req.message_id, plog, reader=not c.durable)
            elif req.HasField("message_publish_time"):
                position = plog.position_at_time(int(req.message_publish_time))
            else:
                raise Refused("a seek names a message id or a publish time")
            where = (c.topic, c.subscription, c.partition)
            for other in [x for x in self._all()
                          if (x.topic, x.subscription, x.partition) == where]:
                if not self._take(other):
                    continue
                self._detach(other, forget=False)
                self._tell_closed(other.id)
            self.subscriptions.reset(c.topic, c.subscription, c.partition, position)
        except TierstreamError as exc:
            log.warning("pulsar client %s: seek refused: %s", self.link.peer, exc)
            self.link.error(req.request_id, error_code(exc), str(exc))
            return
        self.link.write(_Cmd(type=_Cmd.SUCCESS, success=api.CommandSuccess(
            request_id=req.request_id)))

    def _tell_closed(self, consumer_id: int) -> None:
        with contextlib.suppress(OSError):
            self.link.write(_Cmd(type=_Cmd.CLOSE_CONSUMER, close_consumer=(
                api.CommandCloseConsumer(consumer_id=consumer_id,
                                         request_id=self.link.broker_request_id()))))

    def last_message_id(self, req: api.CommandGetLastMessageId) -> None:
        """The id of the partition's last message (ledger and entry -1 when it has none) and
        the subscription's mark-delete position: what ``has_message_available`` compares."""
        c = self.consumers.get(req.consumer_id)
        if c is None:
            self.link.error(req.request_id, api.ConsumerNotFound,
                            f"no consumer {req.consumer_id} on this connection")
            return
        partition = c.wire_partition
        plog = self.store.partition(c.topic, c.partition)
        last = last_compacted(plog, self.store.metadata, self.store.tier) if c.compacted \
            else plog.last_confirmed()[0]
        reply = api.CommandGetLastMessageIdResponse(request_id=req.request_id)
        if last is None:
            reply.last_message_id.CopyFrom(no_message(partition))
        else:
            reply.last_message_id.CopyFrom(last_message_id(last, partition))
        done = self.subscriptions.acknowledged_before(c.topic, c.subscription, c.partition)
        if done is not None:
            reply.consumer_mark_delete_position.CopyFrom(id_before(done, partition))
        self.link.write(_Cmd(type=_Cmd.GET_LAST_MESSAGE_ID_RESPONSE,
                             getLastMessageIdResponse=reply))

    # -- closing ------------------------------------------------------------------------------

    def close(self, req: api.CommandCloseConsumer) -> None:
        """The client closes a consumer (after sending its pending acks): answered once they
        are stored."""
        with self._lock:
            c = self.consumers.pop(req.consumer_id, None)
        if c is not None:
            self._detach(c)
        error = self._stored()
        if error is not None:
            self.link.error(req.request_id, error_code(error), str(error))
            return
        self.link.write(_Cmd(type=_Cmd.SUCCESS, success=api.CommandSuccess(
            request_id=req.request_id)))

    def unsubscribe(self, req: api.CommandUnsubscribe) -> None:
        with self._lock:
            c = self.consumers.pop(req.consumer_id, None)
        try:
            if c is None:
                raise Refused(f"no consumer {req.consumer_id} on this connection")
            self._detach(c)
            self.subscriptions.delete(c.topic, c.subscription)
        except TierstreamError as exc:
            self.link.error(req.request_id, error_code(exc), str(exc))
            return
        self.link.write(_Cmd(type=_Cmd.SUCCESS, success=api.CommandSuccess(
            request_id=req.request_id)))

    def go_away(self) -> None:
        """CLOSE_CONSUMER to the client for each consumer (the broker is going)."""
        for c in self._all():
            self._tell_closed(c.id)

    def close_all(self) -> None:
        """The connection ended: every consumer detached (what they held goes to others),
        its acks stored."""
        self._closing.set()
        with self._lock:
            gone, self.consumers = list(self.consumers.values()), {}
        for c in gone:
            self._detach(c)
        if self._unstored and self.subscriptions is not None:
            self._stored()

    def _detach(self, c: _Consumer, *, forget: bool = True) -> None:
        self.streams.close(c.stream)
        with contextlib.suppress(TierstreamError):
            self.subscriptions.detach(c.topic, c.subscription, c.partition, c.attached)
            if forget and not c.durable:  # a reader's cursor lives as long as the reader
                self.subscriptions.delete(c.topic, c.subscription)
        if c.worker is not None:
            c.worker.join(timeout=5)


def _subscribe_code(exc: BaseException) -> Any:
    if isinstance(exc, ConflictError):
        return api.ConsumerBusy
    return error_code(exc)
