"""The bookie-log reader: a closed segment straight from the ledger files, not the broker.

It binary-searches the entry index for the split's time bounds, verifies every frame's
checksum and ids, reads another replica when one fails, and trims only the entries at the
split's edges. If the ledger is gone on every replica (the segment moved to the tier and its
bookie copy was deleted after planning), it reads the same bounds through the broker, which
serves the segment from wherever it is now.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pyarrow as pa

from tierstream.errors import NotFoundError
from tierstream.readers.trim import trim
from tierstream.schema import with_topic
from tierstream.splits.split import Split
from tierstream.store.bookie import ledger_paths
from tierstream.store.ledger import (
    IndexRecord,
    decode_payload,
    entries_before,
    first_good_replica,
    read_frame,
    read_index,
    unreadable,
)

__all__ = ["read_bookie_split"]


def _index(split: Split) -> list[IndexRecord] | None:
    for d in split.bookie_dirs:
        _, idx = ledger_paths(d, split.segment_id)
        try:
            return read_index(idx)
        except FileNotFoundError:
            continue
    return None


def read_bookie_split(split: Split, *, auth_token: str | None = None
                      ) -> Iterator[pa.RecordBatch]:
    records = _index(split)
    if records is None:
        if split.broker is None:
            raise NotFoundError(f"segment {split.segment_id} of {split.topic!r} partition "
                                f"{split.partition} is on no bookie and no broker was given")
        from tierstream.readers.tail import read_tail_split

        yield from read_tail_split(split, auth_token=auth_token)
        return
    first = split.start.entry_id
    last = len(records) if split.end is None else min(
        len(records), split.end.entry_id + (1 if split.end.batch_index else 0))
    if split.start_time is not None:  # first entry whose last publish time reaches the window
        first = max(first, entries_before(records, split.start_time))
    if split.end_time is not None:  # entries that start at or after the end are out
        last = min(last, entries_before(records, split.end_time, by="first"))
    fds: dict[str, int] = {}
    try:
        for rec in records[first:last]:
            batch = _read_entry(split, rec, fds)
            edge = rec.entry_id in (split.start.entry_id,
                                    None if split.end is None else split.end.entry_id)
            in_time = (split.start_time is None or rec.first_publish_time >= split.start_time) \
                and (split.end_time is None or rec.last_publish_time < split.end_time)
            out = trim(batch, split, check_positions=edge, check_time=not in_time)
            if out.num_rows:
                yield with_topic(out, split.topic)
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_entry(split: Split, rec: IndexRecord, fds: dict[str, int]) -> pa.RecordBatch:
    def read(d: str) -> Callable[[], pa.Buffer]:
        def frame() -> pa.Buffer:
            fd = fds.get(d)
            if fd is None:
                log_path, _ = ledger_paths(d, split.segment_id)
                fd = fds[d] = os.open(log_path, os.O_RDONLY)
            return read_frame(fd, split.segment_id, rec, d)
        return frame

    payload, errors = first_good_replica((d, read(d)) for d in split.bookie_dirs)
    if payload is None:
        raise unreadable(rec.entry_id, split.segment_id, split.topic, split.partition, errors)
    return decode_payload(payload)
