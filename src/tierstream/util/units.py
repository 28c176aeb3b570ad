"""Sizes as people read them: one formatting for the CLI and the read-path counts."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.0 GiB``..."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)
