"""The one place that knows how a data directory of the embedded store is laid out::

    <data dir>/
        metadata.db          SQLite metadata (WAL): topics, segments, cursors, de-dup state
        store.lock           held by the one broker that writes here
        bookies/<id>/        a bookie's ledgers (see bookie/storage.py for the files inside)
        tier/                the default tier: offloaded segments as Parquet
        catalog.db           the default Iceberg SQL catalog of the tier's tables
        transactions/<id>/   a transaction's staged data until it is applied or aborted

The broker's configuration, the planner and the CLI ask this module instead of joining paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DataDir"]


@dataclass(frozen=True)
class DataDir:
    """Paths inside one data directory (nothing is created or checked here)."""

    root: Path

    @classmethod
    def at(cls, path: str | Path) -> DataDir:
        return cls(Path(path))

    @property
    def metadata(self) -> Path:
        return self.root / "metadata.db"

    @property
    def lock(self) -> Path:
        return self.root / "store.lock"

    def bookie(self, bookie_id: str) -> Path:
        return self.root / "bookies" / bookie_id

    @property
    def transactions(self) -> Path:
        return self.root / "transactions"

    @property
    def tier(self) -> Path:
        return self.root / "tier"

    @property
    def catalog_uri(self) -> str:
        return f"sqlite:///{(self.root / 'catalog.db').resolve()}"
