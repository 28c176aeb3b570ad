"""Transactions on the broker: staged writes that no reader sees until a commit shows them all.

A writer (a Spark task, a Python producer) stages rows under a transaction id; the broker keeps
them outside the log, in Arrow IPC stream files::

    <data dir>/transactions/<txn id>/<tenant>/<namespace>/<topic>/<partition>.<ns>.<rows>.arrow

written to a temporary name, fsynced, then renamed, so a file with a final name is whole. No
reader, cursor or planner looks there. ``prepare`` checks the staged row counts against the
writer's and records the transaction PREPARED. ``commit`` decides in one metadata transaction
(``metadata/transaction_records.py``: idempotent by (sink id, batch id), fencing the batch's other
attempts), then applies: it holds every partition it writes (``PartitionLog.hold``), appends the
staged rows through the ordinary write path as a producer named ``txn/<id>`` with sequence ids
0, 1, 2... per partition, and releases the partitions together, so a reader sees the whole
commit at once or nothing of it.

Crash safety: before the decision, a crash leaves the transaction OPEN or PREPARED, which a
later commit may still commit or the timeout aborts. After it, the transaction is COMMITTED in
metadata and recovery applies it again when the broker starts: entries already in the log are
recognised by their (producer, sequence id) exactly like a producer's re-sent batch
(``managed_ledger/dedup.py``), so nothing is stored twice.
``tests/store/test_transactions.py`` kills the broker at each step (``txn.*`` crash points).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa

from tierstream.durable import fsync_dir
from tierstream.errors import ConfigError, ConflictError, NotFoundError, StorageError
from tierstream.faults import crash_point
from tierstream.layout import DataDir
from tierstream.message_format import (
    PRODUCE_SCHEMA,
    as_produce_batch,
    batches_of_about,
    key_hashes,
)
from tierstream.metadata.transaction_records import (
    TransactionRecord,
    TransactionRecords,
    TxnState,
)
from tierstream.names import TopicName, check_txn_id
from tierstream.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.managed_ledger.partition_log import PartitionLog
    from tierstream.metadata.store import MetadataStore


class Partitions(Protocol):
    """What the coordinator needs of the store that owns it (broker/store.py): its
    partitions, its metadata, where its data lives, and the lock a cut is taken under."""

    metadata: MetadataStore
    visibility: threading.Lock

    @property
    def data_dir(self) -> Path: ...

    def partition(self, topic: str, partition: int) -> PartitionLog: ...

    def partition_count(self, topic: str) -> int: ...

    def all_partitions(self) -> list[PartitionLog]: ...

__all__ = ["PRODUCER_PREFIX", "TransactionCoordinator"]

log = logging.getLogger(__name__)

#: Applied entries are written as the producer ``txn/<id>``.
PRODUCER_PREFIX = "txn/"
#: Rows of one applied entry are about this many bytes (fewer, larger entries: fewer fsyncs).
ENTRY_BYTES = 4 * 1024**2
#: Records of ended transactions are kept this long (to answer a late, repeated commit).
KEEP_ENDED_MS = 24 * 3_600_000


class TransactionCoordinator:
    """The broker's transactions for one store (thread-safe)."""

    def __init__(self, store: Partitions, *, timeout_ms: int) -> None:
        self.store = store
        self.timeout_ms = timeout_ms
        self.records = TransactionRecords(store.metadata)
        self.root = DataDir.at(store.data_dir).transactions
        # one commit applies at a time; a scale event waits for it (broker/store.py)
        self.commit_lock = threading.Lock()

    # -- staging ------------------------------------------------------------------------------

    def stage(self, txn_id: str, topic: str, partition: int, batches: Iterable[pa.RecordBatch],
              *, sink_id: str | None = None, batch_id: int | None = None,
              routed: int | None = None) -> int:
        """Write ``batches`` (PRODUCE_SCHEMA columns) as one staged file of ``txn_id``; returns
        its rows once the file is durable. A stream that breaks leaves no file behind. Rows
        ``routed`` by a partition count are routed again at the commit if the topic has
        another count by then (its name records the count)."""
        txn_id = check_txn_id(txn_id)
        name = TopicName.parse(topic)
        plog = self.store.partition(str(name), partition)  # the topic and partition exist
        self.records.begin(txn_id, sink_id, batch_id, now_ms())
        folder = self._folder(txn_id, str(name))
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{plog.partition}.{uuid.uuid4().hex}.tmp"
        rows = 0
        try:
            with open(tmp, "wb") as f:
                writer = pa.ipc.new_stream(f, PRODUCE_SCHEMA)
                for batch in batches:
                    checked = as_produce_batch(batch)
                    writer.write_batch(checked)
                    rows += checked.num_rows
                writer.close()
                f.flush()
                os.fsync(f.fileno())
            if rows:
                count = "" if routed is None else f".{int(routed)}"
                os.rename(tmp, folder / f"{plog.partition}.{time.time_ns()}.{rows}{count}.arrow")
                fsync_dir(folder)
            else:
                tmp.unlink()
        except BaseException:
            tmp.unlink(missing_ok=True)
            self._refuse_if_ended(txn_id)  # the abort removed the folder under the stream
            raise
        self.records.touch(txn_id, now_ms())
        self._refuse_if_ended(txn_id)
        return rows

    def _refuse_if_ended(self, txn_id: str) -> None:
        """Fenced or aborted while a stream was staging (a zombie task attempt): remove its
        staging, which the abort's removal may have missed, and raise ConflictError."""
        record = self.records.get(txn_id)
        if record.state != TxnState.OPEN:
            self._remove(txn_id)
            raise ConflictError(f"transaction {txn_id} is {record.state.lower()}"
                                f"{f' ({record.reason})' if record.reason else ''}: it "
                                "takes no more writes")

    def staged(self, txn_id: str) -> dict[tuple[str, int], list[Path]]:
        """The whole staged files of ``txn_id`` per (topic, partition), in staging order."""
        folder = self.root / txn_id
        out: dict[tuple[str, int], list[tuple[int, Path]]] = {}
        if not folder.is_dir():
            return {}
        for path in folder.rglob("*.arrow"):
            partition, ns, _ = path.name.split(".")[:3]
            topic = str(path.parent.relative_to(folder))
            out.setdefault((topic, int(partition)), []).append((int(ns), path))
        return {k: [p for _, p in sorted(v)] for k, v in sorted(out.items())}

    def prepare(self, txn_id: str, expected: dict[tuple[str, int], int]) -> TransactionRecord:
        """The writer is done: check that the staged rows are the ``expected`` ones per
        (topic, partition) and record the transaction PREPARED (durable)."""
        txn_id = check_txn_id(txn_id)
        record = self.records.get(txn_id)
        if record.state == TxnState.PREPARED:
            return record
        staged = {k: sum(_rows(p) for p in paths) for k, paths in self.staged(txn_id).items()}
        for key in sorted(set(staged) | set(expected)):
            if staged.get(key, 0) != expected.get(key, 0):
                raise ConflictError(
                    f"transaction {txn_id} is incomplete: {key[0]} partition {key[1]} has "
                    f"{staged.get(key, 0)} staged rows, the writer sent {expected.get(key, 0)}"
                    " (a staging stream broke); abort it and write again")
        parts = [(t, p, n) for (t, p), n in sorted(staged.items()) if n]
        return self.records.prepare(txn_id, parts, now_ms())

    # -- commit -------------------------------------------------------------------------------

    def commit(self, txn_ids: list[str], *, sink_id: str | None = None,
               batch_id: int | None = None) -> dict[str, Any]:
        """Make exactly these transactions visible, atomically (see the module docstring).
        With a sink, a batch id at or below its last committed one is a no-op."""
        txn_ids = sorted({check_txn_id(t) for t in txn_ids})
        if (sink_id is None) != (batch_id is None):
            raise ConfigError("a commit names both a sink id and a batch id, or neither")
        if not txn_ids and sink_id is None:
            raise ConfigError("a commit needs at least one transaction, or a sink and batch")
        with self.commit_lock:
            decision = self.records.decide(txn_ids, sink_id, batch_id, now_ms())
            crash_point("txn.decided")
            for fenced in decision.fenced:
                self._remove(fenced)
            if decision.duplicate:
                log.info("commit of batch %s of sink %r: already committed; %d transaction(s) "
                         "of the repeated batch aborted", batch_id, sink_id,
                         len(decision.fenced))
                return {"status": "already-committed", "sink": sink_id, "batch": batch_id,
                        "messages": 0, "aborted": decision.fenced}
            pending = [r for r in decision.committed if r.state == TxnState.COMMITTED]
            self._apply(pending)
        return {"status": "committed", "sink": sink_id, "batch": batch_id,
                "transactions": txn_ids, "aborted": decision.fenced,
                "messages": sum(n for r in decision.committed for _, _, n in r.parts)}

    def _apply(self, records: list[TransactionRecord]) -> None:
        """Append committed transactions' staged rows to the log, all visible at once."""
        if not records:
            return
        plogs = {}
        for r in records:
            for topic, p, _ in r.parts:
                try:
                    plogs[(topic, p)] = self.store.partition(topic, p)
                except NotFoundError:  # deleted since: its part of the commit went with it
                    log.warning("transaction %s: %s partition %d no longer exists; its "
                                "staged rows are dropped", r.txn_id, topic, p)
        counts = {t: self.store.partition_count(t) for t, _ in plogs}
        routed = {r.txn_id: _routed(self.staged(r.txn_id), counts) for r in records}
        for r in records:
            for key in routed[r.txn_id]:
                if key not in plogs and key[0] in counts:  # routed again, to a grown one
                    plogs[key] = self.store.partition(*key)
        for plog in plogs.values():
            plog.hold()
        def apply(txn_id: str, key: tuple[str, int], tables: list[pa.Table]) -> None:
            for seq, batch in enumerate(_entries(tables)):
                plogs[key].append(batch, producer=PRODUCER_PREFIX + txn_id, sequence_id=seq)
            crash_point("txn.partition-applied")

        try:
            # partitions in parallel: their appends share the bookies' group commits
            # (python -m bench sink: the commit of 200,000 rows over 4 partitions)
            with ThreadPoolExecutor(min(8, len(plogs)) or 1) as pool:
                for r in records:
                    staged = routed[r.txn_id]
                    for done in [pool.submit(apply, r.txn_id, key, staged[key])
                                 for key in staged if key in plogs]:
                        done.result()
        finally:
            with self.store.visibility:  # a cut sees all partitions of the commit, or none
                for plog in plogs.values():
                    plog.release()
        self.records.applied([r.txn_id for r in records], now_ms())
        crash_point("txn.applied")
        names = {PRODUCER_PREFIX + r.txn_id for r in records}
        for plog in plogs.values():
            plog.forget_producers(names)
        for r in records:
            self._remove(r.txn_id)

    # -- abort, timeout, recovery -------------------------------------------------------------

    def abort(self, txn_id: str, reason: str = "aborted by its writer") -> bool:
        """Discard an open or prepared transaction; True if it was aborted now."""
        txn_id = check_txn_id(txn_id)
        with self.commit_lock:
            done = self.records.abort([txn_id], now_ms(), reason)
        self._remove(txn_id)
        return bool(done)

    def expire(self, now: int | None = None) -> int:
        """Abort transactions idle for longer than the timeout (housekeeping); also finish
        commits whose apply failed, and forget long-ended transactions."""
        now = now_ms() if now is None else now
        expired = self.records.expired(now - self.timeout_ms)
        for txn_id in expired:
            with self.commit_lock:
                aborted = self.records.abort([txn_id], now, f"timed out after "
                                             f"{self.timeout_ms / 1000:g} s without a commit")
            if aborted:
                log.warning("transaction %s timed out after %g s without a commit: aborted",
                            txn_id, self.timeout_ms / 1000)
                self._remove(txn_id)
        with self.commit_lock:
            self._apply(self.records.in_states(TxnState.COMMITTED))
        self.records.forget_ended(now - KEEP_ENDED_MS)
        return len(expired)

    def recover(self) -> None:
        """At broker start: apply what was committed but not (fully) applied, forget applied
        transactions' de-duplication state, and remove staging nobody can commit."""
        committed = self.records.in_states(TxnState.COMMITTED)
        if committed:
            log.info("recovery: applying %d committed transaction(s)", len(committed))
        with self.commit_lock:
            self._apply(committed)
        live = {r.txn_id for r in self.records.in_states(TxnState.OPEN, TxnState.PREPARED)}
        for plog in self.store.all_partitions():
            plog.forget_producers({n for n in plog.producers() if n.startswith(
                PRODUCER_PREFIX) and n[len(PRODUCER_PREFIX):] not in live})
        if self.root.is_dir():
            for folder in self.root.iterdir():
                if folder.name not in live:
                    self._remove(folder.name)
                else:  # a staging stream cut by the crash: its temporary file is not whole
                    for tmp in folder.rglob(".*.tmp"):
                        tmp.unlink(missing_ok=True)

    def list(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.records.in_states(
            TxnState.OPEN, TxnState.PREPARED, TxnState.COMMITTED, TxnState.APPLIED,
            TxnState.ABORTED)]

    def _folder(self, txn_id: str, topic: str) -> Path:
        return self.root / txn_id / topic

    def _remove(self, txn_id: str) -> None:
        try:
            shutil.rmtree(self.root / txn_id, ignore_errors=False)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StorageError(f"cannot remove the staging of transaction {txn_id}: "
                               f"{exc}") from None


