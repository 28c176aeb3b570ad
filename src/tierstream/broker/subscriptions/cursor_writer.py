"""Group commit of cursors: many acks, one metadata transaction.

An ack changes its dispatcher's state in memory and marks the dispatcher dirty; one writer
thread takes every dirty dispatcher's snapshot and stores them all in one SQLite transaction
(``synchronous=FULL``), then wakes every ack that was waiting for that write. While a write is
on disk the next acks gather for the next one, so N concurrent acks cost about one fsync, not N.
An ack call returns only after the write that holds it, so an acknowledged message is never
delivered again after a crash. With several brokers, a cursor of a partition handed to another
broker meanwhile is not written (the new owner's is the cursor now): :meth:`CursorWriter.wait`
for it raises :class:`NotStoredError`, and the ack is refused rather than said stored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from tierstream.errors import StorageError, TierstreamError, UnavailableError
from tierstream.metadata.store import MetadataStore
from tierstream.util.faults import crash_point, fault_point
from tierstream.util.threads import Worker
from tierstream.util.timeutil import now_ms

__all__ = ["CursorWriter", "NotStoredError", "Snapshotting"]

log = logging.getLogger(__name__)


class NotStoredError(TierstreamError):
    """A cursor was not written: another broker owns its partition now (``owner``, an id)."""

    def __init__(self, topic: str, partition: int, owner: str) -> None:
        super().__init__(f"{topic} partition {partition} is owned by {owner} now: its cursor "
                         "was not stored here")
        self.topic, self.partition, self.owner = topic, partition, owner


class Snapshotting(Protocol):
    topic: str
    subscription: str
    partition: int

    def snapshot(self) -> dict[str, Any]: ...


class CursorWriter:
    """Stores dirty cursors in group transactions, on a thread of its own. A transaction cut
    short is written again; once the metadata store is given up for good, every ack waiting
    and every later one fails (``StorageError``) and the thread ends; an error nobody foresaw
    also goes to ``on_error`` (the broker stops)."""

    def __init__(self, metadata: MetadataStore, *,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self._metadata = metadata
        lock = threading.Lock()
        #: the writer waits on ``_work`` (something is dirty), acks on ``_done`` (a write
        #: ended): one condition for both woke every waiting ack at every other ack
        self._work = threading.Condition(lock)
        self._done = threading.Condition(lock)
        self._dirty: dict[int, Snapshotting] = {}
        self._requested = 0   # generation the next write will complete
        self._written = 0     # last generation on disk
        # partitions whose cursors were not written, as others own them: the last write
        # generation that left each out, and the owner it named
        self._foreign: dict[tuple[str, int], tuple[int, str]] = {}
        self._error: Exception | None = None
        self._stop = False
        self.writes = 0       # transactions so far (bench and stats)
        self.snapshots = 0    # cursors stored by them
        self._on_error = on_error
        self._thread = Worker("cursor-writer", self._run, on_error=self._failed)
        self._thread.start()

    def dirty(self, cursor: Snapshotting) -> int:
        """Mark ``cursor`` for the next write; the generation to :meth:`wait` for."""
        with self._work:
            self._dirty[id(cursor)] = cursor
            self._work.notify()
            return self._requested + 1

    def wait(self, generation: int, *, stopped: Callable[[], bool] = lambda: False,
             partitions: Iterable[tuple[str, int]] = ()) -> None:
        """Return once generation ``generation`` is on disk. NotStoredError if the cursor of
        one of ``partitions`` (``(topic, partition)``: those the caller's state is in) was
        left out of it, or of a later write, because another broker owns it now."""
        with self._done:
            while self._written < generation:
                if self._error is not None:
                    raise StorageError(f"cannot store a cursor: {self._error}")
                if self._stop or stopped():
                    raise UnavailableError("the broker is shutting down; the ack was not "
                                           "stored")
                self._done.wait(0.5)
            for key in partitions:
                left_out, owner = self._foreign.get(key, (0, ""))
                if left_out >= generation:
                    raise NotStoredError(*key, owner)

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._dirty and not self._stop:
                    self._work.wait()
                if not self._dirty and self._stop:
                    return
                batch = list(self._dirty.values())
                self._dirty.clear()
                self._requested += 1
                generation = self._requested
            try:
                fault_point("cursor.write")
                rows = [(c.topic, c.subscription, c.partition, c.snapshot()) for c in batch]
                crash_point("cursor.writing")
                foreign = self._metadata.save_cursors(rows, now=now_ms())
                crash_point("cursor.saved")
            except UnavailableError as exc:
                if self._metadata.backend.lost.is_set():  # its server is given up for good
                    log.warning("storing %d cursor(s) failed: %s", len(batch), exc)
                    self._fail_waiters(exc)
                    return
                # a transaction cut short (the server restarted meanwhile): each cursor is
                # written again as it is then, and the acks waiting for this one with it
                log.warning("storing %d cursor(s) did not complete (%s): writing them again",
                            len(batch), exc)
                with self._work:
                    for cursor in batch:
                        self._dirty.setdefault(id(cursor), cursor)
                continue
            with self._done:
                self.writes += 1
                self.snapshots += len(rows)
                self._written = generation
                for key, owner in foreign.items():
                    self._foreign[key] = (generation, owner)
                self._done.notify_all()

    def _fail_waiters(self, exc: Exception) -> None:
        with self._done:
            self._error = exc
            self._done.notify_all()

    def _failed(self, exc: BaseException) -> None:
        """The thread died of an error nobody foresaw: the acks waiting, and every later one,
        fail; the owner hears of it."""
        self._fail_waiters(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
        if self._on_error is not None:
            self._on_error(exc)

    def close(self) -> None:
        """Write what is dirty, then stop."""
        with self._work:
            self._stop = True
            self._work.notify_all()
            self._done.notify_all()
        self._thread.join(timeout=10)
