"""The entry an append stores: a producer's rows stamped with publish times that never go
backwards within the partition, with their key hashes and positions (MESSAGE_SCHEMA).

A batch is small (a producer's thousand messages), so what it costs is the number of calls
into pyarrow or numpy, not their work: a ``pyarrow.compute`` call through its Python wrapper
costs ~40 us whatever its size, which three per entry made a fifth of an append. A batch
whose publish times the producer left to the broker (every producer does unless it replays
history) is stamped with one constant column instead.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tierstream.model.message_format import MESSAGE_SCHEMA, PRODUCE_SCHEMA, key_hashes

__all__ = ["ENTRY_PUBLISH_TIME", "PRODUCE_PUBLISH_TIME", "build_entry"]

#: where the publish times are in a produced batch and in an entry (columns by position:
#: see build_entry)
PRODUCE_PUBLISH_TIME = PRODUCE_SCHEMA.get_field_index("publish_time")
ENTRY_PUBLISH_TIME = MESSAGE_SCHEMA.get_field_index("publish_time")


def build_entry(batch: pa.RecordBatch, *, partition: int, segment_id: int, entry_id: int,
                now: int, floor: int, columns: list[pa.Array] | None = None
                ) -> tuple[pa.RecordBatch, int, int]:
    """``batch`` (PRODUCE_SCHEMA, in its order; ``columns``: its columns if the caller has
    them) as entry ``entry_id`` of segment ``segment_id``: its rows with publish times (as
    requested, ``now`` where not, never below ``floor`` nor below the row before), and the
    first and last of them."""
    n = batch.num_rows
    # by position, all at once: a column asked for by name costs an exception inside
    # pyarrow (its index is tried as an integer first), ~8,000 instructions a time
    key, value, requested, event_time, properties = batch.columns if columns is None \
        else columns
    if requested.null_count == n:  # stamped by the broker: one time for all
        first = last = max(now, floor)
        publish_time = _filled(first, n, _INT64)
    else:
        filled = pc.fill_null(requested, pa.scalar(now, pa.int64())).to_numpy()
        stamped = np.maximum.accumulate(np.maximum(filled, floor))
        publish_time = pa.array(stamped, pa.int64())
        first, last = int(stamped[0]), int(stamped[-1])
    columns = [
        key,
        key_hashes(key),
        value,
        publish_time,
        event_time,
        properties,
        _constant(partition, n, _INT32),
        _constant(segment_id, n, _INT64),
        _filled(entry_id, n, _INT64),
        _batch_indexes(n),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=MESSAGE_SCHEMA), first, last


#: the integer columns' types, and how one value of each is packed (little-endian: Arrow's)
_INT32, _INT64 = "int32", "int64"
_KINDS = {_INT32: (pa.int32(), struct.Struct("<i")), _INT64: (pa.int64(), struct.Struct("<q"))}


def _filled(value: int, n: int, kind: str) -> pa.Array:
    """``n`` times ``value``: its bytes repeated into a buffer. ``pa.repeat`` copies the value
    element by element (a tenth of an append, under callgrind), and numpy's fill wrapped by
    ``pa.array`` costs 28,000 instructions a column where this costs 8,000."""
    type_, packed = _KINDS[kind]
    return pa.Array.from_buffers(type_, n, [None, pa.py_buffer(packed.pack(value) * n)])


@functools.lru_cache(maxsize=64)
def _constant(value: int, n: int, kind: str) -> pa.Array:
    """:func:`_filled` for what repeats from entry to entry (the partition, the segment)."""
    return _filled(value, n, kind)


@functools.lru_cache(maxsize=8)
def _batch_indexes(n: int) -> pa.Array:
    """0..n-1, the batch index of an entry's messages (kept: entries repeat sizes)."""
    return pa.array(np.arange(n, dtype=np.int32))
