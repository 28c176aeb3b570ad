"""Stopping a foreground command cleanly: SIGTERM and Ctrl-C set an event, not an exception."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["stop_requested"]


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
