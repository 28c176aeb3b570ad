"""The on-disk format of one ledger (segment) on one bookie, and how to read it back.

A ledger is two files in the bookie's directory:

``<segment_id>.log``  append-only frames. A frame is a 40-byte header
    ``magic "TSE1", flags u32, segment_id i64, entry_id i64, meta_len u32, payload_len u32,
    crc32c u32, 4 bytes padding``, then ``meta`` (a small JSON object: producer, sequence id)
    padded to 8 bytes, then the payload (one Arrow IPC record-batch message of
    :data:`~tierstream.model.message_format.MESSAGE_SCHEMA`) padded to 8 bytes. The CRC-32C
    (Castagnoli, as BookKeeper's default digest; hardware-accelerated by the ``crc32c``
    package) covers segment id, entry id, both lengths, meta and payload, so a frame copied
    into the wrong ledger or slot
    fails the check just like a flipped byte.
``<segment_id>.idx``  fixed 40-byte records ``entry_id i64, frame_offset i64, frame_len u32,
    messages u32, first_publish_time i64, last_publish_time i64``; the index is derived data:
    recovery rebuilds it from the frames.

Functions here are pure file I/O with no threads, so the bookie-log reader can use them on an
executor that has nothing but the paths.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import pyarrow as pa

from tierstream.errors import CorruptionError, NotFoundError
from tierstream.model.message_format import MESSAGE_SCHEMA
from tierstream.util.durable import fsync_dir

__all__ = [
    "FRAME_HEADER",
    "INDEX_RECORD",
    "IndexRecord",
    "RecoveredLedger",
    "decode_payload",
    "encode_frame",
    "entries_before",
    "entry_range",
    "first_good_replica",
    "ledger_paths",
    "parse_frame",
    "read_frame",
    "read_index",
    "scan_frames",
    "unreadable",
    "write_ledger_files",
]

MAGIC = b"TSE2"  # version 2: CRC-32C
FRAME_HEADER = struct.Struct("<4sIqqIII4x")
INDEX_RECORD = struct.Struct("<qqIIqq")
_CRC_IDS = struct.Struct("<qqII")
#: where the fields _CRC_IDS packs (segment, entry, meta and payload lengths) sit in a header
_IDS_AT = 8


#: one encoder for every frame's metadata (json.dumps with separators builds one per call)
_META_JSON = json.JSONEncoder(separators=(",", ":"))


def _pad8(n: int) -> int:
    return (8 - n % 8) % 8


@dataclass(frozen=True, slots=True)
class IndexRecord:
    entry_id: int
    frame_offset: int
    frame_len: int
    messages: int
    first_publish_time: int
    last_publish_time: int

    def pack(self) -> bytes:
        return INDEX_RECORD.pack(
            self.entry_id, self.frame_offset, self.frame_len, self.messages,
            self.first_publish_time, self.last_publish_time,
        )


def _crc(ids: bytes | memoryview, meta: bytes | memoryview, payload: Any) -> int:
    """The frame checksum: over the packed ids (:data:`_CRC_IDS`, which a header holds as its
    bytes 8..32), the metadata and the payload, in that order."""
    crc = crc32c.crc32c(ids)
    crc = crc32c.crc32c(meta, value=crc)
    return crc32c.crc32c(payload, value=crc)


def encode_frame(segment_id: int, entry_id: int, meta: dict[str, Any], payload: pa.Buffer) -> list[
    Any
]:
    """The pieces of one frame, ready for ``os.writev`` (payload is not copied)."""
    meta_bytes = _META_JSON.encode(meta).encode()
    crc = _crc(_CRC_IDS.pack(segment_id, entry_id, len(meta_bytes), payload.size), meta_bytes,
               payload)
    header = FRAME_HEADER.pack(
        MAGIC, 0, segment_id, entry_id, len(meta_bytes), payload.size, crc
    )
    return [
        header,
        meta_bytes + b"\0" * _pad8(len(meta_bytes)),
        payload,
        b"\0" * _pad8(payload.size),
    ]


def frame_length(pieces: list[Any]) -> int:
    return sum(len(p) if not isinstance(p, pa.Buffer) else p.size for p in pieces)


def _parse(
    buf: memoryview, segment_id: int, entry_id: int | None, where: str
) -> tuple[int, memoryview, memoryview, int]:
    """(entry_id, meta view, payload view, frame length) of the frame at ``buf``'s start."""
    if len(buf) < FRAME_HEADER.size:
        raise CorruptionError(f"{where}: short frame header")
    magic, _flags, seg, ent, meta_len, payload_len, crc = FRAME_HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptionError(f"{where}: bad frame magic")
    if seg != segment_id or (entry_id is not None and ent != entry_id):
        raise CorruptionError(
            f"{where}: frame belongs to segment {seg} entry {ent}, expected segment {segment_id}"
            f" entry {entry_id}"
        )
    meta_start = FRAME_HEADER.size
    payload_start = meta_start + meta_len + _pad8(meta_len)
    end = payload_start + payload_len + _pad8(payload_len)
    if end > len(buf):
        raise CorruptionError(f"{where}: frame is cut short ({len(buf)} of {end} bytes)")
    meta = buf[meta_start : meta_start + meta_len]
    payload = buf[payload_start : payload_start + payload_len]
    # the checksum's id fields are the header's own bytes: checked in place, not repacked
    if _crc(buf[_IDS_AT : _IDS_AT + _CRC_IDS.size], meta, payload) != crc:
        raise CorruptionError(f"{where}: checksum mismatch in segment {seg} entry {ent}")
    return ent, meta, payload, end