def _rows(path: Path) -> int:
    return int(path.name.split(".")[2])


def _routed(staged: dict[tuple[str, int], list[Path]], counts: dict[str, int]
            ) -> dict[tuple[str, int], list[pa.Table]]:
    """The staged rows per (topic, partition) they go to: where they were staged, unless they
    were routed by a partition count their topic no longer has (it grew at a scale event):
    then each keyed row goes where its key routes now, in staging order. The same files and
    counts give the same result, so a commit applied again after a crash repeats itself."""
    out: dict[tuple[str, int], list[pa.Table]] = {}
    for (topic, p), paths in staged.items():
        for path in paths:
            with pa.OSFile(str(path)) as source:
                table = pa.ipc.open_stream(source).read_all()
            parts = path.name.split(".")
            count = counts.get(topic)
            if len(parts) < 5 or count is None or int(parts[3]) == count:
                out.setdefault((topic, p), []).append(table)
                continue
            keys = table.column("key").combine_chunks()
            target = key_hashes(keys).to_numpy().astype(np.int64) % count
            target[keys.is_null().to_numpy(zero_copy_only=False)] = p
            for q in sorted(set(target.tolist())):
                rows = pa.array(np.flatnonzero(target == q))
                out.setdefault((topic, q), []).append(table.take(rows))
    return dict(sorted(out.items()))


def _entries(tables: list[pa.Table]) -> Iterator[pa.RecordBatch]:
    """The staged rows of one partition as entries of about :data:`ENTRY_BYTES` (the same
    boundaries every time, so a re-applied entry has the sequence id it had)."""
    if not tables:
        return
    yield from batches_of_about(pa.concat_tables(tables).combine_chunks(), ENTRY_BYTES)
