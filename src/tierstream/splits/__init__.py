"""Units of work and the coordinates they are made of."""

from tierstream.splits.positions import KeyRange, Offset, OffsetKind, Position
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
