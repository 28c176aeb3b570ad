"""The data directory a broker holds: created if missing, and locked (``flock``) for as long
as the broker runs, so a second broker on it is refused. The lock file holds the broker's
pid, which ``tierstream broker stop`` signals (:func:`holder_pid`)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from tierstream.errors import ConflictError, StorageError

__all__ = ["holder_pid", "lock_data_dir", "prepare_data_dir", "unlock_data_dir"]


def prepare_data_dir(path: Path) -> None:
    """Create the data directory, or say in one line why it cannot be used."""
    if path.exists() and not path.is_dir():
        raise StorageError(f"data directory {str(path)!r} exists but is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create data directory {str(path)!r}: "
                           f"{exc.strerror or exc}") from None


def lock_data_dir(data_dir: Path, lock: Path) -> Any:
    """Hold ``lock`` (the data directory's) until :func:`unlock_data_dir`, with this
    process's pid in it; ConflictError if another broker holds it."""
    try:
        f = open(lock, "a+")  # noqa: SIM115 - held until unlock_data_dir()
    except OSError as exc:
        raise StorageError(f"data directory {str(data_dir)!r} is not writable: "
                           f"{exc.strerror or exc}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConflictError(
            f"data directory {str(data_dir)!r} is already in use by another broker") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))  # whom `tierstream broker stop` signals
    f.flush()
    return f


def unlock_data_dir(f: Any) -> None:
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


def holder_pid(lock: Path) -> int | None:
    """The pid of the broker holding ``lock`` (None: no broker holds it; -1: one that did
    not write its pid, an older tierstream)."""
    try:
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                text = f.read().strip()
                return int(text) if text.isdigit() else -1
            return None
    except FileNotFoundError:
        return None
