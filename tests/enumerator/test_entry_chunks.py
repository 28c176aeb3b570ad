"""Cutting a closed segment into entry ranges of about maxSplitBytes."""

from __future__ import annotations

import itertools

from tierstream.enumerator.plan import entry_chunks as _entry_chunks
from tierstream.metadata.records import SegmentRecord
from tierstream.model.positions import Position


def _segment(entries: int, nbytes: int) -> SegmentRecord:
    return SegmentRecord(topic="a/b/c", partition=0, segment_id=7, state="CLOSED",
                         entries=entries, messages=entries * 10, bytes=nbytes,
                         min_publish_time=0, max_publish_time=1, created_at=0, sealed_at=1,
                         ensemble=("bookie-0",))


def _pos(entry: int, index: int = 0) -> Position:
    return Position(0, 7, entry, index)


def test_chunks_are_contiguous_and_cover_the_range_by_bytes() -> None:
    chunks = _entry_chunks(_segment(100, 100_000), _pos(0), _pos(100), 25_000)
    assert chunks == [(_pos(0), _pos(25)), (_pos(25), _pos(50)), (_pos(50), _pos(75)),
                      (_pos(75), _pos(100))]


def test_a_small_range_is_one_chunk_and_its_bounds_are_kept() -> None:
    assert _entry_chunks(_segment(100, 100_000), _pos(3, 4), _pos(9, 2), 1 << 30) == [
        (_pos(3, 4), _pos(9, 2))]


def test_mid_entry_bounds_stay_exact_at_both_ends() -> None:
    chunks = _entry_chunks(_segment(10, 10_000), _pos(2, 5), _pos(8, 3), 2_000)
    assert chunks[0][0] == _pos(2, 5) and chunks[-1][1] == _pos(8, 3)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert len(chunks) == 4  # entries 2..8 inclusive: ~7 KB at 2 KB a chunk


def test_never_more_chunks_than_entries() -> None:
    chunks = _entry_chunks(_segment(5, 5_000_000), _pos(0), _pos(5), 1)
    assert len(chunks) == 5
