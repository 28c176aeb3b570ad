"""The source framework's units of work: a split is one reader's share of a read (a segment,
its bounds, its key range, where its data lives), planned by ``enumerator`` and read by
``readers``; the coordinates splits are made of (positions, offsets, key ranges) are
``model/positions.py``, re-exported here."""

from tierstream.model.positions import KeyRange, Offset, OffsetKind, Position
from tierstream.splits.split import (
    SPLIT_FORMAT_VERSION,
    ReaderKind,
    Replica,
    Split,
    StreamCut,
    TierLocation,
)

__all__ = [
    "SPLIT_FORMAT_VERSION",
    "KeyRange",
    "Offset",
    "OffsetKind",
    "Position",
    "ReaderKind",
    "Replica",
    "Split",
    "StreamCut",
    "TierLocation",
]
