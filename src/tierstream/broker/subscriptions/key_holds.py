"""Key order on one partition of a ``key_shared`` subscription (Pulsar's PIP-379 rule).

Each of the 65,536 hash slots has an owner, the consumer its keys go to (consistent hashing or
sticky ranges: ``selectors.py``), and a holder, the consumer that holds its delivered but not
yet acknowledged messages. A message is sent only to its slot's owner, and only while no other
consumer holds messages of that slot: a key that moved waits until its old owner's messages are
acknowledged (or come back to waiting, which puts them ahead of it). A message that cannot be
sent blocks the later messages of its slot for the rest of the pass, so only the moved slots
wait, and a stalled consumer stops only its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from tierstream.broker.subscriptions.attached import Attached, ranges_of
from tierstream.broker.subscriptions.read_window import WAITING, Chunk
from tierstream.broker.subscriptions.selectors import slot_owners
from tierstream.model.message_format import KEY_HASH_SLOTS

__all__ = ["KeyHolds"]


class KeyHolds:
    """Owners and holders of the hash slots of one partition."""

    def __init__(self) -> None:
        self.owners: np.ndarray | None = None  # slot -> owning consumer idx (-1: none)
        self._held = np.zeros(KEY_HASH_SLOTS, dtype=np.int32)     # held messages per slot
        self._holder = np.full(KEY_HASH_SLOTS, -1, dtype=np.int32)  # consumer holding them

    def assign(self, consumers: list[Attached]) -> None:
        """Divide the slots among ``consumers`` (none: no slot has an owner)."""
        if not consumers:
            self.owners = None
            return
        ids = np.array([c.idx for c in consumers], dtype=np.int32)
        owners = slot_owners([c.name for c in consumers],
                             [c.settings.sticky for c in consumers])
        self.owners = np.where(owners >= 0, ids[np.maximum(owners, 0)], -1)

    def ranges(self, idx: int) -> str:
        """The slots consumer ``idx`` owns, as ``lo:hi`` ranges for stats."""
        return "-" if self.owners is None else ranges_of(self.owners == idx)

    def hold(self, slots: np.ndarray, idx: int) -> None:
        """Consumer ``idx`` was sent messages of ``slots`` (one slot per message)."""
        np.add.at(self._held, slots, 1)
        self._holder[slots] = idx

    def release(self, slots: np.ndarray) -> None:
        """Messages of ``slots`` are no longer held (acknowledged, or waiting again)."""
        np.subtract.at(self._held, slots, 1)
        self._holder[slots[self._held[slots] <= 0]] = -1

    def dispatch(self, waiting: Iterable[Chunk], consumers: Mapping[int, Attached],
                 deliver: Callable[[Chunk, np.ndarray, Attached], None]) -> None:
        """Hand the waiting messages of ``waiting`` (in log order) to their slots' owners,
        each up to its permits, through ``deliver``."""
        owners, holder = self.owners, self._holder
        if owners is None:
            return
        blocked: np.ndarray | None = None
        for chunk in waiting:
            rows = np.flatnonzero(chunk.state == WAITING)
            slots = chunk.slots[rows]
            target = owners[slots]
            held_by = holder[slots]
            ok = (target >= 0) & ((held_by < 0) | (held_by == target))
            if blocked is not None:
                ok &= ~blocked[slots]
            for t in np.unique(target[ok]).tolist():
                c = consumers[t]
                idx = np.flatnonzero(ok & (target == t))
                cap = len(idx) if c.settings.whole_entries and c.permits > 0 else c.permits
                if len(idx) > cap:
                    ok[idx[cap:]] = False
                    idx = idx[:cap]
                if len(idx):
                    deliver(chunk, rows[idx], c)
            if not ok.all():
                if blocked is None:
                    blocked = np.zeros(KEY_HASH_SLOTS, dtype=bool)
                blocked[slots[~ok]] = True
            if not any(c.permits > 0 for c in consumers.values()):
                return
