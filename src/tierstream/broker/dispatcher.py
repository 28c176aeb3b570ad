"""One subscription on one partition: who gets which message, and what is acknowledged.

A reader thread reads the partition from the mark-delete position into the
:class:`~tierstream.broker.read_window.ReadWindow`; a dispatch pass hands waiting messages to
consumers, in log order, each up to its permits (its receiver queue). What a consumer holds
unacknowledged goes back to waiting when it leaves, when its ack timeout passes, or when it
nacks (after the nack delay), with its redelivery count raised.

Key order (``key_shared``, PIP-379): every hash slot's delivered-but-unacknowledged messages are
held by one consumer. A message whose slot is held by another consumer than its owner waits
until those are acknowledged (or come back to waiting, which puts them ahead of it); a message
that cannot be sent blocks the later messages of its slot for the rest of the pass. So only the
moved slots wait, and a stalled consumer stops only its own. ``failover`` and ``exclusive``
keep the partition's order: a new active consumer starts once the previous one's messages are
acknowledged or returned.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tierstream.broker.cursor_state import CursorState, DeadLetterIntent
from tierstream.broker.read_window import (
    ACKED,
    DEAD,
    DELAYED,
    DELIVERED,
    WAITING,
    Chunk,
    ReadWindow,
)
from tierstream.broker.selectors import active_for_partition, slot_owners
from tierstream.errors import ConfigError, ConflictError, TierstreamError
from tierstream.message_format import CONSUMER_SCHEMA, KEY_HASH_SLOTS
from tierstream.splits.positions import KeyRange, Position
from tierstream.subscription_type import SubscriptionType

if TYPE_CHECKING:
    from tierstream.broker.cursor_writer import CursorWriter
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["Attached", "ConsumerSettings", "Dispatcher"]

log = logging.getLogger(__name__)

#: Messages read ahead of what consumers can take, at least (so a stalled key does not stop
#: reading for the others, and an idle subscription does not read the whole log).
_MIN_LOOKAHEAD = 1000

#: How long a join that conflicts with a connected consumer is retried (it may be leaving).
_LEAVING_GRACE_S = 1.0


@dataclass(frozen=True)
class ConsumerSettings:
    name: str
    type: str
    sticky: tuple[KeyRange, ...] | None  # key_shared ranges given by the user
    permits: int                          # receiver queue for this partition
    ack_timeout_s: float | None = None
    max_redeliveries: int | None = None
    dead_letter_topic: str | None = None


class Attached:
    """A consumer connected to one partition; the broker streams :attr:`outbox` to it."""

    def __init__(self, idx: int, settings: ConsumerSettings, gone: Callable[[], bool]) -> None:
        self.idx = idx
        self.settings = settings
        self.name = settings.name
        self.gone = gone
        self.permits = settings.permits
        self.held = 0          # messages delivered (or nacked) and not acknowledged
        self.delivered = 0
        self.redelivered = 0   # of those, sent again
        self.acked = 0
        self.outbox: queue.SimpleQueue[pa.RecordBatch | None] = queue.SimpleQueue()
        self.detached = False

    def next_batch(self, timeout: float) -> pa.RecordBatch | None:
        """The next batch to stream, or None (none within ``timeout``, or detached)."""
        try:
            return self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None


class Dispatcher:
    """Dispatch and acknowledgement state of one subscription on one partition."""

    def __init__(self, plog: PartitionLog, subscription: str, state: CursorState, *,
                 writer: CursorWriter,
                 dead_letter: Callable[[Dispatcher, DeadLetterIntent, pa.RecordBatch], None]
                 ) -> None:
        self.plog = plog
        self.topic = plog.topic
        self.partition = plog.partition
        self.subscription = subscription
        self.type = state.type
        self._writer = writer
        self._dead_letter = dead_letter
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self.window = ReadWindow(plog.partition, state.mark_delete, state.acked)
        self.consumers: dict[int, Attached] = {}
        self._next_idx = 0
        self._waiting: list[Chunk] = []   # chunks with waiting messages, in log order
        self._waiting_total = 0
        self._owners: np.ndarray | None = None   # key_shared: slot -> consumer idx
        self._held_slot: np.ndarray | None = None  # key_shared: held messages per slot
        self._holder: np.ndarray | None = None     # key_shared: consumer holding the slot
        self._active: int | None = None            # failover/exclusive: the active idx
        self._intents = list(state.dead_letters)
        self._intents_sent: set[int] = set()
        self._dead_letter_sequence = state.dead_letter_sequence
        self._recovering = {i.sequence_id: {(p.segment_id, p.entry_id, p.batch_index)
                                            for p in i.positions} for i in self._intents}
        self._recovered_rows: dict[int, list[pa.RecordBatch]] = {}
        self._delayed = 0
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"tierstream-dispatch-{self.topic}-"
                                             f"{self.partition}-{subscription}")
        self._reader.start()

    # -- consumers ----------------------------------------------------------------------------

    def attach(self, settings: ConsumerSettings, gone: Callable[[], bool]) -> Attached:
        """Add a consumer. A conflict with one that is just leaving (a closed consumer whose
        cancel has not reached the broker yet) is retried for up to a second."""
        deadline = time.monotonic() + _LEAVING_GRACE_S
        while True:
            try:
                return self._attach(settings, gone)
            except ConflictError:
                if time.monotonic() > deadline:
                    raise
                self._stop.wait(0.02)

    def _attach(self, settings: ConsumerSettings, gone: Callable[[], bool]) -> Attached:
        with self._lock:
            for c in [c for c in self.consumers.values() if c.gone()]:
                self._detach(c)
            self._check_joins(settings)
            if self.type is None:
                self.type = settings.type  # stored by the write the attach waits for
            attached = Attached(self._next_idx, settings, gone)
            self._next_idx += 1
            self.consumers[attached.idx] = attached
            if self.type == SubscriptionType.KEY_SHARED and self._held_slot is None:
                self._held_slot = np.zeros(KEY_HASH_SLOTS, dtype=np.int32)
                self._holder = np.full(KEY_HASH_SLOTS, -1, dtype=np.int32)
            self._select()
            self._dispatch()
            self._cond.notify_all()
            return attached

    def _check_joins(self, s: ConsumerSettings) -> None:
        where = f"subscription {self.subscription!r} on {self.topic!r}"
        if self.type is not None and s.type != self.type:
            raise ConflictError(
                f"{where} is {self.type}; a {s.type} consumer cannot join it (a subscription "
                "keeps the type it was created with: delete it, or use another name)")
        for other in self.consumers.values():
            if other.name == s.name:
                raise ConflictError(f"{where} already has a consumer named {s.name!r} "
                                    "connected")
            if s.type == SubscriptionType.EXCLUSIVE:
                raise ConflictError(f"{where} partition {self.partition} already has an "
                                    f"exclusive consumer ({other.name})")
            if s.type == SubscriptionType.KEY_SHARED:
                theirs = other.settings.sticky
                if (theirs is None) != (s.sticky is None):
                    given = "with" if s.sticky is not None else "without"
                    how = "by consistent hashing" if theirs is None else "by sticky key ranges"
                    raise ConflictError(f"{where} splits keys {how}; a consumer {given} "
                                        "key_ranges cannot join it")
                if s.sticky and theirs and any(a.lo < b.hi and b.lo < a.hi
                                               for a in s.sticky for b in theirs):
                    raise ConflictError(
                        f"key ranges {[str(r) for r in s.sticky]} overlap those of consumer "
                        f"{other.name} on {where}")

    def detach(self, attached: Attached) -> None:
        with self._lock:
            self._detach(attached)
            self._dispatch()

    def _detach(self, c: Attached) -> None:
        if c.detached:
            return
        c.detached = True
        self.consumers.pop(c.idx, None)
        for chunk in list(self.window):
            if chunk.open:
                rows = np.flatnonzero((chunk.owner == c.idx) & (
                    (chunk.state == DELIVERED) | (chunk.state == DELAYED)))
                if len(rows):
                    self._return(chunk, rows)
        c.outbox.put(None)
        self._select()

    def _select(self) -> None:
        live = list(self.consumers.values())
        self._owners, self._active = None, None
        if not live:
            return
        if self.type == SubscriptionType.KEY_SHARED:
            ids = np.array([c.idx for c in live], dtype=np.int32)
            owners = slot_owners([c.name for c in live], [c.settings.sticky for c in live])
            self._owners = np.where(owners >= 0, ids[np.maximum(owners, 0)], -1)
        elif self.type in SubscriptionType.CUMULATIVE:
            self._active = live[active_for_partition([c.name for c in live],
                                                     self.partition)].idx

    def flow(self, name: str, permits: int) -> None:
        with self._lock:
            for c in self.consumers.values():
                if c.name == name:
                    c.permits = min(c.permits + permits, c.settings.permits)
            self._dispatch()
            self._cond.notify_all()

    # -- reading ------------------------------------------------------------------------------

    def _lookahead(self) -> int:
        return max(_MIN_LOOKAHEAD, 2 * sum(c.settings.permits for c in self.consumers.values()))

    def _read_loop(self) -> None:
        try:
            for batch in self.plog.read(self.window.read_pos, end=None, follow=True,
                                        cancelled=self._stop.is_set):
                with self._cond:
                    chunk = self.window.add(batch)
                    if self._recovering:
                        self._recover(batch, chunk)
                    if chunk is not None and chunk.waiting:
                        self._waiting.append(chunk)
                        self._waiting_total += chunk.waiting
                        self._dispatch()
                    while self._waiting_total >= self._lookahead() and not self._stop.is_set():
                        self._cond.wait(0.1)
                if self._stop.is_set():
                    return
        except TierstreamError as exc:
            if not self._stop.is_set():
                log.warning("%s partition %d subscription %s stopped reading: %s", self.topic,
                            self.partition, self.subscription, exc)
        except Exception:
            log.exception("%s partition %d subscription %s: reader failed", self.topic,
                          self.partition, self.subscription)

    # -- dispatch -----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hand waiting messages to consumers with permits (lock held)."""
        if not self._waiting or not any(c.permits > 0 for c in self.consumers.values()):
            return
        if self.type == SubscriptionType.SHARED:
            self._dispatch_shared()
        elif self.type == SubscriptionType.KEY_SHARED:
            self._dispatch_key_shared()
        elif self.type in SubscriptionType.CUMULATIVE:
            self._dispatch_in_order()
        self._waiting = [c for c in self._waiting if c.waiting]
        self._cond.notify_all()

    def _dispatch_in_order(self) -> None:
        c = self.consumers.get(self._active) if self._active is not None else None
        if c is None or any(o.held for o in self.consumers.values() if o is not c):
            return  # the previous active consumer's messages come first
        for chunk in self._waiting:
            if c.permits <= 0:
                return
            rows = np.flatnonzero(chunk.state == WAITING)
            take = rows[:c.permits]
            self._deliver(chunk, take, c)
            if len(take) < len(rows):
                return

    def _dispatch_shared(self) -> None:
        ring = sorted(self.consumers.values(), key=lambda c: (-c.permits, c.idx))
        turn = 0
        for chunk in self._waiting:
            rows = np.flatnonzero(chunk.state == WAITING)
            while len(rows):
                ready = [c for c in ring if c.permits > 0]
                if not ready:
                    return
                c = ready[turn % len(ready)]
                turn += 1
                take = rows[:c.permits]
                self._deliver(chunk, take, c)
                rows = rows[len(take):]

    def _dispatch_key_shared(self) -> None:
        owners, holder = self._owners, self._holder
        assert owners is not None and holder is not None
        blocked: np.ndarray | None = None
        for chunk in self._waiting:
            rows = np.flatnonzero(chunk.state == WAITING)
            slots = chunk.slots[rows]
            target = owners[slots]
            held_by = holder[slots]
            ok = (target >= 0) & ((held_by < 0) | (held_by == target))
            if blocked is not None:
                ok &= ~blocked[slots]
            for t in np.unique(target[ok]).tolist():
                c = self.consumers[t]
                idx = np.flatnonzero(ok & (target == t))
                if len(idx) > c.permits:
                    ok[idx[c.permits:]] = False
                    idx = idx[:c.permits]
                if len(idx):
                    self._deliver(chunk, rows[idx], c)
            if not ok.all():
                if blocked is None:
                    blocked = np.zeros(KEY_HASH_SLOTS, dtype=bool)
                blocked[slots[~ok]] = True
            if not any(c.permits > 0 for c in self.consumers.values()):
                return

    def _deliver(self, chunk: Chunk, rows: np.ndarray, c: Attached) -> None:
        if not len(rows):
            return
        limit = c.settings.max_redeliveries
        if limit is not None:
            over = chunk.redeliveries[rows] > limit
            if over.any():
                self._to_dead_letters(chunk, rows[over], c.settings)
                rows = rows[~over]
                if not len(rows):
                    return
        self._set(chunk, rows, DELIVERED)
        chunk.owner[rows] = c.idx
        chunk.until[rows] = time.monotonic()
        if self._holder is not None and self._held_slot is not None:
            slots = chunk.slots[rows]
            np.add.at(self._held_slot, slots, 1)
            self._holder[slots] = c.idx
        n = len(rows)
        c.held += n
        c.permits -= n
        c.delivered += n
        counts = chunk.redeliveries[rows]
        c.redelivered += int(np.count_nonzero(counts))
        assert chunk.batch is not None
        if n == chunk.n:
            batch = chunk.batch
        elif rows[-1] - rows[0] + 1 == n:
            batch = chunk.batch.slice(int(rows[0]), n)
        else:
            batch = chunk.batch.take(pa.array(rows))
        c.outbox.put(pa.RecordBatch.from_arrays(
            [*batch.columns, pa.array(counts, type=pa.int32())], schema=CONSUMER_SCHEMA))

    def _set(self, chunk: Chunk, rows: np.ndarray, state: int) -> None:
        """Move ``rows`` of ``chunk`` to ``state``, keeping the waiting list and counts."""
        before = chunk.waiting
        chunk.set_state(rows, state)
        self._waiting_total += chunk.waiting - before
        if chunk.waiting and not before:
            bisect.insort(self._waiting, chunk, key=lambda k: k.entry)

    def _unhold(self, chunk: Chunk, rows: np.ndarray) -> None:
        """``rows`` (delivered or delayed) are no longer held by their consumer."""
        owners, counts = np.unique(chunk.owner[rows], return_counts=True)
        for idx, n in zip(owners.tolist(), counts.tolist(), strict=True):
            c = self.consumers.get(idx)
            if c is not None:
                c.held -= n
        if self._held_slot is not None and self._holder is not None:
            slots = chunk.slots[rows]
            np.subtract.at(self._held_slot, slots, 1)
            free = slots[self._held_slot[slots] <= 0]
            self._holder[free] = -1
        chunk.owner[rows] = -1

    def _return(self, chunk: Chunk, rows: np.ndarray) -> None:
        """Held ``rows`` go back to waiting (sent again, ahead of later messages)."""
        self._delayed -= int(np.count_nonzero(chunk.state[rows] == DELAYED))
        self._unhold(chunk, rows)
        chunk.redeliveries[rows] += 1
        self._set(chunk, rows, WAITING)

    # -- acknowledgements ---------------------------------------------------------------------

    def ack(self, name: str, segment: np.ndarray, entry: np.ndarray, index: np.ndarray) -> int:
        """Acknowledge the given messages; the write generation that stores it."""
        with self._lock:
            found, missing = self.window.locate(segment, entry, index)
            for chunk, rows in found:
                self._ack_rows(chunk, np.unique(rows), name)
            for pos in missing:
                if pos >= self.window.read_pos:
                    self.window.ack_ahead(pos, _after(pos))
            return self._acked()

    def ack_cumulative(self, name: str, position: Position) -> int:
        """Acknowledge every message up to and including ``position``."""
        with self._lock:
            if self.type not in SubscriptionType.CUMULATIVE:
                raise ConfigError(
                    f"ack_cumulative is for exclusive and failover subscriptions; "
                    f"{self.subscription!r} is {self.type}: acknowledge each batch with ack()")
            self._ack_through(_after(position), name)
            return self._acked()

    def set_position(self, position: Position) -> int:
        """Everything before ``position`` is acknowledged (a Spark stream's commit)."""
        with self._lock:
            self._ack_through(position, None)
            return self._acked()

    def _ack_through(self, end: Position, name: str | None) -> None:
        for chunk in list(self.window):
            if chunk.position(0) >= end:
                break
            if not chunk.open:
                continue
            upto = chunk.n if chunk.after() <= end else max(0, end.batch_index - chunk.bi0)
            rows = np.flatnonzero(chunk.state[:upto] != ACKED)
            self._ack_rows(chunk, rows, name)
        if end > self.window.read_pos:
            self.window.ack_ahead(self.window.read_pos, end)

    def _ack_rows(self, chunk: Chunk, rows: np.ndarray, name: str | None) -> None:
        state = chunk.state[rows]
        held = rows[(state == DELIVERED) | (state == DELAYED)]
        self._delayed -= int(np.count_nonzero(state == DELAYED))
        if len(held):
            for c in self.consumers.values():
                if c.name == name:
                    c.acked += len(held)
            self._unhold(chunk, held)
        live = rows[(state != ACKED) & (state != DEAD)]
        if len(live):
            self._set(chunk, live, ACKED)

    def _acked(self) -> int:
        self.window.trim()
        self._dispatch()  # acknowledged slots may free the keys that moved
        self._cond.notify_all()
        return self._writer.dirty(self)

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
                rows = np.unique(rows)
                rows = rows[(chunk.state[rows] == DELIVERED) & (chunk.owner[rows] == owner)]
                if len(rows):
                    self._set(chunk, rows, DELAYED)
                    chunk.until[rows] = ready
                    self._delayed += len(rows)

    def tick(self, now: float) -> None:
        """Redeliver what a nack delayed and what outlived its consumer's ack timeout."""
        timeouts = {c.idx: c.settings.ack_timeout_s for c in self.consumers.values()
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
                rows = np.flatnonzero(due)
                if len(rows):
                    self._return(chunk, rows)
                    changed = True
            if changed:
                self._dispatch()

    # -- dead letters -------------------------------------------------------------------------

    def _to_dead_letters(self, chunk: Chunk, rows: np.ndarray, s: ConsumerSettings) -> None:
        topic = s.dead_letter_topic or f"{self.topic}-{self.subscription}-DLQ"
        self._set(chunk, rows, DEAD)
        intent = DeadLetterIntent(self._dead_letter_sequence, topic,
                                  [chunk.position(int(r)) for r in rows])
        self._dead_letter_sequence += 1
        self._intents.append(intent)
        assert chunk.batch is not None
        rows_batch = chunk.batch.take(pa.array(rows))
        self._send_dead_letters(intent, rows_batch, chunk.redeliveries[rows])

    def _send_dead_letters(self, intent: DeadLetterIntent, rows: pa.RecordBatch,
                           counts: np.ndarray) -> None:
        self._intents_sent.add(intent.sequence_id)
        batch = pa.RecordBatch.from_arrays(
            [*rows.columns, pa.array(counts, type=pa.int32())], schema=CONSUMER_SCHEMA)
        self._dead_letter(self, intent, batch)

    def _recover(self, batch: pa.RecordBatch, chunk: Chunk | None) -> None:
        """Messages of dead-letter intents stored before a restart: sent again once read."""
        seg = batch.column("segment_id")[0].as_py()
        ent = batch.column("entry_id")[0].as_py()
        indexes = batch.column("batch_index").to_pylist()
        for intent in self._intents:
            wanted = self._recovering.get(intent.sequence_id)
            if not wanted:
                continue
            rows = [i for i, b in enumerate(indexes) if (seg, ent, b) in wanted]
            if not rows:
                continue
            if chunk is not None:
                self._set(chunk, np.array(rows), DEAD)
            self._recovered_rows.setdefault(intent.sequence_id, []).append(
                batch.take(pa.array(rows)))
            wanted.difference_update((seg, ent, indexes[i]) for i in rows)
        for intent in self._intents:  # in sequence order, so the dead-letter topic dedups
            if intent.sequence_id in self._intents_sent:
                continue
            if self._recovering.get(intent.sequence_id):
                break
            parts = self._recovered_rows.pop(intent.sequence_id, [])
            self._recovering.pop(intent.sequence_id, None)
            if parts:
                table = pa.Table.from_batches(parts).combine_chunks()
                self._send_dead_letters(intent, table.to_batches()[0],
                                        np.zeros(table.num_rows, dtype=np.int32))

    def dead_lettered(self, intent: DeadLetterIntent) -> None:
        """``intent``'s messages are stored on the dead-letter topic: acknowledge them."""
        with self._lock:
            by_entry: dict[tuple[int, int], list[int]] = {}
            for p in intent.positions:
                by_entry.setdefault((p.segment_id, p.entry_id), []).append(p.batch_index)
            for (s, e), indexes in by_entry.items():
                chunk = self.window.by_entry.get((s, e))
                if chunk is not None and chunk.open:
                    rows = np.array(indexes) - chunk.bi0
                    self._set(chunk, rows[chunk.state[rows] == DEAD], ACKED)
            self._intents = [i for i in self._intents if i.sequence_id != intent.sequence_id]
            self._acked()

    # -- state --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return CursorState(self.partition, self.window.mark_delete(),
                               self.window.acked_ranges(), self.type, list(self._intents),
                               self._dead_letter_sequence).to_json()

    def unacknowledged(self) -> int:
        """Messages read and not acknowledged (the backlog before the read position)."""
        with self._lock:
            return self.window.unacknowledged()

    def stats(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for c in self.consumers.values():
                if self.type == SubscriptionType.KEY_SHARED and self._owners is not None:
                    assignment = _ranges_of(self._owners == c.idx)
                elif self.type in SubscriptionType.CUMULATIVE:
                    assignment = "active" if c.idx == self._active else "standby"
                else:
                    assignment = "any"
                out.append({"name": c.name, "partition": self.partition,
                            "assignment": assignment, "unacked": c.held,
                            "delivered": c.delivered, "redelivered": c.redelivered,
                            "permits": c.permits})
            return out

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            for c in list(self.consumers.values()):
                c.outbox.put(None)
            self._cond.notify_all()
        self._reader.join(timeout=5)


def _after(pos: Position) -> Position:
    return Position.known(pos.partition, pos.segment_id, pos.entry_id, pos.batch_index + 1)


def _ranges_of(mask: np.ndarray) -> str:
    """``mask`` over the hash slots as ``lo:hi`` ranges (``-`` if none)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    pairs = edges.reshape(-1, 2)
    if not len(pairs):
        return "-"
    text = ", ".join(f"{a}:{b}" for a, b in pairs[:4].tolist())
    return text + (f" (+{len(pairs) - 4} more)" if len(pairs) > 4 else "")
