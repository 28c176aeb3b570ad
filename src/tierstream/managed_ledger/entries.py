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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tierstream.model.message_format import MESSAGE_SCHEMA, key_hashes

__all__ = ["build_entry"]


def build_entry(batch: pa.RecordBatch, *, partition: int, segment_id: int, entry_id: int,
                now: int, floor: int) -> tuple[pa.RecordBatch, int, int]:
    """``batch`` (PRODUCE_SCHEMA) as entry ``entry_id`` of segment ``segment_id``: its rows
    with publish times (as requested, ``now`` where not, never below ``floor`` nor below the
    row before), and the first and last of them."""
    n = batch.num_rows
    requested = batch.column("publish_time")
    if requested.null_count == n:  # stamped by the broker: one time for all
        first = last = max(now, floor)
        publish_time = pa.repeat(pa.scalar(first, pa.int64()), n)
    else:
        filled = pc.fill_null(requested, pa.scalar(now, pa.int64())).to_numpy()
        stamped = np.maximum.accumulate(np.maximum(filled, floor))
        publish_time = pa.array(stamped, pa.int64())
        first, last = int(stamped[0]), int(stamped[-1])
    columns = [
        batch.column("key"),
        key_hashes(batch.column("key")),
        batch.column("value"),
        publish_time,
        batch.column("event_time"),
        batch.column("properties"),
        pa.repeat(pa.scalar(partition, pa.int32()), n),
        pa.repeat(pa.scalar(segment_id, pa.int64()), n),
        pa.repeat(pa.scalar(entry_id, pa.int64()), n),
        _batch_indexes(n),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=MESSAGE_SCHEMA), first, last


@functools.lru_cache(maxsize=8)
def _batch_indexes(n: int) -> pa.Array:
    """0..n-1, the batch index of an entry's messages (kept: entries repeat sizes)."""
    return pa.array(np.arange(n, dtype=np.int32))
