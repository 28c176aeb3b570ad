"""A bookie: a storage node that only stores. One directory, one ledger file pair per segment.

A ledger's files are created by its first append, and at most ``max_open`` ledgers hold file
descriptors at a time (least recently written ones give theirs up), so the number of
partitions is not bounded by the process's file descriptor limit.

Writes go through one group-commit thread per bookie: it takes every append that is waiting,
writes them, fsyncs each touched ledger once, and only then completes their futures, so
concurrent producers share fsyncs. Reads verify every frame and never go through that thread.

A ledger's copy here is a prefix of the ledger: an append whose entry is not the next one (an
earlier entry failed here, as when the writer's stream broke) is refused, so each frame is at
the same offset on every copy that has it. Readers rely on that: they are given the offsets
of one copy (a writer keeps those of one bookie that confirmed each entry).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tierstream.bookie.ledger import (
    INDEX_RECORD,
    IndexRecord,
    RecoveredLedger,
    encode_frame,
    frame_length,
    ledger_paths,
    read_index,
    scan_frames,
    write_ledger_files,
)
from tierstream.bookie.ledger_reader import LedgerReader
from tierstream.bookie.open_files import LedgerFiles
from tierstream.errors import ConflictError, FencedError, NotFoundError, StorageError
from tierstream.util.durable import fsync_dir
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker

__all__ = ["Bookie", "ledger_paths"]


@dataclass
class _OpenLedger:
    """A ledger open for appends. Its files are created by the first append and its file
    descriptors are opened on demand: at most ``max_open`` ledgers of a bookie hold them."""

    segment_id: int
    log_fd: int | None = None
    idx_fd: int | None = None
    offset: int = 0
    records: list[IndexRecord] = field(default_factory=list)
    created: bool = False
    next_entry: int = 0  # the entry id the next append must carry (a copy is a prefix)


@dataclass
class _Append:
    segment_id: int
    entry_id: int
    meta: dict[str, Any]
    payload: pa.Buffer
    messages: int
    first_pt: int
    last_pt: int
    future: Future[IndexRecord]
    epoch: int | None = None


class Bookie:
    """A storage node rooted at ``root``. ``fsync=False`` is for tests and benchmarks only."""

    def __init__(self, bookie_id: str, root: str | Path, *, fsync: bool = True,
                 max_open: int = 512, first_ledger: int = 0,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.bookie_id = bookie_id
        #: ledgers below this one predate the disk (it replaced a lost one, whose entries
        #: and fences are gone with it: cookie.py): it takes no appends for them
        self.first_ledger = first_ledger
        self.root = Path(root)
        self.fsync = fsync
        self.max_open = max_open
        self.root.mkdir(parents=True, exist_ok=True)
        self._open: dict[int, _OpenLedger] = {}
        self._with_fds: OrderedDict[int, _OpenLedger] = OrderedDict()  # LRU, journal thread
        self._lock = threading.Lock()
        # None stops the journal thread; a bare Future is a flush marker.
        self._queue: queue.SimpleQueue[_Append | Future[None] | None] = queue.SimpleQueue()
        # an error nobody foresaw ends it: every append queued or written at that moment,
        # and every later one, fails (StorageError) rather than wait for good
        self._thread = Worker(f"bookie-{bookie_id}-journal", self._run,
                              on_error=self._journal_failed)
        self._broken: StorageError | None = None
        self._on_failure = on_failure  # told after the appends failed (the broker stops)
        #: the group being written, and its flush markers
        self._in_flight: tuple[list[_Append], list[Future[None]]] = ([], [])
        self._closed = False
        self.checksum_failures = 0
        #: ledger files open for reads, shared and bounded like the ones open for appends
        self.files = LedgerFiles(max_open)
        #: ledger -> the lowest writer epoch it accepts appends from (fence())
        self._fences: dict[int, int] = {}
        self._thread.start()

    def __repr__(self) -> str:
        return f"Bookie(id={self.bookie_id!r}, root={str(self.root)!r})"

    # -- write side ---------------------------------------------------------------------------

    def create_ledger(self, segment_id: int) -> None:
        """Open a new ledger for appending. No file is created and no descriptor held until
        its first append: a broker with many idle partitions holds no files for them."""
        with self._lock:
            self._open.setdefault(segment_id, _OpenLedger(segment_id))

    def open_for_appends(self, segment_id: int, epoch: int, entry_id: int = 0) -> None:
        """A network writer's first append to a ledger (its entry 0) opens it here, unless a
        newer writer fenced it (FencedError) or it was closed before on this bookie (sealed,
        fenced, or open when this bookie restarted), or it predates this disk, which replaced
        a lost one (whatever the epoch: a fence of it was lost too): its copy here stays as it
        is, and the writer places its next segment elsewhere."""
        with self._lock:
            self._check_epoch(segment_id, epoch)
            if segment_id in self._open:
                return
            if segment_id < self.first_ledger:  # its fence, if it had one, was lost too
                raise ConflictError(f"ledger {segment_id} predates the disk of bookie "
                                    f"{self.bookie_id}, which took a lost disk's place: it "
                                    "takes no appends")
            if ledger_paths(self.root, segment_id)[0].exists():
                raise ConflictError(f"ledger {segment_id} is closed on bookie "
                                    f"{self.bookie_id}: it takes no more appends")
            if entry_id != 0:
                raise ConflictError(f"ledger {segment_id} is not on bookie {self.bookie_id}, "
                                    f"which was asked for its entry {entry_id}: its earlier "
                                    "entries were lost with its disk")
            self._open[segment_id] = _OpenLedger(segment_id)

    def _fds(self, ledger: _OpenLedger, busy: set[int]) -> tuple[int, int]:
        """The ledger's descriptors, opened (and its files created) if needed; the least
        recently used ledgers not in ``busy`` give theirs up (journal thread, lock held)."""
        if ledger.log_fd is None or ledger.idx_fd is None:
            log_path, idx_path = ledger_paths(self.root, ledger.segment_id)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            ledger.log_fd = os.open(log_path, flags, 0o644)
            ledger.idx_fd = os.open(idx_path, flags, 0o644)
            ledger.offset = os.fstat(ledger.log_fd).st_size
            if not ledger.created and self.fsync:
                fsync_dir(log_path.parent)  # the new files survive a crash
            ledger.created = True
        self._with_fds[ledger.segment_id] = ledger
        self._with_fds.move_to_end(ledger.segment_id)
        for sid in list(self._with_fds):
            if len(self._with_fds) <= self.max_open:
                break
            if sid not in busy:  # written and fsync'd in an earlier group: safe to close
                _close_fds(self._with_fds.pop(sid))
        return ledger.log_fd, ledger.idx_fd

    def append(
        self,
        segment_id: int,
        entry_id: int,
        meta: dict[str, Any],
        payload: pa.Buffer,
        messages: int,
        first_pt: int,
        last_pt: int,
        epoch: int | None = None,
    ) -> Future[IndexRecord]:
        """Queue an entry; the future completes once it is written (and fsync'd). With
        ``epoch`` (the writing broker's, over the network), an append to a ledger fenced at a
        higher epoch fails with FencedError."""
        fut: Future[IndexRecord] = Future()
        if self._closed:
            fut.set_exception(NotFoundError(f"bookie {self.bookie_id} is closed"))
            return fut
        self._queue.put(_Append(segment_id, entry_id, meta, payload, messages, first_pt, last_pt,
                                fut, epoch))
        if self._broken is not None:  # put after the journal's failure drained the queue
            self._fail_queued(self._broken)
        return fut

    def _run(self) -> None:
        carried: _Append | None = None  # the first of the next group
        while True:
            first = carried if carried is not None else self._queue.get()
            carried = None
            if first is None:
                return
            group: list[_Append] = []
            ledgers: set[int] = set()
            markers: list[Future[None]] = []
            item: _Append | Future[None] | None = first
            while item is not None:
                if isinstance(item, _Append):
                    if item.segment_id not in ledgers and len(ledgers) >= self.max_open:
                        carried = item  # a group keeps at most max_open ledgers' files open
                        break
                    ledgers.add(item.segment_id)
                    group.append(item)
                else:
                    markers.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._in_flight = (group, markers)
            fault_point("bookie.journal")
            if group:
                self._write_group(group)
            for marker in markers:
                marker.set_result(None)
            self._in_flight = ([], [])
            if item is None:
                return

    def _journal_failed(self, exc: BaseException) -> None:
        """The journal thread died: what it held and what is queued fails, and so does
        every later append (reads go on)."""
        self._broken = StorageError(f"the journal of bookie {self.bookie_id} stopped: {exc!r}")
        group, markers = self._in_flight
        for req in group:
            _fail(req.future, self._broken)
        for marker in markers:
            _fail(marker, self._broken)
        self._in_flight = ([], [])
        self._fail_queued(self._broken)
        if self._on_failure is not None:
            self._on_failure(exc)

    def _fail_queued(self, error: StorageError) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _fail(item, error)

    def _write_group(self, group: list[_Append]) -> None:
        done: list[tuple[_Append, IndexRecord]] = []
        touched: dict[int, int] = {}  # segment id -> log fd to sync
        busy = {req.segment_id for req in group}
        for req in group:
            try:
                with self._lock:
                    self._check_epoch(req.segment_id, req.epoch)
                    ledger = self._open.get(req.segment_id)
                    if ledger is None:
                        raise NotFoundError(f"ledger {req.segment_id} is not open on "
                                            f"{self.bookie_id}")
                    if req.entry_id != ledger.next_entry:  # one before it failed here
                        raise ConflictError(f"bookie {self.bookie_id}: ledger {req.segment_id}"
                                            f" takes entry {ledger.next_entry} next, not "
                                            f"{req.entry_id} (an earlier one failed here)")
                    log_fd, idx_fd = self._fds(ledger, busy)
                pieces = encode_frame(req.segment_id, req.entry_id, req.meta, req.payload)
                length = frame_length(pieces)
                written = os.writev(log_fd, pieces)
                if written != length:
                    raise OSError(f"short write to ledger {req.segment_id}: {written} of {length}")
                rec = IndexRecord(req.entry_id, ledger.offset, length, req.messages, req.first_pt,
                                  req.last_pt)
                os.write(idx_fd, rec.pack())
                ledger.offset += length
                ledger.next_entry = req.entry_id + 1
                touched[req.segment_id] = log_fd
                done.append((req, rec))
            except Exception as exc:
                req.future.set_exception(exc)
        try:
            if self.fsync:
                for fd in touched.values():
                    os.fdatasync(fd)
        except OSError as exc:
            for req, _ in done:
                req.future.set_exception(exc)
            return
        for req, rec in done:
            with self._lock:
                ledger = self._open.get(req.segment_id)
                if ledger is not None:
                    ledger.records.append(rec)
            req.future.set_result(rec)

    # -- fencing ------------------------------------------------------------------------------

    def _fence_path(self, segment_id: int) -> Path:
        return ledger_paths(self.root, segment_id)[0].with_suffix(".fence")

    def fenced_at(self, segment_id: int) -> int | None:
        """The epoch ``segment_id`` is fenced at (lock held or not), or None."""
        epoch = self._fences.get(segment_id)
        if epoch is None:  # read once (0: not fenced); only this process fences it
            path = self._fence_path(segment_id)
            epoch = self._fences[segment_id] = int(path.read_text()) if path.exists() else 0
        return epoch or None

    def _check_epoch(self, segment_id: int, epoch: int | None) -> None:
        fenced = self.fenced_at(segment_id) if epoch is not None else None
        if fenced is not None and epoch is not None and epoch < fenced:
            raise FencedError(f"ledger {segment_id} on bookie {self.bookie_id} is fenced: "
                              f"a broker of epoch {fenced} took it over (this write is of "
                              f"epoch {epoch})")

    def fence(self, segment_id: int, epoch: int) -> RecoveredLedger:
        """BookKeeper's fence: from now on appends of writers below ``epoch`` are refused
        (kept on disk, so also after a restart of this bookie); what was written before is
        flushed and returned as recovery sees it. A fence below the current one is refused:
        a newer writer took the ledger over."""
        self.flush()
        with self._lock:
            current = self.fenced_at(segment_id)
            if current is not None and epoch < current:
                raise FencedError(f"ledger {segment_id} on bookie {self.bookie_id} is fenced "
                                  f"at epoch {current}, above {epoch}")
            path = self._fence_path(segment_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".fence.tmp")
            tmp.write_text(str(epoch))
            if self.fsync:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, path)
            if self.fsync:
                fsync_dir(path.parent)
            self._fences[segment_id] = epoch
            ledger = self._open.pop(segment_id, None)
            self._with_fds.pop(segment_id, None)
        if ledger is not None:
            _close_fds(ledger)
        return self.recover_ledger(segment_id)

    def seal_ledger(self, segment_id: int, last_entry_id: int | None) -> None:
        """Make the ledger read-only at ``last_entry_id`` (None: empty) and fsync both files.

        Entries after ``last_entry_id`` (written, never acknowledged) are cut off.
        """
        self.flush()
        with self._lock:
            ledger = self._open.pop(segment_id, None)
            if ledger is not None:
                self._with_fds.pop(segment_id, None)
        if ledger is None:
            return
        if not ledger.created:
            return  # never written: there are no files to seal
        keep = [r for r in ledger.records if last_entry_id is not None and
                r.entry_id <= last_entry_id]
        end = keep[-1].frame_offset + keep[-1].frame_len if keep else 0
        _close_fds(ledger)
        for path, size in zip(ledger_paths(self.root, segment_id),
                              (end, len(keep) * INDEX_RECORD.size), strict=True):
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, size)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def discard_ledger(self, segment_id: int) -> None:
        """Stop appending to a ledger without sealing it (its topic is being deleted)."""
        self.flush()
        with self._lock:
            ledger = self._open.pop(segment_id, None)
            self._with_fds.pop(segment_id, None)
        if ledger is not None:
            _close_fds(ledger)

    def flush(self) -> None:
        """Wait until every append queued so far has been written."""
        if self._closed or self._thread.current:
            return
        marker: Future[None] = Future()
        self._queue.put(marker)
        if self._broken is not None:
            self._fail_queued(self._broken)
        marker.result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        with self._lock:
            ledgers = list(self._open.values())
            self._open.clear()
            self._with_fds.clear()
        for ledger in ledgers:
            _close_fds(ledger)
        self.files.close()

    # -- read side ----------------------------------------------------------------------------

    def index(self, segment_id: int) -> list[IndexRecord]:
        """Index records of a ledger: live for an open ledger, from the file for a sealed one."""
        with self._lock:
            ledger = self._open.get(segment_id)
            if ledger is not None:
                return list(ledger.records)
        _, idx_path = ledger_paths(self.root, segment_id)
        if not idx_path.exists():
            raise NotFoundError(f"ledger {segment_id} has no index on bookie {self.bookie_id}")
        return read_index(idx_path)

    def open_reader(self, segment_id: int) -> LedgerReader:
        """A reader of one ledger's frames; close it when done. Raises NotFoundError."""
        return LedgerReader(self.files, self.root, self.bookie_id, segment_id,
                            on_corrupt=self._count_checksum_failure)

    def _count_checksum_failure(self) -> None:
        self.checksum_failures += 1

    def read_entries(
        self, segment_id: int, records: list[IndexRecord]
    ) -> Iterator[tuple[IndexRecord, pa.Buffer]]:
        """Read and verify the given entries, in order. Raises CorruptionError on a bad frame."""
        reader = self.open_reader(segment_id)
        try:
            for rec in records:
                yield rec, reader.read(rec)
        finally:
            reader.close()

    # -- recovery -----------------------------------------------------------------------------

    def recover_ledger(self, segment_id: int) -> RecoveredLedger:
        """Scan a ledger left open by a crash: the valid prefix of frames (torn tail excluded)."""
        log_path, _ = ledger_paths(self.root, segment_id)
        if not log_path.exists():
            return RecoveredLedger(self.bookie_id, [], [], 0)
        frames, valid = scan_frames(log_path, segment_id)
        cut = log_path.stat().st_size - valid
        return RecoveredLedger(self.bookie_id, [f.record for f in frames],
                               [f.meta for f in frames], cut)

    def rewrite_ledger(self, segment_id: int, frames: list[tuple[IndexRecord, bytes]]) -> None:
        """Replace a ledger's files with exactly ``frames`` (raw frame bytes), fsync'd.

        Used by recovery to cut torn tails and to re-replicate entries a replica missed.
        """
        write_ledger_files(self.root, segment_id, frames)

    def read_raw_frame(self, segment_id: int, rec: IndexRecord) -> bytes:
        log_path, _ = ledger_paths(self.root, segment_id)
        with open(log_path, "rb") as f:
            f.seek(rec.frame_offset)
            return f.read(rec.frame_len)

    def ledger_entries(self) -> dict[int, int]:
        """Every ledger here with the entries its index holds (an audit compares them with
        the segments' records)."""
        found: dict[int, int] = {}
        base = self.root / "ledgers"
        if base.is_dir():
            for group in os.scandir(base):
                if group.is_dir():
                    for f in os.scandir(group.path):
                        if f.name.endswith(".idx"):
                            found[int(f.name[:-4])] = f.stat().st_size // INDEX_RECORD.size
        with self._lock:
            for segment_id, ledger in self._open.items():
                found[segment_id] = len(ledger.records)
        return found

    def delete_ledger(self, segment_id: int) -> None:
        for path in ledger_paths(self.root, segment_id):
            path.unlink(missing_ok=True)
            self.files.forget(path)
        self._fence_path(segment_id).unlink(missing_ok=True)
        self._fences.pop(segment_id, None)


def _fail(item: _Append | Future[Any], error: Exception) -> None:
    future = item.future if isinstance(item, _Append) else item
    if not future.done():
        future.set_exception(error)


def _close_fds(ledger: _OpenLedger) -> None:
    for fd in (ledger.log_fd, ledger.idx_fd):
        if fd is not None:
            os.close(fd)
    ledger.log_fd = ledger.idx_fd = None
