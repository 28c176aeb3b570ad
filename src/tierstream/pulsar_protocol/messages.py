"""A SEND's payload as tierstream rows: one message, or a batch (``num_messages_in_batch``:
per message a ``SingleMessageMetadata`` and its bytes), decompressed with pyarrow's codecs
(Pulsar's LZ4 is the raw block format, ZLIB zlib's, ZSTD and SNAPPY their own)."""

from __future__ import annotations

import struct
import zlib

import pyarrow as pa

from tierstream.errors import ConfigError, ProtocolError
from tierstream.message_format import PRODUCE_SCHEMA
from tierstream.pulsar_protocol import pulsar_api_pb2 as api

__all__ = ["refused_feature", "to_rows"]

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


def to_rows(metadata: api.MessageMetadata, payload: bytes) -> pa.RecordBatch:
    """The messages of one SEND as a batch of PRODUCE_SCHEMA."""
    data = _uncompressed(metadata, payload)
    keys: list[str | None] = []
    values: list[bytes] = []
    events: list[int | None] = []
    props: list[list[tuple[str, str]] | None] = []
    if not metadata.HasField("num_messages_in_batch"):
        keys.append(_key(metadata.partition_key, metadata.null_partition_key,
                         metadata.HasField("partition_key")))
        values.append(b"" if metadata.null_value else data)
        events.append(metadata.event_time or None)
        props.append([(p.key, p.value) for p in metadata.properties] or None)
    else:
        at = 0
        for _ in range(metadata.num_messages_in_batch):
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
            keys.append(_key(single.partition_key, single.null_partition_key,
                             single.HasField("partition_key")))
            values.append(b"" if single.null_value else value)
            events.append(single.event_time or metadata.event_time or None)
            props.append([(p.key, p.value) for p in single.properties] or None)
    return pa.RecordBatch.from_pydict({"key": keys, "value": values,
                                       "publish_time": [None] * len(keys),
                                       "event_time": events, "properties": props},
                                      schema=PRODUCE_SCHEMA)


def _key(key: str, null: bool, given: bool) -> str | None:
    return None if null or not given else key


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
