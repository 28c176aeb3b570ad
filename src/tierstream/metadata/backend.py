"""Where the metadata store's rows live: the one interface between ``MetadataStore`` (and the
modules that keep their own tables) and a SQL engine.

Statements are written once, in the SQL both engines speak (``INSERT ... ON CONFLICT``,
``RETURNING``, ``?`` and ``:name`` placeholders); a backend runs them and says how it differs
where it must (``dialect``). Nobody outside ``metadata/`` holds a connection: a transaction is
:meth:`Backend.transaction`, a read :meth:`Backend.read`.

:class:`SqliteBackend` is the embedded default, a file in the data directory (WAL,
``synchronous=FULL``). The PostgreSQL backend is ``postgres.py``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from tierstream.errors import NotFoundError, StorageError

__all__ = ["POSTGRES_SCHEMES", "Backend", "Cursor", "SqliteBackend", "Tx", "UniqueViolation",
           "first_line"]

#: how a PostgreSQL metadata URL begins (``--metadata``, ``TIERSTREAM_METADATA``)
POSTGRES_SCHEMES = ("postgresql://", "postgres://")

Args = Sequence[Any] | Mapping[str, Any]


class UniqueViolation(Exception):
    """A row with that key exists (the engine's integrity error, whichever engine)."""


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Tx(Protocol):
    """Statements of one transaction."""

    def execute(self, sql: str, args: Args = ()) -> Cursor: ...

    def executemany(self, sql: str, rows: Sequence[Args]) -> None: ...


class Backend(Protocol):
    #: ``sqlite`` or ``postgresql``: where one statement must differ
    dialect: str
    #: an SQL expression of the server's clock in ms since the epoch (a lease is timed by
    #: one clock, whichever broker reads it)
    clock_ms: str
    #: what to call it in a message (a path, or a URL without its password)
    name: str
    #: set when the backend gave up on its server (PostgreSQL unreachable past its limit),
    #: with the reason: the broker stops
    lost: threading.Event
    lost_reason: str
    #: set while a statement waits for an unreachable server (what the broker knows from
    #: memory is served meanwhile rather than waited for: ``Store.topic``)
    unreachable: threading.Event
    #: when (``time.monotonic()``) the session statements run in was opened: a statement
    #: that went through ran after it (a lease renewal that waited out an outage counts
    #: from there, not from its start: ``ownership.py``)
    connected_at: float

    def transaction(self) -> Any:  # a context manager of a Tx: committed, or rolled back
        ...

    def read(self, sql: str, args: Args = ()) -> list[Any]: ...

    def columns(self, table: str) -> list[str]: ...

    def refresh_statistics(self) -> None:
        """Let the engine's planner see the tables as they are now (after bulk changes)."""

    def name_sessions(self, application: str) -> None:
        """Name this backend's sessions on its server (who holds them: a cluster's brokers
        are found so); nothing where the engine has no server."""

    def close(self) -> None: ...


class _SqliteTx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Args = ()) -> Cursor:
        try:
            return self._conn.execute(sql, args)
        except sqlite3.IntegrityError as exc:
            raise UniqueViolation(str(exc)) from None

    def executemany(self, sql: str, rows: Sequence[Args]) -> None:
        try:
            self._conn.executemany(sql, rows)
        except sqlite3.IntegrityError as exc:
            raise UniqueViolation(str(exc)) from None


class SqliteBackend:
    """One SQLite file (WAL). Thread-safe: one connection, one lock. ``read_only`` (planners,
    the CLI) never creates the file."""

    dialect = "sqlite"
    clock_ms = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.lost, self.lost_reason = threading.Event(), ""  # a local file is not lost
        self.unreachable = threading.Event()  # nor unreachable
        self.connected_at = 0.0
        self._lock = threading.RLock()
        try:
            self._open(read_only)
        except sqlite3.Error as exc:
            raise StorageError(f"cannot open metadata store {self.name!r}: {exc}") from None

    def _open(self, read_only: bool) -> None:
        if read_only:
            if not self.path.exists():
                raise NotFoundError(
                    f"no metadata store at {self.name!r}: is the data directory right? "
                    "(--data-dir / TIERSTREAM_HOME)")
            self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True,
                                         check_same_thread=False, timeout=30)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
            self._conn.execute("PRAGMA journal_mode=WAL")
            # seals, cursors and de-dup snapshots must survive power loss, and they are rare
            self._conn.execute("PRAGMA synchronous=FULL")

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock, self._conn:
            yield _SqliteTx(self._conn)

    def read(self, sql: str, args: Args = ()) -> list[Any]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def columns(self, table: str) -> list[str]:
        with self._lock:
            return [r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")]

    def refresh_statistics(self) -> None:
        """Nothing: the planning query's plan does not depend on SQLite's statistics (it
        fixes its join order; ``store.py``)."""

    def name_sessions(self, application: str) -> None:
        """Nothing: a SQLite file has no server and no sessions."""

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def first_line(exc: BaseException) -> str:
    """The first line of a database driver's error: what a one-line message can say."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
