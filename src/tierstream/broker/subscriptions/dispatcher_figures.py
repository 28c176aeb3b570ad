"""What a dispatcher tells about itself (a mixin of ``Dispatcher``): where its
subscription is acknowledged up to, what is out, and each consumer's share, for stats,
backlogs and the cursor writer."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from tierstream.broker.subscriptions.read_window import DELIVERED
from tierstream.model.positions import Position
from tierstream.model.subscription_type import SubscriptionType

if TYPE_CHECKING:
    from tierstream.broker.subscriptions.attached import Attached
    from tierstream.broker.subscriptions.key_holds import KeyHolds
    from tierstream.broker.subscriptions.read_window import ReadWindow

__all__ = ["DispatcherFigures"]


class DispatcherFigures:
    """Read-only figures of a dispatcher, each taken under its lock."""

    partition: int
    type: str | None
    window: ReadWindow
    consumers: dict[int, Attached]
    _lock: threading.RLock
    _keys: KeyHolds | None
    _active: int | None

    def acknowledged_before(self) -> Position:
        """Every message before this position is acknowledged."""
        with self._lock:
            return self.window.mark_delete()

    def unacknowledged(self) -> int:
        """Messages read and not acknowledged (the backlog before the read position)."""
        with self._lock:
            return self.window.unacknowledged()

    def oldest_delivered_s(self) -> float | None:
        """Seconds since the oldest message delivered and not acknowledged yet was sent
        (None: none is out)."""
        with self._lock:
            sent = [float(c.until[c.state == DELIVERED].min()) for c in self.window
                    if c.open and (c.state == DELIVERED).any()]
        return None if not sent else max(0.0, time.monotonic() - min(sent))

    def stats(self) -> list[dict[str, Any]]:
        """Each consumer's share: its key ranges (key_shared), whether it is the active one
        (failover, exclusive) or ``any`` (shared), and its counts."""
        with self._lock:
            return [c.stats(self.partition, self._keys.ranges(c.idx)
                            if self._keys is not None else
                            ("active" if c.idx == self._active else "standby")
                            if self.type in SubscriptionType.CUMULATIVE else "any")
                    for c in self.consumers.values()]
