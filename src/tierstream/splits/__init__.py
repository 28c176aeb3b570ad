"""Units of work and the coordinates they are made of."""

from tierstream.splits.positions import KeyRange, Offset, OffsetKind, Position

__all__ = ["KeyRange", "Offset", "OffsetKind", "Position"]
