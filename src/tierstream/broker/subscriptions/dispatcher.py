"""One subscription on one partition: who gets which message, and what is acknowledged.

A reader thread reads the partition from the mark-delete position into the read window
(:class:`~tierstream.broker.subscriptions.read_window.ReadWindow`); a dispatch pass hands
waiting messages to consumers, in log order, each up to its permits (its receiver queue).
What a consumer holds unacknowledged goes back to waiting when it leaves, when its ack
timeout passes, or when it nacks (after the nack delay), with its redelivery count raised.

Key order (``key_shared``, PIP-379) is kept by
:class:`~tierstream.broker.subscriptions.key_holds.KeyHolds`; the other types' turns are in
``dispatch_order.py``. ``failover`` and ``exclusive`` keep the partition's order: a new
active consumer starts once the previous one's messages are acknowledged or returned.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tierstream.broker.subscriptions.ack_doubt import LoadedCursor, cumulative_in_doubt, in_doubt
from tierstream.broker.subscriptions.attached import Attached, ConsumerSettings, check_join
from tierstream.broker.subscriptions.compacted_source import Reads
from tierstream.broker.subscriptions.cursor_state import CursorState, DeadLetterIntent
from tierstream.broker.subscriptions.dead_letters import DeadLetterSide, IntentRecovery
from tierstream.broker.subscriptions.delivery_time import TIMED, DeliveryTimes
from tierstream.broker.subscriptions.dispatch_order import in_order, round_robin
from tierstream.broker.subscriptions.dispatcher_figures import DispatcherFigures
from tierstream.broker.subscriptions.key_holds import KeyHolds
from tierstream.broker.subscriptions.read_window import (
    ACKED,
    DEAD,
    DELAYED,
    DELIVERED,
    WAITING,
    Chunk,
    ReadWindow,
    following,
    span,
)
from tierstream.broker.subscriptions.redelivery import Redelivery
from tierstream.broker.subscriptions.selectors import active_for_partition
from tierstream.errors import ConfigError, ConflictError, TierstreamError
from tierstream.model.positions import Position
from tierstream.model.subscription_type import SubscriptionType
from tierstream.util.threads import Worker

if TYPE_CHECKING:
    from tierstream.broker.subscriptions.cursor_writer import CursorWriter
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["Attached", "ConsumerSettings", "Dispatcher"]

log = logging.getLogger(__name__)

#: Messages read ahead of what consumers can take, at least (so a stalled key does not stop
#: reading for the others, and an idle subscription does not read the whole log).
_MIN_LOOKAHEAD = 1000

#: How long a join that conflicts with a connected consumer is retried (it may be leaving).
_LEAVING_GRACE_S = 1.0
#: a failed read is tried again after this, doubling up to the second
_READ_RETRY_FIRST_S = 0.2
_READ_RETRY_MAX_S = 5.0


class Dispatcher(DeliveryTimes, DeadLetterSide, DispatcherFigures, Redelivery):
    """Dispatch and acknowledgement state of one subscription on one partition (delayed
    delivery: ``delivery_time.py``; dead letters: ``dead_letters.py``; nacks, ack timeouts
    and silent consumers: ``redelivery.py``)."""

    def __init__(self, plog: PartitionLog, subscription: str, state: CursorState, *,
                 writer: CursorWriter,
                 dead_letter: Callable[[Dispatcher, DeadLetterIntent, pa.RecordBatch], None],
                 reads: Reads | None = None) -> None:
        self.plog = plog
        #: where it reads from: the log (or, compacted, its snapshot first: compacted_source)
        self.compacted = reads is not None
        self._reads: Reads = reads or (lambda start, cancelled: plog.read(
            start, end=None, follow=True, cancelled=cancelled))
        self.topic = plog.topic
        self.partition = plog.partition
        self.subscription = subscription
        self.type = state.type
        self.label = state.label
        self._writer = writer
        self._dead_letter = dead_letter
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        #: the partition's log ended under it (let go, to be opened again as a new log):
        #: the registry loads a new dispatcher for the next consumer (registry.py)
        self.ended = False
        self.window = ReadWindow(plog.partition, state.mark_delete, state.acked,
                                 compacted=self.compacted)
        self._loaded = LoadedCursor(state)  # what was acknowledged before this broker
        self.consumers: dict[int, Attached] = {}
        self._next_idx = 0
        self._waiting: list[Chunk] = []   # chunks with waiting messages, in log order
        self._outgoing: dict[int, list[pa.RecordBatch]] = {}  # batches of one dispatch pass
        self._waiting_total = 0
        self._reader_waits = False  # the reader waits for fewer waiting messages
        self._keys: KeyHolds | None = None  # key_shared: owners and holders of the slots
        self._active: int | None = None            # failover/exclusive: the active idx
        self._intents = list(state.dead_letters)
        self._intents_sent: set[int] = set()
        self._dead_letter_sequence = state.dead_letter_sequence
        self._recovery = IntentRecovery(self._intents)
        self._delayed = 0  # DELAYED messages: nacked, or held for their time (_timed)
        self._timed = 0
        #: a partition grown at a scale event dispatches nothing until this says its keys'
        #: earlier messages were acknowledged (broker/subscriptions/registry.py); then it is dropped
        self.gate: Callable[[], bool] | None = None
        self._gated = False
        # an error nobody foresaw ends the reads: its consumers are let go (_end), to attach
        # again to a dispatcher that reads
        self._reader = Worker(f"tierstream-dispatch-{self.topic}-{self.partition}-"
                              f"{subscription}", self._read_loop,
                              on_error=lambda _: self._end()).start()

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
            for c in [c for c in self.consumers.values() if c.gone() or c.lost_to(settings)]:
                self._detach(c)  # (lost_to: its client attaches again, its stream lost)
            check_join(self.subscription, self.topic, self.partition, self.type,
                       self.consumers.values(), settings)
            if self.type is None:
                self.type = settings.type  # stored by the write the attach waits for
            if self.type in SubscriptionType.CUMULATIVE:
                self._release_all_timed()
            attached = Attached(self._next_idx, settings, gone)
            self._next_idx += 1
            self.consumers[attached.idx] = attached
            if self.type == SubscriptionType.KEY_SHARED and self._keys is None:
                self._keys = KeyHolds()
            try:
                self._select()
                self._dispatch()
            except BaseException:  # a bug: not attached, or its client would meet itself
                self._outgoing.pop(attached.idx, None)
                self._detach(attached)
                raise
            self._cond.notify_all()
            return attached

    def detach(self, attached: Attached) -> None:
        with self._lock:
            self._detach(attached)
            self._dispatch()

    def _detach(self, c: Attached) -> None:
        if c.detached or self.consumers.get(c.idx) is not c:  # gone, or another's consumer
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
        self._active = None
        if self._keys is not None:
            self._keys.assign(live)
        elif live and self.type in SubscriptionType.CUMULATIVE:
            self._active = live[active_for_partition([c.name for c in live],
                                                     self.partition)].idx
            if self.type == SubscriptionType.FAILOVER:
                for c in live:
                    c.active = c.idx == self._active

    def flow(self, name: str, permits: int) -> None:
        with self._lock:
            for c in self.consumers.values():
                if c.name == name:
                    c.permits = min(c.permits + permits, c.settings.permits)
            self._dispatch()

    # -- reading ------------------------------------------------------------------------------

    def _lookahead(self) -> int:
        return max(_MIN_LOOKAHEAD, 2 * sum(c.settings.permits for c in self.consumers.values()))

    def _read_loop(self) -> None:
        """Read the partition into the window for as long as the subscription is loaded. A
        read that fails (every replica of an entry unreadable, the tier unreachable) is tried
        again from where it stopped, with backoff, until it reads: the subscription stalls
        while its data cannot be read, never for good."""
        pause, failing_since = _READ_RETRY_FIRST_S, None
        while not self._stop.is_set():
            try:
                for batch in self._reads(self.window.read_pos, self._stop.is_set):
                    if failing_since is not None:
                        log.warning("%s partition %d subscription %s reads again after %.1f s",
                                    self.topic, self.partition, self.subscription,
                                    time.monotonic() - failing_since)
                        pause, failing_since = _READ_RETRY_FIRST_S, None
                    with self._cond:
                        chunk = self.window.add(batch)
                        if chunk is not None:
                            self._hold_for_time(chunk)
                        if self._recovery:
                            self._recover(batch, chunk)
                        if chunk is not None and chunk.waiting:
                            self._waiting.append(chunk)
                            chunk.queued = True
                            self._waiting_total += chunk.waiting
                            self._dispatch()
                        while self._waiting_total >= self._lookahead() \
                                and not self._stop.is_set():
                            self._reader_waits = True
                            self._cond.wait(0.1)
                        self._reader_waits = False
                    if self._stop.is_set():
                        return
                # the follow ended: the broker closes, or the partition is gone from here
                return self._end()
            except TierstreamError as exc:
                if self._stop.is_set():
                    return
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("%s partition %d subscription %s cannot read: %s; trying again "
                                "until it can", self.topic, self.partition, self.subscription,
                                exc)
                self._stop.wait(pause)
                pause = min(pause * 2, _READ_RETRY_MAX_S)

    def _end(self) -> None:
        """No more reads through this dispatcher: its consumers are let go (their streams
        end and their clients attach again, to a dispatcher of the log served then).
        Before, they stayed attached to a reader that had stopped: a partition let go at a
        lapsed lease and served again as a new log delivered nothing more, for good."""
        with self._lock:
            self.ended = True
            for c in list(self.consumers.values()):
                self._detach(c)
            self._cond.notify_all()

    # -- dispatch -----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hand waiting messages to consumers with permits (lock held); list only chunks with
        waiting messages, after a pass with nobody to hand to too (acks may empty some)."""
        if self._waiting and any(c.permits > 0 for c in self.consumers.values()) \
                and self._gate_open():
            if self.type == SubscriptionType.SHARED:
                round_robin(self._waiting, self.consumers, self._deliver)
            elif self._keys is not None:
                self._keys.dispatch(self._waiting, self.consumers, self._deliver)
            elif self.type in SubscriptionType.CUMULATIVE:
                in_order(self._waiting, self.consumers, self._active, self._deliver)
            # one batch per consumer and pass: a consumer's keys are spread over many chunks,
            # and each batch costs it an ack call
            for idx, parts in self._outgoing.items():
                self.consumers[idx].outbox.put(parts[0] if len(parts) == 1 else
                                               pa.concat_batches(parts))
            self._outgoing.clear()
        for chunk in self._waiting:
            chunk.queued = chunk.waiting > 0
            if not chunk.queued:
                chunk.handed_out()
        self._waiting = [c for c in self._waiting if c.queued]
        # wake the reader if it waits for room there is now; only then: a wake for nothing
        # was two thread switches on every ack and every flow
        if self._reader_waits and self._waiting_total < self._lookahead():
            self._cond.notify_all()

    def _gate_open(self) -> bool:
        """Whether a partition grown at a scale event may dispatch (``tick`` asks again)."""
        if self.gate is not None:
            self._gated = not self.gate()
            if not self._gated:
                self.gate = None  # acknowledgements only move forward: open for good
        return not self._gated

    def _deliver(self, chunk: Chunk, rows: np.ndarray, c: Attached) -> None:
        """Hand ``rows`` (waiting, as every dispatch rule's are) of ``chunk`` to ``c``."""
        if not len(rows):
            return
        limit = c.settings.max_redeliveries
        if limit is not None and chunk.resent:
            over = chunk.redeliveries[rows] > limit
            if over.any():
                self._to_dead_letters(chunk, rows[over], c.settings)
                rows = rows[~over]
                if not len(rows):
                    return
        n = len(rows)
        sel = span(rows)  # (a slice when the rows are one run: views, not gathers)
        chunk.hand_out(sel, n)
        self._waiting_total -= n
        chunk.owner[sel], chunk.until[sel] = c.idx, time.monotonic()
        if self._keys is not None:
            self._keys.hold(chunk.slots[sel], c.idx)
        c.held += n
        c.permits -= n
        c.delivered += n
        if chunk.resent:
            c.redelivered += int(np.count_nonzero(chunk.redeliveries[sel]))
        self._outgoing.setdefault(c.idx, []).append(chunk.take(rows, sel))

    def _set(self, chunk: Chunk, rows: np.ndarray, state: int) -> None:
        """Move ``rows`` of ``chunk`` to ``state``, keeping the waiting list and counts."""
        before = chunk.waiting
        chunk.set_state(rows, state)
        self._waiting_total += chunk.waiting - before
        if chunk.waiting and not chunk.queued:  # (one an ack emptied may still be listed)
            bisect.insort(self._waiting, chunk, key=lambda k: k.entry)
            chunk.queued = True

    def _unhold(self, chunk: Chunk, rows: np.ndarray, *, delivered: bool = False) -> None:
        """``rows`` (delivered or delayed; ``delivered``: all delivered) are no longer held by
        their consumer."""
        owner, mine = chunk.owner[sel := span(rows)], rows
        if not delivered:  # (a delivered message has its consumer; one held for its time not)
            mine, owner = rows[owner >= 0], owner[owner >= 0]
        if len(owner) and (owner == owner[0]).all():  # one consumer's, as an ack's are
            counts = {int(owner[0]): len(owner)}
        else:
            ids, n = np.unique(owner, return_counts=True)
            counts = dict(zip(ids.tolist(), n.tolist(), strict=True))
        for idx, count in counts.items():
            c = self.consumers.get(idx)
            if c is not None:
                c.held -= count
        if self._keys is not None:
            self._keys.release(chunk.slots[mine])
        chunk.owner[sel] = -1

    def _return(self, chunk: Chunk, rows: np.ndarray) -> None:
        """Held ``rows`` go back to waiting (sent again, ahead of later messages)."""
        self._delayed -= int(np.count_nonzero(chunk.state[rows] == DELAYED))
        self._unhold(chunk, rows)
        chunk.count_redelivery(rows)
        self._set(chunk, rows, WAITING)

    # -- acknowledgements ---------------------------------------------------------------------

    def ack(self, name: str, segment: np.ndarray, entry: np.ndarray, index: np.ndarray, *,
            retry: bool = False) -> tuple[int, int]:
        """Acknowledge the given messages: the write generation that stores it, and, for a
        ``retry`` (an ack resent across an outage, or of messages received on a connection
        since lost), how many of them may have been delivered to another consumer meanwhile
        (``ack_doubt.in_doubt``)."""
        with self._lock:
            found, missing = self.window.locate(segment, entry, index)
            mine = {c.idx for c in self.consumers.values() if c.name == name}
            doubt = in_doubt(self.window, self._loaded, mine, segment, entry, index) \
                if retry else 0
            for chunk, rows in found:
                self._ack_rows(chunk, rows, name)
            for pos in missing:
                if pos >= self.window.read_pos:
                    self.window.ack_ahead(pos, following(pos))
            return self._acked(), doubt

    def ack_cumulative(self, name: str, position: Position, *, retry: bool = False
                       ) -> tuple[int, int]:
        """Acknowledge every message up to and including ``position``: the write generation,
        and for a ``retry`` how many may have gone to another consumer meanwhile."""
        with self._lock:
            if self.type not in SubscriptionType.CUMULATIVE:
                raise ConfigError(
                    f"ack_cumulative is for exclusive and failover subscriptions; "
                    f"{self.subscription!r} is {self.type}: acknowledge each batch with ack()")
            mine = {c.idx for c in self.consumers.values() if c.name == name}
            doubt = cumulative_in_doubt(self.window, self._loaded, mine, following(position),
                                        self.plog.backlog) if retry else 0
            self._ack_through(following(position), name)
            return self._acked(), doubt

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
            rows = np.flatnonzero(chunk.state[:chunk.count_before(end)] != ACKED)
            self._ack_rows(chunk, rows, name)
        if end > self.window.read_pos:
            self.window.ack_ahead(self.window.read_pos, end)

    def _ack_rows(self, chunk: Chunk, rows: np.ndarray, name: str | None) -> None:
        sel = span(rows)
        state = chunk.state[sel]
        delivered = len(rows) > 0 and bool((state == DELIVERED).all())  # as most acks' rows
        held = rows if delivered else rows[(state == DELIVERED) | (state == DELAYED)]
        if not delivered:
            self._delayed -= int(np.count_nonzero(state == DELAYED))
            self._timed -= int(np.count_nonzero(chunk.owner[held] == TIMED))
        if len(held):
            for c in self.consumers.values():
                if c.name == name:
                    c.acked += len(held)
            self._unhold(chunk, held, delivered=delivered)
        if delivered:  # (one step, where counting every state first took six)
            chunk.settle(sel, len(rows))
        else:
            live = rows[(state != ACKED) & (state != DEAD)]
            if len(live):
                self._set(chunk, live, ACKED)

    def _acked(self) -> int:
        self.window.trim()
        self._dispatch()  # acknowledged slots may free the keys that moved; room to read
        return self._writer.dirty(self)

    # -- state --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ranges, entries = self.window.acked_state()
            return CursorState(self.partition, self.window.mark_delete(), ranges, self.type,
                               list(self._intents), self._dead_letter_sequence,
                               entries, label=self.label).to_json()

    def stop(self) -> None:
        """:meth:`close` without waiting for the reader to end (it ends at its next read)."""
        self._stop.set()
        with self._cond:
            for c in list(self.consumers.values()):
                c.outbox.put(None)
            self._cond.notify_all()

    def close(self) -> None:
        self.stop()
        self._reader.join(timeout=5)
