"""Reading one ledger of a bookie on another host, as the broker's re-replication and reads
of a segment's copies do: verified frames fetched a window of bytes at a time, over the
bookie endpoint's raw byte-range call (``remote.py`` makes the calls)."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord, parse_frame
from tierstream.errors import CorruptionError

__all__ = ["READ_WINDOW", "RemoteLedgerReader"]

#: bytes a reader of a ledger fetches at a time
READ_WINDOW = 4 * 1024**2


class RemoteLedgerReader:
    """Verified frames of ledger ``segment_id`` on bookie ``bookie_id``, fetched a window of
    bytes at a time by ``byte_range(segment_id, offset, length)`` (consecutive entries are
    contiguous in the file); ``checksum_failed`` is told of each frame that fails its check."""

    def __init__(self, bookie_id: str, segment_id: int,
                 byte_range: Callable[[int, int, int], bytes],
                 checksum_failed: Callable[[], None]) -> None:
        self.bookie_id, self.segment_id = bookie_id, segment_id
        self._byte_range, self._checksum_failed = byte_range, checksum_failed
        self._start, self._data = 0, b""

    def raw(self, rec: IndexRecord) -> bytes:
        lo, hi = rec.frame_offset, rec.frame_offset + rec.frame_len
        if not (self._start <= lo and hi <= self._start + len(self._data)):
            self._start = lo
            self._data = self._byte_range(self.segment_id, lo, max(rec.frame_len, READ_WINDOW))
            if len(self._data) < rec.frame_len:
                raise CorruptionError(f"bookie {self.bookie_id}: ledger {self.segment_id} is "
                                      f"shorter than its index says (entry {rec.entry_id})")
        return self._data[lo - self._start:hi - self._start]

    def read(self, rec: IndexRecord) -> pa.Buffer:
        try:
            return parse_frame(memoryview(self.raw(rec)), self.segment_id, rec.entry_id,
                               f"bookie {self.bookie_id}")
        except CorruptionError:
            self._checksum_failed()
            raise

    def close(self) -> None:
        self._data = b""
