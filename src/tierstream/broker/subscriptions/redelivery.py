"""What goes back to waiting on its own: a nack's messages once their delay passed, what
outlived its consumer's ack timeout, and what a consumer that fell silent held.

A consumer whose client keeps it alive (tierstream's, with ``keepalive_s`` in its ticket)
says it is there every ``keepalive_s``; one not heard from for twice that is let go, as
Pulsar's broker drops a connection that does not answer its pings for as long
(``broker/pulsar/connection.py`` does the same for Pulsar clients). Before, a consumer
whose host was cut off held what it had been sent until the kernel gave its connection up
(about 15 minutes with data unacknowledged; never on an idle stream). A mixin of
``Dispatcher``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from tierstream.broker.subscriptions.read_window import DELAYED, DELIVERED, Chunk

if TYPE_CHECKING:
    from tierstream.broker.subscriptions.attached import Attached
    from tierstream.broker.subscriptions.read_window import ReadWindow

__all__ = ["Redelivery"]

log = logging.getLogger(__name__)


class Redelivery:
    """The dispatcher's redeliveries that no consumer asks for in the moment."""

    topic: str
    partition: int
    subscription: str
    window: ReadWindow
    consumers: dict[int, Attached]
    _lock: threading.RLock
    _delayed: int
    _gated: bool

    def _set(self, chunk: Chunk, rows: np.ndarray, state: int) -> None:
        raise NotImplementedError  # the dispatcher's

    def _return(self, chunk: Chunk, rows: np.ndarray) -> None:
        raise NotImplementedError  # the dispatcher's

    def _release_timed(self, chunk: Chunk, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError  # delivery_time.py's

    def _detach(self, c: Attached) -> None:
        raise NotImplementedError  # the dispatcher's

    def _dispatch(self) -> None:
        raise NotImplementedError  # the dispatcher's

    def nack(self, name: str, segment: np.ndarray, entry: np.ndarray, index: np.ndarray,
             delay_s: float) -> None:
        """Redeliver the given messages of consumer ``name`` after ``delay_s``."""
        with self._lock:
            owner = next((c.idx for c in self.consumers.values() if c.name == name), None)
            if owner is None:
                return
            found, _ = self.window.locate(segment, entry, index)
            ready = time.monotonic() + delay_s
            for chunk, rows in found:
                rows = rows[(chunk.state[rows] == DELIVERED) & (chunk.owner[rows] == owner)]
                if len(rows):
                    self._set(chunk, rows, DELAYED)
                    chunk.until[rows] = ready
                    self._delayed += len(rows)

    def heard(self, name: str, now: float) -> bool:
        """Consumer ``name``'s keepalive came: whether it is attached here."""
        with self._lock:
            found = [c for c in self.consumers.values() if c.name == name]
            for c in found:
                c.heard = now
            return bool(found)

    def tick(self, now: float) -> None:
        """Redeliver what a nack delayed and what outlived its consumer's ack timeout; let go
        of consumers that fell silent; look again whether a closed gate opened."""
        if self._gated:
            with self._lock:
                self._dispatch()
        # (a copy first, made without a thread switch: consumers come and go meanwhile)
        consumers = list(self.consumers.values())
        silent = [c for c in consumers if c.silent(now)]
        if silent:
            with self._lock:
                for c in silent:
                    log.warning("%s partition %d subscription %s: consumer %s was not heard "
                                "from for %.0f s (its keepalive is every %g s): let go, what "
                                "it held goes to the others", self.topic, self.partition,
                                self.subscription, c.name, now - c.heard,
                                c.settings.keepalive_s)
                    self._detach(c)
                self._dispatch()
        timeouts = {c.idx: c.settings.ack_timeout_s for c in consumers
                    if c.settings.ack_timeout_s}
        if not self._delayed and not timeouts:
            return
        with self._lock:
            changed = False
            for chunk in list(self.window):
                if not chunk.open:
                    continue
                due = (chunk.state == DELAYED) & (chunk.until <= now)
                for idx, timeout in timeouts.items():
                    due |= (chunk.state == DELIVERED) & (chunk.owner == idx) & \
                        (chunk.until <= now - timeout)
                rows = self._release_timed(chunk, np.flatnonzero(due))
                changed |= bool(due.any())
                if len(rows):
                    self._return(chunk, rows)
            if changed:
                self._dispatch()
