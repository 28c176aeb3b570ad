"""The entry an append stores: publish times never go backwards, whoever set them; and the
ack a producer gets for it."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tierstream.broker.flight.produce_stream import ack_bytes
from tierstream.errors import ConfigError
from tierstream.managed_ledger.entries import build_entry
from tierstream.managed_ledger.open_segment import Ack
from tierstream.model.message_format import (
    DELIVER_AT,
    MESSAGE_SCHEMA,
    PRODUCE_SCHEMA,
    as_produce_batch,
    as_produce_columns,
    may_have_property,
)
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


@pytest.mark.parametrize("partition,segment_id,entry_id", [
    (0, 1, 0), (2**31 - 1, 2**40 + 3, 2**62), (7, 5, 2**31)])
@pytest.mark.parametrize("with_columns", [False, True])
def test_an_entry_s_constant_columns_hold_their_values_in_the_message_schema(
        partition: int, segment_id: int, entry_id: int, with_columns: bool) -> None:
    """The partition, segment and entry columns are made from their values' bytes (numpy's
    fill cost three times as much): each row holds the value, wide values too, and the entry
    is the message schema whether the caller passed the batch's columns or not."""
    batch, columns = as_produce_columns(pa.record_batch({
        "key": ["a", None, "b"], "value": [b"x", b"", b"z"]}))
    entry, first, last = build_entry(batch, partition=partition, segment_id=segment_id,
                                     entry_id=entry_id, now=1_000, floor=0,
                                     columns=columns if with_columns else None)
    entry.validate(full=True)
    assert entry.schema.equals(MESSAGE_SCHEMA, check_metadata=True)
    assert entry.column("partition").to_pylist() == [partition] * 3
    assert entry.column("segment_id").to_pylist() == [segment_id] * 3
    assert entry.column("entry_id").to_pylist() == [entry_id] * 3
    assert entry.column("publish_time").to_pylist() == [1_000] * 3 and first == last == 1_000
    assert entry.column("key").to_pylist() == ["a", None, "b"]


def test_a_not_null_column_with_nulls_is_refused_on_either_path() -> None:
    batch = pa.record_batch([pa.array([b"x", None], pa.binary())], names=["value"])
    for conform in (as_produce_batch, as_produce_columns):
        with pytest.raises(ConfigError, match="'value' has nulls"):
            conform(batch)
    conformed = as_produce_batch(pa.record_batch({"value": [b"x", b"y"]}))
    with_nulls = pa.RecordBatch.from_arrays(  # the schema says not null, the column has one
        [conformed.column(0), pa.array([b"x", None], pa.binary()), *conformed.columns[2:]],
        schema=conformed.schema)
    for conform in (as_produce_batch, as_produce_columns):
        with pytest.raises(ConfigError, match="'value' has nulls"):
            conform(with_nulls)


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


@pytest.mark.parametrize(("rows", "expected"), [
    ([[("a", "1")], None, [("tierstream.deliver_at", "5")]], True),
    ([[("a", "1")], [("tierstream.deliver_atx", "5")]], True),  # its bytes: looked through
    ([[("a", "1")], [], None], False),
    ([None, None], False),
    ([], False),
])
def test_a_batch_without_a_property_is_told_without_a_lookup_per_message(
        rows: list, expected: bool) -> None:
    """``may_have_property`` is never False where a message has the property (a lookup
    follows where it is True), and False where no key holds its bytes."""
    properties = pa.array(rows, PRODUCE_SCHEMA.field("properties").type)
    assert may_have_property(properties, DELIVER_AT) is expected
