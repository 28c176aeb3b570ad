"""The metadata of transactions and sinks: their states, and the one atomic commit decision.

A transaction moves ``OPEN`` (staging) -> ``PREPARED`` (its writer finished; the staged files
are durable) -> ``COMMITTED`` (decided, durable here) -> ``APPLIED`` (in the log; staging
removed); an ``OPEN`` or ``PREPARED`` one may instead end ``ABORTED``. A sink remembers the last
batch id it committed, so a commit of that batch or an earlier one is a no-op.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tierstream.errors import ConflictError, NotFoundError
from tierstream.metadata.store import MetadataStore

__all__ = ["Decision", "TransactionRecord", "TransactionRecords", "TxnState"]


class TxnState:
    OPEN = "OPEN"
    PREPARED = "PREPARED"
    COMMITTED = "COMMITTED"
    APPLIED = "APPLIED"
    ABORTED = "ABORTED"


@dataclass(frozen=True)
class TransactionRecord:
    txn_id: str
    sink_id: str | None
    batch_id: int | None
    state: str
    created_at: int
    updated_at: int
    parts: list[tuple[str, int, int]]  # (topic, partition, rows)
    reason: str | None
    #: (topic, partition) whose staged entries the commit writes again rather than shows
    #: where they are (recorded with the decision: recovery reads it)
    moved: frozenset[tuple[str, int]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {"txn_id": self.txn_id, "sink_id": self.sink_id, "batch_id": self.batch_id,
                "state": self.state, "created_at": self.created_at,
                "updated_at": self.updated_at, "reason": self.reason,
                "parts": [list(p) for p in self.parts],
                "messages": sum(p[2] for p in self.parts)}


@dataclass(frozen=True)
class Decision:
    """What a commit decided: ``committed`` is empty when the batch was committed before
    (``duplicate``); ``fenced`` are the batch's other transactions, now aborted."""

    committed: list[TransactionRecord]
    fenced: list[str]
    duplicate: bool


_COLUMNS = "txn_id, sink_id, batch_id, state, created_at, updated_at, parts, reason"


def _record(row: Any) -> TransactionRecord:
    txn_id, sink_id, batch_id, state, created, updated, parts, reason = row
    items = json.loads(parts)  # [topic, partition, rows] or [..., "moved"]
    return TransactionRecord(txn_id, sink_id, batch_id, state, created, updated,
                             [(str(i[0]), int(i[1]), int(i[2])) for i in items], reason,
                             frozenset((str(i[0]), int(i[1])) for i in items
                                       if len(i) > 3 and i[3] == "moved"))


