"""Configuration of the embedded store, built from the option table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstream.errors import ConfigError
from tierstream.options import parse_options

__all__ = ["StoreConfig"]


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Everything the embedded store needs to open. Keyword-only; see ``options.py``."""

    data_dir: Path
    bookies: int = 1
    write_quorum: int = 1
    ack_quorum: int = 1
    max_entries_per_segment: int = 50_000
    max_segment_bytes: int = 256 * 1024**2
    segment_rollover_ms: int = 4 * 3_600_000
    fsync: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.write_quorum <= self.bookies:
            raise ConfigError(
                f"invalid writeQuorum {self.write_quorum}: must be between 1 and the number of "
                f"bookies ({self.bookies})"
            )
        if not 1 <= self.ack_quorum <= self.write_quorum:
            raise ConfigError(
                f"invalid ackQuorum {self.ack_quorum}: must be between 1 and writeQuorum "
                f"({self.write_quorum})"
            )

    @classmethod
    def from_options(cls, raw: Mapping[str, Any] | None = None, **overrides: Any) -> StoreConfig:
        """Parse ``raw`` (option keys such as ``maxEntriesPerSegment``) through ``options.py``."""
        opts = parse_options({k: v for k, v in (raw or {}).items() if v is not None},
                             scope="store")
        bookies = opts["bookies"]
        write_quorum = opts["writeQuorum"] or bookies
        ack_quorum = opts["ackQuorum"] or (write_quorum // 2 + 1)
        values: dict[str, Any] = dict(
            data_dir=Path(opts["dataDir"]),
            bookies=bookies,
            write_quorum=write_quorum,
            ack_quorum=ack_quorum,
            max_entries_per_segment=opts["maxEntriesPerSegment"],
            max_segment_bytes=opts["maxSegmentBytes"],
            segment_rollover_ms=opts["segmentRolloverTime"],
            fsync=opts["fsync"],
        )
        values.update(overrides)
        return cls(**values)

    @property
    def metadata_path(self) -> Path:
        return self.data_dir / "metadata.db"

    def bookie_dir(self, bookie_id: str) -> Path:
        return self.data_dir / "bookies" / bookie_id
