"""A SEND's payload as tierstream rows: one message, or a batch (``num_messages_in_batch``:
per message a ``SingleMessageMetadata`` and its bytes), decompressed with pyarrow's codecs
(Pulsar's LZ4 is the raw block format, ZLIB zlib's, ZSTD and SNAPPY their own)."""

from __future__ import annotations

import base64
import functools
import itertools
import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from tierstream.errors import ConfigError, ProtocolError
from tierstream.model.message_format import DELIVER_AT, PRODUCE_SCHEMA, nulls
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.alike import Alike, split_alike
from tierstream.pulsar_protocol.columns import properties_column
from tierstream.pulsar_protocol.schemas import schema_version_bytes
from tierstream.schemas.model import VERSION_PROPERTY

__all__ = ["BATCHED", "BATCH_PROPERTIES", "KEY_BASE64", "NULL_VALUE", "ORDERING_KEY",
           "PUBLISH_TIME", "SEQUENCE_ID", "batch_of", "chunks_of", "metadata_of", "plain_batch",
           "refused_feature", "to_rows"]

_CODECS = {api.LZ4: "lz4_raw", api.ZSTD: "zstd", api.SNAPPY: "snappy"}


def refused_feature(send: api.CommandSend, metadata: api.MessageMetadata) -> str | None:
    """The feature a SEND uses that tierstream does not take over this protocol, by name."""
    if send.txnid_most_bits or send.txnid_least_bits or metadata.HasField("txnid_most_bits"):
        return "transactions (txnid on SEND)"
    if metadata.HasField("encryption_algo") or metadata.HasField("encryption_param"):
        return "encryption"
    if send.marker or metadata.HasField("marker_type"):
        return "marker messages"
    return None


#: message properties that keep what a Pulsar message has and tierstream's columns do not
SEQUENCE_ID = "pulsar.sequence_id"  # the producer's sequence id of the message
PUBLISH_TIME = "pulsar.publish_time"  # the client's publish time (ms); the column is the broker's
NULL_VALUE = "pulsar.null_value"  # "true": the value was null (stored as empty bytes)
ORDERING_KEY = "pulsar.ordering_key"  # the message's ordering key, base64
KEY_BASE64 = "pulsar.key_base64"  # "true": the key is base64 of bytes (partition_key_b64)
#: "true": the message was sent as a batch of one (its receipt's batch index is 0, not -1);
#: a batch of more messages is known by its size, so only a batch of one carries it
BATCHED = "pulsar.batched"


def to_rows(metadata: api.MessageMetadata, payload: bytes, *, sequence_id: int,
            schema_version: int | None = None) -> pa.RecordBatch:
    """The messages of one SEND as a batch of PRODUCE_SCHEMA: key, value, event time and
    properties in tierstream's columns; the sequence id, the client's publish time, a null
    value, an ordering key and a base64 key in ``pulsar.*`` properties; the schema version
    in ``tierstream.schema.version``.

    A batch is a chain of size-prefixed protobufs, so in general it takes a Python step per
    message; a batch of plain messages alike in size (``alike.py``: what a client sends for
    messages of one size without properties) is split column-wise. Everything else is built
    column-wise: the properties of messages that carry nothing of their own beside the
    broker's (the common case) as one map array."""
    data = _uncompressed(metadata, payload)
    if not metadata.HasField("num_messages_in_batch"):
        messages = _Messages()
        messages.add(metadata, data, sequence_id, metadata.event_time)
    else:
        count = metadata.num_messages_in_batch
        alike = split_alike(count, data, metadata.event_time)
        messages = _Messages.of(alike) if alike is not None \
            else _split_batch(count, data, sequence_id, metadata.event_time)
    shared = [(PUBLISH_TIME, str(metadata.publish_time))]
    if metadata.HasField("num_messages_in_batch") and len(messages.values) == 1:
        shared.append((BATCHED, "true"))
    if metadata.HasField("deliver_at_time"):  # delayed delivery: a SEND's messages share it
        shared.append((DELIVER_AT, str(metadata.deliver_at_time)))
    if schema_version is not None:
        shared.append((VERSION_PROPERTY, str(schema_version)))
    n = len(messages.values)
    if messages.own:  # some message has properties or flags of its own: message by message
        properties = pa.array(
            [(messages.own.get(i) or []) + [(SEQUENCE_ID, str(seq))] + shared
             for i, seq in enumerate(messages.sequence_ids)], _PROPERTIES)
    else:
        properties = properties_column(messages.sequence_ids, SEQUENCE_ID, shared)
    events = messages.events
    return pa.RecordBatch.from_arrays([
        messages.keys if isinstance(messages.keys, pa.Array)
        else pa.array(messages.keys, pa.string()) if messages.keys else nulls(n, pa.string()),
        messages.values if isinstance(messages.values, pa.Array)
        else pa.array(messages.values, pa.binary()),
        nulls(n, pa.int64()),
        events if isinstance(events, pa.Array)
        else pa.array(events, pa.int64()) if any(events) else nulls(n, pa.int64()),
        properties], schema=PRODUCE_SCHEMA)


