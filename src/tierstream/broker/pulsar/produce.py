"""The produce half of a Pulsar connection: PRODUCER, SEND, CLOSE_PRODUCER.

A SEND is decoded (``messages.py``), submitted to the partition's log at once
(``PartitionLog.submit``: the store, de-duplication by producer name and sequence id, and
group commit that tierstream's own producers use) and handed to the connection's receipt
thread, which waits for each entry's quorum in order and answers SEND_RECEIPT with
tierstream's position as the message id: ledgerId = segment id, entryId = entry id, the
partition (-1 for a topic of one partition) and, per message of a batch, its batch index. A
refused SEND is answered in the same queue, so answers keep the order of the sends. The chunks
of a chunked message are put together first (``chunks.py``) and stored as one message.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tierstream.broker.pulsar.chunks import Assembly
from tierstream.broker.topics.producer_access import MODES
from tierstream.errors import StaleRoutingError, TierstreamError
from tierstream.model.message_format import key_hashes
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.messages import refused_feature, to_rows
from tierstream.pulsar_protocol.replies import Refused, error_code, send_error_code
from tierstream.pulsar_protocol.schemas import (
    registered_version,
    schema_version_bytes,
    version_of,
)
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker

if TYPE_CHECKING:
    from tierstream.broker.stats.topic_stats import Streams
    from tierstream.broker.store import Store
    from tierstream.metadata.schema_registry import SchemaRegistry

__all__ = ["Link", "ProducePath", "off_hash", "refuse_routing"]

log = logging.getLogger(__name__)

_Cmd = api.BaseCommand


class Link(Protocol):
    """What the produce path needs of its connection."""

    peer: Any

    def write(self, command: api.BaseCommand) -> None: ...

    def error(self, request_id: int, error: Any, message: str) -> None: ...

    def partition_of(self, name: str, *, create: bool, verb: str) -> tuple[str, int, int]: ...

    def broker_request_id(self) -> int: ...

    def drop(self, reason: str) -> None: ...


class ProducePath:
    """The producers of one connection and the thread that answers their sends in order."""

    def __init__(self, link: Link, store: Store, schemas: SchemaRegistry, streams: Streams
                 ) -> None:
        self.link, self.store, self.schemas, self.streams = link, store, schemas, streams
        self.producers: dict[int, _Producer] = {}
        self._waiting: dict[int, _Producer] = {}  # WaitForExclusive ones, not granted yet
        # a waiting producer may be granted (from another connection's thread) before its
        # "not ready" answer is written: the two answers, and _waiting, under this lock
        self._answers = threading.Lock()
        self._fenced: dict[int, str] = {}  # producer id -> why another fenced it
        self._chunked: dict[int, Assembly] = {}  # producer id -> its chunked message
        self._receipts: queue.Queue[Any] = queue.Queue(maxsize=1000)
        self._names = itertools.count()
        self._worker = Worker("tierstream-pulsar-receipts", self._send_receipts,
                              on_error=self._receipts_failed).start()

    def stop(self, timeout: float) -> None:
        """Answer what is queued, then end the receipt thread."""
        for assembly in self._chunked.values():
            assembly.drop(Refused("the connection closed before the message's last chunk"))
        if self._worker.alive:
            self._receipts.put(None)
        self._worker.join(timeout)
        for producer in [*self.producers.values(), *self._waiting.values()]:
            self.streams.close(producer.stream)
        self.producers.clear()
        self._waiting.clear()

    def close_all(self) -> None:
        """CLOSE_PRODUCER to the client for each producer (the broker is going)."""
        for producer_id in list(self.producers):
            self._quietly(self.link.write, _Cmd(
                type=_Cmd.CLOSE_PRODUCER, close_producer=api.CommandCloseProducer(
                    producer_id=producer_id, request_id=self.link.broker_request_id())))

    def close(self, req: api.CommandCloseProducer) -> None:
        """The client closes a producer."""
        producer = self.producers.pop(req.producer_id, None) or \
            self._waiting.pop(req.producer_id, None)
        if producer is not None:
            self.streams.close(producer.stream)
        assembly = self._chunked.pop(req.producer_id, None)
        if assembly is not None:
            assembly.drop(Refused("the producer closed before the message's last chunk"))
        self.link.write(_Cmd(type=_Cmd.SUCCESS, success=api.CommandSuccess(
            request_id=req.request_id)))

    def create(self, req: api.CommandProducer) -> None:
        """PRODUCER: PRODUCER_SUCCESS with the name's last stored sequence id, or ERROR. Its
        access mode is asked for (``broker/topics/producer_access.py``): a WaitForExclusive producer
        that must wait is answered PRODUCER_SUCCESS with producer_ready false, and again
        (ready) when the partition is granted, or ERROR if it is fenced meanwhile."""
        stream = None
        try:
            topic, count, partition = self.link.partition_of(req.topic, create=True,
                                                             verb="produce")
            if req.encrypted:
                raise Refused("encryption is not supported by this tierstream broker")
            version = registered_version(self.schemas, topic, req.schema) \
                if req.HasField("schema") else None
            name = req.producer_name if req.HasField("producer_name") and req.producer_name \
                else f"pulsar-{socket.gethostname()}-{id(self):x}-{next(self._names)}"
            plog = self.store.partition(topic, partition)
            last = plog.producer_state(name)
            old = self.producers.pop(req.producer_id, None) or \
                self._waiting.pop(req.producer_id, None)
            if old is not None:  # the client reuses the id: the old one is gone
                self.streams.close(old.stream)
            stream, counts = self.streams.open("producer", topic, partition, name)
            producer = _Producer(topic, partition, name, count, version, stream, counts,
                                 fresh=last is None)
            # for its stats (which add whether it waits: the access registry knows)
            counts["access"] = MODES.get(req.producer_access_mode, "Shared")
            pid = req.producer_id
            with self._answers:  # until granted (which may come before attach returns)
                self._waiting[pid] = producer
            grant = self.streams.access.attach(
                topic, partition, stream, name, mode=req.producer_access_mode,
                epoch=req.topic_epoch if req.HasField("topic_epoch") else None,
                fence=lambda reason: self._fence(pid, producer, reason),
                ready=lambda epoch: self._answer(req, producer, last, epoch),
                fail=lambda exc: self._refuse_waiting(req, producer, exc))
        except TierstreamError as exc:
            if stream is not None:
                with self._answers:
                    self._waiting.pop(req.producer_id, None)
                self.streams.close(stream)
            log.warning("pulsar client %s: producer on %s refused: %s", self.link.peer, req.topic,
                        exc)
            self.link.error(req.request_id, error_code(exc), str(exc))
            return
        if grant.ready:
            self._answer(req, producer, last, grant.epoch)
            return
        with self._answers:
            if self._waiting.get(req.producer_id) is not producer:
                return  # granted or refused meanwhile, and answered so
            log.info("pulsar client %s: producer %s waits for exclusive access to %s "
                     "partition %d", self.link.peer, name, topic, partition)
            self._quietly(self.link.write, _Cmd(
                type=_Cmd.PRODUCER_SUCCESS, producer_success=api.CommandProducerSuccess(
                    request_id=req.request_id, producer_name=name, producer_ready=False)))

    def _answer(self, req: api.CommandProducer, producer: _Producer, last: int | None,
                epoch: int | None) -> None:
        """The producer may send (now, or later when a waiting one is granted)."""
        success = api.CommandProducerSuccess(
            request_id=req.request_id, producer_name=producer.name,
            last_sequence_id=-1 if last is None else int(last))
        if producer.schema_version is not None:
            success.schema_version = schema_version_bytes(producer.schema_version)
        if epoch is not None:
            success.topic_epoch = epoch
        with self._answers:
            if self._waiting.pop(req.producer_id, None) is not producer:
                if req.producer_id in self._fenced:  # fenced before it was answered
                    self._quietly(self.link.error, req.request_id, api.ProducerFenced,
                                  self._fenced[req.producer_id])
                return  # else closed by its client meanwhile
            self._fenced.pop(req.producer_id, None)
            self.producers[req.producer_id] = producer
            self._quietly(self.link.write, _Cmd(type=_Cmd.PRODUCER_SUCCESS,
                                                producer_success=success))

    def _refuse_waiting(self, req: api.CommandProducer, producer: _Producer,
                        exc: TierstreamError) -> None:
        """A waiting producer was fenced before it was granted."""
        with self._answers:
            if self._waiting.pop(req.producer_id, None) is not producer:
                return
            self._quietly(self.link.error, req.request_id, error_code(exc), str(exc))
        self.streams.close(producer.stream)

    def _fence(self, producer_id: int, producer: _Producer, reason: str) -> None:
        """Another producer took the partition with ExclusiveWithFencing: this one is closed
        (CLOSE_PRODUCER; its client tries again and is refused) and its sends refused."""
        with self._answers:
            for held in (self.producers, self._waiting):
                if held.get(producer_id) is producer:
                    del held[producer_id]
            self._fenced[producer_id] = reason
        self.streams.close(producer.stream)
        log.info("pulsar client %s: producer %s %s", self.link.peer, producer.name, reason)
        self._quietly(self.link.write, _Cmd(
            type=_Cmd.CLOSE_PRODUCER, close_producer=api.CommandCloseProducer(
                producer_id=producer_id, request_id=self.link.broker_request_id())))

    def send(self, send: api.CommandSend, metadata: Any, payload: bytes) -> None:
        producer = self.producers.get(send.producer_id)
        if producer is None:
            self.refuse(send, api.ChecksumError, self._fenced.get(
                send.producer_id, f"no producer {send.producer_id} on this connection"))
            return
        if metadata is None:
            self.refuse(send, api.ChecksumError, "SEND without a message")
            return
        feature = refused_feature(send, metadata)
        if feature is not None:
            self.refuse(send, api.ChecksumError,
                         f"{feature}: not supported by this tierstream broker; "
                             "nothing was stored")
            return
        topic, partition, name, count = (producer.topic, producer.partition, producer.name,
                                          producer.partitions)
        assembly = None
        if metadata.num_chunks_from_msg > 1:  # a chunk: stored with the message's last
            assembly = self._chunked.setdefault(send.producer_id, Assembly())
            try:
                whole, complete = assembly.add(metadata, payload)
            except TierstreamError as exc:
                self.refuse(send, send_error_code(exc), str(exc))
                return
            if complete is None:
                self._receipts.put((send, partition if count > 1 else -1, whole))
                return
            metadata, payload = complete
        try:
            version = version_of(metadata.schema_version) \
                if metadata.HasField("schema_version") else producer.schema_version
            rows = to_rows(metadata, payload, sequence_id=int(send.sequence_id),
                           schema_version=version)
            if version is not None:
                self.schemas.check_named_versions(topic, {str(version)})
            plog = self.store.partition(topic, partition)
            seq = send.highest_sequence_id or send.sequence_id
            checked = not producer.reused(int(send.sequence_id), int(seq))
            for attempt in range(2):
                # each key where tierstream routes it under the topic's count now (which
                # may be more than the client routed by, if the topic grew since it looked);
                # submitted as routed by that count, so a scale event in between refuses
                # it (StaleRoutingError) and it is checked again against the new count
                now = plog.routing or count
                if not self.store.key_routing.by_client(topic):
                    self._check_routing(rows, topic, partition, now, count)
                try:
                    pending = plog.submit(rows, producer=name if checked else None,
                                          sequence_id=int(seq) if checked else None,
                                          routed=now)
                    break
                except StaleRoutingError:
                    if attempt:
                        raise
        except TierstreamError as exc:
            if assembly is not None:
                assembly.refused(exc)
            self.refuse(send, send_error_code(exc), str(exc))
            return
        producer.counts["messages"] += rows.num_rows
        producer.counts["bytes"] += len(payload)  # the SEND's, as Pulsar counts them
        if assembly is not None:
            assembly.stored(pending)
        self._receipts.put((send, partition if count > 1 else -1, pending))

    def _check_routing(self, rows: Any, topic: str, partition: int, count: int,
                       client: int) -> None:
        """A key where tierstream's hash would not put it makes the topic client-routed
        (``broker/topics/key_routing.py``); refused if the topic grew, or the client routed by an
        older count."""
        found = off_hash(rows, partition, count)
        if found is None:
            return
        if client != count or not self.store.key_routing.accept_client_routing(topic):
            refuse_routing(*found, topic, partition, count, client)

    def refuse(self, send: api.CommandSend, error: Any, message: str) -> None:
        """Answer SEND_ERROR in turn: after the receipts of the sends before it. A client
        fails the message at the head of its queue, so an answer that overtook an earlier
        send's receipt would fail the wrong message (the C++ core crashes on it)."""
        self._receipts.put((send, None, (error, message)))

    def _receipts_failed(self, exc: BaseException) -> None:
        """The receipt thread died of an error nobody foresaw (logged with its stack): the
        connection is dropped, as Pulsar's broker drops one on an internal error — its client
        reconnects and sends again what has no receipt, which de-duplication stores once —
        and the queue emptied (each append in it waited for, so that it is confirmed), so a
        send blocked on a full queue goes on to see the connection gone."""
        self.link.drop(f"its receipt thread failed: {exc!r}")
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._receipts.get_nowait()
                if item is not None and not isinstance(item[2], tuple):
                    with contextlib.suppress(Exception):
                        item[2].result()

    def _send_receipts(self) -> None:
        while (item := self._receipts.get()) is not None:
            fault_point("pulsar.receipt")
            send, partition, pending = item
            if isinstance(pending, tuple):
                error, message = pending
                self._quietly(self._send_error, send, error, message)
                continue
            try:
                ack = pending.result()
            except TierstreamError as exc:
                self._quietly(self._send_error, send, send_error_code(exc), str(exc))
                continue
            message_id = api.MessageIdData(
                ledgerId=(2**64 - 1) if ack.segment_id is None else ack.segment_id,
                entryId=(2**64 - 1) if ack.entry_id is None else ack.entry_id,
                partition=partition)
            receipt = api.CommandSendReceipt(producer_id=send.producer_id,
                                             sequence_id=send.sequence_id,
                                             message_id=message_id,
                                             highest_sequence_id=send.highest_sequence_id)
            self._quietly(self.link.write, _Cmd(type=_Cmd.SEND_RECEIPT, send_receipt=receipt))

    def _quietly(self, write: Any, *args: Any) -> None:
        with contextlib.suppress(OSError):  # the client went away; what is stored stays
            write(*args)

    def _send_error(self, send: api.CommandSend, error: Any, message: str) -> None:
        self.link.write(_Cmd(type=_Cmd.SEND_ERROR, send_error=api.CommandSendError(
            producer_id=send.producer_id, sequence_id=send.sequence_id, error=error,
            message=message)))


