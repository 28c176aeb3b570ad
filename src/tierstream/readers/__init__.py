"""Turning one split into Arrow record batches (executor side, data only).

:func:`open_reader` picks the reader the split names; every reader trims to the split's exact
bounds (positions, publish time, key range) and yields batches of
:data:`~tierstream.model.message_format.READ_SCHEMA`, with memory bounded by a few entries or
row groups.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from tierstream.readers.stats import BROKER, ReadStats, counted
from tierstream.splits.split import ReaderKind, Split
from tierstream.util.fanin import Cancel

__all__ = ["ReadStats", "open_reader"]


def open_reader(split: Split, *, auth_token: str | None = None, cancel: Cancel | None = None,
                reconnect_timeout_ms: int | None = None, tls_ca: bytes | None = None,
                stats: ReadStats | None = None,
                tier_cache: tuple[str | None, int | None] | None = None
                ) -> Iterator[pa.RecordBatch]:
    """Batches of ``split``, read from where its data lives (see DESIGN.md §3) by the path
    that fits this host (readers/bookie_log.py), counted in ``stats`` per reader and path.
    Setting ``cancel`` interrupts a read that waits on the broker (a following tail split); a
    tail split rides out a broker restart for up to ``reconnect_timeout_ms``. A remote tier
    file is read through this host's tier cache; ``tier_cache`` (directory, size) overrides
    its settings (tier/cache.py)."""
    if split.reader is ReaderKind.BOOKIE:
        from tierstream.readers.bookie_log import read_bookie_split

        return read_bookie_split(split, auth_token=auth_token, tls_ca=tls_ca, stats=stats)
    if split.reader is ReaderKind.TIER:
        from tierstream.readers.parquet_tier import read_tier_split

        return read_tier_split(split, auth_token=auth_token, tls_ca=tls_ca, stats=stats,
                               cache=tier_cache)
    from tierstream.readers.tail import read_tail_split

    return counted(read_tail_split(split, auth_token=auth_token, cancel=cancel,
                                   reconnect_timeout_ms=reconnect_timeout_ms, tls_ca=tls_ca),
                   stats, ReaderKind.TAIL.value, BROKER)
