"""What readers see of a partition's open segment: confirmed entries shown in order, up to
the first entry of an undecided transaction (Pulsar's max read position) or while a commit
holds the partition; entries of aborted transactions, or written again elsewhere, skipped.
A mixin of :class:`~tierstream.managed_ledger.partition_log.PartitionLog` over its state;
``broker/transactions/coordinator.py`` says how transactions use it.
"""

from __future__ import annotations

import logging
import threading
import time

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord
from tierstream.errors import NotFoundError, NotOwnerError
from tierstream.managed_ledger.dedup import ProducerDedup
from tierstream.managed_ledger.open_segment import TXN_PRODUCER, OpenSegment, TxnPart
from tierstream.managed_ledger.partition_positions import PartitionPositions
from tierstream.metadata.transaction_records import TransactionRecords

__all__ = ["PartitionVisibility"]

log = logging.getLogger(__name__)


class PartitionVisibility(PartitionPositions):
    """Visibility of :class:`~tierstream.managed_ledger.partition_log.PartitionLog`'s open
    segment (a mixin over its state, declared below)."""

    # The partition's state, owned and kept by PartitionLog (managed_ledger/partition_log.py).
    routing: int | None
    _held: bool
    _txns: dict[str, TxnPart]
    _stats_dirty: bool
    _dedup: ProducerDedup
    _txn_records: TransactionRecords
    _max_entries: int
    _max_bytes: int
    _changed: threading.Condition
    _lost: NotOwnerError | None

    def _roll(self, *, reopen: bool = True) -> None:
        raise NotImplementedError

    def _show(self, seg: OpenSegment, record: IndexRecord, batch: pa.RecordBatch | None
              ) -> None:
        """A confirmed entry becomes visible: to reads, positions and stats (lock held)."""
        seg.records.append(record)
        seg.messages += record.messages
        self._count(seg, record)
        if batch is not None:
            self._cache_put((seg.record.segment_id, record.entry_id), batch)

    def _show_skipped(self, seg: OpenSegment, record: IndexRecord) -> None:
        """A confirmed entry readers skip (an aborted transaction's, or one written again
        elsewhere): in the index, so entry ids stay positions, but never read (lock held)."""
        seg.records.append(record)
        seg.skip(record.entry_id)
        self._count(seg, record)

    def _count(self, seg: OpenSegment, record: IndexRecord) -> None:
        seg.bytes += record.frame_len
        seg.min_pt = record.first_publish_time if seg.min_pt is None else seg.min_pt
        seg.max_pt = record.last_publish_time
        self._stats_dirty = True

    def hold(self) -> None:
        """Entries confirmed from now on stay out of sight (reads, positions, stats) and the
        segment does not roll, until :meth:`release`. A transaction commit that writes rows
        again holds every partition it writes, so readers see all of it at once or none.
        Durability is unchanged: producers are acknowledged as usual."""
        with self._lock:
            self._held = True

    def release(self) -> None:
        """End :meth:`hold`: the entries confirmed meanwhile become visible, in order (up to
        an undecided transaction's entry)."""
        with self._lock:
            self._held = False
            self._show_hidden(self._open)

    def _show_hidden(self, seg: OpenSegment) -> None:
        """Show the hidden entries that may be shown now, in order: up to the first entry of
        an undecided transaction (lock held)."""
        if self._held or not seg.hidden:
            return
        shown = 0
        for record, batch in seg.hidden:
            staged = seg.txn_of.get(record.entry_id)
            state = self._txns[staged[0]].state if staged and staged[0] in self._txns \
                else None
            if state == "pending":
                break
            if state == "skipped":
                self._show_skipped(seg, record)
            else:
                self._show(seg, record, batch)
            shown += 1
        del seg.hidden[:shown]
        if not any(seg.txn_of.get(r.entry_id) is None for r, _ in seg.hidden):
            seg.blocked_since = None  # nothing but undecided staged entries waits
        if shown:
            self._changed.notify_all()
        if seg is self._open and not self._held and not seg.hidden and (
                len(seg.records) >= self._max_entries or seg.bytes >= self._max_bytes):
            self._roll()

    # -- transactions -------------------------------------------------------------------------

    def _txn_part(self, txn_id: str) -> TxnPart:
        """This partition's part of ``txn_id`` (lock held); made on its first entry here."""
        part = self._txns.get(txn_id)
        if part is None:
            last = self._dedup.last(TXN_PRODUCER + txn_id)
            part = self._txns[txn_id] = TxnPart(
                txn_id, next_seq=0 if last is None else last + 1,
                set_aside=self._txn_records.has_set_aside(txn_id, self.topic, self.partition))
        return part

    def txn_placement(self, txn_id: str) -> str | None:
        """How a commit of ``txn_id`` shows its entries here: ``in-place`` (where they were
        staged), ``again`` (written again: some were set aside in a sealed segment, or were
        routed by a partition count the topic no longer has), or None (none in the open
        segment)."""
        with self._lock:
            part = self._txns.get(txn_id)
            if part is None or (not part.entries and part.state == "pending"
                                and not part.set_aside):
                return None
            return "in-place" if self._in_place(part) else "again"

    def _in_place(self, part: TxnPart) -> bool:
        return not part.set_aside and part.routed <= {None, self.routing}

    def txn_entries(self, txn_id: str) -> tuple[int, list[tuple[int, int | None]], int]:
        """(open segment id, the entries ``txn_id`` staged in it, each with the partition
        count it was routed by, their rows)."""
        with self._lock:
            part = self._txns.get(txn_id)
            seg = self._open
            entries = [] if part is None else [(e, seg.txn_of[e][1]) for e in part.entries]
            return seg.record.segment_id, entries, 0 if part is None else part.rows

    def resolve(self, txn_id: str, *, committed: bool) -> bool:
        """``txn_id`` is decided: its staged entries in the open segment become visible where
        they are (a commit in place) or skipped (an abort, or a commit that writes them
        again), and the entries confirmed after them show, up to the next undecided one.
        False if another broker owns the partition now (:meth:`lose`): this one can no
        longer show anything, its next owner does (the decision is in the metadata)."""
        with self._lock:
            if self._lost is not None:
                return False
            part = self._txns.get(txn_id)
            if part is not None:
                part.state = "committed" if committed and self._in_place(part) else "skipped"
                self._show_hidden(self._open)
            return True

    def raw_entries(self, segment_id: int, entry_ids: list[int]) -> list[pa.RecordBatch]:
        """Stored entries as they are, skipped or hidden ones too (what a commit writes again
        of a transaction's staged entries)."""
        with self._lock:
            if segment_id == self._open.record.segment_id:
                seg = self._open.record
                by_id = {r.entry_id: r for r in self._open.records}
                by_id.update((r.entry_id, r) for r, _ in self._open.hidden)
            else:
                closed = next((s for s in self._closed_segments if s.segment_id == segment_id),
                              None)
                if closed is None:
                    raise NotFoundError(f"segment {segment_id} of {self.topic} partition "
                                        f"{self.partition} is gone")
                seg = closed
                by_id = {r.entry_id: r for r in self._segment_index(seg)}
        return [self._entry(seg, by_id[e]) for e in entry_ids]

    def roll_if_blocked(self, limit_ms: int) -> bool:
        """Seal the open segment if ordinary entries have waited behind an undecided
        transaction's for ``limit_ms``: its entries are set aside (written again at its
        commit) and the rest become visible."""
        with self._lock:
            seg = self._open
            if self._held or seg.blocked_since is None or \
                    (time.monotonic() - seg.blocked_since) * 1000 < limit_ms:
                return False
            waiting = [t for t, p in self._txns.items() if p.state == "pending" and p.entries]
            log.info("%s partition %d: messages waited %g s behind undecided transaction(s) "
                     "%s; their entries are set aside, to be written at their commit",
                     self.topic, self.partition, limit_ms / 1000, ", ".join(waiting))
            self._roll()
            return True

