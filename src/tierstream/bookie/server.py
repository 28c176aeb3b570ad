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
before any row is sent. Every request may name the bookie it is for (``bookie``, and
``instance``: its disk's cookie): an endpoint that is another one refuses it as unavailable
(:meth:`BookieServer._addressed`). ``DoAction("ping")`` answers ``{"bookie": id, "writable": ...,
"instance": ...}`` (a network bookie's instance: ``cookie.py``; until it claimed it, a ping
is refused as unavailable).
"""

from __future__ import annotations

import logging
import os
import threading
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.bookie.ledger import (
    IndexRecord,
    decode_payload,
    encode_frame,
    entry_range,
    parse_frame,
    read_index,
)
from tierstream.bookie.open_files import LedgerFiles
from tierstream.bookie.storage import ledger_paths
from tierstream.bookie.writes import BookieWrites
from tierstream.errors import (
    ConfigError,
    CorruptionError,
    NotFoundError,
    ProtocolError,
    StorageError,
    TierstreamError,
    UnavailableError,
)
from tierstream.model.message_format import key_range_mask
from tierstream.model.positions import Position
from tierstream.wire.flight import action_result, decode, server_error
from tierstream.wire.security import (
    TokenMiddlewareFactory,
    advertised_host,
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
                 tls_cert: str | None = None, tls_key: str | None = None,
                 writable: bool = False, fsync: bool = True, open_files: int = 512) -> None:
        self.root = Path(root)
        #: ledger files open for the reads served, shared by them and bounded
        self.files = LedgerFiles(open_files)
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
        #: the write side (``bookie serve``); None for the broker's own read endpoints, whose
        #: directories the broker writes itself
        self.writes = BookieWrites(self.bookie_id, self.root, fsync=fsync) if writable \
            else None

    def __repr__(self) -> str:
        return f"BookieServer(id={self.bookie_id!r}, url={self.url!r})"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{url_host(self.host)}:{self.port}"

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        try:
            req = decode(ticket.ticket, "bookie ticket")
            self._addressed(req)
            if req.get("op") == "range":
                batch = self._writes().byte_range(self.files, int(req["segment_id"]),
                                                  int(req["offset"]), int(req["length"]))
                return flight.RecordBatchStream(pa.Table.from_batches([batch]))
            if req.get("op") != "entries":
                raise ProtocolError(f"unknown bookie DoGet operation {req.get('op')!r}")
            segment_id = int(req["segment_id"])
            records = self._index(segment_id)
            end = None if req.get("end") is None else Position.from_dict(req["end"])
            if end is not None and end.segment_id == segment_id and \
                    len(records) < end.entry_id + (1 if end.batch_index else 0):
                raise UnavailableError(  # the reader goes on with another replica
                    f"ledger {segment_id} on bookie {self.bookie_id} holds {len(records)} "
                    f"entries, fewer than the read needs (a copy that missed writes while "
                    "its bookie was away)")
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
        with _served("bookie action"):
            if action.type == "ping":
                # a network bookie answers once it takes writes (its identity claimed)
                instance = self.writes.claimed_instance() if self.writes is not None else None
                return action_result({"bookie": self.bookie_id,
                                      "writable": self.writes is not None,
                                      "instance": instance})
            if action.type == "stats":
                return action_result({"frames_served": self.frames_served,
                                     "bytes_served": self.bytes_served,
                                     **(self.writes.stats() if self.writes else {})})
            body = decode(action.body.to_pybytes(), "bookie action") if action.body else {}
            self._addressed(body)
            return action_result(self._writes().action(action.type, body))

    def do_exchange(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any,
                    writer: Any) -> None:
        with _served("bookie exchange"):
            command = decode(descriptor.command, "bookie exchange")
            self._addressed(command)
            if command.get("op") != "append":
                raise ProtocolError(f"unknown bookie exchange {command.get('op')!r}")
            self._writes().exchange(command, reader, writer)

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any,
               writer: Any) -> None:
        with _served("bookie put"):
            command = decode(descriptor.command, "bookie put")
            self._addressed(command)
            if command.get("op") != "rewrite":
                raise ProtocolError(f"unknown bookie put {command.get('op')!r}")
            self._writes().rewrite(int(command["segment_id"]), reader)

    def _addressed(self, request: dict[str, Any]) -> None:
        """A call names the bookie it is for (``bookie``, and the ``instance`` of its disk
        when the caller knows it): an address another endpoint answers now (a port taken
        while the bookie was down, by another bookie or another store's) is that bookie
        being unavailable, never a copy written to or read from the wrong disk."""
        wanted = request.get("bookie")
        if wanted is None:
            return
        if wanted != self.bookie_id:
            raise UnavailableError(f"the endpoint at {self.url} is bookie {self.bookie_id}, "
                                   f"not {wanted}")
        instance = request.get("instance")
        mine = self.writes.instance if self.writes is not None else None
        if instance is not None and mine is not None and instance != mine:
            raise UnavailableError(f"the endpoint at {self.url} is another disk of bookie "
                                   f"{wanted} (instance {mine}, not {instance})")

    def _writes(self) -> BookieWrites:
        if self.writes is None:
            raise UnavailableError(f"the endpoint at {self.url} serves bookie {self.bookie_id} "
                                   "read-only, for the broker that writes its directory: it "
                                   "takes no writes")
        return self.writes

    def shutdown(self) -> None:
        if self.writes is not None:
            self.writes.closing = True  # open append streams end, so shutdown can finish
        super().shutdown()
        if self.writes is not None:
            self.writes.close()
        self.files.close()

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
            handle, fd = self.files.acquire(log_path)
        except NotFoundError:
            raise server_error(NotFoundError(
                f"ledger {segment_id} is not on bookie {self.bookie_id}")) from None
        where = f"bookie {self.bookie_id}"
        try:
            for group in _groups(records):
                if cancelled():
                    return
                # frames of consecutive entries are contiguous in the ledger: one read each
                start = group[0].frame_offset
                end = group[-1].frame_offset + group[-1].frame_len
                data = os.pread(fd, end - start, start)
                if key_range == (0, 65536):
                    offsets = [r.frame_offset - start for r in group] + [end - start]
                    errors: list[str | None] = [None] * len(group)
                else:
                    data, offsets, errors = _filtered(data, start, group, segment_id, where,
                                                      key_range)
                yield self._batch(group, data, offsets, errors)
        finally:
            self.files.release(handle)

    def _batch(self, group: list[IndexRecord], data: bytes, offsets: list[int],
               errors: list[str | None]) -> pa.RecordBatch:
        with self._lock:
            self.frames_served += len(group)
            self.bytes_served += len(data)
        valid = None if not any(errors) else pa.array([e is None for e in errors]).buffers()[1]
        frames = pa.Array.from_buffers(pa.binary(), len(group), [
            valid, pa.py_buffer(array("i", offsets)), pa.py_buffer(data)])
        return pa.RecordBatch.from_arrays([
            pa.array([r.entry_id for r in group], pa.int64()),
            pa.array([r.first_publish_time for r in group], pa.int64()),
            pa.array([r.last_publish_time for r in group], pa.int64()),
            frames, pa.array(errors, pa.string())], schema=ENTRY_WIRE_SCHEMA)


@contextmanager
def _served(what: str) -> Iterator[None]:
    """Errors of a call as the client turns them back: ours tagged, a malformed request a
    ProtocolError naming it."""
    try:
        yield
    except TierstreamError as exc:
        raise server_error(exc) from None
    except (KeyError, ValueError, TypeError) as exc:
        raise server_error(ProtocolError(f"malformed {what}: {exc!r}")) from None


def _groups(records: list[IndexRecord]) -> Iterator[list[IndexRecord]]:
    """Runs of entries to send as one wire batch: bounded by count and by bytes."""
    group: list[IndexRecord] = []
    size = 0
    for rec in records:
        if group and (len(group) >= _BATCH_ENTRIES or size + rec.frame_len > _BATCH_BYTES):
            yield group
            group, size = [], 0
        group.append(rec)
        size += rec.frame_len
    if group:
        yield group


def _filtered(data: bytes, start: int, group: list[IndexRecord], segment_id: int, where: str,
              key_range: tuple[int, int]) -> tuple[bytes, list[int], list[str | None]]:
    """Each stored frame verified, then re-framed with only the rows of ``key_range`` (and a
    checksum of its own); a frame that fails its check becomes an error for the reader."""
    view = memoryview(data)
    out: list[bytes] = []
    offsets = [0]
    errors: list[str | None] = []
    for rec in group:
        raw = view[rec.frame_offset - start: rec.frame_offset - start + rec.frame_len]
        try:
            payload = parse_frame(raw, segment_id, rec.entry_id, where)
        except CorruptionError as exc:
            errors.append(str(exc))
            offsets.append(offsets[-1])
            continue
        batch = decode_payload(payload)
        mask = key_range_mask(batch.column("key_hash"), [key_range])
        kept = batch.filter(mask) if mask is not None else batch
        frame = b"".join(p.to_pybytes() if isinstance(p, pa.Buffer) else bytes(p)
                         for p in encode_frame(segment_id, rec.entry_id, {}, kept.serialize()))
        out.append(frame)
        offsets.append(offsets[-1] + len(frame))
        errors.append(None)
    return b"".join(out), offsets, errors


def serve_bookie(root: str | Path, *, host: str, port: int, bookie_id: str | None = None,
                 auth_token: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, broker: str | None = None,
                 advertised_address: str | None = None, tls_ca: bytes | None = None,
                 metadata: str | None = None, host_label: str | None = None,
                 fsync: bool = True, ready: Any = None, replace: bool = False) -> None:
    """Run one bookie endpoint until SIGTERM/SIGINT (main thread). With ``metadata`` (a
    ``postgresql://`` URL) it takes writes and registers there as a network bookie (its
    address, and ``host_label`` or the address's host), where brokers started with
    ``--network-bookies`` find it, once its disk's cookie matches its registration
    (``cookie.py``; ``replace``: an empty directory takes the place of a lost disk); with
    ``broker``, its address is registered with that broker as the read endpoint of one of
    its own bookies."""
    from tierstream.metadata.backend import POSTGRES_SCHEMES
    from tierstream.util.signals import stop_requested

    if metadata is not None and not metadata.startswith(POSTGRES_SCHEMES):
        raise ConfigError(f"invalid --metadata {metadata!r}: expected postgresql://user@host"
                          "[:port]/database (network bookies register where every broker "
                          "finds them)")
    if replace and metadata is None:
        raise ConfigError("--replace is for a network bookie (--metadata postgresql://...): "
                          "it takes a lost bookie's place in the metadata store")
    root = Path(root)
    if metadata is not None:
        root.mkdir(parents=True, exist_ok=True)
        _check(root, bookie_id or root.name, metadata, replace)  # before anything binds
    server = BookieServer(root, bookie_id=bookie_id, host=host, port=port,
                          auth_token=auth_token, tls_cert=tls_cert, tls_key=tls_key,
                          writable=metadata is not None, fsync=fsync)
    address = advertised_url(server, advertised_address)
    try:
        if metadata is not None:
            _claim(server, metadata, address, host_label, replace)
        if broker is not None:
            from tierstream.client.admin import Admin

            with Admin(broker, auth_token=auth_token, tls_ca=tls_ca) as admin:
                admin.register_bookie(server.bookie_id, address)
        with stop_requested() as stop:
            if ready is not None:
                ready(server, address)
            while not stop.wait(0.5):
                if server.writes is not None and server.writes.failed.is_set():
                    log.error("%s: the bookie stops", server.writes.failed_reason)
                    raise StorageError(f"{server.writes.failed_reason}: the bookie stopped")
    finally:
        server.shutdown()


def _check(root: Path, bookie_id: str, url: str, replace: bool) -> None:
    from tierstream.bookie.cookie import check_identity
    from tierstream.metadata.store import MetadataStore

    store = MetadataStore(url, hold=False)
    try:
        check_identity(root, bookie_id, store, replace=replace)
    finally:
        store.close()


def _claim(server: BookieServer, url: str, address: str, host_label: str | None,
           replace: bool) -> None:
    """Match the disk's cookie with the bookie's registration (``cookie.py``), then take
    writes: until then a broker that reconnects at once is refused as if the bookie were
    still down."""
    from urllib.parse import urlparse

    from tierstream.bookie.cookie import claim_identity
    from tierstream.metadata.store import MetadataStore

    assert server.writes is not None
    store = MetadataStore(url, hold=False)
    try:
        cookie, lost = claim_identity(server.root, server.bookie_id, store, address=address,
                                      host=host_label or urlparse(address).hostname or address,
                                      replace=replace)
    finally:
        store.close()
    if lost:
        log.warning("bookie %s takes the place of its lost disk (instance %s): %d segment(s) "
                    "it held a copy of are listed as under-replicated; the brokers copy them "
                    "back", server.bookie_id, cookie.instance, len(lost))
    server.writes.claimed(cookie.instance, cookie.first_ledger)


def advertised_url(server: BookieServer, advertised: str | None) -> str:
    """The address readers are given: ``advertised`` (a host, host:port or URL) or the bound
    one."""
    if advertised is None:
        return f"{server.scheme}://{url_host(advertised_host(server.host, None))}:{server.port}"
    if "://" in advertised:
        return advertised
    host, _, port = advertised.rpartition(":") if advertised.count(":") == 1 else \
        (advertised, "", "")
    return f"{server.scheme}://{url_host(host or advertised)}:{port or server.port}"