_PROPERTIES = PRODUCE_SCHEMA.field("properties").type


class _Messages:
    """The columns of a SEND's messages, filled one message at a time."""

    def __init__(self) -> None:
        # list[str | None], empty where no message has a key, or a string array
        self.keys: Any = []
        self.values: Any = []  # list[bytes], or a binary array (``alike.py``)
        self.events: Any = []  # list[int | None], or an int64 array (``alike.py``)
        self.sequence_ids: Any = []  # list[int], or a uint64 array
        self.own: dict[int, list[tuple[str, str]]] = {}  # message -> its own properties

    @classmethod
    def of(cls, alike: Alike) -> _Messages:
        messages = cls()
        messages.keys = [] if alike.keys is None else alike.keys
        messages.values, messages.events = alike.values, alike.events
        messages.sequence_ids = alike.sequence_ids
        return messages

    def add(self, single: Any, value: bytes, sequence_id: int, event_time: int) -> None:
        """One message (a SingleMessageMetadata, or the MessageMetadata of a lone one)."""
        i = len(self.values)
        self.sequence_ids.append(single.sequence_id if single.HasField("sequence_id")
                                 else sequence_id)
        self.keys.append(single.partition_key if single.HasField("partition_key")
                         and not single.null_partition_key else None)
        self.values.append(b"" if single.null_value else value)
        self.events.append(single.event_time or event_time or None)
        own = [(p.key, p.value) for p in single.properties]
        if single.null_value:
            own.append((NULL_VALUE, "true"))
        if single.HasField("ordering_key"):
            own.append((ORDERING_KEY, base64.b64encode(single.ordering_key).decode()))
        if single.partition_key_b64_encoded:
            own.append((KEY_BASE64, "true"))
        if own:
            self.own[i] = own


def _split_batch(count: int, data: bytes, sequence_id: int, event_time: int) -> _Messages:
    """A batch's messages: the plain ones (a payload size, a sequence id and perhaps a key,
    nothing else: what clients send for a message without properties) are taken on a short
    path."""
    messages = _Messages()
    parse = api.SingleMessageMetadata.FromString
    keys, values, events, ids = (messages.keys, messages.values, messages.events,
                                 messages.sequence_ids)
    event = event_time or None
    at, end = 0, len(data)
    for i in range(count):
        if at + 4 > end:
            raise ProtocolError("truncated batch: a message's metadata size is missing")
        size = int.from_bytes(data[at:at + 4], "big")
        raw = data[at + 4:at + 4 + size]
        try:
            single = parse(raw)
        except Exception as exc:
            raise ProtocolError(f"undecodable message metadata in a batch: {exc}") from None
        at += 4 + size
        n = single.payload_size
        value = data[at:at + n]
        if len(value) != n:
            raise ProtocolError("truncated batch: a message is shorter than its size")
        at += n
        # a plain message's metadata is payload_size and sequence_id, one tag byte and a
        # varint each, and perhaps first a key under 128 bytes (its tag, its length, its
        # bytes): if that is all its bytes hold, it has nothing else
        seq = single.sequence_id
        plain = 2 + (n.bit_length() + 6) // 7 + ((seq.bit_length() + 6) // 7 or 1)
        if n and single.HasField("sequence_id") and (
                size == plain or (raw[0] == 0x12 and raw[1] < 128 and size == plain + 2 + raw[1])):
            keys.append(single.partition_key if size != plain else None)
            values.append(value)
            events.append(event)
            ids.append(seq)
        else:
            messages.add(single, value, sequence_id + i, event_time)
    return messages