def _meta(meta_bytes: bytes | memoryview, where: str) -> dict[str, Any]:
    try:
        return json.loads(bytes(meta_bytes)) if meta_bytes else {}
    except ValueError:
        raise CorruptionError(f"{where}: unreadable frame metadata") from None


def read_frame(fd: int, segment_id: int, record: IndexRecord, where: str) -> pa.Buffer:
    """Read and verify the frame ``record`` points at; returns its payload (zero-copy)."""
    return parse_frame(os.pread(fd, record.frame_len, record.frame_offset), segment_id,
                       record.entry_id, where)


def parse_frame(frame: bytes | memoryview, segment_id: int, entry_id: int, where: str
                ) -> pa.Buffer:
    """Verify one whole frame (checksum, segment and entry id); its payload, zero-copy. A
    frame that crossed the network is checked here exactly as one read from disk."""
    _, _, payload, _ = _parse(memoryview(frame), segment_id, entry_id, where)
    return pa.py_buffer(payload)


def decode_payload(payload: pa.Buffer) -> pa.RecordBatch:
    """The record batch of an entry payload, zero-copy over ``payload``."""
    return pa.ipc.read_record_batch(payload, MESSAGE_SCHEMA)


def read_index(path: str | Path) -> list[IndexRecord]:
    """All records of an index file (a trailing partial record is ignored)."""
    data = Path(path).read_bytes()
    n = len(data) // INDEX_RECORD.size
    return [IndexRecord(*INDEX_RECORD.unpack_from(data, i * INDEX_RECORD.size)) for i in range(n)]


@dataclass(frozen=True)
class ScannedFrame:
    record: IndexRecord
    meta: dict[str, Any]


def scan_frames(path: str | Path, segment_id: int) -> tuple[list[ScannedFrame], int]:
    """Every whole, valid frame from the start of a ledger file, in order, and the byte length
    they cover. Scanning stops at the first torn or invalid frame (recovery cuts the file there).
    """
    with open(path, "rb") as f:
        data = memoryview(f.read())
    frames: list[ScannedFrame] = []
    offset = 0
    expected = 0
    while offset < len(data):
        try:
            ent, meta_bytes, payload, length = _parse(data[offset:], segment_id, expected,
                                                      str(path))
            meta = _meta(meta_bytes, str(path))
            batch = decode_payload(pa.py_buffer(payload))
        except (CorruptionError, pa.ArrowInvalid):
            break
        pts = batch.column("publish_time")
        frames.append(ScannedFrame(
            IndexRecord(ent, offset, length, batch.num_rows,
                        pts[0].as_py() if len(pts) else 0, pts[-1].as_py() if len(pts) else 0),
            meta,
        ))
        offset += length
        expected += 1
    return frames, offset


