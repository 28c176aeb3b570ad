"""Durable subscriptions, as Pulsar's: four types, individual acks, redelivery, dead letters.

One :class:`~tierstream.broker.subscriptions.dispatcher.Dispatcher` per (topic,
subscription, partition), loaded when a consumer attaches or an ack arrives; its state is
stored by the :class:`~tierstream.broker.subscriptions.cursor_writer.CursorWriter` (grouped
commits). A cursor a Spark stream keeps (``set-cursor``) is stored directly and has no type
until a consumer attaches to it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from tierstream.broker.subscriptions.attached import Attached, ConsumerSettings
from tierstream.broker.subscriptions.compacted_source import compacted_reads
from tierstream.broker.subscriptions.cursor_state import NON_DURABLE, CursorState
from tierstream.broker.subscriptions.cursor_writer import CursorWriter, NotStoredError
from tierstream.broker.subscriptions.dead_letters import DeadLetterWriter
from tierstream.broker.subscriptions.dispatcher import Dispatcher
from tierstream.errors import (
    ConfigError,
    ConflictError,
    NotFoundError,
    TierstreamError,
    UnavailableError,
)
from tierstream.metadata.records import SegmentState
from tierstream.model.lineage import ScaleEvent
from tierstream.model.positions import Position
from tierstream.util.faults import crash_point, fault_point
from tierstream.util.threads import Worker
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.broker.store import Store

__all__ = ["Subscriptions"]

log = logging.getLogger(__name__)

#: How often nack delays, ack timeouts and silent consumers are checked.
_TICK_S = 0.05
#: How often a closed gate asks another broker again whether its partition's messages
#: before a scale event are acknowledged (several brokers).
_ASK_AGAIN_S = 0.5


class Subscriptions:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._metadata = store.metadata
        self.writer = CursorWriter(store.metadata,
                                   on_error=store.thread_failed("the cursor writer"))
        self.dead_letters = DeadLetterWriter(store, self.writer)
        self._lock = threading.Lock()
        self._dispatchers: dict[tuple[str, str, int], Dispatcher] = {}
        #: dispatchers of subscriptions not stored yet: the first attach waits for the write
        self._unwritten: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
        # without it no ack timeout, nack delay or delayed message would ever come due
        self._ticker = Worker("subscription-timer", self._tick,
                              on_error=store.thread_failed("the subscriptions' timer"))
        self._ticker.start()
        #: asks other brokers whether a gate opened, off the dispatchers' locks
        self._asking = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gate-ask")
        if store.cluster is None:  # with several brokers, the others' readers live on
            self._drop_non_durable()

    def _drop_non_durable(self) -> None:
        """Cursors of non-durable subscriptions (Pulsar readers) left by a broker that
        stopped while they were open: their readers are gone with it."""
        for topic in self._store.topics():
            for row in self._metadata.cursors(topic.name):
                state = row["state"]
                if isinstance(state, dict) and state.get("label") == NON_DURABLE:
                    self._metadata.delete_cursors(topic.name, row["subscription"])
                    log.info("%s: the cursor of reader %r, gone with the broker, is deleted",
                             topic.name, row["subscription"])

    def _dispatcher(self, topic: str, subscription: str, partition: int,
                    initial: Position | None = None, label: str | None = None, *,
                    compacted: bool = False) -> Dispatcher:
        """The loaded dispatcher; loaded from its stored state, or created at ``initial``
        with ``label`` (NotFoundError without one). One loaded for a consumer that reads
        ``compacted`` reads the partition's compaction snapshot first (one loaded before
        for a consumer that did not stays as it is)."""
        key = (topic, subscription, partition)
        with self._lock:
            d = self._dispatchers.get(key)
            if d is not None and not d.ended and not d.plog.lost:
                return d
            if d is not None:  # of a log no longer served: its state is stored, load anew
                self._dispatchers.pop(key)
                d.stop()
            plog = self._store.partition(topic, partition)
            stored = self._metadata.get_cursor(*key)
            if stored is not None:
                state = CursorState.from_json(stored, partition)
            elif initial is not None:
                state = CursorState(partition, initial, label=label)
            else:
                raise NotFoundError(f"topic {topic!r} has no subscription {subscription!r} "
                                    f"on partition {partition}")
            d = Dispatcher(plog, subscription, state, writer=self.writer,
                           dead_letter=self.dead_letters.submit,
                           reads=compacted_reads(plog, self._metadata, self._store.tier)
                           if compacted else None)
            if stored is None:
                self._unwritten.add(d)
            record = self._store.topic(topic)
            if partition >= record.partitions:  # new in a growth announced, not yet read
                d.gate = self._announced_gate(topic, subscription, partition)
            elif ancestors := record.lineage.ancestors(partition):
                d.gate = self._gate(topic, subscription, ancestors)
            self._dispatchers[key] = d
            return d

    def _announced_gate(self, topic: str, subscription: str, partition: int
                        ) -> Callable[[], bool]:
        """Closed while the growth that made ``partition`` is only announced (its Pulsar
        clients write to it, its parents may still get keys routed by the old count:
        ``broker/topics/growth.py``), then :meth:`_gate` of the event recorded."""
        recorded: list[Callable[[], bool]] = []

        def gate() -> bool:
            if not recorded:
                ancestors = self._store.topic(topic).lineage.ancestors(partition)
                if not ancestors:
                    return False
                recorded.append(self._gate(topic, subscription, ancestors))
            return recorded[0]()

        return gate

    def _gate(self, topic: str, subscription: str, ancestors: list[tuple[int, ScaleEvent]]
              ) -> Callable[[], bool]:
        """Whether every message the subscription has in ``ancestors`` from before the
        event their keys left them at is acknowledged: a key's messages after a scale event
        are dispatched after its earlier ones (``lineage.py``)."""
        ends = []
        for a, event in ancestors:
            closed = self._store.partition(topic, a).closed_segments() if self._here(
                topic, a) else [s for s in self._metadata.segments(topic, a)
                                if s.state != SegmentState.OPEN]
            before = [s for s in closed if s.segment_id < event.first_segment_id and s.entries]
            if before:
                ends.append(Position(a, before[-1].segment_id, before[-1].entries, 0))
        asks: dict[Position, tuple[float, Future[bool] | None]] = {}

        def acknowledged() -> bool:
            for end in ends:
                done = self.acknowledged_before(topic, subscription, end.partition)
                if done is None or not done < end:
                    continue  # the subscription has nothing there, or all of it is acked
                # an entry's end may be named (s, e, n) or (s, e + 1, 0): count what lies
                # between, here or (an ancestor another broker serves) as its owner does
                if self._here(topic, end.partition):
                    try:
                        if self._store.partition(topic, end.partition).advance(done, 1,
                                                                              end)[1]:
                            return False
                    except TierstreamError:  # moved away meanwhile: asked again next tick
                        return False
                elif not self._asked(topic, done, end, asks):
                    return False
            return True

        return acknowledged

    def _here(self, topic: str, partition: int) -> bool:
        return self._store.cluster is None or (topic, partition) in self._store.serves()

    def _asked(self, topic: str, done: Position, end: Position,
               asks: dict[Position, tuple[float, Future[bool] | None]]) -> bool:
        """Whether the owner of ``end``'s partition said nothing lies between ``done`` and
        ``end``: asked on another thread (a gate is looked at under its dispatcher's lock),
        again every :data:`_ASK_AGAIN_S` while it says no or does not answer."""
        at, future = asks.get(end, (0.0, None))
        if future is not None and future.done() and future.exception() is None \
                and future.result():
            return True
        if (future is None or future.done()) and time.monotonic() - at >= _ASK_AGAIN_S:
            asks[end] = (time.monotonic(), self._asking.submit(self._ask_owner, topic, done, end))
        return False

    def _ask_owner(self, topic: str, done: Position, end: Position) -> bool:
        cluster = self._store.cluster
        owner = self._store.owners.owner_of(topic, end.partition)
        if cluster is None or owner is None or owner.url is None:
            return False
        try:
            answer = cluster.peers.call(owner.url, "advance", {
                "topic": topic, "partition": end.partition, "start": done.to_dict(),
                "bound": end.to_dict(), "max_messages": 1})
        except TierstreamError:  # down, moving it: asked again
            return False
        return int(answer["messages"]) == 0

    def attach(self, topic: str, subscription: str, partition: int,
               settings: ConsumerSettings, *, initial: Position,
               gone: Callable[[], bool], label: str | None = None,
               compacted: bool = False) -> Attached:
        """Attach a consumer; a new subscription starts at ``initial``, its cursor labelled
        ``label`` (``NON_DURABLE``: deleted at the next broker start); ``compacted``: see
        :meth:`_dispatcher`."""
        d = self._dispatcher(topic, subscription, partition, initial, label,
                             compacted=compacted)
        crash_point("consumer.attaching")
        attached = d.attach(settings, gone)
        try:
            fault_point("consumer.attached")
            with self._lock:  # let go meanwhile (its partition moved) or ended: its consumers
                current = self._dispatchers.get((topic, subscription, partition)) is d \
                    and not d.ended  # were detached before this one came: it would wait
            if not current:
                if d.plog.lost:
                    raise self._store.not_served(topic, partition)  # names the owner now
                raise UnavailableError(f"{topic} partition {partition}: subscription "
                                       f"{subscription!r} was reloaded as the consumer "
                                       "attached; attach again")
            if d in self._unwritten:  # the subscription exists once attached
                self._wait(self.writer.dirty(d), (topic, partition))
                self._unwritten.discard(d)
        except BaseException:
            # no stream will serve it: left attached, it would hold what it is sent (and an
            # exclusive subscription) for good, and its client, told to attach again,
            # would meet itself ("already has a consumer named ... connected")
            d.detach(attached)
            raise
        return attached

    def detach(self, topic: str, subscription: str, partition: int, attached: Attached
               ) -> None:
        d = self._dispatchers.get((topic, subscription, partition))
        if d is not None:
            d.detach(attached)

    def close_consumer(self, topic: str, subscription: str, partition: int, name: str) -> None:
        """A consumer's close: detached at once, not when its stream's end reaches us."""
        d = self._dispatchers.get((topic, subscription, partition))
        if d is None:
            return
        for c in [c for c in list(d.consumers.values()) if c.name == name]:
            d.detach(c)

    def keepalive(self, topic: str, subscription: str, partition: int, name: str) -> bool:
        """Consumer ``name`` is there (its client's keepalive): whether it is attached here
        (not: its stream is lost, and its client attaches again)."""
        d = self._dispatchers.get((topic, subscription, partition))
        return d is not None and d.heard(name, time.monotonic())

    def ack(self, topic: str, subscription: str, partition: int, consumer: str,
            segment: np.ndarray, entry: np.ndarray, index: np.ndarray, *, retry: bool = False
            ) -> int:
        """Store the ack; for a ``retry``, how many of its messages may have been delivered
        again before it came (``Dispatcher.ack``)."""
        d = self._dispatcher(topic, subscription, partition)
        generation, doubt = d.ack(consumer, segment, entry, index, retry=retry)
        self._wait(generation, (topic, partition))
        return doubt

    def ack_later(self, topic: str, subscription: str, partition: int, consumer: str,
                  segment: np.ndarray, entry: np.ndarray, index: np.ndarray) -> int:
        """Take the ack now (nothing of it is delivered again while the broker runs) and
        store it with the next group commit: the write generation to :meth:`stored` on. For
        acks nobody waits on (a Pulsar client's without a receipt): the caller goes on at
        once instead of one commit per ack."""
        return self._dispatcher(topic, subscription, partition).ack(consumer, segment, entry,
                                                                    index)[0]

    def ack_cumulative(self, topic: str, subscription: str, consumer: str,
                       position: Position, *, retry: bool = False, wait: bool = True) -> int:
        """Store the cumulative ack; for a ``retry``, how many of its messages may have been
        delivered to another consumer before it came. Without ``wait``, as :meth:`ack_later`:
        the write generation that stores it."""
        d = self._dispatcher(topic, subscription, position.partition)
        generation, doubt = d.ack_cumulative(consumer, position, retry=retry)
        if not wait:
            return generation
        self._wait(generation, (topic, position.partition))
        return doubt

    def stored(self, generation: int, partitions: Iterable[tuple[str, int]] = ()) -> None:
        """Return once the acks taken up to write ``generation`` are on disk; NotOwnerError
        if those of one of ``partitions`` were not, as another broker owns it now."""
        self._wait(generation, *partitions)

    def _wait(self, generation: int, *partitions: tuple[str, int]) -> None:
        """Once write ``generation`` is on disk. The cursor of one of ``partitions`` handed
        to another broker meanwhile was not written: what waits on it is refused, naming
        the owner, so that its client sends it there (an ack said stored here would be
        lost, and its messages, dropped by a client that acknowledged them, never
        acknowledged)."""
        try:
            self.writer.wait(generation, partitions=partitions)
        except NotStoredError as exc:
            raise self._not_stored(exc.topic, exc.partition, exc.owner) from None

    def _not_stored(self, topic: str, partition: int, owner_id: str) -> TierstreamError:
        owner = self._store.owners.owner_of(topic, partition)
        if owner is None or owner.broker_id == self._store.owners.broker_id:
            return UnavailableError(f"{topic} partition {partition} was moving (to "
                                    f"{owner_id}); nothing was stored: try again")
        return self._store.owners.refusal(topic, partition, owner)

    def nack(self, topic: str, subscription: str, partition: int, consumer: str,
             segment: np.ndarray, entry: np.ndarray, index: np.ndarray, delay_s: float) -> None:
        self._dispatcher(topic, subscription, partition).nack(consumer, segment, entry, index,
                                                              delay_s)

    def flow(self, topic: str, subscription: str, partition: int, consumer: str,
             permits: int) -> None:
        self._dispatcher(topic, subscription, partition).flow(consumer, permits)

    def acknowledged_before(self, topic: str, subscription: str, partition: int
                            ) -> Position | None:
        """Everything before this position is acknowledged (None: no such subscription)."""
        d = self._dispatchers.get((topic, subscription, partition))
        if d is not None:
            return d.acknowledged_before()
        stored = self._metadata.get_cursor(topic, subscription, partition)
        return None if stored is None else CursorState.from_json(stored, partition).mark_delete

    def set_position(self, topic: str, subscription: str, partition: int, position: Position,
                     *, label: str | None = None) -> None:
        """Everything before ``position`` is acknowledged (forward only): a Spark stream's
        commit, with ``label`` saying whose. Stored directly unless a consumer has the
        subscription loaded."""
        if position.partition != partition:
            raise ConfigError(f"position {position} is not in partition {partition}")
        key = (topic, subscription, partition)
        with self._lock:
            d = self._dispatchers.get(key)
            if d is None:
                stored = self._metadata.get_cursor(*key)
                state = CursorState.from_json(stored, partition) if stored is not None \
                    else CursorState(partition, position)
                if position > state.mark_delete:
                    state.mark_delete = position
                    state.acked = [(a, b) for a, b in state.acked if b > position]
                    if state.acked and state.acked[0][0] <= position:
                        state.mark_delete = state.acked.pop(0)[1]
                state.label = label or state.label
                self._save(key, state)
                return
        self._wait(d.set_position(position), (topic, partition))

    def reset(self, topic: str, subscription: str, partition: int, position: Position) -> None:
        """Seek: the cursor moves to ``position``, back or forward: every message before it is
        acknowledged, every message from it on is not (redelivery counts start again). The
        consumers attached are detached (they attach again and are served from there)."""
        key = (topic, subscription, partition)
        if position.partition != partition:
            raise ConfigError(f"position {position} is not in partition {partition}")
        with self._lock:
            d = self._dispatchers.pop(key, None)
            if d is not None:
                for c in list(d.consumers.values()):
                    d.detach(c)
                d.close()
                # nothing of it is written after this
                self._wait(self.writer.dirty(d), (topic, partition))
                stored: Any = d.snapshot()
            else:
                stored = self._metadata.get_cursor(*key)
            if stored is None:
                raise NotFoundError(f"topic {topic!r} has no subscription {subscription!r} "
                                    f"on partition {partition}")
            old = CursorState.from_json(stored, partition)
            state = CursorState(partition, position, type=old.type, label=old.label,
                                dead_letter_sequence=old.dead_letter_sequence)
            self._save(key, state)

    def _save(self, key: tuple[str, str, int], state: CursorState) -> None:
        """Store one cursor directly; refused, naming the owner, if another broker owns its
        partition now."""
        foreign = self._metadata.save_cursors([(*key, state.to_json())], now=now_ms())
        if (key[0], key[2]) in foreign:
            raise self._not_stored(key[0], key[2], foreign[key[0], key[2]])

    def delete(self, topic: str, subscription: str) -> int:
        """Remove an abandoned subscription: its stored cursors on every partition (how
        many). ConflictError while a consumer is attached; NotFoundError if there is none."""
        with self._lock:
            mine = {k: d for k, d in self._dispatchers.items() if k[:2] == (topic, subscription)}
            attached = sorted({c.name for d in mine.values() for c in d.consumers.values()
                               if not c.gone()})
            if attached:
                raise ConflictError(f"subscription {subscription!r} on {topic!r} has consumers "
                                    f"attached ({', '.join(attached)}): close them first")
            for k, d in mine.items():
                d.close()
                del self._dispatchers[k]
                # an ack taken for a later commit (ack_later) must not write it back after
                self.writer.wait(self.writer.dirty(d))
            removed = self._metadata.delete_cursors(topic, subscription)
        if not removed:
            raise NotFoundError(f"topic {topic!r} has no subscription {subscription!r}")
        return removed

    def let_go(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Partitions another broker owns now: their dispatchers stop, and each consumer
        attached there is let go (its stream ends, and its client goes to the owner)."""
        keys = set(partitions)
        with self._lock:
            stopped = [self._dispatchers.pop(k) for k in list(self._dispatchers)
                       if (k[0], k[2]) in keys]
        for d in stopped:
            for c in list(d.consumers.values()):
                d.detach(c)
            d.close()

    def forget_topic(self, topic: str) -> None:
        """A deleted topic's dispatchers stop."""
        with self._lock:
            for k in [k for k in self._dispatchers if k[0] == topic]:
                self._dispatchers.pop(k).close()

    def listing(self, topic: str) -> list[dict[str, Any]]:
        """Per subscription and partition: type, acknowledged position, backlog (messages
        not acknowledged), and each consumer's share."""
        ends = self._store.ends(topic)
        out = []
        for row in self._metadata.cursors(topic):
            p = int(row["partition"])
            if p not in ends:  # another broker serves it (several brokers): it lists it
                continue
            plog = self._store.partition(topic, p)
            d = self._dispatchers.get((topic, row["subscription"], p))
            if d is not None:
                state = CursorState.from_json(d.snapshot(), p)
                read_pos = d.window.read_pos
                backlog = d.unacknowledged() + plog.backlog(read_pos, ends[p]) \
                    if read_pos < ends[p] else d.unacknowledged()
                ahead = [(max(a, read_pos), b) for a, b in state.acked if b > read_pos]
                consumers = d.stats()
                oldest = d.oldest_delivered_s()
                delayed = d.held_for_time()
            else:
                state = CursorState.from_json(row["state"], p)
                backlog = plog.backlog(state.mark_delete, ends[p]) \
                    if state.mark_delete < ends[p] else 0
                ahead = state.acked
                consumers = []
                oldest = None
                delayed = 0  # nothing read yet: what is held is known once it is read
            for a, b in ahead:
                if a < ends[p]:
                    backlog -= plog.backlog(a, min(b, ends[p]))
            out.append({"subscription": row["subscription"], "partition": p,
                        "type": state.type,
                        "label": CursorState.from_json(row["state"], p).label,
                        "position": state.mark_delete.to_dict(),
                        "acked_ranges": len(state.acked), "backlog": max(0, backlog),
                        "updated_at": row["updated_at"], "consumers": consumers,
                        "oldest_unacked_s": oldest, "delayed": delayed})
        return out

    def _tick(self) -> None:
        while not self._ticker.stopping.wait(_TICK_S):
            fault_point("subscriptions.tick")
            now = time.monotonic()
            with self._lock:
                loaded = list(self._dispatchers.values())
            for d in loaded:
                d.tick(now)

    def close(self) -> None:
        self._ticker.stopping.set()
        self._asking.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for d in self._dispatchers.values():
                d.close()
        self.dead_letters.close()
        self.writer.close()
        self._ticker.join(timeout=5)