def off_hash(rows: Any, partition: int, count: int) -> tuple[str, int] | None:
    """The first key of ``rows`` that tierstream's hash puts in another partition than
    ``partition`` of ``count``, with that partition (None: every key is where it would)."""
    keys = rows.column("key")
    if keys.null_count == len(keys):
        return None
    slots = key_hashes(keys).to_numpy()
    keyed = keys.is_valid().to_numpy(zero_copy_only=False)
    wrong = np.flatnonzero(keyed & (slots % count != partition))
    if not len(wrong):
        return None
    return keys[int(wrong[0])].as_py(), int(slots[wrong[0]]) % count


def refuse_routing(key: str, home: int, topic: str, partition: int, count: int, client: int
                   ) -> None:
    """Refuse a key stored elsewhere than tierstream's hash puts it, on a topic whose keys
    must stay there: one that grew (its readers follow keys across scale events by that
    hash), or one the client routed by an older partition count."""
    if client != count:
        raise Refused(
            f"{topic} grew from {client} to {count} partitions: key {key!r} now belongs to "
            f"partition {home}, not {partition}; nothing was stored. The client routes it "
            "there once it refreshes the topic's partitions (Java autoUpdatePartitionsInterval"
            ", Go PartitionsAutoDiscoveryInterval, C++ partitionsUpdateInterval: 60 s by "
            "default), or when the producer is made again")
    raise Refused(
        f"key {key!r} belongs to partition {home} of {topic} ({count} partitions), not "
        f"{partition}: the topic grew, and across its scale events readers find a key where "
        "tierstream's hash puts it (murmur3_32 % 65536 % partitions): give the producer that "
        "routing (Python: message_router=tierstream.pulsar_protocol.key_router; Java: "
        "hashingScheme Murmur3_32Hash, which agrees when the partition count divides "
        "65,536); nothing was stored")


