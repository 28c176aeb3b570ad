"""The write side of a bookie endpoint (``tierstream bookie serve``): what a broker on another
host needs to keep its ledgers there, as BookKeeper's bookies take a writer's entries.

Wire, on the same Flight service as the reads (``bookie/server.py``):

- ``DoExchange`` ``{"op": "append", "epoch": E}``: the broker streams :data:`APPEND_SCHEMA`
  batches (entries of any of its ledgers, in the order it wants them written); the bookie
  writes them through its group-commit journal (``storage.py``: written, fsync'd) and answers
  with one :data:`ACK_SCHEMA` batch per batch received, in the same order, each entry with
  its index record or the error that kept it from disk. Entries of a ledger fenced above
  ``E`` are refused (``fenced``): another broker took the ledger over.
- ``DoAction``: ``fence`` (``{segment_id, epoch}``: refuse lower epochs from now on; answers
  what recovery reads: the valid entries and their frames' metadata), ``seal``
  (``{segment_id, last_entry_id, epoch}``), ``discard``, ``delete`` and ``index``
  (``{segment_id}``).
- ``DoGet`` ``{"op": "range", segment_id, offset, length}``: raw bytes of a ledger file (the
  caller verifies each frame's checksum), for reads of open segments and recovery;
  ``DoPut`` ``{"op": "rewrite", segment_id}``: :data:`FRAME_SCHEMA` rows replace the ledger
  (recovery's re-replication).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.bookie.ledger import IndexRecord
from tierstream.bookie.open_files import LedgerFiles
from tierstream.bookie.storage import Bookie, ledger_paths
from tierstream.bookie.wire import ACK_SCHEMA, RECORD_FIELDS, recovered_to
from tierstream.errors import (
    FencedError,
    NotFoundError,
    ProtocolError,
    TierstreamError,
    UnavailableError,
)
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker
from tierstream.wire.flight import error_text

__all__ = ["BookieWrites"]

class BookieWrites:
    """The write operations of one bookie directory, served over the network. The storage
    (its journal thread) is opened on the first write request: an endpoint that only serves
    reads holds nothing open for writing."""

    def __init__(self, bookie_id: str, root: Any, *, fsync: bool = True) -> None:
        self.bookie_id, self.root, self.fsync = bookie_id, root, fsync
        self._bookie: Bookie | None = None
        self._lock = threading.Lock()
        self.entries_written = 0
        self.bytes_written = 0
        self.fenced_refusals = 0
        #: set when the endpoint shuts down: append streams end at their next batch (an idle
        #: broker sends an empty one every remote.KEEPALIVE_S)
        self.closing = False
        #: the disk's cookie instance, once the bookie claimed its identity (``cookie.py``):
        #: nothing is written before; no appends to ledgers below ``first_ledger`` ever are
        self.instance: str | None = None
        self.first_ledger = 0
        #: set (with the reason) when the journal died of an error nobody foresaw: the
        #: process stops (server.serve_bookie), and the brokers place segments elsewhere
        self.failed = threading.Event()
        self.failed_reason = ""

    def claimed(self, instance: str, first_ledger: int) -> None:
        """The directory is this bookie's (its cookie matches its registration): take writes,
        but no appends to ledgers below ``first_ledger`` (they predate a replacing disk)."""
        with self._lock:
            self.first_ledger = first_ledger
            self.instance = instance

    def claimed_instance(self) -> str:
        """The instance this bookie claimed; UnavailableError before it did."""
        instance = self.instance
        if instance is None:
            raise UnavailableError(f"bookie {self.bookie_id} is starting: it takes writes "
                                   "once its disk's cookie matched its registration")
        return instance

    @property
    def bookie(self) -> Bookie:
        self.claimed_instance()
        with self._lock:
            if self._bookie is None:
                self._bookie = Bookie(self.bookie_id, self.root, fsync=self.fsync,
                                      first_ledger=self.first_ledger, on_failure=self._failed)
            return self._bookie

    def _failed(self, exc: BaseException) -> None:
        self.failed_reason = f"the journal of bookie {self.bookie_id} failed: {exc!r}"
        self.failed.set()

    def close(self) -> None:
        self.closing = True
        with self._lock:
            if self._bookie is not None:
                self._bookie.close()

    # -- appends ------------------------------------------------------------------------------

    def exchange(self, command: dict[str, Any], reader: Any, writer: Any) -> None:
        """Take appends from ``reader`` until it ends; answer each batch in order on
        ``writer`` once every entry of it is on disk (or failed). Reading goes on while
        earlier batches are still being written: the broker pipelines."""
        epoch = int(command["epoch"])
        bookie = self.bookie
        replies: queue.SimpleQueue[list[tuple[int, int, Future[IndexRecord]]] | None] = \
            queue.SimpleQueue()
        failed: list[BaseException] = []

        def answer() -> None:
            while (item := replies.get()) is not None:
                fault_point("bookie.acks")
                try:
                    writer.write_batch(self._acks(item))
                except (flight.FlightError, pa.ArrowException, OSError) as exc:
                    failed.append(exc)  # the stream broke: the broker retries elsewhere
                    return

        writer.begin(ACK_SCHEMA)
        # any other error is a bug: logged with its stack, and the call ends (below) so
        # that the broker, its entries unanswered, writes them elsewhere
        thread = Worker(f"bookie-{self.bookie_id}-acks", answer, on_error=failed.append)
        thread.start()
        try:
            for chunk in reader:
                if failed or self.closing:  # ends the call: the broker moves on
                    break
                batch = chunk.data
                if batch is not None and batch.num_rows:
                    replies.put(self._submit(bookie, batch, epoch))
        finally:
            replies.put(None)
            thread.join()

    def _submit(self, bookie: Bookie, batch: pa.RecordBatch, epoch: int
                ) -> list[tuple[int, int, Future[IndexRecord]]]:
        segs = batch.column("segment_id").to_pylist()
        entries = batch.column("entry_id").to_pylist()
        metas = batch.column("meta")
        payloads = batch.column("payload")
        counts = batch.column("messages").to_pylist()
        firsts = batch.column("first_publish_time").to_pylist()
        lasts = batch.column("last_publish_time").to_pylist()
        out: list[tuple[int, int, Future[IndexRecord]]] = []
        for i, seg in enumerate(segs):
            try:
                bookie.open_for_appends(seg, epoch, entries[i])  # by its first append
            except TierstreamError as exc:
                refused: Future[IndexRecord] = Future()
                refused.set_exception(exc)
                out.append((seg, entries[i], refused))
                continue
            meta = json.loads(metas[i].as_py()) if len(metas[i].as_buffer()) else {}
            out.append((seg, entries[i], bookie.append(
                seg, entries[i], meta, payloads[i].as_buffer(), counts[i], firsts[i],
                lasts[i], epoch=epoch)))
        return out

    def _acks(self, item: list[tuple[int, int, Future[IndexRecord]]]) -> pa.RecordBatch:
        rows: dict[str, list[Any]] = {f.name: [] for f in ACK_SCHEMA}
        for seg, entry_id, fut in item:
            exc = fut.exception()
            rec = fut.result() if exc is None else IndexRecord(entry_id, 0, 0, 0, 0, 0)
            for f in RECORD_FIELDS:
                rows[f].append(getattr(rec, f))
            rows["segment_id"].append(seg)
            if exc is None:
                rows["error"].append(None)
                with self._lock:
                    self.entries_written += 1
                    self.bytes_written += rec.frame_len
            else:
                if isinstance(exc, FencedError):
                    with self._lock:
                        self.fenced_refusals += 1
                err = exc if isinstance(exc, TierstreamError) else NotFoundError(str(exc))
                rows["error"].append(error_text(err))
        return pa.RecordBatch.from_pydict(rows, schema=ACK_SCHEMA)

    # -- control ------------------------------------------------------------------------------

    def action(self, kind: str, body: dict[str, Any]) -> Any:
        bookie = self.bookie
        if kind == "ledgers":  # what an audit compares with the metadata
            return {str(s): n for s, n in bookie.ledger_entries().items()}
        segment_id = int(body["segment_id"])
        if kind == "fence":
            return recovered_to(bookie.fence(segment_id, int(body["epoch"])))
        if kind == "seal":
            epoch = body.get("epoch")
            fenced = bookie.fenced_at(segment_id)
            if epoch is not None and fenced is not None and int(epoch) < fenced:
                raise FencedError(f"ledger {segment_id} on bookie {self.bookie_id} is fenced "
                                  f"at epoch {fenced}: a seal of epoch {epoch} is refused")
            last = body.get("last_entry_id")
            bookie.seal_ledger(segment_id, None if last is None else int(last))
            return {}
        if kind in ("discard", "delete"):
            epoch = body.get("epoch")
            fenced = bookie.fenced_at(segment_id)
            if epoch is not None and fenced is not None and int(epoch) < fenced:
                raise FencedError(f"ledger {segment_id} on bookie {self.bookie_id} is fenced "
                                  f"at epoch {fenced}: a {kind} of epoch {epoch} is refused")
            if kind == "discard":
                bookie.discard_ledger(segment_id)
            else:
                bookie.delete_ledger(segment_id)
            return {}
        if kind == "index":
            return [[getattr(r, f) for f in RECORD_FIELDS] for r in bookie.index(segment_id)]
        raise ProtocolError(f"unknown bookie action {kind!r}")

    def byte_range(self, files: LedgerFiles, segment_id: int, offset: int, length: int
                   ) -> pa.RecordBatch:
        """Raw bytes of a ledger file (fewer at its end), as one row."""
        log_path, _ = ledger_paths(self.root, segment_id)
        try:
            handle, fd = files.acquire(log_path)
        except NotFoundError:
            raise NotFoundError(f"ledger {segment_id} is not on bookie {self.bookie_id}") \
                from None
        try:
            data = os.pread(fd, length, offset)
        finally:
            files.release(handle)
        return pa.RecordBatch.from_pydict({"data": [data]},
                                          schema=pa.schema([("data", pa.binary())]))

    def rewrite(self, segment_id: int, reader: Any) -> None:
        frames = []
        for chunk in reader:
            batch = chunk.data
            for row in batch.to_pylist():
                rec = IndexRecord(int(row["entry_id"]), 0, len(row["frame"]),
                                  int(row["messages"]), int(row["first_publish_time"]),
                                  int(row["last_publish_time"]))
                frames.append((rec, row["frame"]))
        bookie = self.bookie
        bookie.discard_ledger(segment_id)
        bookie.rewrite_ledger(segment_id, frames)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries_written": self.entries_written,
                    "bytes_written": self.bytes_written,
                    "fenced_refusals": self.fenced_refusals}
