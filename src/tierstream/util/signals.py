"""Stopping a foreground command cleanly: SIGTERM and Ctrl-C set an event, not an exception;
servers shut down within a grace period, and a process that had to leave one waiting exits
without finalizing it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

__all__ = ["exit_process", "shut_down", "stop_requested"]

log = logging.getLogger(__name__)

#: set once a server was left waiting for a client's stream (:func:`shut_down`): its
#: destructor would wait for that stream again as the interpreter finalizes it
_LEFT_WAITING = threading.Event()


@contextmanager
def stop_requested() -> Iterator[threading.Event]:
    """An event that SIGTERM or SIGINT sets while the block runs (main thread only); the
    previous handlers are back afterwards. The block polls it and shuts down in order."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def shut_down(servers: Sequence[tuple[str, Callable[[], object]]], grace_s: float
              ) -> list[str]:
    """Run each ``(name, shutdown)`` in order, each on a thread of its own, all within
    ``grace_s`` (one at least a second): the names of those still waiting then. A gRPC or
    HTTP server's shutdown waits for every call under way, and a client's idle stream (a
    producer that sends nothing) ends only when that client closes it: such a server is
    left waiting, and :func:`exit_process` ends the process without it."""
    deadline = time.monotonic() + grace_s
    left = []
    for name, stop in servers:
        def run(name: str = name, stop: Callable[[], object] = stop) -> None:
            try:
                stop()
            except Exception as exc:  # one server's failure stops no other
                log.warning("shutting the %s down failed: %r", name, exc)

        thread = threading.Thread(target=run, name=f"shutdown-{name}", daemon=True)
        thread.start()
        thread.join(max(deadline - time.monotonic(), 1.0))
        if thread.is_alive():
            left.append(name)
    if left:
        _LEFT_WAITING.set()
    return left


def exit_process(code: int) -> NoReturn:
    """``sys.exit(code)``; once a server was left waiting (:func:`shut_down`), the process
    ends at once after flushing its output, without finalizing it."""
    if _LEFT_WAITING.is_set():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed (a reader that left)
                stream.flush()
        os._exit(code)
    sys.exit(code)
