"""What a bookie endpoint and the broker's client of it (``managed_ledger/bookies/remote.py``)
say to each other: the schemas of the append stream, its answers and a ledger's frames, and
how a recovered ledger travels (``bookie/writes.py`` says what each call does).
"""

from __future__ import annotations

from array import array
from typing import Any

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord, RecoveredLedger

__all__ = ["ACK_SCHEMA", "APPEND_SCHEMA", "FRAME_SCHEMA", "RECORD_FIELDS", "append_batch",
           "not_this_bookie", "recovered_from", "recovered_to"]

APPEND_SCHEMA = pa.schema([
    pa.field("segment_id", pa.int64(), nullable=False),
    pa.field("entry_id", pa.int64(), nullable=False),
    pa.field("meta", pa.binary(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),
    pa.field("messages", pa.int64(), nullable=False),
    pa.field("first_publish_time", pa.int64(), nullable=False),
    pa.field("last_publish_time", pa.int64(), nullable=False),
])

ACK_SCHEMA = pa.schema([
    pa.field("segment_id", pa.int64(), nullable=False),
    pa.field("entry_id", pa.int64(), nullable=False),
    pa.field("frame_offset", pa.int64(), nullable=False),
    pa.field("frame_len", pa.int64(), nullable=False),
    pa.field("messages", pa.int64(), nullable=False),
    pa.field("first_publish_time", pa.int64(), nullable=False),
    pa.field("last_publish_time", pa.int64(), nullable=False),
    pa.field("error", pa.string(), nullable=True),  # tagged as protocol.error_text
])

FRAME_SCHEMA = pa.schema([
    pa.field("entry_id", pa.int64(), nullable=False),
    pa.field("messages", pa.int64(), nullable=False),
    pa.field("first_publish_time", pa.int64(), nullable=False),
    pa.field("last_publish_time", pa.int64(), nullable=False),
    pa.field("frame", pa.binary(), nullable=False),
])

RECORD_FIELDS = ("entry_id", "frame_offset", "frame_len", "messages", "first_publish_time",
                  "last_publish_time")


def recovered_to(found: RecoveredLedger) -> dict[str, Any]:
    return {"bookie": found.bookie_id, "cut_bytes": found.cut_bytes, "metas": found.metas,
            "records": [[getattr(r, f) for f in RECORD_FIELDS] for r in found.records]}


def recovered_from(body: dict[str, Any], bookie_id: str) -> RecoveredLedger:
    return RecoveredLedger(bookie_id, [IndexRecord(*map(int, r)) for r in body["records"]],
                           list(body["metas"]), int(body["cut_bytes"]))


def append_batch(rows: list[list[Any]]) -> pa.RecordBatch:
    """Queued appends as one :data:`APPEND_SCHEMA` batch (the payloads copied once, into one
    buffer)."""
    columns = list(zip(*rows, strict=True))
    payloads = columns[3]
    offsets = array("i", [0])
    for p in payloads:
        offsets.append(offsets[-1] + p.size)
    data = pa.py_buffer(b"".join(memoryview(p) for p in payloads))
    arrays = [pa.array(col, type=f.type) if i != 3 else pa.Array.from_buffers(
        pa.binary(), len(rows), [None, pa.py_buffer(offsets), data])
        for i, (col, f) in enumerate(zip(columns, APPEND_SCHEMA, strict=True))]
    return pa.RecordBatch.from_arrays(arrays, schema=APPEND_SCHEMA)


def not_this_bookie(answer: dict[str, Any], bookie_id: str, address: str) -> str | None:
    """Why a ping's ``answer`` (``{"bookie", "writable", "instance"}``) at ``address`` is not
    bookie ``bookie_id`` taking writes, or None."""
    if answer.get("bookie") != bookie_id:
        return f"the endpoint at {address} is bookie {answer.get('bookie')}, not {bookie_id}"
    if not answer.get("writable"):
        return f"the endpoint at {address} serves bookie {bookie_id} read-only: it takes no " \
            "writes"
    return None
