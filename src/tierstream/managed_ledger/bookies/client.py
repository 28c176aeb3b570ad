"""What the managed ledger asks of a bookie, wherever it is: one interface that a bookie
directory of this process (``local.py``) and a network bookie (``remote.py``) both implement,
so that placement, recovery, reads and re-replication never ask which kind they hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord, RecoveredLedger

__all__ = ["BookieClient", "EntryReader"]


class EntryReader(Protocol):
    """Verified entries of one ledger, read by their index records."""

    def read(self, rec: IndexRecord) -> pa.Buffer: ...

    def close(self) -> None: ...


class BookieClient(Protocol):
    """A bookie as the broker writes, seals, recovers, reads and deletes ledgers on it."""

    bookie_id: str
    #: its host: a segment's copies go to distinct hosts ("local" for a directory here)
    host: str

    @property
    def root(self) -> Path | None:
        """Its directory when it is one of this process (served to readers), else None."""
        ...

    @property
    def checksum_failures(self) -> int:
        """Frames read from it that failed their checksum."""
        ...

    def is_available(self) -> bool:
        """Whether it takes writes now (one taken for gone is asked again)."""
        ...

    def state(self) -> dict[str, Any]:
        """What ``broker stats`` says of it."""
        ...

    def write_under(self, epoch: int) -> None:
        """Fence, recover, seal and delete under the writer ``epoch`` from now on (a bookie
        of this process checks no epoch: the data directory's lock is its fence)."""
        ...

    def create_ledger(self, segment_id: int) -> None: ...

    def append(self, segment_id: int, entry_id: int, meta: dict[str, Any], payload: pa.Buffer,
               messages: int, first_pt: int, last_pt: int) -> Future[IndexRecord]:
        """Queue an entry; the future completes once it is on the bookie's disk."""
        ...

    def flush(self) -> None: ...

    def seal_ledger(self, segment_id: int, last_entry_id: int | None) -> None: ...

    def discard_ledger(self, segment_id: int) -> None: ...

    def delete_ledger(self, segment_id: int) -> None: ...

    def index(self, segment_id: int) -> list[IndexRecord]: ...

    def ledger_entries(self) -> dict[int, int]:
        """Every ledger it holds, with the entries its index has."""
        ...

    def recover_ledger(self, segment_id: int) -> RecoveredLedger:
        """Fence the ledger against older writers and read what the bookie has of it."""
        ...

    def read_raw_frames(self, segment_id: int, records: list[IndexRecord]
                        ) -> Iterable[tuple[IndexRecord, bytes]]:
        """The stored frames of ``records`` as they are (recovery and re-replication copy
        them to other bookies)."""
        ...

    def rewrite_ledger(self, segment_id: int, frames: list[tuple[IndexRecord, bytes]]
                       ) -> None: ...

    def open_reader(self, segment_id: int) -> EntryReader: ...

    def close(self) -> None: ...
