"""A bookie endpoint: one bookie directory's sealed ledgers, served read-only over Arrow Flight.

This is how a reader on a host that cannot see the store's files reads closed segments
straight from log storage, as Pulsar's readers read ledgers from the bookies: the broker is
not in the data path.

Wire (``DoGet``, ticket ``{"op": "entries", segment_id, first, end, start_time, end_time,
key_range}``): the endpoint binary-searches the ledger's index for the entry range and streams
:data:`ENTRY_WIRE_SCHEMA` batches, one row per entry, in entry order:

- ``frame``: the entry's frame as stored, checksum included, so the reader verifies it
  exactly as it verifies one read from disk (a frame corrupted on disk or on the way fails
  there). With a key range, the endpoint first verifies the stored frame, keeps the rows of
  the range and sends a new frame of just those rows with its own checksum: filtering on
  the server keeps the bytes on the wire near what the range holds.
- ``error``: set instead of ``frame`` when the stored frame fails its checksum; the reader
  reads that entry from another replica.

A ledger this bookie does not have (never had, or deleted after offload) is a NotFoundError
before any row is sent. ``DoAction("ping")`` answers ``{"bookie": id}``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.errors import (
    ConfigError,
    CorruptionError,
    NotFoundError,
    ProtocolError,
    TierstreamError,
)
from tierstream.schema import key_range_mask
from tierstream.splits.positions import Position
from tierstream.store.bookie import ledger_paths
from tierstream.store.ledger import (
    IndexRecord,
    decode_payload,
    encode_frame,
    entry_range,
    parse_frame,
    read_index,
)
from tierstream.store.protocol import decode, encode, server_error
from tierstream.store.security import (
    TokenMiddlewareFactory,
    check_bind,
    server_tls,
    url_host,
)

__all__ = ["ENTRY_WIRE_SCHEMA", "BookieServer", "serve_bookie"]

log = logging.getLogger(__name__)

ENTRY_WIRE_SCHEMA = pa.schema([
    pa.field("entry_id", pa.int64(), nullable=False),
    pa.field("first_publish_time", pa.int64(), nullable=False),
    pa.field("last_publish_time", pa.int64(), nullable=False),
    pa.field("frame", pa.binary(), nullable=True),
    pa.field("error", pa.string(), nullable=True),
])

#: Frames per wire batch are bounded by count and by bytes (a few MiB in flight per stream).
_BATCH_ENTRIES = 64
_BATCH_BYTES = 4 * 1024**2


class BookieServer(flight.FlightServerBase):
    """Serves the sealed ledgers under ``root`` (a bookie directory). Read-only."""

    def __init__(self, root: str | Path, *, bookie_id: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, auth_token: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self.root = Path(root)
        if not (self.root / "ledgers").is_dir() and not self.root.is_dir():
            raise ConfigError(f"invalid bookie directory {str(root)!r}: it does not exist")
        self.bookie_id = bookie_id or self.root.name
        tls = server_tls(tls_cert, tls_key)
        check_bind(host, auth_token=auth_token, tls=tls is not None, what="bookie endpoint")
        scheme = "grpc+tls" if tls else "grpc"
        location = f"{scheme}://{url_host(host)}:{port}"
        middleware = {"auth": TokenMiddlewareFactory(auth_token)} if auth_token else {}
        try:
            super().__init__(location, middleware=middleware, tls_certificates=tls or [])
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"cannot listen on {location}: {exc}") from None
        self.host, self.scheme = host, scheme
        self.frames_served = 0
        self.bytes_served = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"BookieServer(id={self.bookie_id!r}, url={self.url!r})"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{url_host(self.host)}:{self.port}"

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        try:
            req = decode(ticket.ticket, "bookie ticket")
            if req.get("op") != "entries":
                raise ProtocolError(f"unknown bookie DoGet operation {req.get('op')!r}")
            segment_id = int(req["segment_id"])
            records = self._index(segment_id)
            end = None if req.get("end") is None else Position.from_dict(req["end"])
            i, j = entry_range(records, int(req.get("first") or 0), end,
                               req.get("start_time"), req.get("end_time"))
            lo, hi = req.get("key_range") or (0, 65536)
            rows = self._entries(segment_id, records[i:j], (int(lo), int(hi)),
                                 context.is_cancelled)
            reader = pa.RecordBatchReader.from_batches(ENTRY_WIRE_SCHEMA, rows)
            return flight.RecordBatchStream(reader)
        except TierstreamError as exc:
            raise server_error(exc) from None
        except (KeyError, ValueError, TypeError) as exc:
            raise server_error(ProtocolError(f"malformed bookie request: {exc!r}")) from None

    def do_action(self, context: Any, action: flight.Action) -> Iterator[bytes]:
        if action.type != "ping":
            raise server_error(ProtocolError(f"unknown bookie action {action.type!r}"))
        return iter([encode({"result": {"bookie": self.bookie_id}})])

    def _index(self, segment_id: int) -> list[IndexRecord]:
        _, idx = ledger_paths(self.root, segment_id)
        try:
            return read_index(idx)
        except FileNotFoundError:
            raise NotFoundError(f"ledger {segment_id} is not on bookie {self.bookie_id}") \
                from None

    def _entries(self, segment_id: int, records: list[IndexRecord], key_range: tuple[int, int],
                 cancelled: Any) -> Iterator[pa.RecordBatch]:
        log_path, _ = ledger_paths(self.root, segment_id)
        try:
            fd = os.open(log_path, os.O_RDONLY)
        except FileNotFoundError:
            raise server_error(NotFoundError(
                f"ledger {segment_id} is not on bookie {self.bookie_id}")) from None
        where = f"bookie {self.bookie_id}"
        filtered = key_range != (0, 65536)
        try:
            cols: list[list[Any]] = [[], [], [], [], []]
            size = 0
            for rec in records:
                if cancelled():
                    return
                frame, error = self._frame(fd, segment_id, rec, where, key_range, filtered)
                for col, value in zip(cols, (rec.entry_id, rec.first_publish_time,
                                             rec.last_publish_time, frame, error), strict=True):
                    col.append(value)
                size += len(frame or b"")
                if len(cols[0]) >= _BATCH_ENTRIES or size >= _BATCH_BYTES:
                    yield self._batch(cols, size)
                    cols, size = [[], [], [], [], []], 0
            if cols[0]:
                yield self._batch(cols, size)
        finally:
            os.close(fd)

    def _frame(self, fd: int, segment_id: int, rec: IndexRecord, where: str,
               key_range: tuple[int, int], filtered: bool) -> tuple[bytes | None, str | None]:
        raw = os.pread(fd, rec.frame_len, rec.frame_offset)
        if not filtered:
            return raw, None  # verified by the reader, end to end
        try:
            payload = parse_frame(raw, segment_id, rec.entry_id, where)
        except CorruptionError as exc:
            return None, str(exc)
        batch = decode_payload(payload)
        mask = key_range_mask(batch.column("key_hash"), [key_range])
        kept = batch.filter(mask) if mask is not None else batch
        return b"".join(bytes(p) if not isinstance(p, pa.Buffer) else p.to_pybytes()
                        for p in encode_frame(segment_id, rec.entry_id, {},
                                              kept.serialize())), None

    def _batch(self, cols: list[list[Any]], size: int) -> pa.RecordBatch:
        with self._lock:
            self.frames_served += len(cols[0])
            self.bytes_served += size
        return pa.RecordBatch.from_arrays([pa.array(c, type=f.type) for c, f in
                                           zip(cols, ENTRY_WIRE_SCHEMA, strict=True)],
                                          schema=ENTRY_WIRE_SCHEMA)


def serve_bookie(root: str | Path, *, host: str, port: int, bookie_id: str | None = None,
                 auth_token: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, broker: str | None = None,
                 advertised_address: str | None = None, tls_ca: bytes | None = None,
                 ready: Any = None) -> None:
    """Run one bookie endpoint until SIGTERM/SIGINT (main thread). With ``broker``, its
    address (``advertised_address`` or the bound one) is registered in the store's metadata,
    so planners hand it to readers."""
    import signal

    server = BookieServer(root, bookie_id=bookie_id, host=host, port=port,
                          auth_token=auth_token, tls_cert=tls_cert, tls_key=tls_key)
    address = advertised_url(server, advertised_address)
    try:
        if broker is not None:
            from tierstream.store.admin import Admin

            with Admin(broker, auth_token=auth_token, tls_ca=tls_ca) as admin:
                admin.action("register-bookie", {"bookie": server.bookie_id,
                                                 "address": address})
        stop = threading.Event()
        previous = {s: signal.signal(s, lambda *_: stop.set())
                    for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if ready is not None:
                ready(server, address)
            while not stop.wait(0.5):
                pass
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        server.shutdown()


def advertised_url(server: BookieServer, advertised: str | None) -> str:
    """The address readers are given: ``advertised`` (a host, host:port or URL) or the bound
    one."""
    if advertised is None:
        return server.url
    if "://" in advertised:
        return advertised
    host, _, port = advertised.rpartition(":") if advertised.count(":") == 1 else \
        (advertised, "", "")
    return f"{server.scheme}://{url_host(host or advertised)}:{port or server.port}"
