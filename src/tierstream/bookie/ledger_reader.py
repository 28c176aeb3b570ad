"""Reads of one bookie's closed or open ledger file: verified single frames over one fd."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord, ledger_paths, read_frame
from tierstream.errors import CorruptionError, NotFoundError

__all__ = ["LedgerReader"]


class LedgerReader:
    """An open ledger file of one bookie: verified reads of single frames, one fd."""

    def __init__(self, root: Path, bookie_id: str, segment_id: int, *,
                 on_corrupt: Callable[[], None] = lambda: None) -> None:
        self.bookie_id = bookie_id
        self.segment_id = segment_id
        self._on_corrupt = on_corrupt  # the bookie counts its checksum failures
        log_path, _ = ledger_paths(root, segment_id)
        try:
            self._fd = os.open(log_path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFoundError(
                f"ledger {segment_id} is missing on bookie {bookie_id}"
            ) from None

    def read(self, rec: IndexRecord) -> pa.Buffer:
        try:
            return read_frame(self._fd, self.segment_id, rec, f"bookie {self.bookie_id}")
        except CorruptionError:
            self._on_corrupt()
            raise

    def close(self) -> None:
        os.close(self._fd)