@dataclass
class _Producer:
    topic: str
    partition: int
    name: str
    partitions: int  # the topic's count when the producer was made: how the client routes
    schema_version: int | None  # of the producer's schema; None: bytes
    stream: int  # its key in the broker's Streams
    counts: dict[str, Any]  # its Streams entry: messages and bytes sent
    fresh: bool  # its name had nothing stored when it was made (told last_sequence_id -1)
    highest_sent: int = -1  # the highest sequence id this producer sent
    reused_up_to: int = -1  # its client numbered from 0 again: ids up to this were reused

    def reused(self, lowest: int, highest: int) -> bool:
        """Whether a batch's ids were used before by this producer for other messages.

        Within one producer a client's ids only grow, except that the C++ core (the Python,
        Node and C++ clients) numbers the messages queued before a producer's first
        PRODUCER_SUCCESS from 0 and, told -1, numbers on from 0 again: a partitioned
        producer's new partitions after a growth, lazy partitioned producers
        (pulsar-client-cpp#341). Pulsar's broker stores both (de-duplication is off there by
        default); here they would be dropped as duplicates, their receipts sent: lost. So a
        fresh producer whose ids restart at 0 has its reused ids stored without the check."""
        if self.fresh and lowest == 0 and self.highest_sent >= 0 and self.reused_up_to < 0:
            self.reused_up_to = self.highest_sent
            log.warning("pulsar producer %s on %s partition %d numbered its messages from 0 "
                        "again after %d (a client bug: pulsar-client-cpp#341): those up to %d "
                        "are stored without de-duplication", self.name, self.topic,
                        self.partition, self.highest_sent, self.highest_sent)
        self.highest_sent = max(self.highest_sent, highest)
        return highest <= self.reused_up_to
