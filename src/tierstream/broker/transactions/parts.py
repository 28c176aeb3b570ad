"""What a broker's transactions need of the partitions they stage to (``Partitions``: the
store; ``Elsewhere``: the owners of partitions other brokers serve,
``broker/transactions/owners.py``),
and the steps of staging and applying a commit done on one partition (writing its rows
again among them)
(``transaction_coordinator.py`` decides when)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tierstream.managed_ledger.open_segment import TXN_PRODUCER, PendingAppend
from tierstream.model.message_format import (
    PRODUCE_SCHEMA,
    as_produce_batch,
    batches_of_about,
    key_hashes,
)
from tierstream.util.faults import crash_point
from tierstream.util.threads import Worker

if TYPE_CHECKING:
    from tierstream.managed_ledger.partition_log import PartitionLog
    from tierstream.metadata.store import MetadataStore
    from tierstream.metadata.transaction_records import TransactionRecords

__all__ = ["IN_FLIGHT", "Elsewhere", "Held", "Partitions", "Snapshot", "route", "snapshot",
           "stage_entries", "staged_again", "staged_rows", "write_again"]

log = logging.getLogger(__name__)

#: Staged entries on their way to the bookies at once, per staging stream.
IN_FLIGHT = 16
#: A transaction's entries in one partition (:func:`snapshot`): the open segment's id, its
#: entries there (each with the partition count it was routed by), their rows, and the
#: set-aside ones ``[(segment id, [[entry id, rows, routed], ...])]``.
Snapshot = tuple[int, list[tuple[int, int | None]], int, list[tuple[int, Any]]]


class Partitions(Protocol):
    """What the coordinator needs of the store that owns it (broker/store.py): its
    partitions, its metadata, where its data lives, and the lock a cut is taken under."""

    metadata: MetadataStore
    visibility: threading.Lock

    @property
    def data_dir(self) -> Path: ...

    def partition(self, topic: str, partition: int) -> PartitionLog: ...

    def partition_count(self, topic: str) -> int: ...

    def partitions(self, topic: str) -> list[PartitionLog]: ...

    def all_partitions(self) -> list[PartitionLog]: ...


class Elsewhere(Protocol):
    """The owners of partitions this broker does not serve (several brokers: ``--cluster``,
    ``broker/transactions/owners.py``), asked for their part of a transaction."""

    def serves(self, topic: str, partition: int) -> bool: ...

    def check_serving(self, topic: str, partition: int) -> None: ...

    def staged(self, txn_id: str, parts: Iterable[tuple[str, int]]
               ) -> dict[tuple[str, int], int]: ...

    def apply(self, txn_ids: list[str], parts: Iterable[tuple[str, int]]) -> list[str]: ...

    def end(self, txn_ids: list[str], parts: Iterable[tuple[str, int]]) -> None: ...


def stage_entries(plog: PartitionLog, txn_id: str, batches: Iterable[pa.RecordBatch], *,
                  routed: int | None, entry_bytes: int) -> int:
    """Append ``batches`` to ``plog`` as entries staged by ``txn_id`` (about ``entry_bytes``
    each); their rows, once an ack quorum has every one. A second thread waits for each
    entry's quorum as it completes (confirming it, in entry order), while this one submits
    the next: the stream's entries share the bookies' group commits, and each is confirmed
    soon after it is durable."""
    rows = 0
    waiting: queue.Queue[PendingAppend | None] = queue.Queue(maxsize=IN_FLIGHT)
    failed: list[BaseException] = []

    def confirm() -> None:
        while (entry := waiting.get()) is not None:
            try:
                entry.result()
            except BaseException as exc:  # raised in the stream's thread
                failed.append(exc)

    confirmer = Worker("tierstream-stage", confirm).start()
    try:
        for batch in batches:
            checked = as_produce_batch(batch)
            for piece in batches_of_about(pa.Table.from_batches([checked]), entry_bytes):
                waiting.put(plog.submit(piece, producer=None, sequence_id=None, txn=txn_id,
                                        routed=routed))
                rows += piece.num_rows
            if failed:
                break
    finally:
        waiting.put(None)
        confirmer.join()
    if failed:
        raise failed[0]
    return rows


class Held:
    """Partitions held for a commit (``PartitionLog.hold``), released together: by the
    commit under the visibility lock, or on the way out if it fails."""

    def __init__(self) -> None:
        self.logs: dict[int, PartitionLog] = {}

    def add(self, logs: Iterable[PartitionLog | None]) -> None:
        for plog in logs:
            if plog is not None and id(plog) not in self.logs:
                plog.hold()
                self.logs[id(plog)] = plog

    def release_all(self) -> None:
        logs, self.logs = list(self.logs.values()), {}
        for plog in logs:
            plog.release()

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_all()


def staged_rows(batch: pa.RecordBatch) -> pa.Table:
    """A stored entry's rows as they are staged again: the produce columns, the publish
    time left to the broker (rows written at the commit are published then)."""
    columns = [batch.column(f.name) if f.name != "publish_time"
               else pa.nulls(batch.num_rows, pa.int64()) for f in PRODUCE_SCHEMA]
    return pa.Table.from_arrays(columns, schema=PRODUCE_SCHEMA)


def route(table: pa.Table, partition: int, routed: int | None, count: int
           ) -> Iterator[tuple[int, pa.Table]]:
    """``table``'s rows by the partition they go to now: where they were staged, unless
    they were routed by a count the topic no longer has (it grew at a scale event); then
    each keyed row goes where its key routes now, in order (unkeyed rows stay)."""
    if routed is None or routed == count:
        yield partition, table
        return
    keys = table.column("key").combine_chunks()
    target = key_hashes(keys).to_numpy().astype(np.int64) % count
    target[pc.is_null(keys).to_numpy(zero_copy_only=False)] = partition
    for q in sorted(set(target.tolist())):
        yield q, table.take(pa.array(np.flatnonzero(target == q)))


def snapshot(records: TransactionRecords, plog: PartitionLog | None, txn_id: str, topic: str,
             partition: int) -> Snapshot:
    """``txn_id``'s entries in one partition as one snapshot: those in its open segment
    (``PartitionLog.txn_entries``; none for a partition deleted since, ``plog`` None) and
    those set aside. A seal moves entries from the first to the second under the
    partition's lock, so both are read under it; read apart, a seal in between counted its
    rows twice."""
    def aside() -> list[tuple[int, Any]]:
        return [(s, entries) for _, _, s, entries in records.set_aside(txn_id, topic,
                                                                        partition)]

    if plog is None:
        return 0, [], 0, aside()
    with plog.lock:
        segment_id, open_entries, open_rows = plog.txn_entries(txn_id)
        return segment_id, open_entries, open_rows, aside()


def staged_again(plog: PartitionLog, snap: Snapshot) -> list[tuple[pa.Table, int | None]]:
    """A transaction's staged rows of one partition as a commit writes them again, in staging
    order (its set-aside entries, then those in the open segment), each with the partition
    count it was routed by."""
    segment_id, open_entries, _, aside = snap
    staged: list[tuple[pa.Table, int | None]] = []
    for aside_segment, entries in aside:
        batches = plog.raw_entries(aside_segment, [int(e[0]) for e in entries])
        staged.extend((staged_rows(b), e[2]) for b, e in zip(batches, entries, strict=True))
    batches = plog.raw_entries(segment_id, [e for e, _ in open_entries])
    staged.extend((staged_rows(b), routed) for b, (_, routed) in zip(
        batches, open_entries, strict=True))
    return staged


def write_again(store: Partitions, plog_of: Callable[[str, int], PartitionLog | None],
                records: TransactionRecords, txn_id: str, topic: str, partition: int,
                held: Held, *, entry_bytes: int) -> None:
    """Append a transaction's staged rows of one partition again, in staging order (its
    set-aside entries, then those in the open segment), as ``txn/<id>/moved/<p>`` with
    sequence ids 0, 1, 2... per partition written: the same rows and boundaries every
    time, so a commit applied again after a crash stores each entry once. Rows routed by
    a partition count the topic no longer has go where their keys route now (``plog_of``:
    a partition served here, None if deleted since)."""
    plog = plog_of(topic, partition)
    if plog is None:
        log.warning("transaction %s: %s partition %d no longer exists; its rows are "
                    "dropped", txn_id, topic, partition)
        return
    count = store.partition_count(topic)
    targets: dict[int, list[pa.Table]] = {}
    for table, routed in staged_again(plog, snapshot(records, plog, txn_id, topic, partition)):
        for q, rows in route(table, partition, routed, count):
            targets.setdefault(q, []).append(rows)
    for q, tables in sorted(targets.items()):
        target = plog_of(topic, q)
        if target is None:
            continue
        held.add([target])
        producer = f"{TXN_PRODUCER}{txn_id}/moved/{partition}"
        rows = pa.concat_tables(tables).combine_chunks()
        for seq, batch in enumerate(batches_of_about(rows, entry_bytes)):
            target.append(batch, producer=producer, sequence_id=seq)
        crash_point("txn.partition-applied")
