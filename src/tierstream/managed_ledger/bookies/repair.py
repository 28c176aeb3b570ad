"""Re-replication of closed segments that lost a copy, and the audit that finds them, in the
background (the broker's housekeeping runs :meth:`Repairer.run_once`).

Which segments lack a whole copy is kept in the metadata store (``metadata/replication.py``),
never only here, so a broker that takes the store over or restarts resumes the repair. A
segment is listed when it was sealed while a bookie of its ensemble did not answer (its copy
there may be short or missing), when it was placed on fewer bookies than the write quorum,
when recovery sealed it without some of its bookies, when a bookie that held a copy was
replaced by an empty disk (``cookie.py``), or when an audit finds a copy short.

On a cluster (several brokers) each broker audits and repairs the segments of the partitions
it serves alone: the owner's log is the one that must learn a segment's new ensemble (its
reads, offload and deletions go by it).

**The audit** (BookKeeper's auditor) compares every closed segment still on bookies with
what each answering bookie of its ensemble holds: one call per bookie lists its ledgers with
the entries their index holds, and a copy with fewer entries than the segment's record is
listed. It runs every ``audit_interval_s`` and at once when a bookie answers again after it
did not. A copy on a bookie that does not answer is not judged: it may come back whole.

**A pass** checks each listed segment's copies (a copy is whole when its index holds the
segment's entries), copies the frames of a whole copy to each bookie that lacks one — the
same bookie if it answers, else an available bookie outside the ensemble, on a new host where
there is one — and records the new ensemble and takes the segment off the list in one
metadata transaction, only once every copy is written. A segment left with one whole copy is
a warning, with none an error, each logged once; ``broker stats`` shows the list's size, how
many segments have one copy and none, the last audit and what was repaired.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tierstream.errors import NotFoundError, TierstreamError
from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.replication import (
    mark_under_replicated,
    repaired,
    segments_on_bookies,
    under_replicated,
)
from tierstream.metadata.store import MetadataStore

__all__ = ["DEFAULT_AUDIT_INTERVAL_S", "Repairer"]

log = logging.getLogger(__name__)

#: how often every closed segment's copies are checked, when nothing calls for it sooner
DEFAULT_AUDIT_INTERVAL_S = 60.0


class Repairer:
    def __init__(self, metadata: MetadataStore, bookies: dict[str, BookieClient],
                 write_quorum: int, updated: Callable[[SegmentRecord], None], *,
                 seal: Callable[[SegmentRecord], None] | None = None,
                 serves: Callable[[], set[tuple[str, int]]] | None = None,
                 audit_interval_s: float = DEFAULT_AUDIT_INTERVAL_S) -> None:
        self._metadata, self._bookies, self._write_quorum = metadata, bookies, write_quorum
        #: the partitions this broker serves, when it is one of several: it audits and
        #: repairs their segments alone (the owner's log learns each new ensemble); None: all
        self._serves = serves
        self._updated = updated  # the partition's log serves the new record
        self._seal = seal  # seals an open segment listed because a bookie lost its copy
        self._audit_interval_s = audit_interval_s
        self._lock = threading.Lock()
        self.repaired = 0
        self._listed = 0  # segments on the metadata's list at the last pass
        self._copies: dict[int, int] = {}  # segments with fewer than two whole copies: how many
        self._told: dict[int, int] = {}  # the copies last logged for a segment (logged once)
        self._waits: dict[int, str] = {}  # why a segment's repair waits, as last logged
        self._answered: dict[str, bool] = {}  # whether each bookie answered at the last pass
        self._next_audit = 0.0  # monotonic: the first pass audits
        self.last_audit: dict[str, Any] | None = None

    def suspect(self, segment_id: int, reason: str) -> None:
        """List ``segment_id`` as lacking a copy (in the metadata: any broker resumes it)."""
        mark_under_replicated(self._metadata, [(segment_id, reason)])
        with self._lock:
            self._listed += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"under_replicated": self._listed, "re_replicated": self.repaired,
                    "one_copy": sum(1 for n in self._copies.values() if n == 1),
                    "no_copy": sum(1 for n in self._copies.values() if n == 0),
                    "last_audit": self.last_audit}

    def run_once(self) -> None:
        """Audit when due (or when a bookie answers again), then repair what is listed."""
        answered = {b: bookie.is_available() for b, bookie in self._bookies.items()}
        back = [b for b, up in answered.items() if up and self._answered.get(b) is False]
        self._answered = answered
        if back or time.monotonic() >= self._next_audit:
            self.audit(why="bookie(s) " + ", ".join(back) + " answer again" if back
                       else "periodic", answering=[b for b, up in answered.items() if up])
        listed = under_replicated(self._metadata)
        with self._lock:
            self._listed = len(listed)
        mine = None if self._serves is None else self._serves()
        for segment_id in sorted(listed):
            try:
                done = self._repair(segment_id, mine)
            except TierstreamError as exc:  # a bookie went away meanwhile: next pass
                self._tell_wait(segment_id, str(exc))
                continue
            if done:
                self._waits.pop(segment_id, None)
                with self._lock:
                    self._listed -= 1
                    self._copies.pop(segment_id, None)

    def audit(self, why: str = "asked", answering: list[str] | None = None
              ) -> dict[str, Any]:
        """Check every closed segment's copies on its answering bookies (``answering``, as
        the caller just found them; None: asked now); list the short ones. Returns what it
        found (also ``last_audit`` in stats)."""
        started = time.monotonic()
        self._next_audit = started + self._audit_interval_s
        if answering is None:
            answering = [b for b, bookie in self._bookies.items() if bookie.is_available()]
        held: dict[str, dict[int, int]] = {}
        for b in answering:
            try:
                held[b] = self._bookies[b].ledger_entries()
            except (TierstreamError, OSError) as exc:
                log.info("audit: bookie %s did not list its ledgers: %s", b, exc)
        listed = under_replicated(self._metadata)
        found: list[tuple[int, str]] = []
        copies: dict[int, int] = {}
        segments = segments_on_bookies(self._metadata)
        if self._serves is not None:  # the other partitions' owners audit theirs
            mine = self._serves()
            segments = [s for s in segments if (s.topic, s.partition) in mine]
        for seg in segments:
            answering = [b for b in seg.ensemble if b in held]
            short = [b for b in answering if held[b].get(seg.segment_id, 0) < seg.entries]
            whole = len(answering) - len(short)
            if whole < min(2, self._write_quorum):  # one copy is all a quorum of 1 keeps
                copies[seg.segment_id] = whole
            if seg.segment_id in listed:
                continue
            if short:
                found.append((seg.segment_id, f"audit: the copies on {', '.join(short)} are "
                                              "short or missing"))
            elif len(seg.ensemble) < self._write_quorum:
                found.append((seg.segment_id, f"audit: {len(seg.ensemble)} copies, below the "
                                              f"write quorum {self._write_quorum}"))
        mark_under_replicated(self._metadata, found)
        for segment_id, _ in found:
            log.warning("audit: segment %d lacks a whole copy; it is re-replicated",
                        segment_id)
        with self._lock:
            self._copies = copies
            self.last_audit = {"why": why, "segments": len(segments),
                               "bookies": sorted(held), "found": len(found),
                               "seconds": round(time.monotonic() - started, 3)}
        self._tell_copies(copies, segments)
        return dict(self.last_audit)

    def _tell_wait(self, segment_id: int, why: str) -> None:
        """Say why a segment's repair waits, once per reason (not at every pass)."""
        if self._waits.get(segment_id) != why:
            self._waits[segment_id] = why
            log.info("re-replication of segment %d waits: %s", segment_id, why)

    def _tell_copies(self, copies: dict[int, int], segments: list[SegmentRecord]) -> None:
        """Log a segment left with one whole copy (a warning) or none (an error), once per
        change, not at every pass."""
        by_id = {s.segment_id: s for s in segments}
        for segment_id, n in copies.items():
            if self._told.get(segment_id) == n:
                continue
            self._told[segment_id] = n
            seg = by_id[segment_id]
            if n == 1:
                log.warning("segment %d (%s partition %d) is down to one whole copy on the "
                            "bookies that answer: one more loss loses acknowledged messages "
                            "until it is re-replicated", segment_id, seg.topic, seg.partition)
            else:
                log.error("segment %d (%s partition %d) has no whole copy on a bookie that "
                          "answers: its messages cannot be read until one does",
                          segment_id, seg.topic, seg.partition)
        for segment_id in [s for s in self._told if s not in copies]:
            del self._told[segment_id]

    def _repair(self, segment_id: int, mine: set[tuple[str, int]] | None) -> bool:
        """True when the segment needs nothing more (repaired, whole, or gone); a segment of
        a partition not in ``mine`` (None: every one) is its owner's to repair."""
        try:
            seg = self._metadata.get_segment(segment_id)
        except NotFoundError:
            repaired(self._metadata, segment_id)  # deleted (retention, topic deletion)
            return True
        if mine is not None and (seg.topic, seg.partition) not in mine:
            return False
        if seg.state != SegmentState.CLOSED:
            # open: listed because a bookie of it lost its copy; repaired once sealed
            if self._seal is not None:
                self._seal(seg)
            return False
        if seg.bookie_deleted_at is not None or not seg.entries:
            repaired(self._metadata, segment_id)  # only in the tier now, or empty
            return True
        whole: list[str] = []
        lacking: list[str] = []
        for b in seg.ensemble:
            (whole if self._holds(b, seg) else lacking).append(b)
        missing = max(0, self._write_quorum - len(seg.ensemble))
        if not lacking and not missing:
            repaired(self._metadata, segment_id)
            return True
        if not whole:
            if self._told.get(segment_id) != 0:
                self._told[segment_id] = 0
                log.error("segment %d (%s partition %d) has no whole copy on a bookie that "
                          "answers; it is re-replicated once one does", seg.segment_id,
                          seg.topic, seg.partition)
            return False
        source = self._bookies[whole[0]]
        records = source.index(segment_id)[:seg.entries]
        frames = list(source.read_raw_frames(segment_id, records))
        ensemble = list(seg.ensemble)
        wanted: list[str | None] = [*lacking, *([None] * missing)]
        for lost in wanted:
            back = self._bookies.get(lost) if lost is not None else None
            target = lost if back is not None and back.is_available() else \
                self._replacement(ensemble)
            if target is None:
                return False  # no bookie to take it now: the next pass tries again
            self._bookies[target].rewrite_ledger(segment_id, frames)
            if lost is None:
                ensemble.append(target)
            else:
                ensemble[ensemble.index(lost)] = target
        repaired(self._metadata, segment_id, tuple(ensemble))
        self._updated(replace(seg, ensemble=tuple(ensemble)))
        with self._lock:
            self.repaired += 1
        self._told.pop(segment_id, None)
        log.info("segment %d (%s partition %d) re-replicated: its copies are on %s",
                 segment_id, seg.topic, seg.partition, ", ".join(ensemble))
        return True

    def _holds(self, bookie_id: str, seg: SegmentRecord) -> bool:
        bookie = self._bookies.get(bookie_id)
        if bookie is None or not bookie.is_available():
            return False
        try:
            return len(bookie.index(seg.segment_id)) >= seg.entries
        except (NotFoundError, OSError):
            return False

    def _replacement(self, ensemble: list[str]) -> str | None:
        hosts = {self._bookies[b].host for b in ensemble if b in self._bookies}
        spare = [b for b, bk in self._bookies.items() if b not in ensemble and bk.is_available()]
        spare.sort(key=lambda b: self._bookies[b].host in hosts)  # new hosts first
        return spare[0] if spare else None
