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

_ONE = np.int32(1)  # (ufunc.at with a Python int: 4x slower, a cast per element)


class KeyHolds:
    """Owners and holders of the hash slots of one partition."""

    def __init__(self) -> None:
        self.owners: np.ndarray | None = None  # slot -> owning consumer idx (-1: none)
        self._held = np.zeros(KEY_HASH_SLOTS, dtype=np.int32)     # held messages per slot
        self._holder = np.full(KEY_HASH_SLOTS, -1, dtype=np.int32)  # consumer holding them
        self._assigned = 0  # how many times the slots were divided (chunks group by it)
        #: whether a slot may be held by another consumer than its owner (a key moved): only
        #: then can a message wait for another's acknowledgements
        self._moved = False

    def assign(self, consumers: list[Attached]) -> None:
        """Divide the slots among ``consumers`` (none: no slot has an owner)."""
        self._assigned += 1
        self._moved = True  # (found out at the next dispatch)
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
        np.add.at(self._held, slots, _ONE)
        self._holder[slots] = idx

    def release(self, slots: np.ndarray) -> None:
        """Messages of ``slots`` are no longer held (acknowledged, or waiting again)."""
        np.subtract.at(self._held, slots, _ONE)
        self._holder[slots[self._held[slots] <= 0]] = -1

    def dispatch(self, waiting: Iterable[Chunk], consumers: Mapping[int, Attached],
                 deliver: Callable[[Chunk, np.ndarray, Attached], None]) -> None:
        """Hand the waiting messages of ``waiting`` (in log order) to their slots' owners,
        each up to its permits, through ``deliver``."""
        owners, holder = self.owners, self._holder
        if owners is None:
            return
        if self._moved:
            self._moved = bool(((holder >= 0) & (holder != owners)).any())
        ready = [c for c in consumers.values() if c.permits > 0]
        if self._moved:
            self._dispatch_moved(waiting, ready, deliver)
            return
        # every held slot is held by its owner: no message waits on another consumer's acks
        for chunk in waiting:
            if chunk.grouped_by != self._assigned:  # each consumer's messages, one run each
                chunk.group(owners[chunk.slots], self._assigned)
            for c in ready:
                if c.permits <= 0:
                    continue
                rows = chunk.rows_of(c.idx)
                rows = rows[chunk.state[rows] == WAITING]
                if len(rows):
                    deliver(chunk, rows if c.settings.whole_entries else rows[:c.permits], c)
            if not any(c.permits > 0 for c in ready):
                return

    def _dispatch_moved(self, waiting: Iterable[Chunk], ready: list[Attached],
                        deliver: Callable[[Chunk, np.ndarray, Attached], None]) -> None:
        """:meth:`dispatch` while a slot may be held by another consumer than its owner: a
        message of such a slot, and every later one of it in this pass, waits."""
        owners, holder = self.owners, self._holder
        assert owners is not None
        blocked: np.ndarray | None = None
        for chunk in waiting:
            if chunk.grouped_by != self._assigned:  # each consumer's messages, one run each
                chunk.group(owners[chunk.slots], self._assigned)
            rows = np.flatnonzero(chunk.state == WAITING)
            slots = chunk.slots[rows]
            target = owners[slots]
            held_by = holder[slots]
            ok = (target >= 0) & ((held_by < 0) | (held_by == target))
            if blocked is not None:
                ok &= ~blocked[slots]
            for c in ready:  # (a consumer without permits takes nothing in this pass)
                if c.permits <= 0:
                    continue
                idx = np.flatnonzero(ok & (target == c.idx))
                cap = len(idx) if c.settings.whole_entries else c.permits
                if len(idx) > cap:
                    ok[idx[cap:]] = False
                    idx = idx[:cap]
                if len(idx):
                    deliver(chunk, rows[idx], c)
            if not ok.all():
                if blocked is None:
                    blocked = np.zeros(KEY_HASH_SLOTS, dtype=bool)
                blocked[slots[~ok]] = True
            if not any(c.permits > 0 for c in ready):
                return
