"""A bookie directory of this broker's process (the embedded store's bookies), written
through :class:`~tierstream.managed_ledger.bookies.client.BookieClient` as a network bookie is:
the broker's calls go straight to the bookie's storage (``bookie/storage.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord, RecoveredLedger
from tierstream.bookie.ledger_reader import LedgerReader
from tierstream.bookie.storage import Bookie

__all__ = ["LocalBookie"]


class LocalBookie:
    """:class:`Bookie` ``storage`` as the managed ledger's client of it."""

    host = "local"

    def __init__(self, storage: Bookie) -> None:
        self.storage = storage
        self.bookie_id = storage.bookie_id

    def __repr__(self) -> str:
        return f"LocalBookie({self.storage!r})"

    @property
    def root(self) -> Path | None:
        return self.storage.root

    @property
    def checksum_failures(self) -> int:
        return self.storage.checksum_failures

    def is_available(self) -> bool:
        return True  # it is this process

    def state(self) -> dict[str, Any]:
        return {"where": str(self.storage.root), "host": self.host, "available": True,
                "read_files": self.storage.files.open, "read_files_limit": self.storage.files.limit}

    def write_under(self, epoch: int) -> None:
        pass  # one process writes this directory: its lock fences the others

    def create_ledger(self, segment_id: int) -> None:
        self.storage.create_ledger(segment_id)

    def append(self, segment_id: int, entry_id: int, meta: dict[str, Any], payload: pa.Buffer,
               messages: int, first_pt: int, last_pt: int) -> Future[IndexRecord]:
        return self.storage.append(segment_id, entry_id, meta, payload, messages, first_pt,
                                   last_pt)

    def flush(self) -> None:
        self.storage.flush()

    def seal_ledger(self, segment_id: int, last_entry_id: int | None) -> None:
        self.storage.seal_ledger(segment_id, last_entry_id)

    def discard_ledger(self, segment_id: int) -> None:
        self.storage.discard_ledger(segment_id)

    def delete_ledger(self, segment_id: int) -> None:
        self.storage.delete_ledger(segment_id)

    def index(self, segment_id: int) -> list[IndexRecord]:
        return self.storage.index(segment_id)

    def ledger_entries(self) -> dict[int, int]:
        return self.storage.ledger_entries()

    def recover_ledger(self, segment_id: int) -> RecoveredLedger:
        return self.storage.recover_ledger(segment_id)

    def read_raw_frames(self, segment_id: int, records: list[IndexRecord]
                        ) -> Iterator[tuple[IndexRecord, bytes]]:
        for rec in records:
            yield rec, self.storage.read_raw_frame(segment_id, rec)

    def rewrite_ledger(self, segment_id: int, frames: list[tuple[IndexRecord, bytes]]
                       ) -> None:
        self.storage.rewrite_ledger(segment_id, frames)

    def open_reader(self, segment_id: int) -> LedgerReader:
        return self.storage.open_reader(segment_id)

    def close(self) -> None:
        self.storage.close()
