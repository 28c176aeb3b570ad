import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstream.errors import ConfigError
from tierstream.model.positions import KeyRange, Offset, OffsetKind, Position
from tierstream.util.timeutil import parse_duration_ms, parse_time_ms


def test_positions_order_within_a_partition() -> None:
    assert Position(0, 1, 5, 3) < Position(0, 1, 6, 0) < Position(0, 2, 0, 0)
    assert Position.parse("0:12:345") == Position(0, 12, 345, 0)


@pytest.mark.parametrize("bad", ["", "1:2", "a:b:c", "1:2:3:4:5", "-1:2:3"])
def test_malformed_positions_are_rejected(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid position"):
        Position.parse(bad)


@pytest.mark.parametrize("bad", ["5:3", "0:0", "0:65537", "x:10", "10", "-1:5"])
def test_bad_key_ranges_are_rejected_naming_the_value(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid key range"):
        KeyRange.parse(bad)


@settings(deadline=None)  # k=65536 builds 65,536 ranges: slow on a busy machine, not wrong
@given(st.integers(min_value=1, max_value=65536))
def test_split_covers_every_slot_once(k: int) -> None:
    ranges = KeyRange.split(k)
    assert len(ranges) == k
    assert ranges[0].lo == 0 and ranges[-1].hi == 65536
    assert all(a.hi == b.lo for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("k", [0, 65537, -3])
def test_split_rejects_k_outside_range(k: int) -> None:
    with pytest.raises(ConfigError, match="key ranges"):
        KeyRange.split(k)


def test_offsets_parse_every_form_and_round_trip() -> None:
    cases = {
        "earliest": Offset.earliest(),
        "latest": Offset.latest(),
        "2026-11-01T00:00:00Z": Offset.at_time(1793491200000),
        "1793491200000": Offset.at_time(1793491200000),
        "1:2:3:4": Offset.at_position(Position(1, 2, 3, 4)),
    }
    for text, expected in cases.items():
        parsed = Offset.parse(text)
        assert parsed == expected
        assert Offset.from_dict(parsed.to_dict()) == parsed
    assert Offset.parse("2026-11-01T01:00:00+01:00").kind is OffsetKind.TIME


@pytest.mark.parametrize("bad", ["yesterday", "2026-13-01", "", "1.5"])
def test_bad_times_name_the_value(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        Offset.parse(bad, what="--from")
    assert repr(bad) in str(info.value)


def test_time_and_duration_parsing() -> None:
    assert parse_time_ms("2026-11-01T00:00:00") == 1793491200000
    assert parse_duration_ms("2h30m") == 9_000_000
    assert parse_duration_ms("500ms") == 500
    for bad in ["", "5 parsecs", "-1s", "h"]:
        with pytest.raises(ConfigError):
            parse_duration_ms(bad)
