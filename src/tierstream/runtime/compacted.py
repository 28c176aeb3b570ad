"""A compacted read: each partition's snapshot (the latest message of each key up to its
horizon), then the log after the horizon, folded per key — the log's versions win
(``model/compacted_view.py``). A partition without a snapshot is folded from its start. With
an end before the latest position the snapshot may hold versions from after it, so such a
read folds the log up to the end instead (and says so in the log)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from tierstream.errors import ConfigError
from tierstream.model.compacted_view import fold_latest
from tierstream.model.message_format import MESSAGE_SCHEMA, READ_SCHEMA, with_topic
from tierstream.model.positions import Offset, OffsetKind
from tierstream.read_options import ReadOptions
from tierstream.readers.snapshot import read_snapshot
from tierstream.splits.split import as_bound

__all__ = ["compacted_batches"]

log = logging.getLogger(__name__)


def compacted_batches(topic: Any, scan: Callable[..., Iterator[pa.RecordBatch]],
                      **kwargs: Any) -> Iterator[pa.RecordBatch]:
    """The compacted view of ``topic`` (READ_SCHEMA batches); ``scan`` reads the log with
    the remaining arguments of ``tierstream.scan``."""
    if kwargs.get("start") not in (None, "earliest"):
        raise ConfigError(f"invalid start {kwargs['start']!r} for a compacted read: it reads "
                          "each key's latest value, from the beginning")
    kwargs.pop("start", None)
    if kwargs.get("options") is not None:
        raise ConfigError("a compacted read takes arguments, not options")
    plain = {k: kwargs[k] for k in ("data_dir", "broker", "auth_token", "partitions")
             if kwargs.get(k) is not None}
    read = ReadOptions.from_kwargs(topic, **plain)
    if len(read.topics) != 1:
        raise ConfigError(f"a compacted read takes one topic, not {len(read.topics)}")
    name = read.topics[0]
    end = as_bound(kwargs.get("end", "latest"), "end")
    latest = isinstance(end, Offset) and end.kind is OffsetKind.LATEST
    with read.enumerator() as enum:
        enum.metadata.get_topic(name)  # an unknown topic fails here, named
        if not latest:
            log.info("compacted read of %s up to %s: its snapshots may hold later versions, "
                     "so the log up to there is folded instead", name, end)
        cut, snapshots = enum.compacted_start(name, read.partitions) if latest else (None, {})
        location = enum.tier
    tables = [read_snapshot(s.url, location).select(MESSAGE_SCHEMA.names).cast(MESSAGE_SCHEMA)
              for _, s in sorted(snapshots.items()) if s.url is not None]
    start = cut if cut is not None else "earliest"
    for batch in scan(name, start=start, **kwargs):
        tables.append(pa.Table.from_batches([batch]).drop_columns(["topic"]))
    if not tables:
        return
    folded = fold_latest(pa.concat_tables(tables))
    for batch in folded.combine_chunks().to_batches():
        yield with_topic(batch, name).cast(READ_SCHEMA)
