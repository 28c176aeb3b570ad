"""Turning a query into splits (driver side, metadata only)."""

from tierstream.enumerator.planner import Enumerator, Query

__all__ = ["Enumerator", "Query"]
