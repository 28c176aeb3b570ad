"""Dead letters: messages redelivered more than a consumer's ``max_redeliveries`` go to the
dead-letter topic (default ``<topic>-<subscription>-DLQ``, Pulsar's name) exactly once.

A dispatcher records the move as an intent in its cursor (durable first), then this writer
appends the messages to the dead-letter topic as producer
``tierstream-dead-letters/<topic>/<partition>/<subscription>`` with the intent's sequence id,
then the dispatcher acknowledges them. A crash between any two steps repeats the append with
the same sequence id, which the topic's de-duplication stores once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa

from tierstream.broker.subscriptions.attached import ConsumerSettings
from tierstream.broker.subscriptions.cursor_state import DeadLetterIntent
from tierstream.broker.subscriptions.cursor_writer import CursorWriter, Snapshotting
from tierstream.broker.subscriptions.read_window import ACKED, DEAD, Chunk, ReadWindow
from tierstream.errors import AlreadyExistsError, TierstreamError
from tierstream.model.message_format import CONSUMER_SCHEMA, PRODUCE_SCHEMA
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker

if TYPE_CHECKING:
    from tierstream.broker.store import Store

__all__ = ["DeadLetterSide", "DeadLetterWriter", "DeadLettering", "IntentRecovery",
           "dead_letter_batch"]

log = logging.getLogger(__name__)

_RETRY_S = 1.0


class DeadLettering(Snapshotting, Protocol):
    """A subscription's cursor whose messages go to a dead-letter topic (the dispatcher)."""

    def dead_lettered(self, intent: DeadLetterIntent) -> None: ...


class DeadLetterWriter:
    def __init__(self, store: Store, writer: CursorWriter) -> None:
        self._store = store
        self._writer = writer
        self._queue: queue.Queue[tuple[DeadLettering, DeadLetterIntent, pa.RecordBatch] | None] = \
            queue.Queue()
        self.written = 0
        # without it, messages past their redeliveries would wait for good
        self._thread = Worker("dead-letters", self._run,
                              on_error=store.thread_failed("the dead-letter writer"))
        self._stop = self._thread.stopping
        self._thread.start()

    def submit(self, dispatcher: DeadLettering, intent: DeadLetterIntent,
               batch: pa.RecordBatch) -> None:
        self._queue.put((dispatcher, intent, batch))

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            dispatcher, intent, batch = item
            fault_point("dead_letters.write")
            try:
                self._writer.wait(self._writer.dirty(dispatcher), stopped=self._stop.is_set)
                self._append(dispatcher, intent, batch)
            except TierstreamError as exc:
                if self._stop.is_set():
                    return
                log.warning("dead letters of %s/%s to %s: %s; retrying", dispatcher.topic,
                            dispatcher.subscription, intent.topic, exc)
                self._stop.wait(_RETRY_S)
                self._queue.put(item)
                continue
            dispatcher.dead_lettered(intent)
            self.written += batch.num_rows

    def _append(self, d: DeadLettering, intent: DeadLetterIntent, batch: pa.RecordBatch) -> None:
        with contextlib.suppress(AlreadyExistsError):
            self._store.create_topic(intent.topic, 1)
        partitions = self._store.topic(intent.topic).partitions
        out = dead_letter_batch(d.topic, d.partition, d.subscription, batch)
        target = batch.column("key_hash").to_numpy() % partitions
        producer = f"tierstream-dead-letters/{d.topic}/{d.partition}/{d.subscription}"
        for p in range(partitions):
            rows = np.flatnonzero(target == p)
            if len(rows):
                self._store.partition(intent.topic, p).append(
                    out.take(pa.array(rows)), producer=producer,
                    sequence_id=intent.sequence_id)

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=5)