class TransactionRecords:
    """The ``transactions`` and ``sinks`` tables of one metadata store."""

    def __init__(self, metadata: MetadataStore) -> None:
        self._meta = metadata

    def begin(self, txn_id: str, sink_id: str | None, batch_id: int | None, now: int
              ) -> TransactionRecord:
        """Register ``txn_id`` as OPEN (idempotent); a transaction that ended is refused."""
        with self._meta.atomic() as c:
            c.execute("INSERT INTO transactions (txn_id, sink_id, batch_id, state, "
                      "created_at, updated_at) VALUES (?,?,?,?,?,?) "
                      "ON CONFLICT (txn_id) DO NOTHING",
                      (txn_id, sink_id, batch_id, TxnState.OPEN, now, now))
        record = self.get(txn_id)
        if record.state != TxnState.OPEN:
            raise ConflictError(f"transaction {txn_id} is {record.state.lower()}"
                                f"{_why(record)}: it cannot take more writes")
        return record

    def get(self, txn_id: str) -> TransactionRecord:
        rows = self._meta.query(f"SELECT {_COLUMNS} FROM transactions WHERE txn_id=?",
                                (txn_id,))
        if not rows:
            raise NotFoundError(f"no transaction {txn_id!r} (never staged, or cleaned up long "
                                "after it ended)")
        return _record(rows[0])

    def in_states(self, *states: str) -> list[TransactionRecord]:
        marks = ",".join("?" * len(states))
        return [_record(r) for r in self._meta.query(
            f"SELECT {_COLUMNS} FROM transactions WHERE state IN ({marks}) "
            "ORDER BY created_at, txn_id", states)]

    def prepare(self, txn_id: str, parts: list[tuple[str, int, int]], now: int
                ) -> TransactionRecord:
        """OPEN -> PREPARED with the staged parts; PREPARED again is a no-op."""
        with self._meta.atomic() as c:
            c.execute("UPDATE transactions SET state=?, parts=?, updated_at=? "
                      "WHERE txn_id=? AND state=?",
                      (TxnState.PREPARED, json.dumps(parts), now, txn_id, TxnState.OPEN))
        record = self.get(txn_id)
        if record.state != TxnState.PREPARED:
            raise ConflictError(f"transaction {txn_id} is {record.state.lower()}"
                                f"{_why(record)}: it cannot be prepared")
        return record

    def decide(self, txn_ids: list[str], sink_id: str | None, batch_id: int | None, now: int,
               moved: dict[str, set[tuple[str, int]]] | None = None) -> Decision:
        """The commit decision, in one metadata transaction: every listed transaction
        PREPARED -> COMMITTED, with the parts its commit writes again (``moved``), and the
        sink's last batch set; the batch's other open or prepared transactions (failed or
        speculative task attempts) aborted. A batch at or below the sink's last committed one
        changes nothing but aborting the listed ones. Listing a transaction already committed
        is fine (a retried commit)."""
        with self._meta.atomic() as c:
            if sink_id is not None:
                row = c.execute("SELECT last_batch FROM sinks WHERE sink_id=?",
                                (sink_id,)).fetchone()
                if row is not None and batch_id is not None and batch_id <= row[0]:
                    # every attempt of a batch that is already decided is fenced: the
                    # listed ones and the batch's other open or prepared ones alike
                    others = self._attempts(c, sink_id, batch_id, exclude=txn_ids)
                    repeated = self._abort(c, [*txn_ids, *others], now,
                                           f"batch {batch_id} of sink {sink_id!r} was already "
                                           f"committed (last committed batch: {row[0]})")
                    return Decision([], repeated, True)
            records = []
            for txn_id in txn_ids:
                row = c.execute(f"SELECT {_COLUMNS} FROM transactions WHERE txn_id=?",
                                (txn_id,)).fetchone()
                if row is None:
                    raise NotFoundError(f"cannot commit: no transaction {txn_id!r}")
                record = _record(row)
                if record.state not in (TxnState.PREPARED, TxnState.COMMITTED,
                                        TxnState.APPLIED):
                    raise ConflictError(f"cannot commit: transaction {txn_id} is "
                                        f"{record.state.lower()}{_why(record)}")
                if (record.sink_id, record.batch_id) != (sink_id, batch_id):
                    raise ConflictError(
                        f"cannot commit: transaction {txn_id} was staged for sink "
                        f"{record.sink_id!r} batch {record.batch_id}, not {sink_id!r} batch "
                        f"{batch_id}")
                records.append(record)
            c.executemany(
                "UPDATE transactions SET state=?, updated_at=?, parts=? WHERE txn_id=? "
                "AND state=?", [(TxnState.COMMITTED, now, _parts(r, (moved or {}).get(
                    r.txn_id, set())), r.txn_id, TxnState.PREPARED) for r in records])
            fenced: list[str] = []
            if sink_id is not None:
                c.execute("INSERT INTO sinks (sink_id, last_batch, committed_at) VALUES (?,?,?) "
                          "ON CONFLICT (sink_id) DO UPDATE SET last_batch=excluded.last_batch, "
                          "committed_at=excluded.committed_at", (sink_id, batch_id, now))
                fenced = self._abort(c, self._attempts(c, sink_id, batch_id, exclude=txn_ids),
                                     now, f"fenced: not among the transactions committed for "
                                     f"batch {batch_id} of sink {sink_id!r}")
        committed = [self.get(r.txn_id) for r in records]
        return Decision(committed, fenced, False)

    def abort(self, txn_ids: list[str], now: int, reason: str) -> list[str]:
        """OPEN/PREPARED -> ABORTED; returns those that were aborted now. Committed ones are
        refused (a commit is final)."""
        with self._meta.atomic() as c:
            for txn_id in txn_ids:
                row = c.execute("SELECT state FROM transactions WHERE txn_id=?",
                                (txn_id,)).fetchone()
                if row is not None and row[0] in (TxnState.COMMITTED, TxnState.APPLIED):
                    raise ConflictError(f"cannot abort transaction {txn_id}: it is "
                                        f"{row[0].lower()}")
            return self._abort(c, txn_ids, now, reason)

    @staticmethod
    def _attempts(c: Any, sink_id: str, batch_id: int | None, *, exclude: list[str]
                  ) -> list[str]:
        """The open or prepared transactions of a sink's batch, but ``exclude``."""
        marks = ",".join("?" * len(exclude))
        return [r[0] for r in c.execute(
            f"SELECT txn_id FROM transactions WHERE sink_id=? AND batch_id=? AND "
            f"state IN (?,?) AND txn_id NOT IN ({marks}) ORDER BY txn_id",
            (sink_id, batch_id, TxnState.OPEN, TxnState.PREPARED, *exclude))]

    @staticmethod
    def _abort(c: Any, txn_ids: list[str], now: int, reason: str) -> list[str]:
        done = []
        for txn_id in txn_ids:
            cur = c.execute("UPDATE transactions SET state=?, reason=?, updated_at=? "
                            "WHERE txn_id=? AND state IN (?,?)",
                            (TxnState.ABORTED, reason, now, txn_id, TxnState.OPEN,
                             TxnState.PREPARED))
            if cur.rowcount:
                done.append(txn_id)
        return done

    def applied(self, txn_ids: list[str], now: int) -> None:
        with self._meta.atomic() as c:
            c.executemany("UPDATE transactions SET state=?, updated_at=? WHERE txn_id=? AND "
                          "state=?", [(TxnState.APPLIED, now, t, TxnState.COMMITTED)
                                      for t in txn_ids])

    def add_moved(self, txn_id: str, topic: str, partition: int) -> None:
        """A committed transaction's part that its commit writes again after all (some of
        its entries were set aside after the decision): recorded before it is written, so
        that recovery skips its entries still in place. A compare-and-set: the owners of a
        transaction's other partitions may record theirs at the same time."""
        while True:
            record = self.get(txn_id)
            if (topic, partition) in record.moved:
                return
            before = _parts(record, set(record.moved))
            after = _parts(record, {*record.moved, (topic, partition)})
            with self._meta.atomic() as c:
                done = c.execute("UPDATE transactions SET parts=? WHERE txn_id=? AND parts=?",
                                 (after, txn_id, before)).rowcount
            if done:
                return

    def expired(self, before: int) -> list[str]:
        """OPEN/PREPARED transactions not touched since ``before``."""
        return [r[0] for r in self._meta.query(
            "SELECT txn_id FROM transactions WHERE state IN (?,?) AND updated_at < ?",
            (TxnState.OPEN, TxnState.PREPARED, before))]

    def forget_ended(self, before: int) -> None:
        """Drop records of transactions that ended (applied or aborted) before ``before``."""
        with self._meta.atomic() as c:
            c.execute("DELETE FROM transactions WHERE state IN (?,?) AND updated_at < ?",
                      (TxnState.APPLIED, TxnState.ABORTED, before))

    def touch(self, txn_id: str, now: int) -> None:
        with self._meta.atomic() as c:
            c.execute("UPDATE transactions SET updated_at=? WHERE txn_id=?", (now, txn_id))

    def counts(self) -> dict[str, int]:
        """How many transactions are in each state (ended ones until they are forgotten)."""
        found = dict(self._meta.query("SELECT state, COUNT(*) FROM transactions GROUP BY state"))
        return {state: int(found.get(state, 0)) for state in (
            TxnState.OPEN, TxnState.PREPARED, TxnState.COMMITTED, TxnState.APPLIED,
            TxnState.ABORTED)}

    def last_batch(self, sink_id: str) -> int | None:
        rows = self._meta.query("SELECT last_batch FROM sinks WHERE sink_id=?", (sink_id,))
        return None if not rows else int(rows[0][0])

    # -- entries set aside in sealed segments (written by MetadataStore.seal_segment) -------

    def set_aside(self, txn_id: str, topic: str | None = None, partition: int | None = None
                  ) -> list[tuple[str, int, int, list[list[Any]]]]:
        """The entries of ``txn_id`` set aside in sealed segments (of one ``topic`` and
        ``partition``, if given): (topic, partition, segment id,
        ``[[entry_id, rows, routed], ...]``), in log order."""
        args: tuple[Any, ...] = (txn_id,)
        where = "txn_id=?"
        if topic is not None and partition is not None:
            where, args = "txn_id=? AND topic=? AND partition=?", (txn_id, topic, partition)
        rows = self._meta.query(
            f"SELECT topic, partition, segment_id, entries FROM txn_set_aside WHERE {where} "
            "ORDER BY topic, partition, segment_id", args)
        return [(t, p, s, json.loads(e)) for t, p, s, e in rows]

    def has_set_aside(self, txn_id: str, topic: str, partition: int) -> bool:
        return bool(self._meta.query(
            "SELECT 1 FROM txn_set_aside WHERE txn_id=? AND topic=? AND partition=? LIMIT 1",
            (txn_id, topic, partition)))

    def drop_set_aside(self, txn_ids: list[str]) -> None:
        with self._meta.atomic() as c:
            c.executemany("DELETE FROM txn_set_aside WHERE txn_id=?", [(t,) for t in txn_ids])

    def set_aside_segments(self) -> set[int]:
        """Segments holding set-aside entries that a commit may still need (their bookie
        copies are kept until the transaction ends)."""
        return {r[0] for r in self._meta.query("SELECT DISTINCT segment_id FROM txn_set_aside")}


def _parts(record: TransactionRecord, moved: set[tuple[str, int]]) -> str:
    return json.dumps([[t, p, n, *(["moved"] if (t, p) in moved else [])]
                       for t, p, n in record.parts])


def _why(record: TransactionRecord) -> str:
    return f" ({record.reason})" if record.reason else ""
