"""Rollover of a partition's segments: a segment is sealed (on its bookies, then in the
metadata) when it is full, old, asked to, or its ensemble lost a member, and the next one is
placed on a new ensemble. A mixin of :class:`~tierstream.managed_ledger.partition_log.
PartitionLog` over its state.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import wait as wait_futures
from typing import Any

from tierstream.bookie.ledger import IndexRecord
from tierstream.errors import FencedError, NotOwnerError, UnavailableError
from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.managed_ledger.open_segment import OpenSegment
from tierstream.managed_ledger.visibility import PartitionVisibility
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.store import MetadataStore
from tierstream.util.faults import crash_point
from tierstream.util.timeutil import now_ms

__all__ = ["PartitionRollover"]

log = logging.getLogger(__name__)

#: Decided transactions a partition remembers after a roll (an entry of one still in flight
#: when it ended is skipped, never taken for a new transaction's)
_ENDED_KEPT = 10_000


class PartitionRollover(PartitionVisibility):
    """Sealing and opening segments of :class:`~tierstream.managed_ledger.partition_log.
    PartitionLog` (a mixin over its state, declared below)."""

    # The partition's state, owned and kept by PartitionLog (managed_ledger/partition_log.py).
    topic: str
    partition: int
    _metadata: MetadataStore
    _bookies: dict[str, BookieClient]
    _choose_ensemble: Callable[[], tuple[str, ...]]
    _rollover_ms: int
    _on_fenced: Callable[[str, int, str], None] | None
    _on_sealed: Callable[[SegmentRecord, bool], None] | None
    _index_cache: OrderedDict[int, list[IndexRecord]]
    _lock: threading.RLock
    _lost: NotOwnerError | None

    def _advance(self, seg: OpenSegment, *, roll_on_failure: bool = True) -> None:
        raise NotImplementedError

    def _new_open_segment(self) -> OpenSegment:
        try:
            record = self._metadata.new_segment(self.topic, self.partition,
                                                ensemble=self._choose_ensemble(),
                                                created_at=now_ms())
        except NotOwnerError as exc:  # another broker claimed the partition
            self._fenced(str(exc))
            raise
        crash_point("roll.next-registered")
        for b in record.ensemble:
            self._bookies[b].create_ledger(record.segment_id)
        return OpenSegment(record)

    def _reopen_if_sealed(self) -> None:
        """The open segment was sealed but no next one could be opened (too few bookies):
        open it now, or raise UnavailableError again at once. Lock held."""
        if self._open.sealed:
            self._open = self._new_open_segment()
            self._changed.notify_all()

    def _roll_if_due(self, now: int) -> None:
        seg = self._open
        if self._held or seg.sealed:
            return  # a commit is being applied; the segment rolls after it
        if seg.records and now - seg.record.created_at >= self._rollover_ms:
            self._roll()

    def _roll_if_full(self) -> None:
        """Roll before an entry the open segment has no room for, counting the entries still
        in flight (submitted back to back, they are not confirmed yet): the roll confirms
        them first."""
        seg = self._open
        if self._held or not seg.in_flight or seg.sealed:
            return
        if seg.next_entry >= self._max_entries or seg.bytes + sum(
                f.size for f in seg.in_flight.values()) >= self._max_bytes:
            self._roll()

    def roll_if_aged(self) -> bool:
        """Seal the open segment if it is non-empty and older than the rollover time."""
        with self._lock:
            before = self._open
            self._roll_if_due(now_ms())
            return self._open is not before

    def seal(self) -> SegmentRecord | None:
        """Seal the open segment now if it has entries (hidden ones too) and open a new one
        (NotOwnerError, naming the owner, once another broker owns the partition)."""
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if not (self._open.records or self._open.in_flight or self._open.hidden):
                return None
            self._roll()
            return self._closed_segments[-1] if self._closed_segments else None

    def seal_if_open(self, segment_id: int) -> bool:
        """Seal the open segment now if it is ``segment_id`` and has entries: a bookie of it
        lost its copy (a replaced disk), and the copy is re-replicated once it is closed."""
        with self._lock:
            if self._open.record.segment_id != segment_id:
                return False
            if not (self._open.records or self._open.in_flight or self._open.hidden):
                return False
            self._roll()
            return True

    def _roll(self, *, reopen: bool = True) -> None:
        if self._lost is not None:
            return  # another broker owns the partition: it seals what is open (lose())
        seg = self._open
        if seg.sealed:  # sealed already: only the next segment is missing
            if reopen:
                self._reopen_if_sealed()
            return
        wait_futures([f for p in seg.in_flight.values() for f in p.futures])
        self._advance(seg, roll_on_failure=False)
        for cut in seg.in_flight.values():  # not confirmed: after a failed write
            if cut.producer is not None and cut.sequence_id is not None and cut.txn is None:
                self._dedup.cut_off(cut.producer, cut.sequence_id)
        seg.in_flight.clear()
        # Every confirmed entry goes into the sealed segment: undecided transactions' entries
        # are set aside (skipped by readers, written again at their commit), the rest is
        # readable from the bookies (a commit being applied here, only on a seal request,
        # shutdown or a failed write, shows early).
        set_aside: dict[str, list[list[Any]]] = {}
        for record, batch in seg.hidden:
            staged = seg.txn_of.get(record.entry_id)
            part = self._txns.get(staged[0]) if staged else None
            if staged is not None and part is not None and part.state == "pending":
                set_aside.setdefault(staged[0], []).append(
                    [record.entry_id, record.messages, staged[1]])
                self._show_skipped(seg, record)
            elif part is not None and part.state == "skipped":
                self._show_skipped(seg, record)
            else:
                self._show(seg, record, batch)
        seg.hidden.clear()
        seg.blocked_since = None
        last = seg.records[-1].entry_id if seg.records else None
        degraded = not self._seal_on_bookies(seg.record, last) or seg.failed
        crash_point("roll.bookies-sealed")
        if seg.records:
            sealed = seg.record.with_stats(
                state=SegmentState.CLOSED, entries=len(seg.records), messages=seg.messages,
                bytes=seg.bytes, min_publish_time=seg.min_pt, max_publish_time=seg.max_pt,
                sealed_at=now_ms(), skipped=seg.skipped_ranges(),
            )
            try:
                self._metadata.seal_segment(sealed, self._dedup.rows(), set_aside)
            except NotOwnerError as exc:
                self._fenced(str(exc))
                raise
            crash_point("roll.metadata-sealed")
            if self._on_sealed is not None:
                self._on_sealed(sealed, degraded)
            self._closed_segments.append(sealed)
            self._index_cache[sealed.segment_id] = seg.records
        else:
            self._metadata.delete_segment(seg.record.segment_id)
            for b in seg.record.ensemble:
                try:
                    self._bookies[b].delete_ledger(seg.record.segment_id)
                except FencedError:
                    raise
                except UnavailableError:  # an empty ledger stays there: never read again
                    # (raising made every retry of an append close this segment again)
                    log.info("bookie %s did not answer: its empty ledger %d stays", b,
                             seg.record.segment_id)
        # the undecided transactions' entries are set aside now; decided ones are kept (a
        # late entry of an aborted one is skipped too), the oldest dropped past a bound
        for part in self._txns.values():
            if part.state == "pending" and part.entries:
                part.set_aside = True
            part.entries, part.rows, part.routed = [], 0, set()
        ended = [t for t, p in self._txns.items() if p.state != "pending"]
        for txn_id in ended[:max(0, len(ended) - _ENDED_KEPT)]:
            del self._txns[txn_id]
        seg.sealed = True  # if no next one can be opened now, appends try again: no reseal
        if reopen:
            self._open = self._new_open_segment()
        self._changed.notify_all()

    def _seal_on_bookies(self, record: SegmentRecord, last: int | None) -> bool:
        """Seal the ledger on every bookie of its ensemble that answers. One that does not
        keeps a copy that may run past ``last`` (readers stop at the entries metadata
        records); a refusal as fenced means this broker is no longer the writer."""
        missed = []
        for b in record.ensemble:
            try:
                self._bookies[b].seal_ledger(record.segment_id, last)
            except FencedError as exc:
                self._fenced(str(exc))
                if self._lost is not None:  # another broker owns the partition now
                    raise self._lost from None
                raise
            except UnavailableError as exc:
                missed.append(f"{b}: {exc}")
        if missed:
            log.warning("segment %d (%s partition %d) sealed without %d of its bookies: %s",
                        record.segment_id, self.topic, self.partition, len(missed),
                        "; ".join(missed))
        return not missed

    def _fenced(self, reason: str) -> None:
        """Another writer has this partition's ledger or its metadata: the owner of the
        store decides whether the partition was taken over (it is let go: :meth:`lose`)
        or the whole store was (the broker stops writing)."""
        if self._on_fenced is not None:
            self._on_fenced(self.topic, self.partition, reason)

    def seal_for_scale(self) -> None:
        """Seal the open segment for a scale event, opening none: the caller holds this
        log's lock until :meth:`reopen` gives it the segment the event registered."""
        with self._lock:
            self._roll(reopen=False)

    def reopen(self, record: SegmentRecord, routing: int) -> None:
        """After a scale event: write to ``record`` (registered by the event) and refuse
        batches routed by any count but ``routing``."""
        with self._lock:
            for b in record.ensemble:
                self._bookies[b].create_ledger(record.segment_id)
            self._open = OpenSegment(record)
            self.routing = routing
            self._changed.notify_all()

