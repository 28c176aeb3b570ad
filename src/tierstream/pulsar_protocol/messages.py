"""A SEND's payload as tierstream rows: one message, or a batch (``num_messages_in_batch``:
per message a ``SingleMessageMetadata`` and its bytes), decompressed with pyarrow's codecs
(Pulsar's LZ4 is the raw block format, ZLIB zlib's, ZSTD and SNAPPY their own)."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import pyarrow as pa

from tierstream.errors import ConfigError, ProtocolError
from tierstream.message_format import PRODUCE_SCHEMA
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.schemas.model import VERSION_PROPERTY

__all__ = ["KEY_BASE64", "NULL_VALUE", "ORDERING_KEY", "PUBLISH_TIME", "SEQUENCE_ID",
           "refused_feature", "to_rows"]

_CODECS = {api.LZ4: "lz4_raw", api.ZSTD: "zstd", api.SNAPPY: "snappy"}


def refused_feature(send: api.CommandSend, metadata: api.MessageMetadata) -> str | None:
    """The feature a SEND uses that tierstream does not take over this protocol, by name."""
    if send.txnid_most_bits or send.txnid_least_bits or metadata.HasField("txnid_most_bits"):
        return "transactions (txnid on SEND)"
    if send.is_chunk or metadata.HasField("num_chunks_from_msg"):
        return "chunked messages"
    if metadata.HasField("encryption_algo") or metadata.HasField("encryption_param"):
        return "encryption"
    if metadata.HasField("deliver_at_time"):
        return "delayed delivery (deliver_at_time)"
    if send.marker or metadata.HasField("marker_type"):
        return "marker messages"
    return None


#: message properties that keep what a Pulsar message has and tierstream's columns do not
SEQUENCE_ID = "pulsar.sequence_id"  # the producer's sequence id of the message
PUBLISH_TIME = "pulsar.publish_time"  # the client's publish time (ms); the column is the broker's
NULL_VALUE = "pulsar.null_value"  # "true": the value was null (stored as empty bytes)
ORDERING_KEY = "pulsar.ordering_key"  # the message's ordering key, base64
KEY_BASE64 = "pulsar.key_base64"  # "true": the key is base64 of bytes (partition_key_b64)


def to_rows(metadata: api.MessageMetadata, payload: bytes, *, sequence_id: int,
            schema_version: int | None = None) -> pa.RecordBatch:
    """The messages of one SEND as a batch of PRODUCE_SCHEMA: key, value, event time and
    properties in tierstream's columns; the sequence id, the client's publish time, a null
    value, an ordering key and a base64 key in ``pulsar.*`` properties; the schema version
    in ``tierstream.schema.version``."""
    data = _uncompressed(metadata, payload)
    shared = [(PUBLISH_TIME, str(metadata.publish_time))]
    if schema_version is not None:
        shared.append((VERSION_PROPERTY, str(schema_version)))
    keys: list[str | None] = []
    values: list[bytes] = []
    events: list[int | None] = []
    props: list[list[tuple[str, str]]] = []
    if not metadata.HasField("num_messages_in_batch"):
        singles: Any = [(metadata, data)]
    else:
        singles = _split_batch(metadata.num_messages_in_batch, data)
    for i, (single, value) in enumerate(singles):
        keys.append(None if single.null_partition_key or not single.HasField("partition_key")
                    else single.partition_key)
        values.append(b"" if single.null_value else value)
        events.append(single.event_time or metadata.event_time or None)
        seq = single.sequence_id if single.HasField("sequence_id") else sequence_id + i
        own = [(p.key, p.value) for p in single.properties]
        own.append((SEQUENCE_ID, str(seq)))
        if single.null_value:
            own.append((NULL_VALUE, "true"))
        if single.HasField("ordering_key"):
            own.append((ORDERING_KEY, base64.b64encode(single.ordering_key).decode()))
        if single.partition_key_b64_encoded:
            own.append((KEY_BASE64, "true"))
        props.append(own + shared)
    return pa.RecordBatch.from_pydict({"key": keys, "value": values,
                                       "publish_time": [None] * len(keys),
                                       "event_time": events, "properties": props},
                                      schema=PRODUCE_SCHEMA)


def _split_batch(count: int, data: bytes) -> list[tuple[api.SingleMessageMetadata, bytes]]:
    out = []
    at = 0
    for _ in range(count):
        if at + 4 > len(data):
            raise ProtocolError("truncated batch: a message's metadata size is missing")
        (size,) = struct.unpack_from(">I", data, at)
        single = api.SingleMessageMetadata()
        try:
            single.ParseFromString(data[at + 4:at + 4 + size])
        except Exception as exc:
            raise ProtocolError(f"undecodable message metadata in a batch: {exc}") from None
        at += 4 + size
        value = data[at:at + single.payload_size]
        if len(value) != single.payload_size:
            raise ProtocolError("truncated batch: a message is shorter than its size")
        at += single.payload_size
        out.append((single, value))
    return out


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
