"""Sizes as people read them: one formatting for the CLI and the read-path counts."""

from __future__ import annotations

from typing import Any

__all__ = ["cache_bytes", "human_bytes", "parse_bytes"]


def parse_bytes(raw: Any) -> int:
    """``1048576``, ``64KiB``, ``128MiB``, ``1GiB`` (also KB/MB/GB as powers of 1000); a
    positive size, else ValueError."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    else:
        text = str(raw).strip()
        units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2,
                 "gb": 1000**3, "b": 1}
        for suffix, mult in units.items():
            if text.lower().endswith(suffix):
                value = int(float(text[: -len(suffix)]) * mult)
                break
        else:
            value = int(text)
    if value < 1:
        raise ValueError("expected a positive size such as 1048576, 64KiB or 128MiB")
    return value


def cache_bytes(raw: Any) -> int:
    """A cache's size: ``0``/``off`` (none) or a size as :func:`parse_bytes` reads it."""
    if str(raw).strip().lower() in ("0", "off"):
        return 0
    return parse_bytes(raw)


def human_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.0 GiB``..."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)