class IntentRecovery:
    """Dead-letter intents stored before a restart, whose messages the dispatcher reads again:
    each intent's rows are collected as they come, and an intent is sent once all of its rows
    are read and every earlier intent was sent (in sequence order, so the dead-letter topic
    de-duplicates a repeated append)."""

    def __init__(self, intents: list[DeadLetterIntent]) -> None:
        self._wanted = {i.sequence_id: {(p.segment_id, p.entry_id, p.batch_index)
                                        for p in i.positions} for i in intents}
        self._rows: dict[int, list[pa.RecordBatch]] = {}

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def read(self, batch: pa.RecordBatch, intents: list[DeadLetterIntent], sent: set[int]
             ) -> tuple[np.ndarray, list[tuple[DeadLetterIntent, pa.RecordBatch]]]:
        """Take a batch the dispatcher read: the rows of it that belong to an intent (now
        dead), and the intents whose rows are all read, ready to send (consumer schema)."""
        seg = batch.column("segment_id")[0].as_py()
        ent = batch.column("entry_id")[0].as_py()
        indexes = batch.column("batch_index").to_pylist()
        dead: list[int] = []
        for intent in intents:
            wanted = self._wanted.get(intent.sequence_id)
            if not wanted:
                continue
            rows = [i for i, b in enumerate(indexes) if (seg, ent, b) in wanted]
            if not rows:
                continue
            dead.extend(rows)
            self._rows.setdefault(intent.sequence_id, []).append(batch.take(pa.array(rows)))
            wanted.difference_update((seg, ent, indexes[i]) for i in rows)
        ready = []
        for intent in intents:
            if intent.sequence_id in sent:
                continue
            if self._wanted.get(intent.sequence_id):
                break
            parts = self._rows.pop(intent.sequence_id, [])
            self._wanted.pop(intent.sequence_id, None)
            if parts:
                rows = pa.Table.from_batches(parts).combine_chunks().to_batches()[0]
                ready.append((intent, pa.RecordBatch.from_arrays(  # as never redelivered
                    [*rows.columns, pa.array(np.zeros(rows.num_rows, dtype=np.int32))],
                    schema=CONSUMER_SCHEMA)))
        return np.array(dead, dtype=np.int64), ready


def dead_letter_batch(topic: str, partition: int, subscription: str,
                      batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` (consumer schema) as messages for the dead-letter topic: key, value, event
    time and properties kept; Pulsar's ``REAL_TOPIC`` and ``ORIGIN_MESSAGE_ID`` added, with
    the subscription and the redelivery count."""
    props = []
    for i, original in enumerate(batch.column("properties").to_pylist()):
        entries = dict(original or [])
        entries.update({
            "REAL_TOPIC": f"{topic}-partition-{partition}",
            "ORIGIN_MESSAGE_ID": ":".join(str(batch.column(c)[i].as_py()) for c in
                                          ("partition", "segment_id", "entry_id",
                                           "batch_index")),
            "tierstream.dead_letter.subscription": subscription,
            "tierstream.dead_letter.redeliveries": str(batch.column("redelivery_count")[i]
                                                       .as_py()),
        })
        props.append(list(entries.items()))
    return pa.RecordBatch.from_arrays(
        [batch.column("key"), batch.column("value"),
         pa.nulls(batch.num_rows, pa.int64()), batch.column("event_time"),
         pa.array(props, type=PRODUCE_SCHEMA.field("properties").type)],
        schema=PRODUCE_SCHEMA)


class DeadLetterSide:
    """The dispatcher's side of dead letters (a mixin of ``Dispatcher``): a message over its
    consumer's ``max_redeliveries`` is recorded as an intent and sent; sent intents found
    again after a restart are sent again; a stored one is acknowledged."""

    topic: str
    subscription: str
    window: ReadWindow
    _lock: threading.RLock
    _intents: list[DeadLetterIntent]
    _intents_sent: set[int]
    _dead_letter_sequence: int
    _recovery: IntentRecovery
    _dead_letter: Callable[[Any, DeadLetterIntent, pa.RecordBatch], None]

    def _set(self, chunk: Chunk, rows: np.ndarray, state: int) -> None:
        raise NotImplementedError  # the dispatcher's

    def _acked(self) -> int:
        raise NotImplementedError  # the dispatcher's

    def _to_dead_letters(self, chunk: Chunk, rows: np.ndarray, s: ConsumerSettings) -> None:
        topic = s.dead_letter_topic or f"{self.topic}-{self.subscription}-DLQ"
        self._set(chunk, rows, DEAD)
        intent = DeadLetterIntent(self._dead_letter_sequence, topic,
                                  [chunk.position(int(r)) for r in rows])
        self._dead_letter_sequence += 1
        self._intents.append(intent)
        self._send_dead_letters(intent, chunk.take(rows))

    def _send_dead_letters(self, intent: DeadLetterIntent, batch: pa.RecordBatch) -> None:
        self._intents_sent.add(intent.sequence_id)
        self._dead_letter(self, intent, batch)

    def _recover(self, batch: pa.RecordBatch, chunk: Chunk | None) -> None:
        """Messages of dead-letter intents stored before a restart: sent again once read."""
        dead, ready = self._recovery.read(batch, self._intents, self._intents_sent)
        if chunk is not None and len(dead):
            self._set(chunk, dead, DEAD)
        for intent, rows in ready:
            self._send_dead_letters(intent, rows)

    def dead_lettered(self, intent: DeadLetterIntent) -> None:
        """``intent``'s messages are stored on the dead-letter topic: acknowledge them."""
        with self._lock:
            for chunk, rows in self.window.locate(*intent.arrays())[0]:
                self._set(chunk, rows[chunk.state[rows] == DEAD], ACKED)
            self._intents = [i for i in self._intents if i.sequence_id != intent.sequence_id]
            self._acked()
