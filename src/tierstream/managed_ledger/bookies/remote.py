"""A bookie on another host, as the broker's write path sees it: the operations of
:class:`~tierstream.managed_ledger.bookies.client.BookieClient` (``append`` returns a future
completed once the entry is on that bookie's disk), over the bookie endpoint's Flight service
(``bookie/wire.py`` has the wire, ``bookie/writes.py`` what the bookie does with it).

Appends of every ledger the broker writes there share one ``DoExchange`` stream: a sender
thread writes what producers queued meanwhile as one batch (the bookie's group commit then
takes it whole), a receiver thread completes the futures in order as the bookie's answers
arrive. A bookie that fails, breaks the stream or leaves an entry unanswered for
``timeout_s`` fails every entry in flight (the ack quorum of the others decides) and is
marked unavailable: the broker seals the segments written there and places the next ones
on other bookies; appends are tried again after ``retry_s``.

Every append carries the broker's writer epoch: once a newer broker fenced a ledger, the
bookie refuses them (``FencedError``). Every call names the bookie and its disk's instance
(``bookie/cookie.py``): another endpoint at the address is this bookie unavailable, never a
copy on the wrong disk. A ping asks the registration when it finds another instance (a disk
that replaced a lost one is adopted) or nobody (a bookie restarted at a new address).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.bookie.ledger import IndexRecord, RecoveredLedger
from tierstream.bookie.wire import APPEND_SCHEMA, FRAME_SCHEMA, append_batch, recovered_from
from tierstream.errors import UnavailableError
from tierstream.managed_ledger.bookies.identity import BookieIdentity
from tierstream.managed_ledger.bookies.remote_reader import RemoteLedgerReader
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker
from tierstream.wire.flight import decode, encode, error_from_text, translate_errors
from tierstream.wire.security import call_headers, client_for

__all__ = ["RemoteBookie"]

log = logging.getLogger(__name__)

#: rows and payload bytes per batch on the append stream
_BATCH_ROWS = 512
_BATCH_BYTES = 8 * 1024**2
#: an idle append stream sends an empty batch this often
KEEPALIVE_S = 0.5
_EMPTY = pa.RecordBatch.from_pylist([], schema=APPEND_SCHEMA)


class RemoteBookie(BookieIdentity):
    """A bookie endpoint (``tierstream bookie serve``) at ``address``, written under
    ``epoch``."""

    def __init__(self, bookie_id: str, address: str, *, host: str, epoch: int,
                 instance: str | None = None,
                 registration: Callable[[], tuple[str, str | None] | None] | None = None,
                 auth_token: str | None = None, tls_ca: bytes | None = None,
                 timeout_s: float = 10.0, retry_s: float = 1.0) -> None:
        self.bookie_id, self.address, self.host, self.epoch = bookie_id, address, host, epoch
        #: the instance of the bookie's disk its registration names (None: not checked)
        self.instance = instance
        self._registration = registration  # (address, instance) as registered now
        self._tls_ca = tls_ca
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.root: Path | None = None  # no directory on this host
        self.checksum_failures = 0
        self._client = client_for(address, tls_ca=tls_ca)
        headers = call_headers(auth_token)
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout_s)
        self._stream_options = flight.FlightCallOptions(headers=headers)
        self._ping_options = flight.FlightCallOptions(headers=headers,
                                                      timeout=min(1.0, timeout_s))
        self._lock = threading.Condition()
        self._outbox: deque[tuple[list[Any], Future[IndexRecord], float]] = deque()
        self._pending: deque[tuple[int, int, Future[IndexRecord], float]] = deque()
        self._stream: tuple[Any, Any] | None = None
        self._generation = 0  # of the stream: a broken one's threads stop
        #: broken streams for the send loop to close (the one thread that writes them):
        #: collected unclosed, Arrow prints "Close() failed: Cancelled" to stderr
        self._retired: list[tuple[Any, Any]] = []
        self.down_since: float | None = None
        self._down_at: float | None = None  # when the current outage began (not retries)
        self._failures_at_down = 0
        self.down_reason = ""
        self.failures = 0
        self._closed = False
        #: set when a thread of this client died of an error nobody foresaw: every append
        #: fails at once from then on (the broker writes the next segments elsewhere)
        self._dead: str | None = None
        self._sender = Worker(f"remote-bookie-{bookie_id}-send", self._send_loop,
                              on_error=self._thread_failed)
        self._watchdog = Worker(f"remote-bookie-{bookie_id}-watch", self._watch,
                                on_error=self._thread_failed)
        self._sender.start()
        self._watchdog.start()
        self._receiver: Worker | None = None  # of the current stream

    def __repr__(self) -> str:
        return f"RemoteBookie(id={self.bookie_id!r}, address={self.address!r})"

    @property
    def available(self) -> bool:
        return self.down_since is None

    def is_available(self) -> bool:
        """Whether it takes writes now (one that was down is pinged; never once a thread of
        this client died)."""
        return self._dead is None and (self.available or self.ping())

    def state(self) -> dict[str, Any]:
        return {"where": self.address, "host": self.host, "available": self.available,
                "failures": self.failures,
                **({} if self.available else {"unavailable_because": self.down_reason})}

    # -- appends ------------------------------------------------------------------------------

    def write_under(self, epoch: int) -> None:
        self.epoch = epoch

    def create_ledger(self, segment_id: int) -> None:
        """Nothing to do here: the bookie opens a ledger at its first append."""

    def append(self, segment_id: int, entry_id: int, meta: dict[str, Any], payload: pa.Buffer,
               messages: int, first_pt: int, last_pt: int) -> Future[IndexRecord]:
        fut: Future[IndexRecord] = Future()
        row = [segment_id, entry_id, json.dumps(meta).encode() if meta else b"", payload,
               messages, first_pt, last_pt]
        with self._lock:
            if self._closed:
                fut.set_exception(UnavailableError(f"bookie {self.bookie_id}: closed"))
            elif self._dead is not None:
                fut.set_exception(UnavailableError(f"bookie {self.bookie_id}: {self._dead}"))
            elif self.down_since is not None and \
                    time.monotonic() - self.down_since < self.retry_s:
                fut.set_exception(UnavailableError(
                    f"bookie {self.bookie_id} at {self.address} is unavailable: "
                    f"{self.down_reason}"))
            else:
                self._outbox.append((row, fut, time.monotonic()))
                self._lock.notify_all()
        return fut

    def _send_loop(self) -> None:
        """Open the stream when there is something to send, then send what is queued, a
        batch at a time (an empty one when idle). Writes happen outside the lock: one that
        blocks (a host that vanished) is broken by the watchdog, not waited for."""
        while True:
            fault_point("bookie.client.send")
            with self._lock:
                if not self._outbox and not self._closed and not self._retired:
                    self._lock.wait(KEEPALIVE_S)
                retired, self._retired = self._retired, []
                closed = self._closed
                stream, generation, idle = self._stream, self._generation, not self._outbox
            _close_writers(retired)
            if closed:
                return
            if stream is None:
                if not idle:
                    self._connect_stream()
                continue
            with self._lock:
                if generation != self._generation:
                    continue  # broke meanwhile: its entries failed with it
                take: list[tuple[list[Any], Future[IndexRecord], float]] = []
                size = 0
                while self._outbox and len(take) < _BATCH_ROWS and size < _BATCH_BYTES:
                    item = self._outbox.popleft()
                    take.append(item)
                    size += item[0][3].size
                self._pending.extend((row[0], row[1], fut, t) for row, fut, t in take)
            try:
                stream[0].write_batch(append_batch([row for row, _, _ in take]) if take
                                      else _EMPTY)
            except Exception as exc:
                self._broken(generation, f"write failed: {exc}")

    def _connect_stream(self) -> None:
        try:
            stream = self._open_stream()
        except Exception as exc:
            with self._lock:
                queued, self._outbox = self._outbox, deque()
                self._fail_locked([f for _, f, _ in queued],
                                  f"cannot open a write stream: {exc}")
            return
        with self._lock:
            if self._closed:
                self._retired.append(stream)  # closed by the send loop as it ends
                return
            self._stream, generation = stream, self._generation
            self.down_since = None
        self._receiver = Worker(
            f"remote-bookie-{self.bookie_id}-recv",
            lambda: self._receive_loop(stream[1], generation),
            on_error=lambda exc: self._broken(generation, f"its receiver failed: {exc!r}"),
        ).start()

    def _open_stream(self) -> tuple[Any, Any]:
        descriptor = flight.FlightDescriptor.for_command(encode(
            {"op": "append", "epoch": self.epoch, **self._addressed()}))
        with translate_errors(self.address, "bookie"):
            writer, reader = self._client.do_exchange(descriptor, self._stream_options)
            writer.begin(APPEND_SCHEMA)
        if self.down_since is not None:
            log.info("bookie %s at %s takes writes again", self.bookie_id, self.address)
        return writer, reader

    def _receive_loop(self, reader: Any, generation: int) -> None:
        try:
            while True:
                chunk = reader.read_chunk()
                fault_point("bookie.client.receive")
                acks = chunk.data.to_pylist()
                with self._lock:
                    if generation != self._generation:
                        return
                    for ack in acks:
                        if not self._pending:
                            raise UnavailableError("an answer for an entry never sent")
                        seg, entry_id, fut, _ = self._pending.popleft()
                        if (seg, entry_id) != (ack["segment_id"], ack["entry_id"]):
                            raise UnavailableError(f"answer for entry {ack['entry_id']} of "
                                                   f"ledger {ack['segment_id']} out of order")
                        if ack["error"] is None:
                            fut.set_result(IndexRecord(
                                entry_id, ack["frame_offset"], ack["frame_len"],
                                ack["messages"], ack["first_publish_time"],
                                ack["last_publish_time"]))
                        else:
                            fut.set_exception(error_from_text(ack["error"]))
        except StopIteration:
            self._broken(generation, "the bookie ended the write stream")
        except (flight.FlightError, pa.ArrowException, OSError, UnavailableError) as exc:
            self._broken(generation, f"{type(exc).__name__}: {exc}")

    def _watch(self) -> None:
        """Break the stream when its oldest entry waited ``timeout_s``: a bookie whose host
        vanished answers nothing, and the segment must not wait for it."""
        while not self._watchdog.stopping.wait(min(1.0, self.timeout_s / 4)):
            fault_point("bookie.client.watch")
            with self._lock:
                if self._closed:
                    return
                waiting = [q[0][-1] for q in (self._pending, self._outbox) if q]
                oldest = min(waiting) if waiting else None
                generation = self._generation
            if oldest is not None and time.monotonic() - oldest > self.timeout_s:
                self._broken(generation, f"no answer in {self.timeout_s:g} s")

    def _thread_failed(self, exc: BaseException) -> None:
        """The send or watch thread died (logged with its stack by its Worker): without it
        appends would wait for good, so every one in flight fails now and every later one
        at once — the broker seals this bookie's segments and writes elsewhere."""
        with self._lock:
            self._dead = f"a thread of its client failed: {exc!r}"
            generation = self._generation
        self._broken(generation, self._dead)

    def _broken(self, generation: int, reason: str) -> None:
        with self._lock:
            if generation != self._generation:
                return
            self._generation += 1
            stream, self._stream = self._stream, None
            pending = [fut for *_, fut, _ in self._pending] + [f for _, f, _ in self._outbox]
            self._pending.clear()
            self._outbox.clear()
            if self.down_since is None:
                log.warning("bookie %s at %s is unavailable: %s", self.bookie_id,
                            self.address, reason)
            self._fail_locked(pending, reason)
        if stream is not None:  # ending a broken stream: its errors say nothing new
            with contextlib.suppress(Exception):
                stream[1].cancel()
            with self._lock:
                self._retired.append(stream)  # closed by the send loop
                self._lock.notify_all()

    def _fail_locked(self, futures: list[Future[IndexRecord]], reason: str) -> None:
        if self._down_at is None:  # the start of an outage: summed up when it ends (ping)
            self._down_at = time.monotonic()
            self._failures_at_down = self.failures
        self.down_since = self.down_since or time.monotonic()
        self.down_reason = reason
        self.failures += 1
        for fut in futures:
            if not fut.done():
                fut.set_exception(UnavailableError(
                    f"bookie {self.bookie_id} at {self.address}: {reason}"))

    def flush(self) -> None:
        """Wait until every append queued so far is answered (or failed)."""
        with self._lock:
            futures = [f for _, f, _ in self._outbox] + [f for _, _, f, _ in self._pending]
        for fut in futures:
            fut.exception()

    # -- control ------------------------------------------------------------------------------

    def _addressed(self) -> dict[str, Any]:
        """What every request carries: the bookie it is for (``BookieServer._addressed``)."""
        return {"bookie": self.bookie_id, "instance": self.instance}

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """A call that finds the bookie unavailable (gone, or another disk at its address)
        takes it for down: the next :meth:`is_available` pings it at once (and adopts a disk
        its registration names: a repair never retries a stale instance for good)."""
        try:
            with translate_errors(self.address, "bookie"):
                yield
        except UnavailableError as exc:
            with self._lock:
                if self.down_since is None:
                    log.warning("bookie %s at %s is unavailable: %s", self.bookie_id,
                                self.address, exc)
                    self._down_at, self._failures_at_down = time.monotonic(), self.failures
                # pinged at the next is_available(), not after retry_s
                self.down_since = time.monotonic() - self.retry_s
                self.down_reason = str(exc)
            raise

    def _action(self, kind: str, body: dict[str, Any]) -> Any:
        with self._control():
            results = list(self._client.do_action(
                flight.Action(kind, encode({**body, **self._addressed()})), self._options))
        return decode(results[0].body.to_pybytes(), "bookie answer")["result"]

    def _require_available(self) -> None:
        """A control call to a bookie taken for gone fails at once, not after its timeout
        (the caller holds a partition's lock)."""
        if not self.available and not self.ping():
            raise UnavailableError(f"bookie {self.bookie_id} at {self.address} is "
                                   f"unavailable: {self.down_reason}")

    def seal_ledger(self, segment_id: int, last_entry_id: int | None) -> None:
        self.flush()
        self._require_available()
        self._action("seal", {"segment_id": segment_id, "last_entry_id": last_entry_id,
                              "epoch": self.epoch})

    def discard_ledger(self, segment_id: int) -> None:
        self.flush()
        self._require_available()
        self._action("discard", {"segment_id": segment_id, "epoch": self.epoch})

    def delete_ledger(self, segment_id: int) -> None:
        self._action("delete", {"segment_id": segment_id, "epoch": self.epoch})

    def index(self, segment_id: int) -> list[IndexRecord]:
        return [IndexRecord(*map(int, r)) for r in
                self._action("index", {"segment_id": segment_id})]

    def ledger_entries(self) -> dict[int, int]:
        """Every ledger on the bookie with the entries its index holds (one call)."""
        return {int(s): int(n) for s, n in self._action("ledgers", {}).items()}

    def recover_ledger(self, segment_id: int) -> RecoveredLedger:
        """Fence the ledger at this broker's epoch and read what the bookie has of it."""
        return recovered_from(self._action("fence", {"segment_id": segment_id,
                                                     "epoch": self.epoch}), self.bookie_id)

    def byte_range(self, segment_id: int, offset: int, length: int) -> bytes:
        ticket = flight.Ticket(encode({"op": "range", "segment_id": segment_id,
                                       "offset": offset, "length": length,
                                       **self._addressed()}))
        with self._control():
            table = self._client.do_get(ticket, self._options).read_all()
        return bytes(table.column("data")[0].as_py())

    def read_raw_frames(self, segment_id: int, records: list[IndexRecord]
                        ) -> Iterator[tuple[IndexRecord, bytes]]:
        """The raw frames of consecutive ``records``, a window of bytes per call."""
        reader = self.open_reader(segment_id)
        for rec in records:
            yield rec, reader.raw(rec)

    def rewrite_ledger(self, segment_id: int, frames: list[tuple[IndexRecord, bytes]]) -> None:
        descriptor = flight.FlightDescriptor.for_command(encode(
            {"op": "rewrite", "segment_id": segment_id, **self._addressed()}))
        with self._control():
            writer, _ = self._client.do_put(descriptor, FRAME_SCHEMA, self._options)
            try:
                for i in range(0, len(frames), 256):
                    part = frames[i:i + 256]
                    writer.write_batch(pa.RecordBatch.from_pydict({
                        "entry_id": [r.entry_id for r, _ in part],
                        "messages": [r.messages for r, _ in part],
                        "first_publish_time": [r.first_publish_time for r, _ in part],
                        "last_publish_time": [r.last_publish_time for r, _ in part],
                        "frame": [f for _, f in part]}, schema=FRAME_SCHEMA))
            except BaseException:  # the write's error is the one to raise, not the close's
                with contextlib.suppress(Exception):
                    writer.close()
                raise
            writer.close()

    def open_reader(self, segment_id: int) -> RemoteLedgerReader:
        return RemoteLedgerReader(self.bookie_id, segment_id, self.byte_range,
                                  self._checksum_failed)

    def _checksum_failed(self) -> None:
        self.checksum_failures += 1

    def ping(self) -> bool:
        """Whether the bookie answers, as itself (once per ``retry_s`` while it is down)."""
        with self._lock:
            if self.down_since is not None and \
                    time.monotonic() - self.down_since < self.retry_s:
                return False
        for attempt in range(2):
            try:
                results = list(self._client.do_action(flight.Action("ping", b""),
                                                      self._ping_options))
                other = self._someone_else(decode(results[0].body.to_pybytes(),
                                                  "bookie answer")["result"])
            except Exception:
                other = None
                answered = False
                if attempt == 0 and self._moved():
                    continue  # pinged again, at the address it registered
            else:
                answered = other is None
            break
        if not answered:
            with self._lock:
                self.down_since = time.monotonic()
                if self._down_at is None:
                    self._down_at, self._failures_at_down = self.down_since, self.failures
                if other is not None and other != self.down_reason:
                    log.warning("bookie %s at %s is unavailable: %s", self.bookie_id,
                                self.address, other)
                    self.down_reason = other
            return False
        with self._lock:
            if self.down_since is not None and self._down_at is not None:
                log.warning("bookie %s at %s answers again after %.1f s (%d failure(s) "
                            "meanwhile; what it missed is re-replicated)", self.bookie_id,
                            self.address, time.monotonic() - self._down_at,
                            self.failures - self._failures_at_down)
            self.down_since = self._down_at = None
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._generation += 1
            stream, self._stream = self._stream, None
            self._fail_locked([f for _, f, _ in self._outbox] +
                              [f for _, _, f, _ in self._pending], "closed")
            self._outbox.clear()
            self._pending.clear()
            self._lock.notify_all()
        if stream is not None:  # no Finish: it would wait on the receiver's read
            with contextlib.suppress(Exception):
                stream[0].done_writing()
            with contextlib.suppress(Exception):
                stream[1].cancel()
            with self._lock:
                self._retired.append(stream)  # closed by the send loop, or below if it ended
                self._lock.notify_all()
        self._sender.join(timeout=self.timeout_s)
        if not self._sender.alive:  # it may have ended before it was handed the stream
            with self._lock:
                retired, self._retired = self._retired, []
            _close_writers(retired)
        self._watchdog.stop(timeout=self.timeout_s)
        if self._receiver is not None:
            self._receiver.join(timeout=self.timeout_s)
        self._client.close()


def _close_writers(streams: list[tuple[Any, Any]]) -> None:
    """Close the writers of streams given up on, here rather than by Arrow's destructor
    (which prints the close's error to stderr); their errors say nothing new."""
    for writer, _ in streams:
        with contextlib.suppress(Exception):
            writer.close()
