"""The properties column of a SEND's messages, built from buffers: per message its sequence id
(``pulsar.sequence_id``) and then what the SEND's messages share (the client's publish time,
a schema version, a delivery time).

A map array per message is otherwise built by a take over the keys and over the values
(four Arrow calls, each a pass over every entry, each a GIL hand-over in the broker); here the
keys and the entries' offsets depend only on the batch's shape, so they are made once per
shape and kept, and the values are one byte matrix — a row per message: its id's digits, then
the shared values — when every id has the same number of digits (ids of a batch are
consecutive, so they cross a power of ten at most once in a great while)."""

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
    texts = pa.array(ids, pa.uint64()).cast(pa.string())
    names = (first, *(k for k, _ in shared))
    if n:
        spans = np.frombuffer(texts.buffers()[1], np.int32, n + 1)
        digits = int(spans[1] - spans[0])
        if int(spans[-1]) == n * digits and _uniform(ids, digits):
            tail = "".join(v for _, v in shared).encode()
            keys, item_offsets, map_offsets = _layout(
                n, digits, names, tuple(len(v.encode()) for _, v in shared))
            values = np.empty((n, digits + len(tail)), dtype=np.uint8)
            values[:, :digits] = np.frombuffer(texts.buffers()[2], np.uint8,
                                               n * digits).reshape(n, digits)
            values[:, digits:] = np.frombuffer(tail, np.uint8)
            items = pa.Array.from_buffers(pa.string(), n * len(names),
                                          [None, item_offsets, pa.py_buffer(values)])
            return pa.MapArray.from_arrays(map_offsets, keys, items, type=_PROPERTIES)
    return _taken(texts, names, [v for _, v in shared])


def _uniform(ids: np.ndarray | Sequence[int], digits: int) -> bool:
    """Every id has ``digits`` digits (the first one has)."""
    lo, hi = (int(ids.min()), int(ids.max())) if isinstance(ids, np.ndarray) \
        else (min(ids), max(ids))
    return bool((digits == 1 or lo >= 10 ** (digits - 1)) and hi < 10 ** digits)


@functools.lru_cache(maxsize=32)
def _layout(n: int, digits: int, names: tuple[str, ...], lengths: tuple[int, ...]
            ) -> tuple[pa.Array, pa.Buffer, pa.Array]:
    """What a batch of ``n`` messages of one shape shares: its keys (``names``, n times), the
    offsets of its values in a matrix of rows ``digits + sum(lengths)`` wide, and each
    message's first entry."""
    width = len(names)
    encoded = [name.encode() for name in names]
    blob = b"".join(encoded)
    keys = pa.Array.from_buffers(pa.string(), n * width, [
        None, pa.py_buffer(_offsets(n, len(blob), [len(b) for b in encoded])),
        pa.py_buffer(blob * n)])
    item_offsets = _offsets(n, digits + sum(lengths), [digits, *lengths])
    map_offsets = pa.array(np.arange(0, n * width + 1, width, dtype=np.int32))
    return keys, pa.py_buffer(item_offsets), map_offsets


def _offsets(n: int, row: int, lengths: list[int]) -> np.ndarray:
    """The start of each of ``len(lengths)`` strings in each of ``n`` rows ``row`` bytes wide,
    and the end: string offsets."""
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int32)
    out = np.empty(n * len(lengths) + 1, dtype=np.int32)
    out[:-1] = (np.arange(n, dtype=np.int32)[:, None] * row + starts).ravel()
    out[-1] = n * row
    return out


def _taken(texts: pa.Array, names: tuple[str, ...], values: list[str]) -> pa.Array:
    """:func:`properties_column` for ids of different lengths: the entries taken from one
    array of the shared values followed by the ids."""
    n, width = len(texts), len(names)
    items = pa.concat_arrays([pa.array(values, pa.string()), texts])
    at = np.empty(n * width, dtype=np.int64)
    at[0::width] = np.arange(width - 1, width - 1 + n)
    for j in range(1, width):
        at[j::width] = j - 1
    return pa.MapArray.from_arrays(
        pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)),
        pa.array(names, pa.string()).take(pa.array(np.tile(np.arange(width), n))),
        items.take(pa.array(at)), type=_PROPERTIES)
