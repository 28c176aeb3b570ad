"""Typed values: per-topic schemas with versions and compatibility (model.py, compat.py),
and what producers and readers do with them (codec.py)."""

from tierstream.schemas.model import Compatibility, SchemaInfo, SchemaType

__all__ = ["Compatibility", "SchemaInfo", "SchemaType"]
