"""The entry an append stores: publish times never go backwards, whoever set them; and the
ack a producer gets for it."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tierstream.broker.flight.produce_stream import ack_bytes
from tierstream.managed_ledger.entries import build_entry
from tierstream.managed_ledger.open_segment import Ack
from tierstream.model.message_format import as_produce_batch
from tierstream.wire.flight import PROTOCOL_VERSION, encode


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


@pytest.mark.parametrize("ack", [
    Ack(0, 5, 7, 1000, 1, 2, 9),
    Ack(3, None, None, 0, 0, 0, 12, duplicate=True),
    Ack(1, 2, 3, 4, 5, 6, None, restamped=3),
    Ack(0, 2**40, 3, 4, 2**62, 2**62 + 1, 2**63 - 1)])
def test_an_ack_goes_out_as_the_json_the_encoder_makes(ack: Ack) -> None:
    """The produce stream formats its acks itself (the JSON encoder was a tenth of its ack
    thread): the bytes must stay what a client decodes."""
    assert ack_bytes(ack) == encode(ack.to_dict())
    assert json.loads(ack_bytes(ack)) == {"v": PROTOCOL_VERSION, **ack.to_dict()}
