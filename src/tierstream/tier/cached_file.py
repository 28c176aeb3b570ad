"""A remote tier file read through the host's cache (tier/cache.py), as pyarrow reads files.

:class:`CachedFile` is a seekable binary file over an object's blocks: a read takes the blocks
it spans from the cache, fetching the missing ones from the store at once (one ranged GET
each), and keeps the last few in memory, since pyarrow reads a footer, then column chunks,
often several from one block. It counts the bytes it served from the cache and from the store,
so that a read can say which path its rows took.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict

from tierstream.tier.cache import ObjectRef, Payload, TierCache

__all__ = ["CachedFile"]

#: Blocks a CachedFile keeps in memory (pyarrow's reads of a row group fall in one or two).
_KEEP = 2


class CachedFile(io.RawIOBase):
    """``obj`` read through ``cache``; thread-safe (pyarrow may read it from its I/O threads)."""

    def __init__(self, cache: TierCache, obj: ObjectRef) -> None:
        super().__init__()
        self.cache, self.obj = cache, obj
        self._pos = 0
        self._kept: OrderedDict[int, Payload] = OrderedDict()
        self._lock = threading.Lock()
        self.from_cache = 0  # bytes of blocks that were in the cache
        self.from_store = 0  # bytes of blocks fetched from the store

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self.obj.size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.obj.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes | memoryview:
        with self._lock:
            start = self._pos
            end = self.obj.size if size is None or size < 0 else min(self.obj.size, start + size)
            if end <= start:
                return b""
            data = self._range(start, end)
            self._pos = end
            return data

    def readall(self) -> bytes:
        return bytes(self.read(-1))

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        memoryview(buffer)[:len(data)] = data
        return len(data)

    def _range(self, start: int, end: int) -> bytes | memoryview:
        block = self.cache.block_size
        indexes = list(range(start // block, (end - 1) // block + 1))
        missing = [i for i in indexes if i not in self._kept]
        for i, (payload, hit) in zip(missing, self.cache.blocks(self.obj, missing),
                                     strict=True):
            if hit:
                self.from_cache += len(payload)
            else:
                self.from_store += len(payload)
            self._kept[i] = payload
        parts = []
        for i in indexes:
            self._kept.move_to_end(i)
            payload = self._kept[i]
            lo = max(start - i * block, 0)
            hi = min(end - i * block, len(payload))
            parts.append(payload if lo == 0 and hi == len(payload) else payload[lo:hi])
        while len(self._kept) > max(_KEEP, len(indexes)):
            self._kept.popitem(last=False)
        return parts[0] if len(parts) == 1 else b"".join(parts)
