"""The bookie-log reader: a closed segment straight from log storage, not through the broker.

Where the data is read depends on where the reader runs, in this order:

1. **local files**: a replica's ledger files are on this host (the store's host): they are
   read directly, binary-searching the entry index for the split's time bounds;
2. **bookie endpoints**: otherwise the replicas' endpoints (``tierstream bookie serve``, or the
   broker's own per bookie) stream the entry range, key range filtered on the bookie;
3. **the broker**: only when the segment really left the bookies (every endpoint says the
   ledger is not there: it moved to the tier and its bookie copy was deleted after planning),
   or no bookie advertised an endpoint; the broker serves it from wherever it is now.

Every frame is verified against its checksum wherever it came from, and an entry that fails
on one replica is read from another. If an endpoint fails mid-read, the read continues from
the next entry on another replica. Each path is counted in ``stats`` (readers/stats.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.bookie.ledger import (
    IndexRecord,
    decode_payload,
    entry_range,
    first_good_replica,
    parse_frame,
    read_index,
    unreadable,
)
from tierstream.bookie.storage import ledger_paths
from tierstream.errors import (
    AuthError,
    CorruptionError,
    NotFoundError,
    ProtocolError,
    TierstreamError,
    UnavailableError,
)
from tierstream.model.message_format import MESSAGE_SCHEMA, with_topic
from tierstream.model.positions import Position, in_ranges
from tierstream.readers.stats import BROKER_FALLBACK, ENDPOINT, LOCAL, ReadStats, counted
from tierstream.readers.trim import trim
from tierstream.splits.split import Replica, Split
from tierstream.util.mapped import map_read_only
from tierstream.wire.flight import encode, translate_errors
from tierstream.wire.security import call_headers, client_for

__all__ = ["read_bookie_split"]

log = logging.getLogger(__name__)

READER = "bookie-log"
_EMPTY = pa.RecordBatch.from_pylist([], schema=MESSAGE_SCHEMA)


def read_bookie_split(split: Split, *, auth_token: str | None = None,
                      tls_ca: bytes | None = None, stats: ReadStats | None = None
                      ) -> Iterator[pa.RecordBatch]:
    local = _local_index(split)
    if local is not None:
        records, dirs = local
        yield from counted(_read_local(split, records, dirs), stats, READER, LOCAL)
        return
    remote = [r for r in split.replicas if r.endpoint]
    resume = split.start
    if remote:
        try:
            yield from _read_endpoints(split, remote, auth_token, tls_ca, stats)
            return
        except _LedgerGone as gone:
            resume = gone.resume
            log.info("segment %s of %s partition %s is on none of its bookies any more; "
                     "reading it through the broker", split.segment_id, split.topic,
                     split.partition)
    if split.broker is None:
        raise NotFoundError(f"segment {split.segment_id} of {split.topic!r} partition "
                            f"{split.partition} is on no bookie this host can reach and no "
                            "broker was given")
    from tierstream.readers.tail import read_tail_split

    rest = replace(split, start=resume)  # after what the endpoints delivered, if anything
    yield from counted(read_tail_split(rest, auth_token=auth_token, tls_ca=tls_ca), stats,
                       READER, BROKER_FALLBACK)


def _read_endpoints(split: Split, replicas: list[Replica], auth_token: str | None,
                    tls_ca: bytes | None, stats: ReadStats | None) -> Iterator[pa.RecordBatch]:
    """The split from its replicas' endpoints. If none answers, the broker may have been
    restarted since planning and its endpoints moved: ask it once for the current ones."""
    reader = _RemoteLedger(split, replicas, auth_token, tls_ca)
    try:
        yield from counted(reader.read(), stats, READER, ENDPOINT)
        return
    except UnavailableError:
        moved = _current_endpoints(split, replicas, auth_token, tls_ca)
        if moved is None:
            raise
        log.info("bookie endpoints of segment %s moved since planning; now %s",
                 split.segment_id, [r.endpoint for r in moved])
    rest = replace(split, start=reader.resume)
    yield from counted(_RemoteLedger(rest, moved, auth_token, tls_ca).read(), stats, READER,
                       ENDPOINT)


def _current_endpoints(split: Split, replicas: list[Replica], auth_token: str | None,
                       tls_ca: bytes | None) -> list[Replica] | None:
    """The replicas with the broker's current endpoints, or None if nothing changed (or the
    broker cannot say)."""
    if split.broker is None:
        return None
    from tierstream.client.admin import Admin

    try:
        with Admin(split.broker, auth_token=auth_token, tls_ca=tls_ca, timeout=10) as admin:
            now = admin.bookie_endpoints()
    except TierstreamError:
        return None
    moved = [replace(r, endpoint=now.get(r.bookie, r.endpoint)) for r in replicas]
    return moved if moved != replicas else None


# -- local files ------------------------------------------------------------------------------


def _local_index(split: Split) -> tuple[list[IndexRecord], list[str]] | None:
    """The entry index from the first replica whose files this host sees, and every such
    replica's directory (for per-entry fallback), or None when no replica is local."""
    dirs = [r.local_dir for r in split.replicas if r.local_dir]
    for i, d in enumerate(dirs):
        _, idx = ledger_paths(d, split.segment_id)
        try:
            records = read_index(idx)
        except FileNotFoundError:
            continue
        return records, dirs[i:]
    return None


