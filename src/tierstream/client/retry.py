"""Riding out a broker restart: bounded retries with backoff, then one clear error.

Every client that follows the log (the tail reader, ``consume --follow``, a Spark stream's
driver calls) retries an :class:`~tierstream.errors.UnavailableError` with exponential backoff
(0.1 s doubling to 2 s) for up to ``reconnectTimeout`` (option, default 60 s), then raises one
UnavailableError that says what it was doing and for how long it tried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tierstream.errors import UnavailableError
from tierstream.options import parse_options
from tierstream.util.fanin import Cancel

__all__ = ["Backoff", "reconnect_timeout_s", "with_reconnect"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def reconnect_timeout_s(given_ms: int | None = None) -> float:
    """``given_ms``, else the ``reconnectTimeout`` option (env, default), in seconds."""
    if given_ms is None:
        given_ms = parse_options({}, scope="client")["reconnectTimeout"]
    return given_ms / 1000


class Backoff:
    """Waits between reconnect attempts; :meth:`wait` is False once ``timeout_s`` has passed
    since the first failure (or when ``cancel`` is set)."""

    def __init__(self, timeout_s: float, *, cancel: Cancel | None = None) -> None:
        self.timeout_s = timeout_s
        self._started = time.monotonic()
        self._deadline = self._started + timeout_s
        self._delay = 0.1
        self._cancel = cancel
        self.attempts = 0

    def elapsed_s(self) -> float:
        """Seconds since the first failure."""
        return time.monotonic() - self._started

    def wait(self) -> bool:
        left = self._deadline - time.monotonic()
        if left <= 0:
            return False
        delay = min(self._delay, left)
        self._delay = min(self._delay * 2, 2.0)
        self.attempts += 1
        if self._cancel is not None:
            return not self._cancel.wait(delay)
        threading.Event().wait(delay)
        return True


def with_reconnect(call: Callable[[], T], *, what: str, timeout_s: float | None = None) -> T:
    """``call()``, retried while the broker is unavailable, for up to ``timeout_s``."""
    backoff: Backoff | None = None
    while True:
        try:
            return call()
        except UnavailableError as exc:
            if backoff is None:
                backoff = Backoff(reconnect_timeout_s() if timeout_s is None else timeout_s)
                log.warning("%s: broker unavailable, retrying for up to %gs (%s)", what,
                            backoff.timeout_s, exc)
            if not backoff.wait():
                raise UnavailableError(f"{what}: the broker stayed unavailable for "
                                       f"{backoff.timeout_s:g}s: {exc}") from None


def gave_up(producer: str, topic: str, partition: int, timeout_s: float, why: str,
            unacked: list[tuple[int, int]]) -> UnavailableError:
    """A producer's error for a send timeout: it names the batches whose fate is unknown
    (``unacked``: sequence id, messages), as ``exc.unacknowledged`` (partition -> ids) too."""
    seqs = [seq for seq, _ in unacked]
    ids = str(seqs[0]) if len(seqs) == 1 else f"{seqs[0]}..{seqs[-1]}"
    messages = sum(n for _, n in unacked)
    exc = UnavailableError(
        f"producer {producer!r} gave up on {topic!r} partition {partition} after "
        f"{timeout_s}s ({why}): sequence id(s) {ids} ({messages} message(s)) were sent but "
        "never acknowledged, so they may or may not be stored; flush() re-sends them, and a "
        f"producer named {producer!r} stores each at most once")
    exc.unacknowledged = {partition: seqs}  # type: ignore[attr-defined]
    return exc