def _uncompressed(metadata: api.MessageMetadata, payload: bytes) -> bytes:
    kind = metadata.compression
    if kind == api.NONE:
        return payload
    size = metadata.uncompressed_size
    if size > 64 * 1024 * 1024:
        raise ConfigError(f"uncompressed size {size} is over the 64 MiB a message may have")
    try:
        if kind == api.ZLIB:
            out = zlib.decompress(payload)
        elif kind in _CODECS:
            out = pa.Codec(_CODECS[kind]).decompress(payload, decompressed_size=size)
            out = out.to_pybytes() if isinstance(out, pa.Buffer) else bytes(out)
        else:
            raise ConfigError(f"unknown compression type {kind}")
    except (ConfigError, ProtocolError):
        raise
    except Exception as exc:
        raise ProtocolError(f"cannot decompress the payload "
                            f"({api.CompressionType.Name(kind)}): {exc}") from None
    if len(out) != size:
        raise ProtocolError(f"payload decompressed to {len(out)} bytes, the metadata says "
                            f"{size}")
    return out


def metadata_of(key: str | None, publish_time: int, event_time: int | None,
              properties: list[tuple[str, str]] | None) -> api.MessageMetadata:
    """A stored message's Pulsar metadata: what tierstream's columns and the ``pulsar.*``
    properties (``messages.py``) keep."""
    meta = api.MessageMetadata(producer_name="tierstream", sequence_id=0,
                               publish_time=publish_time)
    for k, v in _fill(meta, key, event_time, properties):
        if k == VERSION_PROPERTY:
            meta.schema_version = schema_version_bytes(int(v))
        elif k == DELIVER_AT:
            meta.deliver_at_time = int(v)
        # the client's publish time (the message's is the log's) and BATCHED: not sent
    return meta


def _fill(meta: Any, key: str | None, event_time: int | None,
          properties: Any) -> list[tuple[str, str]]:
    """Set on ``meta`` — a MessageMetadata or a batch's SingleMessageMetadata — what both keep
    of one message: its key, event time, sequence id, null value, ordering key and its own
    properties. The properties a batch's messages share (``BATCH_PROPERTIES``) are
    returned, for the caller."""
    if key is not None:
        meta.partition_key = key
    if event_time:
        meta.event_time = event_time
    shared = []
    for k, v in properties or []:
        if k == SEQUENCE_ID:
            meta.sequence_id = int(v)
        elif k == NULL_VALUE:
            meta.null_value = v == "true"
        elif k == ORDERING_KEY:
            meta.ordering_key = base64.b64decode(v)
        elif k == KEY_BASE64:
            meta.partition_key_b64_encoded = v == "true"
        elif k in BATCH_PROPERTIES:
            shared.append((k, v))
        else:
            meta.properties.add(key=k, value=v)
    return shared

#: what a batch's messages share, kept in the batch's metadata rather than each message's
BATCH_PROPERTIES = frozenset({VERSION_PROPERTY, DELIVER_AT, PUBLISH_TIME, BATCHED})
_SHARED = BATCH_PROPERTIES


def batch_of(keys: list[str | None], values: list[bytes], event_times: list[int | None],
             properties: list[list[tuple[str, str]] | None], publish_time: int
             ) -> tuple[api.MessageMetadata, bytes] | None:
    """Stored messages of one entry as the batch a Pulsar client unpacks: the batch's
    metadata and payload (per message a size-prefixed ``SingleMessageMetadata`` and its
    bytes). None where the messages disagree on what a batch's metadata holds for all of them
    (schema version, delivery time): they go out one by one."""
    shared = {k: v for k, v in properties[0] or [] if k in _SHARED}
    meta = metadata_of(None, publish_time, None, list(shared.items()))
    meta.num_messages_in_batch = len(values)
    if properties.count(None) == len(properties):  # none has properties: no loop in Python
        meta.sequence_id = 0
        return meta, _plain_payload(keys, values, event_times)
    parts: list[bytes] = []
    cache: dict[Any, bytes] = {}
    sequence = None
    for key, value, event, props in zip(keys, values, event_times, properties, strict=True):
        own = tuple(p for p in props or [] if p[0] not in _SHARED)
        if {k: v for k, v in props or [] if k in _SHARED} != shared:
            return None
        head = cache.get((key, event, own, len(value)))
        if head is None:
            head = cache[(key, event, own, len(value))] = _head(key, event, own, len(value))
        if sequence is None:
            sequence = _sequence_of(own)
        parts += (head, value)
    meta.sequence_id = sequence or 0
    return meta, b"".join(parts)


