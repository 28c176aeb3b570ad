"""Fan-in of producer threads into one iterator: the loop the runner and clients share, and
the cancellation that lets a consumer leave at once."""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["DONE", "Cancel", "drain", "put", "start_reader"]

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


#: reader threads still running; joined briefly at interpreter exit
_READERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: how long exit waits, in all, for readers that were told to stop to leave their calls
EXIT_JOIN_S = 2.0


def start_reader(target: Callable[..., object], *args: object, name: str) -> threading.Thread:
    """Start a daemon reader thread (it never holds up exit by itself). A program that leaves
    a read (``break``) cancels it, but the thread may still be inside a Flight call when the
    interpreter finalizes, which aborts the process (``PyGILState_Release``): exit waits up
    to :data:`EXIT_JOIN_S` for such threads to return."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _READERS.add(thread)
    thread.start()
    return thread


@atexit.register
def _join_readers() -> None:
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread in list(_READERS):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        thread.join(left)
