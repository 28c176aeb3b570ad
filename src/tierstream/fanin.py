"""Fan-in of producer threads into one iterator: the loop the runner and clients share, and
the cancellation that lets a consumer leave at once."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["DONE", "Cancel", "drain", "put"]

#: What a producer thread puts last, after its items (or after an exception).
DONE = object()


class Cancel:
    """A stop signal that also interrupts blocking calls: a reader registers how to interrupt
    itself (e.g. a Flight stream's ``cancel``), and :meth:`set` calls it from any thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._next = 0

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def register(self, interrupt: Callable[[], object]) -> Callable[[], None]:
        """Call ``interrupt`` on :meth:`set` (at once if already set); returns an unregister
        function for when the blocking call is over."""
        with self._lock:
            key = self._next
            self._next += 1
            self._callbacks[key] = interrupt
            fire = self._event.is_set()
        if fire:
            interrupt()

        def unregister() -> None:
            with self._lock:
                self._callbacks.pop(key, None)

        return unregister

    def set(self) -> None:
        with self._lock:
            self._event.set()
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for interrupt in callbacks:
            with contextlib.suppress(Exception):  # an already closed stream: nothing to do
                interrupt()


def put(out: queue.Queue[Any], item: Any, cancel: Cancel | threading.Event) -> bool:
    """Put ``item`` on a bounded queue unless ``cancel`` is set first (a full queue whose
    consumer left must not hold a producer thread forever). True if it was put."""
    while not cancel.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def drain(out: queue.Queue[Any], producers: int, cancel: Cancel | None = None, *,
          tick: Callable[[], int] | None = None) -> Iterator[Any]:
    """Items from ``out`` until ``producers`` threads have each put :data:`DONE` (or until
    ``cancel`` is set); an exception a producer put is raised here, in the consuming thread.
    ``tick`` (with ``cancel``) is called at least every 0.1 s and returns how many producer
    threads it started meanwhile."""
    finished = 0
    while finished < producers:
        if tick is not None:
            producers += tick()
        if cancel is None:
            item = out.get()
        else:
            try:
                item = out.get(timeout=0.1)
            except queue.Empty:
                if cancel.is_set():
                    return
                continue
        if item is DONE:
            finished += 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item