def _read_local(split: Split, records: list[IndexRecord], dirs: list[str]
                ) -> Iterator[pa.RecordBatch]:
    return _trimmed(split, _decoded_local(split, records, dirs))


#: a key-range read filters this many entries at a time (one concatenation, one filter)
GROUP_ENTRIES = 16


def _trimmed(split: Split, entries: Iterator[tuple[int, int, int, pa.RecordBatch]]
             ) -> Iterator[pa.RecordBatch]:
    """Each decoded entry trimmed to ``split``. A split of every key passes most entries
    through whole (zero-copy), one by one; a key-range split keeps about 1/k of each entry's
    rows, and filtering entries one by one costs ~60 µs each in per-column call overhead
    (1,000-row entries), 3x the rows' copy: it filters groups of :data:`GROUP_ENTRIES`."""
    size = 1 if split.key_range.is_full else GROUP_ENTRIES
    group: list[tuple[int, int, int, pa.RecordBatch]] = []
    for item in entries:
        group.append(item)
        if len(group) == size:
            out = _trim_entries(split, group, check_keys=True)
            if out.num_rows:
                yield out
            group = []
    if group:
        out = _trim_entries(split, group, check_keys=True)
        if out.num_rows:
            yield out


def _decoded_local(split: Split, records: list[IndexRecord], dirs: list[str]
                   ) -> Iterator[tuple[int, int, int, pa.RecordBatch]]:
    """A sealed ledger file is memory-mapped: a frame is verified and decoded where the page
    cache holds it, with no copy and no system call per entry. The first replica's copy is
    read directly; only an entry that fails there goes through the per-entry fallback.
    Yields (entry id, first and last publish time, decoded entry)."""
    first, last = entry_range(records, split.start.entry_id, split.end, split.start_time,
                              split.end_time)
    if first >= last:
        return
    maps: dict[str, pa.Buffer] = {}  # unmapped when the last batch over it is gone
    # only the frames this split reads: a chunk of a large ledger faults in its own pages
    span = records[first].frame_offset, records[last - 1].frame_offset \
        + records[last - 1].frame_len
    try:
        mapped, base = _mapped(str(ledger_paths(dirs[0], split.segment_id)[0]), *span)
    except FileNotFoundError:
        mapped, base = pa.py_buffer(b""), 0
    primary = memoryview(mapped)
    segment_id, where, size = split.segment_id, dirs[0], len(primary)
    skipped = split.skipped
    for rec in records[first:last]:
        if skipped and in_ranges(skipped, rec.entry_id):
            continue  # an aborted or set-aside transaction's entry
        start, end = rec.frame_offset - base, rec.frame_offset - base + rec.frame_len
        try:
            payload = parse_frame(primary[start:end], segment_id, rec.entry_id, where) \
                if end <= size else None
        except CorruptionError:
            payload = None
        if payload is None:  # the fallback reads it again, says what is wrong, tries others
            payload = _read_entry(split, rec, dirs, maps)
        yield rec.entry_id, rec.first_publish_time, rec.last_publish_time, \
            decode_payload(payload)


