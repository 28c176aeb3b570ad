"""Long-lived threads with an owner.

A bare thread that meets an exception nobody expected dies silently, and whatever waited on
its work waits for good (a queue that fills, a consumer that never gets its messages). A
:class:`Worker` runs one body for its owner: such an exception is logged with its stack and
handed to the owner's ``on_error``, which fails or gives back the work the thread held, so
nothing hangs; the owner ends it with :meth:`Worker.stop` (its ``stopping`` event set, the
thread joined).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Worker"]

log = logging.getLogger(__name__)


class Worker:
    """A named daemon thread running ``body`` for its owner."""

    def __init__(self, name: str, body: Callable[[], None], *,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.name = name
        self.stopping = threading.Event()
        self.error: BaseException | None = None  # what ended it, if anything did
        self._body, self._on_error = body, on_error
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Worker:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def current(self) -> bool:
        """Whether the caller runs on this worker's thread."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        try:
            self._body()
        except BaseException as exc:
            self.error = exc
            log.error("%s stopped by an unexpected error: %r", self.name, exc, exc_info=exc)
            if self._on_error is not None:
                try:
                    self._on_error(exc)
                except Exception:
                    log.exception("%s: its owner could not take back its work", self.name)

    def stop(self, timeout: float | None = None) -> None:
        """Ask the body to end (``stopping``) and wait for it, up to ``timeout``; from its own
        thread, only ask."""
        self.stopping.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join(timeout)
