"""A batch of plain messages alike in size, split column-wise.

A Pulsar batch is a chain of ``[4-byte size][SingleMessageMetadata][payload]``. What a client
sends for messages without properties is plain — a payload size, a sequence id and perhaps a
key, nothing else — and when every message's metadata and payload have one size, the batch is
a table of ``count`` rows of one width: its columns are read at once, by numpy over the
payload's bytes, with no Python step per message (``split_alike``). A producer's sequence ids
cross a varint length (128, 16,384, ...) in one batch now and then: that batch is two such
tables, the second a byte wider.

Each field is read as one strided array — an unaligned little-endian integer per row, or a
fixed-size byte string per row — so each check and each column is one numpy operation over
``count`` elements, never a row at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tierstream.model.message_format import nulls

__all__ = ["Alike", "split_alike"]

_KEY_TAG, _SIZE_TAG, _SEQUENCE_TAG = 0x12, 0x18, 0x40  # fields 2, 3 and 8, their wire types
_NOT_BASE64 = b"\x30\x00"  # partition_key_b64_encoded false: Java's clients set it with a key


@dataclass
class Alike:
    """The columns of an alike batch."""

    keys: pa.Array | None  # None: no message has a key
    values: pa.Array
    events: pa.Array
    sequence_ids: np.ndarray  # uint64


def split_alike(count: int, data: bytes, event_time: int) -> Alike | None:
    """The batch's columns if it is one table of plain messages alike in size, or two whose
    second is a byte wider (its ids crossed a varint length); None where it is not (keys of
    different lengths, properties, a null value, ...: taken message by message)."""
    if count < 2:  # a message alone is parsed more cheaply than split
        return None
    whole = _table(count, data, event_time)
    if whole is not None:
        return whole
    width = _width(data)
    first = count * (width + 1) - len(data)  # messages of the first width
    if not 0 < first < count:
        return None
    cut = len(data) - (count - first) * (width + 1)
    head = _table(first, data[:cut], event_time)
    tail = _table(count - first, data[cut:], event_time) if head is not None else None
    if head is None or tail is None or (head.keys is None) != (tail.keys is None):
        return None
    return Alike(None if head.keys is None else pa.concat_arrays([head.keys, tail.keys]),
                 pa.concat_arrays([head.values, tail.values]),
                 pa.concat_arrays([head.events, tail.events]),
                 np.concatenate([head.sequence_ids, tail.sequence_ids]))


def _width(data: bytes) -> int:
    """The first message's width (size field, metadata, payload); 0 if it is not plain."""
    if len(data) < 6:
        return 0
    end = 4 + int.from_bytes(data[:4], "big")
    return end + _payload_size(data, min(end, len(data)))[0]


def _table(count: int, data: bytes, event_time: int) -> Alike | None:
    if count < 1 or len(data) < 6:
        return None
    end = 4 + int.from_bytes(data[:4], "big")  # of the first message's metadata
    keyed = data[4] == _KEY_TAG and data[5] < 0x80
    key_size = data[5] if keyed else 0
    size, at = _payload_size(data, min(end, len(data)))
    if data[at:at + 2] == _NOT_BASE64:
        at += 2
    width = end + size
    digits = end - at - 1  # the sequence id's varint bytes
    if not size or width * count != len(data) or not 1 <= digits <= 8 \
            or data[at] != _SEQUENCE_TAG:
        return None
    rows = _Rows(data, count, width)
    # every message's sizes, key tag and length, payload size, flag and id tag as the first's
    fixed = [(0, 6), (6 + key_size, at + 1)] if keyed else [(0, at + 1)]
    if not all(rows.same(lo, hi) for lo, hi in fixed):
        return None
    varints = rows.integers(at + 1, digits)
    more = int.from_bytes(b"\x80" * (digits - 1) + b"\x00", "little")  # continuation bits
    if not ((varints & _each_byte(0x80, digits)) == more).all():
        return None
    ids = varints & np.uint64(0x7F)
    for j in range(1, digits):  # byte j's 7 bits, shifted down by j to bits 7j.. 7j + 6
        ids |= (varints >> np.uint64(j)) & np.uint64(0x7F << (7 * j))
    keys = None
    if keyed:
        keys = pa.Array.from_buffers(pa.string(), count, [
            None, _offsets(count, key_size), pa.py_buffer(rows.strings(6, key_size))])
        try:
            keys.validate(full=True)  # UTF-8, as a protobuf string is
        except pa.ArrowInvalid:
            return None  # taken message by message, and refused there
    values = pa.Array.from_buffers(pa.binary(), count, [
        None, _offsets(count, size), pa.py_buffer(rows.strings(end, size))])
    events = pa.repeat(pa.scalar(event_time, pa.int64()), count) if event_time \
        else nulls(count, pa.int64())
    return Alike(keys, values, events, ids)


class _Rows:
    """``data`` as ``count`` rows of ``width`` bytes, read a field at a time."""

    def __init__(self, data: bytes, count: int, width: int) -> None:
        self.data, self.count, self.width = data, count, width

    def integers(self, at: int, size: int) -> np.ndarray:
        """Bytes ``at:at + size`` (at most 8) of each row as a little-endian uint64."""
        if at + 8 <= self.width:  # read 8, keep ``size``
            return self._u64(at) & np.uint64(_each_byte(0xFF, size))
        if at + size >= 8:  # near the row's end: read the 8 that end there, drop the first
            return self._u64(at + size - 8) >> np.uint64(8 * (8 - size))
        out = np.zeros(self.count, dtype=np.uint64)  # a row under 8 bytes: byte by byte
        for j in range(size):
            out |= self._u8(at + j).astype(np.uint64) << np.uint64(8 * j)
        return out

    def same(self, lo: int, hi: int) -> bool:
        """Whether bytes ``lo:hi`` of every row are those of the first."""
        for at in range(lo, hi, 8):
            field = self.integers(at, min(8, hi - at))
            if not (field == field[0]).all():
                return False
        return True

    def strings(self, at: int, size: int) -> bytes:
        """Bytes ``at:at + size`` of every row, one after another."""
        return np.ndarray((self.count,), dtype=f"V{size}", buffer=self.data, offset=at,
                          strides=(self.width,)).tobytes()

    def _u64(self, at: int) -> np.ndarray:
        return np.ndarray((self.count,), dtype="<u8", buffer=self.data, offset=at,
                          strides=(self.width,))

    def _u8(self, at: int) -> np.ndarray:
        return np.ndarray((self.count,), dtype=np.uint8, buffer=self.data, offset=at,
                          strides=(self.width,))


def _each_byte(byte: int, size: int) -> int:
    return int.from_bytes(bytes([byte]) * size, "little")


def _payload_size(data: bytes, end: int) -> tuple[int, int]:
    """The payload size (field 3) of the plain message metadata at ``data[4:end]`` (after
    perhaps a key under 128 bytes: its varint) and where its varint ends; 0 where it is not
    there."""
    at = 4
    if at + 2 <= end and data[at] == _KEY_TAG and data[at + 1] < 0x80:
        at += 2 + data[at + 1]
    if at >= end or data[at] != _SIZE_TAG:
        return 0, at
    size, at = 0, at + 1
    for shift in range(0, 35, 7):
        if at >= end:
            return 0, at
        byte = data[at]
        size |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return size, at
    return 0, at


@functools.lru_cache(maxsize=16)
def _offsets(count: int, size: int) -> pa.Buffer:
    """The offsets of ``count`` values (or keys) of ``size`` bytes each (kept: batches repeat
    shapes)."""
    return pa.py_buffer(np.arange(0, size * (count + 1), size, dtype=np.int32))
