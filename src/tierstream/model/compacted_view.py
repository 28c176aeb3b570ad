"""A compacted topic's view: the latest message of each key, as the compactor
(``broker/topics/compaction.py``) and a compacted read (``read(compacted=True)``) both fold
it — one rule, in one place."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tierstream.model.positions import in_position_order

__all__ = ["fold_latest"]


def fold_latest(rows: pa.Table, *, in_order: bool = False) -> pa.Table:
    """The compacted view of ``rows`` (MESSAGE_SCHEMA columns, any order): per partition and
    key the row with the highest position, unless its value is empty; rows without a key
    left out; in partition and position order.

    Only the positions are ordered (not at all when they come in order: ``in_order`` says so
    of rows known to, as the compactor's snapshot-then-log are, else it is checked) and only
    the winners are taken: the rows, values and all, are never reordered whole."""
    n = rows.num_rows
    if n == 0:
        return rows
    p = rows.column("partition").to_numpy()
    one_partition = bool(p.min() == p.max())
    if in_order:
        columns = None
    else:
        columns = [p, *(rows.column(c).to_numpy() for c in
                        ("segment_id", "entry_id", "batch_index"))]
    if columns is None or in_position_order(*columns):
        rank = order = np.arange(n, dtype=np.int64)
    else:
        order = np.lexsort(columns[::-1])  # rank -> row
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n, dtype=np.int64)  # row -> rank
    by = ["key"] if one_partition else ["partition", "key"]  # (one column groups faster)
    numbered = pa.table({"partition": rows.column("partition"), "key": rows.column("key"),
                         "n": pa.array(rank)})
    last = numbered.group_by(by, use_threads=False).aggregate([("n", "max")])
    last = last.filter(pc.is_valid(last.column("key")))  # keyless rows have no view
    if last.num_rows == 0:
        return rows.schema.empty_table()
    latest = _take(rows, order[np.sort(last.column("n_max").to_numpy())])
    value = latest.column("value")
    live = pc.and_(pc.is_valid(value), pc.greater(pc.binary_length(value), 0))
    return latest.filter(live)


def _take(rows: pa.Table, idx: np.ndarray) -> pa.Table:
    """``rows.take(idx)``, chunk by chunk: a table read batch by batch has a chunk per
    batch, and one take across a thousand chunks costs more than the fold."""
    batches = rows.to_batches()
    if len(batches) <= 1:
        return rows.take(pa.array(idx))
    offsets = np.cumsum([0, *(len(batch) for batch in batches)])
    by_row = np.argsort(idx, kind="stable")
    rows_sorted = idx[by_row]
    chunk = np.searchsorted(offsets, rows_sorted, side="right") - 1
    bounds = np.flatnonzero(np.diff(chunk)) + 1
    parts = [batches[int(chunk[a])].take(pa.array(rows_sorted[a:z] - offsets[int(chunk[a])]))
             for a, z in zip([0, *bounds.tolist()], [*bounds.tolist(), len(idx)], strict=True)]
    taken = pa.Table.from_batches(parts, schema=rows.schema).combine_chunks()
    back = np.empty_like(by_row)
    back[by_row] = np.arange(len(idx))
    return taken.take(pa.array(back))
