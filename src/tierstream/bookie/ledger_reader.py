"""Reads of one bookie's closed or open ledger file: verified single frames over the
descriptor the bookie's :class:`~tierstream.bookie.open_files.LedgerFiles` shares."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord, ledger_paths, read_frame
from tierstream.bookie.open_files import LedgerFiles
from tierstream.errors import CorruptionError, NotFoundError

__all__ = ["LedgerReader"]


class LedgerReader:
    """An open ledger file of one bookie: verified reads of single frames."""

    def __init__(self, files: LedgerFiles, root: Path, bookie_id: str, segment_id: int, *,
                 on_corrupt: Callable[[], None] = lambda: None) -> None:
        self.bookie_id = bookie_id
        self.segment_id = segment_id
        self._on_corrupt = on_corrupt  # the bookie counts its checksum failures
        self._files = files
        log_path, _ = ledger_paths(root, segment_id)
        try:
            self._handle, self._fd = files.acquire(log_path)
        except NotFoundError:
            raise NotFoundError(
                f"ledger {segment_id} is missing on bookie {bookie_id}"
            ) from None
        self._closed = False

    def read(self, rec: IndexRecord) -> pa.Buffer:
        try:
            return read_frame(self._fd, self.segment_id, rec, f"bookie {self.bookie_id}")
        except CorruptionError:
            self._on_corrupt()
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._files.release(self._handle)
