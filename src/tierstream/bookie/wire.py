"""What a bookie endpoint and the broker's client of it (``managed_ledger/bookies/remote.py``)
say to each other: the schemas of the append stream, its answers and a ledger's frames, and
how a recovered ledger travels (``bookie/writes.py`` says what each call does).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from tierstream.bookie.ledger import IndexRecord, RecoveredLedger

__all__ = ["ACK_SCHEMA", "APPEND_SCHEMA", "FRAME_SCHEMA", "RECORD_FIELDS", "recovered_from",
           "recovered_to"]

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
