"""Pulsar's binary frames: ``[total size][command size][BaseCommand]``, and for a command with a
payload (SEND, MESSAGE) after it an optional broker-entry-metadata block (magic ``0x0e02``),
the magic ``0x0e01``, a CRC32-C over what follows, the ``MessageMetadata`` and the payload.
Sizes are 4-byte big-endian; the magics 2 bytes."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

from tierstream.errors import ProtocolError
from tierstream.pulsar_protocol import pulsar_api_pb2 as api

__all__ = ["MAX_FRAME_SIZE", "MAX_MESSAGE_SIZE", "BadPayload", "Frame", "command_frame",
           "parse_frame", "payload_frame", "read_frame_size"]

#: what CONNECTED advertises as max_message_size (Pulsar's default, 5 MiB)
MAX_MESSAGE_SIZE = 5 * 1024 * 1024
#: a frame may carry that much payload plus its command and metadata
MAX_FRAME_SIZE = MAX_MESSAGE_SIZE + 10 * 1024

_CHECKSUM_MAGIC = 0x0E01
_ENTRY_METADATA_MAGIC = 0x0E02


class BadPayload(ProtocolError):
    """A frame whose command was read but whose payload was not (``command`` says whose)."""

    def __init__(self, message: str, command: api.BaseCommand) -> None:
        super().__init__(message)
        self.command = command


@dataclass
class Frame:
    command: api.BaseCommand
    metadata: api.MessageMetadata | None = None  # payload commands only
    payload: bytes = b""


def read_frame_size(header: bytes | bytearray | memoryview) -> int:
    """The size of the frame after its 4-byte size field."""
    (size,) = struct.unpack(">I", header)
    return int(size)


def parse_frame(body: bytes | bytearray | memoryview) -> Frame:
    """A frame from ``body`` (what follows its total size); ProtocolError for a malformed one,
    naming what is wrong (a bad checksum is refused, never taken). The payload is the one copy
    made of ``body``'s bytes (it may be a receive buffer)."""
    if len(body) < 4:
        raise ProtocolError(f"truncated frame: {len(body)} bytes")
    (cmd_size,) = struct.unpack_from(">I", body, 0)
    if cmd_size > len(body) - 4:
        raise ProtocolError(f"command size {cmd_size} exceeds the frame ({len(body)} bytes)")
    view = memoryview(body)
    command = api.BaseCommand()
    try:
        command.ParseFromString(view[4:4 + cmd_size])
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ProtocolError(f"undecodable command: {exc}") from None
    rest = view[4 + cmd_size:]
    if not rest:
        return Frame(command)
    try:
        return _with_payload(command, rest)
    except ProtocolError as exc:
        raise BadPayload(str(exc), command) from None


def _with_payload(command: api.BaseCommand, rest: memoryview) -> Frame:
    at = 0
    if len(rest) >= 2 and struct.unpack_from(">H", rest, 0)[0] == _ENTRY_METADATA_MAGIC:
        (size,) = struct.unpack_from(">I", rest, 2)
        at = 6 + size  # broker entry metadata: understood, and not needed here
    if len(rest) < at + 10 or struct.unpack_from(">H", rest, at)[0] != _CHECKSUM_MAGIC:
        raise ProtocolError("payload without the checksum magic 0x0e01")
    (checksum,) = struct.unpack_from(">I", rest, at + 2)
    checked = rest[at + 6:]
    if crc32c.crc32c(checked) != checksum:
        raise ProtocolError("checksum mismatch: the payload was damaged on the way")
    (meta_size,) = struct.unpack_from(">I", checked, 0)
    if meta_size > len(checked) - 4:
        raise ProtocolError(f"metadata size {meta_size} exceeds the payload")
    metadata = api.MessageMetadata()
    try:
        metadata.ParseFromString(checked[4:4 + meta_size])
    except Exception as exc:
        raise ProtocolError(f"undecodable message metadata: {exc}") from None
    return Frame(command, metadata, bytes(checked[4 + meta_size:]))


def command_frame(command: api.BaseCommand) -> bytes:
    """A frame of ``command`` alone."""
    data: bytes = command.SerializeToString()
    return struct.pack(">II", len(data) + 4, len(data)) + data


def payload_frame(command: api.BaseCommand, metadata: api.MessageMetadata,
                  payload: bytes) -> bytes:
    """A frame of ``command`` with a message: the checksum magic, CRC32-C, metadata, payload."""
    return serialized_payload_frame(command.SerializeToString(), metadata.SerializeToString(),
                                    payload)


def serialized_payload_frame(data: bytes, meta: bytes, payload: bytes) -> bytes:
    """:func:`payload_frame` of a command and metadata already serialized."""
    checked = struct.pack(">I", len(meta)) + meta + payload
    head = struct.pack(">I", len(data)) + data + struct.pack(">HI", _CHECKSUM_MAGIC,
                                                            crc32c.crc32c(checked))
    return struct.pack(">I", len(head) + len(checked)) + head + checked
