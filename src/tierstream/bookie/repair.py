"""Re-replication of closed segments that lost a copy, in the background (the broker's
housekeeping runs :meth:`Repairer.run_once`).

A segment becomes a suspect when it was sealed while a bookie of its ensemble did not
answer (its copy there may be short or missing), when it was placed on fewer bookies than
the write quorum, or when recovery sealed it without some of its bookies. A pass checks
each suspect's copies (a copy is whole when its index holds the segment's entries), copies
the frames of a whole copy to each bookie that lacks one — the same bookie if it answers
again, else an available bookie outside the ensemble, on a new host where there is one —
and records the new ensemble in the metadata, in one statement, only once every copy is
written. ``broker stats`` shows the suspects left and the segments repaired.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tierstream.bookie.network import AnyBookie, available, host_of, raw_frames
from tierstream.errors import NotFoundError, TierstreamError
from tierstream.metadata.bookie_registry import set_ensemble
from tierstream.metadata.records import SegmentRecord, SegmentState
from tierstream.metadata.store import MetadataStore

__all__ = ["Repairer"]

log = logging.getLogger(__name__)


class Repairer:
    def __init__(self, metadata: MetadataStore, bookies: dict[str, AnyBookie],
                 write_quorum: int, updated: Callable[[SegmentRecord], None]) -> None:
        self._metadata, self._bookies, self._write_quorum = metadata, bookies, write_quorum
        self._updated = updated  # the partition's log serves the new record
        self._lock = threading.Lock()
        self._suspects: set[int] = set()
        self.repaired = 0

    def suspect(self, segment_id: int) -> None:
        with self._lock:
            self._suspects.add(segment_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"under_replicated": len(self._suspects), "re_replicated": self.repaired}

    def run_once(self) -> None:
        with self._lock:
            suspects = sorted(self._suspects)
        for segment_id in suspects:
            try:
                done = self._repair(segment_id)
            except TierstreamError as exc:  # a bookie went away meanwhile: next pass
                log.info("re-replication of segment %d waits: %s", segment_id, exc)
                continue
            if done:
                with self._lock:
                    self._suspects.discard(segment_id)

    def _repair(self, segment_id: int) -> bool:
        """True when the segment needs nothing more (repaired, whole, or gone)."""
        try:
            seg = self._metadata.get_segment(segment_id)
        except NotFoundError:
            return True  # deleted (retention, topic deletion)
        if seg.state != SegmentState.CLOSED:
            return False  # recovery or the roll has not sealed it yet
        if seg.bookie_deleted_at is not None or not seg.entries:
            return True  # only in the tier now, or empty
        whole: list[str] = []
        lacking: list[str] = []
        for b in seg.ensemble:
            (whole if self._holds(b, seg) else lacking).append(b)
        missing = max(0, self._write_quorum - len(seg.ensemble))
        if not lacking and not missing:
            return True
        if not whole:
            log.error("segment %d (%s partition %d) has no whole copy on a bookie that "
                      "answers; it is re-replicated once one does", seg.segment_id,
                      seg.topic, seg.partition)
            return False
        source = self._bookies[whole[0]]
        records = source.index(segment_id)[:seg.entries]
        frames = raw_frames(source, segment_id, records)
        ensemble = list(seg.ensemble)
        wanted: list[str | None] = [*lacking, *([None] * missing)]
        for lost in wanted:
            back = self._bookies.get(lost) if lost is not None else None
            target = lost if back is not None and available(back) else \
                self._replacement(ensemble)
            if target is None:
                return False  # no bookie to take it now: the next pass tries again
            self._bookies[target].rewrite_ledger(segment_id, frames)
            if lost is None:
                ensemble.append(target)
            else:
                ensemble[ensemble.index(lost)] = target
        record = set_ensemble(self._metadata, seg, tuple(ensemble))
        self._updated(record)
        self.repaired += 1
        log.info("segment %d (%s partition %d) re-replicated: its copies are on %s",
                 segment_id, seg.topic, seg.partition, ", ".join(ensemble))
        return True

    def _holds(self, bookie_id: str, seg: SegmentRecord) -> bool:
        bookie = self._bookies.get(bookie_id)
        if bookie is None or not available(bookie):
            return False
        try:
            return len(bookie.index(seg.segment_id)) >= seg.entries
        except (NotFoundError, OSError):
            return False

    def _replacement(self, ensemble: list[str]) -> str | None:
        hosts = {host_of(self._bookies[b]) for b in ensemble if b in self._bookies}
        spare = [b for b, bk in self._bookies.items() if b not in ensemble and available(bk)]
        spare.sort(key=lambda b: host_of(self._bookies[b]) in hosts)  # new hosts first
        return spare[0] if spare else None
