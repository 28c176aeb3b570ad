"""Durable subscriptions: Exclusive and Key_Shared (sticky hash ranges), with cumulative acks.

A subscription's cursor on one partition is a map from hash-slot intervals to the next position
to deliver. A consumer owns key ranges (all slots for Exclusive); it starts at the earliest
position stored for any slot it owns, and an ack moves only its own slots forward. So a consumer
that comes back with the same ranges resumes exactly where it acknowledged, and one with other
ranges is redelivered at most what nobody acknowledged for them (at-least-once).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tierstream.errors import AlreadyExistsError, ConfigError, ConflictError, NotFoundError
from tierstream.faults import crash_point
from tierstream.message_format import KEY_HASH_SLOTS
from tierstream.metadata.store import MetadataStore
from tierstream.splits.positions import KeyRange, Position
from tierstream.timeutil import now_ms

__all__ = ["CursorMap", "SubscriptionMode", "Subscriptions"]

_DISCONNECT_GRACE_S = 1.0


class SubscriptionMode:
    EXCLUSIVE = "exclusive"
    KEY_SHARED = "key_shared"
    ALL = (EXCLUSIVE, KEY_SHARED)


@dataclass
class CursorMap:
    """Disjoint ``[lo, hi) -> next position`` intervals covering every hash slot."""

    intervals: list[tuple[int, int, Position]]

    @classmethod
    def at(cls, position: Position) -> CursorMap:
        return cls([(0, KEY_HASH_SLOTS, position)])

    def start_for(self, ranges: list[KeyRange]) -> Position:
        return min(pos for lo, hi, pos in self.intervals
                   if any(lo < r.hi and r.lo < hi for r in ranges))

    def ack(self, ranges: list[KeyRange], next_position: Position) -> None:
        """Move the slots of ``ranges`` to ``next_position`` (never backwards)."""
        cuts = sorted({0, KEY_HASH_SLOTS, *(b for lo, hi, _ in self.intervals for b in (lo, hi)),
                       *(b for r in ranges for b in (r.lo, r.hi))})
        pieces: list[tuple[int, int, Position]] = []
        for lo, hi in itertools.pairwise(cuts):
            pos = next(p for a, b, p in self.intervals if a <= lo and hi <= b)
            if any(r.lo <= lo and hi <= r.hi for r in ranges) and next_position > pos:
                pos = next_position
            if pieces and pieces[-1][2] == pos and pieces[-1][1] == lo:
                pieces[-1] = (pieces[-1][0], hi, pos)
            else:
                pieces.append((lo, hi, pos))
        self.intervals = pieces

    def pending(self, batch: pa.RecordBatch) -> int:
        """How many messages of ``batch`` (the message schema) are not acknowledged: those
        at or after the position of the interval their key hash falls in."""
        if batch.num_rows == 0:
            return 0
        key_hash = batch.column("key_hash").to_numpy()
        seg = batch.column("segment_id").to_numpy()
        ent = batch.column("entry_id").to_numpy()
        idx = batch.column("batch_index").to_numpy()
        total = 0
        for lo, hi, pos in self.intervals:
            at_or_after = (seg > pos.segment_id) | ((seg == pos.segment_id) & (
                (ent > pos.entry_id) | ((ent == pos.entry_id) & (idx >= pos.batch_index))))
            total += int(np.count_nonzero((key_hash >= lo) & (key_hash < hi) & at_or_after))
        return total

    def to_json(self) -> list[Any]:
        return [[lo, hi, pos.to_dict()] for lo, hi, pos in self.intervals]

    @classmethod
    def from_json(cls, data: list[Any]) -> CursorMap:
        return cls([(int(lo), int(hi), Position.from_dict(pos)) for lo, hi, pos in data])


@dataclass(frozen=True)
class _Active:
    consumer: str
    mode: str
    ranges: tuple[KeyRange, ...]
    gone: Callable[[], bool]  # the consumer's call was cancelled (it disconnected)


class Subscriptions:
    """Cursors (durable, in the metadata store) and who is connected (in memory)."""

    def __init__(self, metadata: MetadataStore) -> None:
        self._metadata = metadata
        self._lock = threading.Lock()
        self._detached = threading.Condition(self._lock)
        self._cursors: dict[tuple[str, str, int], CursorMap] = {}
        self._active: dict[tuple[str, str, int], list[_Active]] = {}

    def attach(self, topic: str, subscription: str, partition: int, *, consumer: str, mode: str,
               ranges: list[KeyRange], initial: Position,
               gone: Callable[[], bool] = lambda: False) -> Position:
        """Register a consumer on one partition and return where it starts.

        A consumer that just disconnected may still be registered for a moment: a conflict with
        one whose call is cancelled waits (up to a second) for it to leave.
        """
        if mode not in SubscriptionMode.ALL:
            raise ConfigError(f"invalid subscription mode {mode!r}: expected one of "
                              f"{', '.join(SubscriptionMode.ALL)}")
        key = (topic, subscription, partition)
        deadline = time.monotonic() + _DISCONNECT_GRACE_S
        with self._lock:
            while any(o.gone() for o in self._active.get(key, [])) and \
                    time.monotonic() < deadline:
                self._detached.wait(0.02)
            for other in self._active.get(key, []):
                if other.mode != mode:
                    raise AlreadyExistsError(
                        f"subscription {subscription!r} on {topic!r} is {other.mode}; "
                        f"cannot attach a {mode} consumer")
                if mode == SubscriptionMode.EXCLUSIVE:
                    raise AlreadyExistsError(
                        f"subscription {subscription!r} on {topic!r} partition {partition} "
                        f"already has an exclusive consumer ({other.consumer})")
                if any(a.lo < b.hi and b.lo < a.hi for a in ranges for b in other.ranges):
                    raise AlreadyExistsError(
                        f"key ranges {[str(r) for r in ranges]} overlap those of consumer "
                        f"{other.consumer} on subscription {subscription!r}")
            cursor = self._load(key, initial)
            self._active.setdefault(key, []).append(_Active(consumer, mode, tuple(ranges), gone))
            return cursor.start_for(ranges)

    def detach(self, topic: str, subscription: str, partition: int, consumer: str) -> None:
        key = (topic, subscription, partition)
        with self._lock:
            self._active[key] = [a for a in self._active.get(key, []) if a.consumer != consumer]
            self._detached.notify_all()

    def ack(self, topic: str, subscription: str, partition: int, ranges: list[KeyRange],
            position: Position) -> None:
        """Cumulative ack: everything up to and including ``position`` in ``ranges`` is done."""
        if position.partition != partition:
            raise ConfigError(f"ack position {position} is not in partition {partition}")
        key = (topic, subscription, partition)
        nxt = Position(partition, position.segment_id, position.entry_id, position.batch_index + 1)
        with self._lock:
            cursor = self._cursors.get(key)
            if cursor is None:
                stored = self._metadata.get_cursor(topic, subscription, partition)
                if stored is None:
                    raise ConfigError(
                        f"subscription {subscription!r} has no cursor on {topic!r} partition "
                        f"{partition}: attach a consumer before acknowledging")
                cursor = self._cursors[key] = CursorMap.from_json(stored)
            cursor.ack(ranges, nxt)
            self._metadata.save_cursor(topic, subscription, partition, cursor.to_json(),
                                       now=now_ms())
            crash_point("cursor.saved")

    def set_position(self, topic: str, subscription: str, partition: int, position: Position
                     ) -> None:
        """Move every slot of a subscription's partition to ``position`` (forward only)."""
        if position.partition != partition:
            raise ConfigError(f"position {position} is not in partition {partition}")
        key = (topic, subscription, partition)
        with self._lock:
            cursor = self._cursors.get(key)
            if cursor is None:
                stored = self._metadata.get_cursor(*key)
                cursor = CursorMap.from_json(stored) if stored else CursorMap.at(position)
                self._cursors[key] = cursor
            cursor.ack([KeyRange(0, KEY_HASH_SLOTS)], position)
            self._metadata.save_cursor(topic, subscription, partition, cursor.to_json(),
                                       now=now_ms())

    def delete(self, topic: str, subscription: str) -> int:
        """Remove an abandoned subscription: its durable cursors on every partition (how
        many). ConflictError while a consumer is attached; NotFoundError if there is none."""
        with self._lock:
            attached = sorted({a.consumer for (t, sub, _), active in self._active.items()
                               if t == topic and sub == subscription for a in active
                               if not a.gone()})
            if attached:
                raise ConflictError(f"subscription {subscription!r} on {topic!r} has consumers "
                                    f"attached ({', '.join(attached)}): close them first")
            removed = self._metadata.delete_cursors(topic, subscription)
            for key in [k for k in self._cursors if k[:2] == (topic, subscription)]:
                del self._cursors[key]
        if not removed:
            raise NotFoundError(f"topic {topic!r} has no subscription {subscription!r}")
        return removed

    def connected(self, topic: str, subscription: str, partition: int) -> list[str]:
        """The consumers attached to a subscription's partition now."""
        with self._lock:
            return [a.consumer for a in self._active.get((topic, subscription, partition), [])]

    def _load(self, key: tuple[str, str, int], initial: Position) -> CursorMap:
        cursor = self._cursors.get(key)
        if cursor is None:
            stored = self._metadata.get_cursor(*key)
            if stored is None:
                cursor = CursorMap.at(initial)
                self._metadata.save_cursor(*key, cursor.to_json(), now=now_ms())
            else:
                cursor = CursorMap.from_json(stored)
            self._cursors[key] = cursor
        return cursor