def _read_entry(split: Split, rec: IndexRecord, dirs: list[str], maps: dict[str, pa.Buffer]
                ) -> pa.Buffer:
    """One entry's verified payload from the first replica whose frame verifies."""
    def read(d: str) -> Callable[[], pa.Buffer]:
        def frame() -> pa.Buffer:
            whole = _ledger_map(split, d, maps)
            if rec.frame_offset + rec.frame_len > whole.size:
                raise CorruptionError(f"{d}: ledger {split.segment_id} is shorter than its "
                                      f"index says (entry {rec.entry_id})")
            return parse_frame(memoryview(whole.slice(rec.frame_offset, rec.frame_len)),
                               split.segment_id, rec.entry_id, d)
        return frame

    payload, errors = first_good_replica((d, read(d)) for d in dirs)
    if payload is None:
        raise unreadable(rec.entry_id, split.segment_id, split.topic, split.partition, errors)
    return payload


def _ledger_map(split: Split, d: str, maps: dict[str, pa.Buffer]) -> pa.Buffer:
    whole = maps.get(d)
    if whole is None:
        log_path, _ = ledger_paths(d, split.segment_id)
        try:
            whole = maps[d] = _mapped(str(log_path))[0]
        except FileNotFoundError:
            raise NotFoundError(f"{d}: ledger {split.segment_id} is missing") from None
    return whole


def _mapped(path: str, lo: int = 0, hi: int | None = None) -> tuple[pa.Buffer, int]:
    """Bytes ``[lo, hi)`` of a sealed ledger file (``hi`` None: to its end), from the page
    boundary at or before ``lo``, as one zero-copy buffer over a read-only mapping that holds
    no descriptor (``util/mapped.py``: a table over thousands of segments keeps thousands
    of mappings); and the file offset where the buffer starts."""
    import mmap

    base = lo - lo % mmap.ALLOCATIONGRANULARITY
    size = os.stat(path).st_size
    length = (size if hi is None else min(hi, size)) - base
    if length <= 0:
        return pa.py_buffer(b""), base
    return map_read_only(path, base, length), base


def _trim_entries(split: Split, group: list[tuple[int, int, int, pa.RecordBatch]], *,
                  check_keys: bool) -> pa.RecordBatch:
    """The rows inside the split of consecutive entries (entry id, first and last publish
    time, decoded rows), as one batch: only entries at its edges can hold rows of positions
    or times outside it."""
    batch = pa.concat_batches([b for *_, b in group]) if len(group) > 1 else group[0][3]
    lo, hi = group[0][0], group[-1][0]
    edge = lo <= split.start.entry_id <= hi or (split.end is not None
                                                and lo <= split.end.entry_id <= hi)
    in_time = (split.start_time is None or group[0][1] >= split.start_time) \
        and (split.end_time is None or group[-1][2] < split.end_time)
    out = trim(batch, split, check_positions=edge, check_time=not in_time,
               check_keys=check_keys)
    return with_topic(out, split.topic) if out.num_rows else out


# -- bookie endpoints -------------------------------------------------------------------------


class _LedgerGone(Exception):
    """Every replica's endpoint says it does not have the ledger (any more)."""

    def __init__(self, resume: Position) -> None:
        self.resume = resume


