"""The properties column of a SEND's messages, built from buffers: per message its sequence id
(``pulsar.sequence_id``) and then what the SEND's messages share (the client's publish time,
a schema version, a delivery time).

A map array per message is otherwise built by a take over the keys and over the values
(four Arrow calls, each a pass over every entry, each a GIL hand-over in the broker); here the
keys and the entries' offsets depend only on the batch's shape, so they are made once per
shape and kept, and the values are one byte matrix — a row per message: its id's digits, then
the shared values — when every id has the same number of digits (ids of a batch are
consecutive, so they cross a power of ten at most once in a great while), its digits written
four at a time from a table rather than by Arrow's cast (a builder step per id)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from tierstream.model.message_format import PRODUCE_SCHEMA

__all__ = ["properties_column"]

_PROPERTIES = PRODUCE_SCHEMA.field("properties").type


def properties_column(ids: np.ndarray | Sequence[int], first: str,
                      shared: Sequence[tuple[str, str]]) -> pa.Array:
    """A map array of ``len(ids)`` messages: each has ``(first, its id)`` and then ``shared``,
    in that order."""
    n = len(ids)
    ids = np.asarray(ids, dtype=np.uint64)
    names = (first, *(k for k, _ in shared))
    keys, map_offsets = _keys(n, names)
    digits = len(str(int(ids.max()))) if n else 0
    if n and len(str(int(ids.min()))) == digits:  # every id as many digits as the largest
        tail = "".join(v for _, v in shared).encode()
        item_offsets = _item_offsets(n, digits, tuple(len(v.encode()) for _, v in shared))
        items = pa.Array.from_buffers(pa.string(), n * len(names), [
            None, item_offsets, pa.py_buffer(_rows_of(ids, digits, tail))])
    else:  # taken from one array of the shared values followed by the ids
        width = len(names)
        at = np.empty(n * width, dtype=np.int64)
        at[0::width] = np.arange(width - 1, width - 1 + n)
        for j in range(1, width):
            at[j::width] = j - 1
        texts = pa.array(ids, pa.uint64()).cast(pa.string())
        items = pa.concat_arrays([pa.array([v for _, v in shared], pa.string()), texts]
                                 ).take(pa.array(at))
    return pa.MapArray.from_arrays(map_offsets, keys, items, type=_PROPERTIES)


def _rows_of(ids: np.ndarray, digits: int, tail: bytes) -> np.ndarray:
    """A row per id: its ``digits`` decimal digits, then ``tail``. Written four digits at a
    time from a table (a uint32 of four ASCII digits each), a numpy operation over every id
    per four digits."""
    chunks = (digits + 3) // 4
    top = digits - 4 * (chunks - 1)  # the first chunk's digits, 1 to 4
    # the tail is in every row from the start (a repeat of bytes: one copy, doubling)
    rows = np.frombuffer(bytearray((b"0" * digits + tail) * len(ids)), dtype=np.dtype({
        "names": ["top", *(f"c{k}" for k in range(chunks - 1))],
        "formats": [f"V{top}", *["<u4"] * (chunks - 1)],
        "offsets": [0, *(top + 4 * k for k in range(chunks - 1))],
        "itemsize": digits + len(tail)}))
    rest = ids
    for k in reversed(range(chunks - 1)):  # from the least significant four
        rest, four = np.divmod(rest, 10_000)
        rows[f"c{k}"] = np.take(_digit_table(4), four)
    rows["top"] = np.take(_digit_table(top), rest)
    return rows


@functools.lru_cache(maxsize=4)
def _digit_table(width: int) -> np.ndarray:
    """The ASCII of 0 .. 10**width - 1, ``width`` digits each (with leading zeros): as
    uint32 for 4, else as byte strings of ``width``."""
    text = "".join(f"{i:0{width}d}" for i in range(10 ** width)).encode()
    return np.frombuffer(text, "<u4" if width == 4 else f"V{width}")


#: made for a power of two of messages (at least this many), and cut to a batch's: a Pulsar
#: client's batches, cut by its batching timer, differ in size from one SEND to the next,
#: and made for each size these were a tenth of its SEND's cost. (A cut keeps the buffers
#: whole: what counts a batch's buffers sees at most twice its keys.)
_MADE_FOR = 16


def _keys(n: int, names: tuple[str, ...]) -> tuple[pa.Array, pa.Array]:
    """What every batch of ``n`` messages with properties ``names`` shares: its keys
    (``names``, n times) and each message's first entry."""
    keys, offsets = _keys_made(_capacity(n), names)
    return keys.slice(0, n * len(names)), offsets.slice(0, n + 1)


@functools.lru_cache(maxsize=32)
def _keys_made(n: int, names: tuple[str, ...]) -> tuple[pa.Array, pa.Array]:
    width = len(names)
    encoded = [name.encode() for name in names]
    blob = b"".join(encoded)
    keys = pa.Array.from_buffers(pa.string(), n * width, [
        None, pa.py_buffer(_offsets(n, len(blob), [len(b) for b in encoded])),
        pa.py_buffer(blob * n)])
    return keys, pa.array(np.arange(0, n * width + 1, width, dtype=np.int32))


def _item_offsets(n: int, digits: int, lengths: tuple[int, ...]) -> pa.Buffer:
    """The offsets of the values of ``n`` messages in a matrix of rows ``digits +
    sum(lengths)`` wide: an id of ``digits``, then shared values of ``lengths``."""
    made = _item_offsets_made(_capacity(n), digits, lengths)
    return made.slice(0, (n * (1 + len(lengths)) + 1) * 4)


@functools.lru_cache(maxsize=32)
def _item_offsets_made(n: int, digits: int, lengths: tuple[int, ...]) -> pa.Buffer:
    return pa.py_buffer(_offsets(n, digits + sum(lengths), [digits, *lengths]))


def _capacity(n: int) -> int:
    """The size made for ``n`` messages: the next power of two, at least _MADE_FOR."""
    return max(_MADE_FOR, 1 << max(0, n - 1).bit_length())


def _offsets(n: int, row: int, lengths: list[int]) -> np.ndarray:
    """The start of each of ``len(lengths)`` strings in each of ``n`` rows ``row`` bytes wide,
    and the end: string offsets."""
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int32)
    out = np.empty(n * len(lengths) + 1, dtype=np.int32)
    out[:-1] = (np.arange(n, dtype=np.int32)[:, None] * row + starts).ravel()
    out[-1] = n * row
    return out
