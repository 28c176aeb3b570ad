"""Read-only mappings of files that hold no file descriptor.

A reader returns zero-copy Arrow buffers over memory-mapped ledger files, and a table built
from them keeps each mapping for as long as it lives. Python's ``mmap.mmap`` duplicates the
file's descriptor and keeps the copy as long as the mapping (before Python 3.13's
``trackfd=False``), so a table read from 5,000 segments held 5,000 descriptors and a process
with the usual limit of 1,024 open files failed with "Too many open files". POSIX lets a
mapping outlive its descriptor: here the file is mapped with libc's ``mmap`` directly, the
descriptor closed at once, and the mapping released (``munmap``) when the last buffer over it
is gone. Reads stay zero-copy (``bench readers``).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pyarrow as pa

from tierstream.errors import StorageError

__all__ = ["map_read_only", "open_files_hint"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """One mapping; unmapped when the last buffer over it is collected."""

    __slots__ = ("address", "length")

    def __init__(self, address: int, length: int) -> None:
        self.address, self.length = address, length

    def __del__(self) -> None:
        _libc.munmap(self.address, self.length)


def map_read_only(path: str, offset: int, length: int) -> pa.Buffer:
    """Bytes ``[offset, offset + length)`` of the file at ``path`` (``offset`` a multiple of
    ``mmap.ALLOCATIONGRANULARITY``) as one zero-copy buffer, its pages faulted in up front
    (one system call instead of one fault per page). No descriptor stays open."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno == 24:  # EMFILE
            raise StorageError(open_files_hint(path)) from None
        raise
    try:
        address = _libc.mmap(None, length, mmap.PROT_READ, flags, fd, offset)
    finally:
        os.close(fd)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise StorageError(f"cannot map {path}: {os.strerror(err)}")
    return pa.foreign_buffer(address, length, base=_Mapping(address, length))


def open_files_hint(path: str) -> str:
    """The one line for a file that cannot be opened for want of descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"cannot open {path}: this process has {soft} open files, its limit "
            f"(RLIMIT_NOFILE; hard limit {hard}): raise it (ulimit -n), or read fewer "
            "segments at a time")
