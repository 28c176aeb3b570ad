"""Units of work and the coordinates they are made of."""

from tierstream.splits.positions import KeyRange, Offset, OffsetKind, Position
from tierstream.splits.split import (
    SPLIT_FORMAT_VERSION,
    ReaderKind,
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
    "Split",
    "StreamCut",
    "TierLocation",
]