def first_good_replica(reads: Iterable[tuple[str, Callable[[], pa.Buffer]]]
                       ) -> tuple[pa.Buffer | None, list[str]]:
    """Try each replica's read of one frame in order; the first payload that reads and
    verifies, and what went wrong with those before it. The one replica fallback: the broker
    and the bookie-log reader both use it."""
    errors: list[str] = []
    for name, read in reads:
        try:
            return read(), errors
        except (CorruptionError, NotFoundError, OSError) as exc:
            errors.append(f"{name}: {exc}")
    return None, errors


def unreadable(entry_id: int, segment_id: int, topic: str, partition: int, errors: list[str]
               ) -> CorruptionError:
    return CorruptionError(f"entry {entry_id} of segment {segment_id} ({topic} partition "
                           f"{partition}) is unreadable on every replica: {'; '.join(errors)}")


def entry_range(records: Sequence[IndexRecord], first: int, end: Any, start_time: int | None,
                end_time: int | None) -> tuple[int, int]:
    """The slice ``[i, j)`` of an index that a read from entry ``first`` to position ``end``
    (exclusive; None: the whole ledger) within publish times ``[start_time, end_time)`` needs,
    found by binary search. The bookie-log reader and the bookie endpoint both use it."""
    last = len(records) if end is None else min(
        len(records), end.entry_id + (1 if end.batch_index else 0))
    if start_time is not None:  # first entry whose last publish time reaches the window
        first = max(first, entries_before(records, start_time))
    if end_time is not None:  # entries that start at or after the end are out
        last = min(last, entries_before(records, end_time, by="first"))
    return first, max(first, last)


def entries_before(records: Sequence[IndexRecord], t: int, *, by: str = "last") -> int:
    """How many leading entries of an index lie wholly before time ``t``: the index of the
    first entry whose last (``by="last"``) or first (``by="first"``) publish time is at or
    after ``t``. publish_time never decreases along a ledger, so this is a binary search;
    the broker's position-at-time and the bookie-log reader's time bounds both use it."""
    if by == "last":
        return bisect.bisect_left(records, t, key=lambda r: r.last_publish_time)
    return bisect.bisect_left(records, t, key=lambda r: r.first_publish_time)


@dataclass(frozen=True)
class RecoveredLedger:
    """What recovery found in one replica: the valid entries and the frames' metadata."""

    bookie_id: str
    records: list[IndexRecord]
    metas: list[dict[str, Any]]
    cut_bytes: int


def ledger_paths(bookie_dir: str | Path, segment_id: int) -> tuple[Path, Path]:
    """(log, index) paths of ``segment_id`` under a bookie directory."""
    base = Path(bookie_dir) / "ledgers" / f"{segment_id // 1000:06d}"
    return base / f"{segment_id}.log", base / f"{segment_id}.idx"


def write_ledger_files(bookie_dir: str | Path, segment_id: int,
                       frames: list[tuple[IndexRecord, bytes]]) -> None:
    """Replace a ledger's files in ``bookie_dir`` with exactly ``frames`` (raw frame bytes,
    each record's entry id and stats; their offsets are where they land), fsync'd, each
    file replaced whole (write to a temporary file, then rename)."""
    log_path, idx_path = ledger_paths(bookie_dir, segment_id)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_log, tmp_idx = log_path.with_suffix(".log.tmp"), idx_path.with_suffix(".idx.tmp")
    offset = 0
    with open(tmp_log, "wb") as log, open(tmp_idx, "wb") as idx:
        for rec, raw in frames:
            log.write(raw)
            idx.write(IndexRecord(rec.entry_id, offset, len(raw), rec.messages,
                                  rec.first_publish_time, rec.last_publish_time).pack())
            offset += len(raw)
        for f in (log, idx):
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp_log, log_path)
    os.replace(tmp_idx, idx_path)
    fsync_dir(log_path.parent)
