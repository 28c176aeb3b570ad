"""Transactions on the broker: staged entries no reader sees until a commit shows them all.

A writer (a Spark task, a Python producer) stages rows under a transaction id, and they are
written **once**, as entries of the partitions they go to (``PartitionLog.submit(txn=...)``:
the producer ``txn/<id>``, replicated and fsynced like any entry), as Pulsar's transaction
buffer appends transactional messages to the topic. Until the transaction is decided its
entries, and every entry confirmed after the first of them, stay invisible: a partition's
visible entries are a prefix (Pulsar's max read position). ``prepare`` checks the staged row
counts against the writer's and records the transaction PREPARED. ``commit`` decides in one
metadata transaction (``metadata/transaction_records.py``: idempotent by (sink id, batch id),
fencing the batch's other attempts), then shows the staged entries where they are, in every
partition at once (under the store's visibility lock). An abort or the timeout makes them
entries every reader skips (``SegmentRecord.skipped``, ``Split.skipped``).

An entry of an undecided transaction can end up in a sealed segment: the open segment rolled
(it was full, or ordinary messages waited behind it for ``transactionHoldLimit``), the topic
grew at a scale event, or the broker restarted. It is then **set aside**: skipped by readers
and listed in ``txn_set_aside``; the commit writes the transaction's entries of that partition
again, in staging order, as the producer ``txn/<id>/moved/<p>`` (sequence ids 0, 1, 2..., routed
by the topic's current partition count), so that a key's rows keep their order. The parts a
commit writes again are recorded with its decision (``moved``): recovery reads that to tell
which staged entries of an open segment to show.

Crash safety: before the decision, a crash leaves the transaction OPEN or PREPARED and its
entries set aside at recovery (``broker/topics/recovery.py``); a later commit still commits it, or
the timeout aborts it. After the decision, recovery shows the entries committed in place and
sets aside those of parts written again, and ``recover`` writes those again: entries already in
the log are recognised by their (producer, sequence id) exactly like a producer's re-sent
batch (``managed_ledger/dedup.py``), so nothing is stored twice.
``tests/store/test_transactions.py`` kills the broker at each step (``txn.*`` crash points).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tierstream.broker.transactions.old_staging import finish_old_staging
from tierstream.broker.transactions.parts import (
    Elsewhere,
    Held,
    Partitions,
    Snapshot,
    snapshot,
    stage_entries,
    write_again,
)
from tierstream.errors import ConfigError, ConflictError, NotFoundError
from tierstream.managed_ledger.open_segment import TXN_PRODUCER
from tierstream.metadata.transaction_records import (
    TransactionRecord,
    TransactionRecords,
    TxnState,
)
from tierstream.model.layout import DataDir
from tierstream.model.names import TopicName, check_txn_id
from tierstream.util.faults import crash_point
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["PRODUCER_PREFIX", "TransactionCoordinator"]

log = logging.getLogger(__name__)

#: Staged entries are written as the producer ``txn/<id>``.
PRODUCER_PREFIX = TXN_PRODUCER
#: Rows of one staged or re-written entry are about this many bytes.
ENTRY_BYTES = 4 * 1024**2
#: Records of ended transactions are kept this long (to answer a late, repeated commit).
KEEP_ENDED_MS = 24 * 3_600_000


class TransactionCoordinator:
    """The broker's transactions for one store (thread-safe)."""

    def __init__(self, store: Partitions, *, timeout_ms: int,
                 elsewhere: Elsewhere | None = None) -> None:
        self.store = store
        self.timeout_ms = timeout_ms
        #: the owners of the partitions served by other brokers (several brokers), if any
        self.elsewhere = elsewhere
        self.records = TransactionRecords(store.metadata)
        self.root = DataDir.at(store.data_dir).transactions  # staging of older versions
        # one commit applies at a time; a scale event waits for it (broker/store.py)
        self.commit_lock = threading.Lock()
        self._lock = threading.Lock()
        #: partitions each live transaction staged entries to since the broker started
        self._touched: dict[str, set[tuple[str, int]]] = {}
        #: (transaction, topic, partition): committed entries this broker showed (a cluster's
        #: owner looks for those it has not, :meth:`_show_committed`)
        self._shown: set[tuple[str, str, int]] = set()

    # -- staging ------------------------------------------------------------------------------

    def stage(self, txn_id: str, topic: str, partition: int, batches: Iterable[pa.RecordBatch],
              *, sink_id: str | None = None, batch_id: int | None = None,
              routed: int | None = None) -> int:
        """Append ``batches`` (PRODUCE_SCHEMA columns) to the partition as entries staged by
        ``txn_id``; returns their rows once an ack quorum has every one. Rows ``routed`` by a
        partition count the topic no longer has at the commit are routed again then. A stream
        that breaks leaves its entries staged: the writer aborts (or the timeout does)."""
        txn_id = check_txn_id(txn_id)
        name = TopicName.parse(topic)
        plog = self.store.partition(str(name), partition)  # the topic and partition exist
        if self.elsewhere is not None:  # owned here (else: who does, for the writer to go)
            self.elsewhere.check_serving(plog.topic, plog.partition)
            self._show_committed(plog.topic, plog.partition)
        self.records.begin(txn_id, sink_id, batch_id, now_ms())
        with self._lock:
            self._touched.setdefault(txn_id, set()).add((plog.topic, plog.partition))
        try:
            rows = stage_entries(plog, txn_id, batches, routed=routed, entry_bytes=ENTRY_BYTES)
        except BaseException:
            self._refuse_if_ended(txn_id)  # aborted under the stream: say that
            raise
        self.records.touch(txn_id, now_ms())
        self._refuse_if_ended(txn_id)
        return rows

    def _show_committed(self, topic: str, partition: int) -> None:
        """Several brokers: before a transaction stages to this partition, show the
        committed ones with a part in it that this broker has not shown. Their commit asked
        an owner that was handing the partition over (or did not answer in time) and
        returned; shown only by a later housekeeping pass, written again behind what was
        staged and committed since, a key's rows would come out of commit order. Now a
        transaction staged after a commit returned comes after it here, as on one broker."""
        pending = [r for r in self.records.in_states(TxnState.COMMITTED)
                   if (r.txn_id, topic, partition) not in self._shown
                   and any((t, p) == (topic, partition) for t, p, _ in r.parts)]
        if not pending:
            return
        self._apply_here(pending)
        log.info("%s partition %d: showed committed transaction(s) %s here before staging "
                 "more (their commit did not reach this partition's owner)", topic, partition,
                 ", ".join(r.txn_id for r in pending))

    def _refuse_if_ended(self, txn_id: str) -> None:
        """Fenced or aborted while a stream was staging (a zombie task attempt): make sure
        what it staged is skipped, and raise ConflictError."""
        record = self.records.get(txn_id)
        if record.state != TxnState.OPEN:
            if record.state == TxnState.ABORTED:
                self._end(txn_id)
            raise ConflictError(f"transaction {txn_id} is {record.state.lower()}"
                                f"{f' ({record.reason})' if record.reason else ''}: it "
                                "takes no more writes")

    def _parts_of(self, txn_id: str) -> set[tuple[str, int]]:
        """The partitions ``txn_id`` has staged entries in: those it staged to since the
        broker started, and those holding its set-aside entries."""
        with self._lock:
            parts = set(self._touched.get(txn_id, ()))
        parts.update((t, p) for t, p, _, _ in self.records.set_aside(txn_id))
        if self.elsewhere is not None:  # and where its writer said it staged (prepared)
            with contextlib.suppress(NotFoundError):
                parts.update((t, p) for t, p, _ in self.records.get(txn_id).parts)
        return parts

    def _here(self, parts: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
        """Those of ``parts`` served here (all of them but on a cluster)."""
        if self.elsewhere is None:
            return set(parts)
        return {(t, p) for t, p in parts if self.elsewhere.serves(t, p)}

    def staged(self, txn_id: str, parts: Iterable[tuple[str, int]] | None = None
               ) -> dict[tuple[str, int], int]:
        """The rows ``txn_id`` has staged per (topic, partition), of the partitions served
        here (of ``parts`` only, if given)."""
        counts: dict[tuple[str, int], int] = {}
        for topic, p in sorted(self._here(self._parts_of(txn_id) if parts is None else parts)):
            _, _, open_rows, aside = self._snapshot(txn_id, topic, p)
            counts[(topic, p)] = open_rows + sum(int(e[1]) for _, entries in aside
                                                 for e in entries)
        return {k: v for k, v in counts.items() if v}

    def _snapshot(self, txn_id: str, topic: str, partition: int) -> Snapshot:
        return snapshot(self.records, self._plog(topic, partition), txn_id, topic, partition)

    def prepare(self, txn_id: str, expected: dict[tuple[str, int], int]) -> TransactionRecord:
        """The writer is done: check that the staged rows are the ``expected`` ones per
        (topic, partition) and record the transaction PREPARED (durable)."""
        txn_id = check_txn_id(txn_id)
        record = self.records.get(txn_id)
        if record.state == TxnState.PREPARED:
            return record
        staged = self.staged(txn_id)
        if self.elsewhere is not None:  # the other owners' parts, as they count them
            named = set(expected) | self._parts_of(txn_id)
            staged.update(self.elsewhere.staged(txn_id, named - self._here(named)))
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
        with self.commit_lock, Held() as held:
            # the partitions the commit shows entries in do not roll meanwhile, so where
            # each transaction's entries are (and so the decision's "moved") stays true
            held.add([self._plog(t, p) for txn in txn_ids
                      for t, p in self._here(self._parts_of(txn))])
            moved = {txn: self._moved(txn) for txn in txn_ids}
            decision = self.records.decide(txn_ids, sink_id, batch_id, now_ms(), moved=moved)
            crash_point("txn.decided")
            for fenced in decision.fenced:
                self._end(fenced, everywhere=True)
            if decision.duplicate:
                log.info("commit of batch %s of sink %r: already committed; %d transaction(s) "
                         "of the repeated batch aborted", batch_id, sink_id,
                         len(decision.fenced))
                return {"status": "already-committed", "sink": sink_id, "batch": batch_id,
                        "messages": 0, "aborted": decision.fenced}
            pending = [r for r in decision.committed if r.state == TxnState.COMMITTED]
            self._apply(pending, held)
        unanswered = self._applied(pending)
        return {"status": "committed", "sink": sink_id, "batch": batch_id,
                "transactions": txn_ids, "aborted": decision.fenced,
                "messages": sum(n for r in decision.committed for _, _, n in r.parts),
                **({"applying": unanswered} if unanswered else {})}

    def _plog(self, topic: str, partition: int) -> PartitionLog | None:
        try:
            return self.store.partition(topic, partition)
        except (NotFoundError, ConfigError):  # deleted since: its part went with it
            return None

    def _moved(self, txn_id: str) -> set[tuple[str, int]]:
        """The partitions whose entries of ``txn_id`` a commit now writes again (of those
        served elsewhere, by what the metadata knows: their owners add theirs as they
        apply the commit)."""
        out = set()
        parts = self._parts_of(txn_id)
        here = self._here(parts)
        for topic, p in parts:
            plog = self._plog(topic, p) if (topic, p) in here else None
            again = plog is not None and plog.txn_placement(txn_id) == "again"
            if again or self.records.has_set_aside(txn_id, topic, p):
                out.add((topic, p))
        return out

    def _apply(self, records: list[TransactionRecord], held: Held) -> None:
        """Show committed transactions (under the commit lock): in place where their
        entries are, written again where they were set aside (or routed by an older
        partition count), all visible at once. On a cluster, in the partitions served here
        (:meth:`_applied` asks the other owners)."""
        if not records:
            return
        written: set[tuple[str, str, int]] = set()
        while True:
            for r in records:
                for topic, p in sorted(self._again(r)):
                    if (r.txn_id, topic, p) not in written:
                        if (topic, p) not in r.moved:  # set aside since the decision
                            self.records.add_moved(r.txn_id, topic, p)
                        write_again(self.store, self._plog, self.records, r.txn_id, topic,
                                    p, held, entry_bytes=ENTRY_BYTES)
                        written.add((r.txn_id, topic, p))
            with self.store.visibility:  # a cut sees all partitions of the commit, or none
                # an entry meant to show in place may have been set aside since (an explicit
                # seal or a failed write sealed its segment): then that part is written
                # again first, and everything shows together
                if all((r.txn_id, t, p) in written for r in records for t, p in self._again(r)):
                    for r in records:
                        for topic, p in self._here(self._parts_of(r.txn_id)):
                            plog = self._plog(topic, p)  # one lost since: not shown here
                            if plog is None or plog.resolve(r.txn_id, committed=True):
                                with self._lock:
                                    self._shown.add((r.txn_id, topic, p))
                    held.release_all()
                    break

    def _apply_here(self, records: list[TransactionRecord]) -> None:
        """:meth:`_apply` of committed ``records`` that another broker decided, their
        partitions served here held meanwhile (their entries all show at once)."""
        with self.commit_lock, Held() as held:
            held.add([self._plog(t, p) for r in records
                      for t, p in self._here(self._parts_of(r.txn_id))])
            self._apply(records, held)

    def _applied(self, records: list[TransactionRecord]) -> list[str]:
        """After :meth:`_apply`: mark the transactions APPLIED, and drop what they left.
        On a cluster, once the owners of their other partitions said they showed theirs
        too (asked outside the commit lock: they may be asking this broker at the same
        time). Returns what did not answer: those stay COMMITTED, and every broker's
        housekeeping asks again.

        The owners asked are those of every part this broker has not shown, served here now
        or not: a partition taken over or handed to this broker since :meth:`_apply` (its
        part set aside by the former owner) is shown by a later pass here, and the
        transaction stays COMMITTED until then. Taken for shown because it was served here,
        it was marked APPLIED and its set-aside rows dropped: a committed batch lost."""
        if not records:
            return []
        if self.elsewhere is not None:
            crash_point("txn.shown-here")
            parts = {(r.txn_id, t, p) for r in records for t, p in self._parts_of(r.txn_id)}
            with self._lock:
                theirs = {(t, p) for txn, t, p in parts - self._shown}
            if theirs:
                unanswered = self.elsewhere.apply([r.txn_id for r in records], theirs)
                if unanswered:
                    return unanswered
        with self.commit_lock:
            self.records.applied([r.txn_id for r in records], now_ms())
            crash_point("txn.applied")
            for r in records:
                self._forget(r.txn_id)
        return []

    def _again(self, record: TransactionRecord) -> set[tuple[str, int]]:
        """The partitions served here whose entries of ``record`` its commit writes again:
        as decided, and any set aside since."""
        return self._here(set(record.moved) | self._moved(record.txn_id))

    # -- abort, timeout, recovery -------------------------------------------------------------

    def abort(self, txn_id: str, reason: str = "aborted by its writer") -> bool:
        """Discard an open or prepared transaction; True if it was aborted now."""
        txn_id = check_txn_id(txn_id)
        with self.commit_lock:
            done = self.records.abort([txn_id], now_ms(), reason)
        self._end(txn_id, everywhere=True)
        return bool(done)

    def _end(self, txn_id: str, *, everywhere: bool = False) -> None:
        """An aborted transaction's entries: skipped everywhere, set-aside ones dropped. On
        a cluster, in the partitions served here; the owners of the others are told
        (``everywhere``; one that misses it learns it at its next housekeeping pass)."""
        parts = self._parts_of(txn_id)
        here = self._here(parts)
        for topic, p in here:
            plog = self._plog(topic, p)
            if plog is not None:
                plog.resolve(txn_id, committed=False)
        if everywhere and self.elsewhere is not None:  # every live broker (TxnOwners.end)
            self.elsewhere.end([txn_id], parts - here)
        self._forget(txn_id)

    def _forget(self, txn_id: str) -> None:
        """Drop what an ended transaction left: set-aside rows, de-duplication state, the
        partitions it touched."""
        topics = {t for t, _ in self._parts_of(txn_id)}
        self.records.drop_set_aside([txn_id])
        prefix = f"{PRODUCER_PREFIX}{txn_id}"
        for topic in sorted(topics):
            with contextlib.suppress(NotFoundError, ConfigError):  # deleted since
                for plog in self.store.partitions(topic):
                    plog.forget_producers({n for n in plog.producers()
                                           if n == prefix or n.startswith(prefix + "/")})
        with self._lock:
            self._touched.pop(txn_id, None)
            self._shown -= {k for k in self._shown if k[0] == txn_id}

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
                self._end(txn_id, everywhere=True)
        with self.commit_lock, Held() as held:
            committed = self.records.in_states(TxnState.COMMITTED)
            self._apply(committed, held)
        self._applied(committed)
        if self.elsewhere is not None:
            self._settle()
        # an ended transaction's state decides its staged entries in a segment still open
        # (recovery reads it): it is kept while such a segment may hold them (any broker's)
        opened = [p.segments()[-1] for p in self.store.all_partitions()] if \
            self.elsewhere is None else self.store.metadata.open_segments()
        oldest_open = min((s.created_at for s in opened), default=now)
        self.records.forget_ended(min(now - KEEP_ENDED_MS, oldest_open))
        return len(expired)

    def _settle(self) -> None:
        """On a cluster: transactions with entries here that another broker ended (aborted,
        or applied everywhere) while this one did not hear of it."""
        with self._lock:  # and those it showed another broker's commit of
            touched = sorted(set(self._touched) | {txn for txn, _, _ in self._shown})
        for txn_id in touched:
            record = self._record(txn_id)  # None: forgotten long after it ended
            if record is None or record.state == TxnState.ABORTED:
                self._end(txn_id)
            elif record.state == TxnState.APPLIED:
                self._forget(txn_id)

    def here(self, op: str, txn_ids: list[str], parts: Iterable[tuple[str, int]]
             ) -> dict[str, Any]:
        """Another broker of a cluster asks about transactions' entries in partitions it
        believes served here (action ``txn-here``): the rows staged (``staged``), show the
        committed ones (``apply``), skip the aborted ones (``end``). ``not_here``: those of
        ``parts`` not served here, before or after the work (moved meanwhile), and for
        ``apply`` those whose part this broker did not show: a partition handed over while
        the question waited (its seal set the entries aside) is shown by its next owner, and
        the asking broker must not take it for shown."""
        crash_point("txn.asked")
        asked = {(str(t), int(p)) for t, p in parts}
        served = self._here(asked)
        out: dict[str, Any] = {}
        unshown: set[tuple[str, int]] = set()
        txn_ids = [check_txn_id(t) for t in txn_ids]
        if op == "staged":
            out["staged"] = [[t, p, n] for txn_id in txn_ids
                             for (t, p), n in self.staged(txn_id, asked).items()]
        elif op == "apply":
            crash_point("txn.asked-to-show")
            records = [r for r in map(self._record, txn_ids) if r is not None]
            committed = [r for r in records if r.state == TxnState.COMMITTED]
            self._apply_here(committed)
            theirs = {(r.txn_id, t, p) for r in committed for t, p in self._parts_of(r.txn_id)
                      if (t, p) in asked}
            with self._lock:
                unshown = {(t, p) for _, t, p in theirs - self._shown}
            for r in records:
                if r.state == TxnState.APPLIED:  # every owner did: nothing more to keep here
                    self._forget(r.txn_id)
        elif op == "end":
            for txn_id in txn_ids:
                record = self._record(txn_id)
                if record is None or record.state == TxnState.ABORTED:
                    self._end(txn_id)
        else:
            raise ConfigError(f"unknown transaction operation {op!r}: expected staged, "
                              "apply or end")
        gone = (asked - (served & self._here(asked))) | unshown
        out["not_here"] = [list(k) for k in sorted(gone)]
        return out

    def _record(self, txn_id: str) -> TransactionRecord | None:
        try:
            return self.records.get(txn_id)
        except NotFoundError:
            return None

    def recover(self) -> None:
        """At broker start: write again what was committed but not applied (every staged
        entry is in a sealed segment now: shown or set aside by recovery; on a cluster, in
        the partitions served here, the other owners being asked by housekeeping), finish
        commits staged by an older version, and remove staging nobody can commit."""
        committed = self.records.in_states(TxnState.COMMITTED)
        if committed:
            log.info("recovery: applying %d committed transaction(s)", len(committed))
        finish_old_staging(self.root, self.records, self._plog, ENTRY_BYTES)
        with self.commit_lock, Held() as held:
            committed = self.records.in_states(TxnState.COMMITTED)
            self._apply(committed, held)
        if self.elsewhere is None:  # on a cluster, housekeeping asks the others (a start
            self._applied(committed)  # does not wait on brokers that may be down)
        live = {r.txn_id for r in self.records.in_states(TxnState.OPEN, TxnState.PREPARED)}
        for plog in self.store.all_partitions():
            plog.forget_producers({n for n in plog.producers() if n.startswith(
                PRODUCER_PREFIX) and n[len(PRODUCER_PREFIX):].split("/")[0] not in live})

    def list(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.records.in_states(
            TxnState.OPEN, TxnState.PREPARED, TxnState.COMMITTED, TxnState.APPLIED,
            TxnState.ABORTED)]
