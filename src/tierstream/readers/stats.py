"""Which way each read went: rows and bytes per reader and per path.

A reader takes the path that fits where it runs (see ``readers/__init__.py``): a bookie-log
split reads local ledger files, else a bookie endpoint, else, only when the segment left the
bookies, the broker. Counting each path makes a fallback visible instead of silent.
``tierstream read`` and ``tierstream backfill`` print the counts; on Spark they travel back
from the executors in an accumulator (``spark_adapter.source.StatsParam``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from tierstream.util.units import human_bytes

__all__ = ["BROKER", "BROKER_FALLBACK", "ENDPOINT", "LOCAL", "OBJECT_STORE", "TIER_CACHE",
           "ReadStats", "counted"]

LOCAL = "local file"
ENDPOINT = "bookie endpoint"
BROKER = "broker"
BROKER_FALLBACK = "broker fallback"
OBJECT_STORE = "object store"
#: a remote tier file's bytes all from this host's tier cache (tier/cache.py)
TIER_CACHE = "tier cache"


class ReadStats:
    """Rows and bytes (Arrow bytes of the rows delivered) per (reader, path). Thread-safe;
    picklable as plain data."""

    def __init__(self, counts: dict[tuple[str, str], tuple[int, int]] | None = None) -> None:
        self._counts: dict[tuple[str, str], list[int]] = {
            k: list(v) for k, v in (counts or {}).items()}
        self._lock = threading.Lock()

    def add(self, reader: str, path: str, rows: int, nbytes: int) -> None:
        with self._lock:
            slot = self._counts.setdefault((reader, path), [0, 0])
            slot[0] += rows
            slot[1] += nbytes

    def merge(self, other: ReadStats) -> ReadStats:
        for (reader, path), (rows, nbytes) in other.items():
            self.add(reader, path, rows, nbytes)
        return self

    def items(self) -> list[tuple[tuple[str, str], tuple[int, int]]]:
        with self._lock:
            return sorted((k, (v[0], v[1])) for k, v in self._counts.items())

    def rows(self, reader: str | None = None, path: str | None = None) -> int:
        return sum(r for (k, p), (r, _) in self.items()
                   if (reader is None or k == reader) and (path is None or p == path))

    def to_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (reader, path), (rows, nbytes) in self.items():
            out.setdefault(reader, {})[path] = {"rows": rows, "bytes": nbytes}
        return out

    def summary(self) -> str:
        """``bookie-log via bookie endpoint: 1,200 rows, 96.0 KiB; ...``, or ``nothing read``."""
        parts = [f"{reader} via {path}: {rows:,} rows, {human_bytes(nbytes)}"
                 for (reader, path), (rows, nbytes) in self.items()]
        return "; ".join(parts) or "nothing read"

    def __reduce__(self) -> Any:
        return (ReadStats, ({k: (v[0], v[1]) for k, v in self._counts.items()},))

    def __repr__(self) -> str:
        return f"ReadStats({self.summary()})"


def counted(batches: Iterable[pa.RecordBatch], stats: ReadStats | None, reader: str, path: str
            ) -> Iterator[pa.RecordBatch]:
    """``batches``, each counted under (reader, path) as it is delivered."""
    for batch in batches:
        if stats is not None:
            stats.add(reader, path, batch.num_rows, batch.nbytes)
        yield batch