class _RemoteLedger:
    """Reads a split's entries from its replicas' endpoints, moving to the next replica when
    one fails, and reading single corrupt entries from another replica."""

    def __init__(self, split: Split, replicas: list[Replica], auth_token: str | None,
                 tls_ca: bytes | None) -> None:
        self.split = split
        self.replicas = replicas
        self.tls_ca = tls_ca
        self._options = flight.FlightCallOptions(headers=call_headers(auth_token))
        self._clients: dict[str, Any] = {}
        #: where a read that stopped would continue: after the last entry delivered
        self.resume = split.start

    def _client(self, replica: Replica) -> Any:
        assert replica.endpoint is not None
        client = self._clients.get(replica.endpoint)
        if client is None:
            client = self._clients[replica.endpoint] = client_for(replica.endpoint,
                                                                  tls_ca=self.tls_ca)
        return client

    def _stream(self, replica: Replica, first: int, end: Position | None,
                timed: bool) -> Iterator[pa.RecordBatch]:
        s = self.split
        ticket = {"op": "entries", "bookie": replica.bookie, "segment_id": s.segment_id,
                  "first": first,
                  "end": None if end is None else end.to_dict(),
                  "start_time": s.start_time if timed else None,
                  "end_time": s.end_time if timed else None,
                  "key_range": s.key_range.to_list()}
        assert replica.endpoint is not None
        with translate_errors(replica.endpoint, what=f"bookie endpoint of {replica.bookie}"):
            reader = self._client(replica).do_get(flight.Ticket(encode(ticket)), self._options)
            for chunk in reader:
                yield chunk.data

    def read(self) -> Iterator[pa.RecordBatch]:
        s = self.split
        errors: dict[str, str] = {}
        gone: set[str] = set()
        k = 0
        try:
            while len(errors) < len(self.replicas):
                replica = self.replicas[k % len(self.replicas)]
                k += 1
                if replica.bookie in errors:
                    continue
                try:
                    for wire in self._stream(replica, self.resume.entry_id, s.end, timed=True):
                        for out, entry_id in self._entries(wire, replica):
                            if out.num_rows:
                                yield out
                            self.resume = Position(s.partition, s.segment_id, entry_id + 1, 0)
                            errors.clear()  # progress: every replica may be tried again
                            gone.clear()
                    return
                except AuthError:
                    raise  # the reader's token, not the replica: no other will take it
                except NotFoundError as exc:
                    errors[replica.bookie] = str(exc)
                    gone.add(replica.bookie)
                except (UnavailableError, ProtocolError, OSError) as exc:
                    errors[replica.bookie] = str(exc)
                    log.warning("bookie endpoint %s failed reading segment %s at entry %s "
                                "(%s); continuing on another replica", replica.endpoint,
                                s.segment_id, self.resume.entry_id, exc)
        finally:
            for client in self._clients.values():
                client.close()
        if len(gone) == len(self.replicas):
            raise _LedgerGone(self.resume)
        raise UnavailableError(
            f"segment {s.segment_id} of {s.topic!r} partition {s.partition}: no bookie "
            f"endpoint could serve entry {self.resume.entry_id}: "
            + "; ".join(f"{b}: {e}" for b, e in errors.items()))

    def _entries(self, wire: pa.RecordBatch, source: Replica
                 ) -> Iterator[tuple[pa.RecordBatch, int]]:
        s = self.split
        where = f"bookie endpoint {source.endpoint}"
        ids = wire.column("entry_id").to_pylist()
        firsts = wire.column("first_publish_time").to_pylist()
        lasts = wire.column("last_publish_time").to_pylist()
        frames = wire.column("frame")
        errors = wire.column("error")
        for i, entry_id in enumerate(ids):
            if s.skipped and in_ranges(s.skipped, entry_id):
                yield _EMPTY, entry_id  # an aborted or set-aside transaction's entry
                continue
            try:
                if not frames[i].is_valid:
                    raise CorruptionError(f"{where}: {errors[i].as_py()}")
                # zero-copy: a slice of the wire buffer, verified like a frame from disk
                payload = parse_frame(memoryview(frames[i].as_buffer()), s.segment_id,
                                      entry_id, where)
            except CorruptionError as exc:
                payload = self._from_others(entry_id, source, str(exc))
            entry = (entry_id, firsts[i], lasts[i], decode_payload(payload))
            yield _trim_entries(s, [entry], check_keys=False), entry_id

    def _from_others(self, entry_id: int, bad: Replica, first_error: str) -> pa.Buffer:
        """One entry that failed its check, from each other replica in turn."""
        s = self.split
        errors = [first_error]
        end = Position(s.partition, s.segment_id, entry_id + 1, 0)
        for replica in self.replicas:
            if replica is bad:
                continue
            try:
                for wire in self._stream(replica, entry_id, end, timed=False):
                    row = wire.to_pydict()
                    if row["frame"] and row["frame"][0] is not None:
                        return parse_frame(row["frame"][0], s.segment_id, entry_id,
                                           f"bookie endpoint {replica.endpoint}")
                    errors.append(f"{replica.bookie}: {row['error'][0] if row['error'] else ''}")
            except (TierstreamError, OSError) as exc:
                errors.append(f"{replica.bookie}: {exc}")
        raise unreadable(entry_id, s.segment_id, s.topic, s.partition, errors)
