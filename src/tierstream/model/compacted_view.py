"""A compacted topic's view: the latest message of each key, as the compactor
(``broker/topics/compaction.py``) and a compacted read (``read(compacted=True)``) both fold
it — one rule, in one place."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["fold_latest"]


def fold_latest(rows: pa.Table) -> pa.Table:
    """The compacted view of ``rows`` (MESSAGE_SCHEMA columns, any order): per partition and
    key the row with the highest position, unless its value is empty; rows without a key
    left out; in partition and position order."""
    if rows.num_rows == 0:
        return rows
    order = pc.sort_indices(rows, sort_keys=[("partition", "ascending"),
                                             ("segment_id", "ascending"),
                                             ("entry_id", "ascending"),
                                             ("batch_index", "ascending")])
    rows = rows.take(order)
    keyed = rows.filter(pc.is_valid(rows.column("key")))
    if keyed.num_rows == 0:
        return keyed
    numbered = pa.table({"partition": keyed.column("partition"), "key": keyed.column("key"),
                         "n": pa.array(np.arange(keyed.num_rows, dtype=np.int64))})
    last = numbered.group_by(["partition", "key"], use_threads=False).aggregate([("n", "max")])
    winners = np.sort(last.column("n_max").to_numpy())
    latest = keyed.take(pa.array(winners))
    value = latest.column("value")
    live = pc.and_(pc.is_valid(value), pc.greater(pc.binary_length(value), 0))
    return latest.filter(live)
