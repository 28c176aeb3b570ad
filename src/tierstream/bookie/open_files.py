"""The ledger files a bookie has open for reading: one descriptor per file, shared by every
read of it, and at most ``limit`` kept open once no read uses them.

Each consumer's dispatcher, each broker read stream and each remote reader used to open a
ledger file of its own: a thousand subscriptions reading the same segment held a thousand
descriptors, and a broker with the usual limit of 1,024 open files failed with "Too many
open files". BookKeeper bounds its open ledger files (``openFileLimit``), RocksDB its SST
files (``max_open_files``); so does this. Reads use ``pread``, so one descriptor serves any
number of them at once. A file is known by its inode: a ledger rewritten whole (repair
replaces the file) gets a new descriptor, and one deleted (retention) is closed as soon as
no read uses it, so that its space is freed.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierstream.errors import NotFoundError, StorageError
from tierstream.util.mapped import open_files_hint

__all__ = ["LedgerFiles"]


@dataclass
class _File:
    fd: int
    users: int = 0


class LedgerFiles:
    """Open ledger files for reading, by (path, inode); see the module's docstring."""

    def __init__(self, limit: int) -> None:
        #: files kept open: as configured, but never more than a quarter of what the process
        #: may open (a broker limited to 256 must not keep 512)
        self.limit = min(limit, max(8, _process_limit() // 4))
        self._lock = threading.Lock()
        #: every file open, least recently let go first (a file in use is never closed)
        self._files: OrderedDict[tuple[str, int], _File] = OrderedDict()

    @property
    def open(self) -> int:
        """Descriptors held now (in use or kept for the next read)."""
        with self._lock:
            return len(self._files)

    def acquire(self, path: Path) -> tuple[tuple[str, int], int]:
        """(a handle for :meth:`release`, the descriptor). NotFoundError if there is no such
        file; StorageError naming the limit if the process may open no more files."""
        try:
            key = (str(path), os.stat(path).st_ino)
        except FileNotFoundError:
            raise NotFoundError(f"no ledger file {path}") from None
        with self._lock:
            found = self._files.get(key)
            if found is not None:
                found.users += 1
                self._files.move_to_end(key)
                return key, found.fd
        fd = self._open(path)
        with self._lock:
            found = self._files.get(key)
            if found is not None:  # another read opened it meanwhile: share that one
                os.close(fd)
                found.users += 1
                return key, found.fd
            self._files[key] = _File(fd, users=1)
            self._close_unused(lambda k: k[0] == key[0] and k != key)  # before a rewrite
            self._close_unused(limit=self.limit)
        return key, fd

    def _open(self, path: Path) -> int:
        """A new descriptor of ``path``; out of descriptors, the unused ones kept here are
        closed and it is tried once more."""
        try:
            return _open_read_only(path)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        with self._lock:
            self._close_unused()
        try:
            return _open_read_only(path)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise StorageError(open_files_hint(str(path))) from None

    def release(self, key: tuple[str, int]) -> None:
        with self._lock:
            found = self._files.get(key)
            if found is None:
                return
            found.users -= 1
            if found.users == 0:
                self._files.move_to_end(key)
                if not os.path.exists(key[0]):
                    self._close_unused(lambda k: k == key)  # deleted: free its space now
            self._close_unused(limit=self.limit)

    def forget(self, path: Path) -> None:
        """``path`` is deleted or replaced: close what no read uses of it."""
        with self._lock:
            self._close_unused(lambda k: k[0] == str(path))

    def close(self) -> None:
        with self._lock:
            for found in self._files.values():
                os.close(found.fd)
            self._files.clear()

    def _close_unused(self, which: Callable[[tuple[str, int]], bool] = lambda _: True, *,
                      limit: int = 0) -> None:
        """Close files no read holds, least recently used first, that ``which`` picks, until
        at most ``limit`` are open (under the lock)."""
        for key in [k for k, f in self._files.items() if not f.users and which(k)]:
            if len(self._files) <= limit:
                return
            os.close(self._files.pop(key).fd)


def _open_read_only(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise NotFoundError(f"no ledger file {path}") from None


def _process_limit() -> int:
    """How many files this process may open (its soft RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
