"""The entry an append stores: publish times never go backwards, whoever set them."""

from __future__ import annotations

import pyarrow as pa

from tierstream.managed_ledger.entries import build_entry
from tierstream.model.message_format import as_produce_batch


def _times(requested: list[int | None], *, now: int, floor: int) -> tuple[list[int], int, int]:
    batch = as_produce_batch(pa.record_batch({
        "value": [b"v"] * len(requested), "publish_time": pa.array(requested, pa.int64())}))
    entry, first, last = build_entry(batch, partition=2, segment_id=5, entry_id=7, now=now,
                                     floor=floor)
    assert entry.column("entry_id").to_pylist() == [7] * len(requested)
    assert entry.column("batch_index").to_pylist() == list(range(len(requested)))
    return entry.column("publish_time").to_pylist(), first, last


def test_times_left_to_the_broker_are_now_or_the_partition_s_last_if_that_is_later() -> None:
    assert _times([None] * 3, now=100, floor=40) == ([100] * 3, 100, 100)
    assert _times([None] * 3, now=100, floor=130) == ([130] * 3, 130, 130)


def test_requested_times_are_kept_unless_they_would_go_back() -> None:
    # 50 is below the floor, 90 below the 120 before it: each is raised, never lowered
    assert _times([50, 120, None, 90, 200], now=110, floor=60) == (
        [60, 120, 120, 120, 200], 60, 200)