def plain_batch(values: pa.Array, publish_time: int) -> tuple[api.MessageMetadata, bytes] | None:
    """:func:`batch_of` for messages without keys, event times or properties, all of one
    size, from their value column (binary, no nulls) with no step per message: each message's
    size prefix and metadata are the same bytes, laid before each value by numpy. None where
    the values differ in size (or are empty): :func:`batch_of` makes those."""
    n = len(values)
    offsets = np.frombuffer(values.buffers()[1], np.int32, n + 1, values.offset * 4)
    size = int(offsets[1] - offsets[0]) if n else 0
    if size == 0 or int(offsets[-1] - offsets[0]) != n * size or \
            (np.diff(offsets) != size).any():
        return None
    head = np.frombuffer(_plain_head(size), np.uint8)
    data = np.frombuffer(values.buffers()[2], np.uint8, n * size, int(offsets[0]))
    out = np.empty((n, len(head) + size), np.uint8)
    out[:, :len(head)] = head
    out[:, len(head):] = data.reshape(n, size)
    meta = metadata_of(None, publish_time, None, [])
    meta.num_messages_in_batch = n
    meta.sequence_id = 0
    return meta, out.tobytes()


@functools.lru_cache(maxsize=64)
def _plain_head(size: int) -> bytes:
    return _head(None, None, (), size)


def _plain_payload(keys: list[str | None], values: list[bytes],
                   event_times: list[int | None]) -> bytes:
    """A batch's payload of messages without properties: each message's size prefix and
    ``SingleMessageMetadata`` made once per distinct (key, event time, size), then the
    prefixes and values joined in one call."""
    sizes = list(map(len, values))
    if keys.count(None) == len(keys) and event_times.count(None) == len(event_times):
        # unkeyed, no event times: a message's metadata is its size alone
        by_size = {size: _head(None, None, (), size) for size in set(sizes)}
        if len(by_size) == 1:  # all of one size: the same prefix before each value
            head = by_size[sizes[0]]
            return head + head.join(values)
        heads = list(map(by_size.__getitem__, sizes))
    else:
        shapes = list(zip(keys, event_times, sizes, strict=True))
        by_shape = {(k, e, size): _head(k, e, (), size) for k, e, size in set(shapes)}
        heads = list(map(by_shape.__getitem__, shapes))
    return b"".join(itertools.chain.from_iterable(zip(heads, values, strict=True)))


def _head(key: str | None, event_time: int | None, own: tuple[tuple[str, str], ...],
          size: int) -> bytes:
    """What goes before a batched message's value: its ``SingleMessageMetadata``, prefixed
    with its size."""
    single: bytes = _single(key, event_time, own, size).SerializeToString()
    return len(single).to_bytes(4, "big") + single


def _sequence_of(own: tuple[tuple[str, str], ...]) -> int | None:
    return next((int(v) for k, v in own if k == SEQUENCE_ID), None)


def _single(key: str | None, event_time: int | None, own: tuple[tuple[str, str], ...],
            size: int) -> api.SingleMessageMetadata:
    """One message's metadata in a batch: what ``metadata_of`` keeps for a message alone."""
    single = api.SingleMessageMetadata(payload_size=size)
    _fill(single, key, event_time, own)
    return single


def chunks_of(meta: api.MessageMetadata, value: bytes, uuid: str, limit: int
              ) -> list[tuple[bytes, bytes]] | None:
    """A message whose metadata and value would make a frame over ``limit`` bytes, as the
    chunks a Pulsar client puts together (``uuid``, ``chunk_id`` of ``num_chunks_from_msg``,
    ``total_chunk_msg_size``): per chunk its serialized metadata and its bytes. None for a
    message that fits one frame."""
    room = limit - meta.ByteSize() - 1024  # the command, the chunk fields, the frame's head
    if len(value) <= room:
        return None
    count = -(-len(value) // room)
    chunked = api.MessageMetadata()
    chunked.CopyFrom(meta)
    chunked.uuid, chunked.num_chunks_from_msg = uuid, count
    chunked.total_chunk_msg_size = len(value)
    out = []
    for i in range(count):
        chunked.chunk_id = i
        out.append((chunked.SerializeToString(), value[i * room:(i + 1) * room]))
    return out
