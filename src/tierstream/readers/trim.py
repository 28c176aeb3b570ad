"""Trimming a batch to a split's exact bounds: position range, publish time, key range."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tierstream.model.message_format import key_range_mask
from tierstream.model.positions import Position
from tierstream.splits.split import Split

__all__ = ["trim"]


def _at_or_after(batch: pa.RecordBatch | pa.Table, pos: Position) -> pa.Array:
    seg = batch.column("segment_id")
    ent = batch.column("entry_id")
    idx = batch.column("batch_index")
    same_seg = pc.equal(seg, pos.segment_id)
    same_entry = pc.and_(same_seg, pc.equal(ent, pos.entry_id))
    return pc.or_(pc.greater(seg, pos.segment_id),
                  pc.or_(pc.and_(same_seg, pc.greater(ent, pos.entry_id)),
                         pc.and_(same_entry, pc.greater_equal(idx, pos.batch_index))))


def trim(batch: pa.RecordBatch | pa.Table, split: Split, *, check_positions: bool = True,
         check_time: bool = True, check_keys: bool = True) -> pa.RecordBatch | pa.Table:
    """The rows of ``batch`` inside ``split``. Callers that know a check cannot fail skip it;
    a check that cannot fail here (no time bounds, every key) costs nothing either."""
    if check_keys and split.key_range.is_full:
        check_keys = False
    if check_time and split.start_time is None and split.end_time is None:
        check_time = False
    if not (check_positions or check_time or check_keys):
        return batch
    masks = []
    if check_positions:
        masks.append(_at_or_after(batch, split.start))
        if split.end is not None:
            masks.append(pc.invert(_at_or_after(batch, split.end)))
    if check_time:
        pt = batch.column("publish_time")
        if split.start_time is not None:
            masks.append(pc.greater_equal(pt, split.start_time))
        if split.end_time is not None:
            masks.append(pc.less(pt, split.end_time))
    if check_keys:
        keys = key_range_mask(batch.column("key_hash"),
                              [(split.key_range.lo, split.key_range.hi)])
        if keys is not None:
            masks.append(keys)
    if not masks:
        return batch
    mask = masks[0]
    for m in masks[1:]:
        mask = pc.and_(mask, m)
    return batch.filter(mask)
