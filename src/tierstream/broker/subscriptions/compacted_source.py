"""What a subscription that reads compacted (Pulsar's ``readCompacted``: a reader, or an
Exclusive or Failover consumer) is read from: the partition's compaction snapshot for what
lies before its horizon, then the log (``broker/topics/compaction.py`` writes the snapshot).

The snapshot's rows keep their positions, so the dispatcher's window takes them as it takes
the log's: an entry's messages kept, one chunk per entry, with the ones compaction left out
between them as placeholders the window holds acknowledged (``_runs``); the messages left
out between entries fall between the chunks, and the mark-delete position moves over them
as over acknowledged ones."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tierstream.broker.subscriptions.read_window import COMPACTED_OUT
from tierstream.metadata.compactions import compactions_of
from tierstream.model.message_format import MESSAGE_SCHEMA
from tierstream.model.positions import Position

if TYPE_CHECKING:
    from tierstream.managed_ledger.partition_log import PartitionLog
    from tierstream.metadata.store import MetadataStore
    from tierstream.tier.storage import TierStorage

__all__ = ["Reads", "compacted_reads", "last_compacted"]

#: a dispatcher's reads: the batches from a position on, following the log until cancelled
Reads = Callable[[Position, Callable[[], bool]], Iterator[pa.RecordBatch]]


def compacted_reads(plog: PartitionLog, metadata: MetadataStore, tier: TierStorage) -> Reads:
    """The reads of a compacted subscription of ``plog``'s partition."""

    def read(start: Position, cancelled: Callable[[], bool]) -> Iterator[pa.RecordBatch]:
        snap = compactions_of(metadata, plog.topic).get(plog.partition)
        if snap is not None and start < snap.horizon:
            if snap.url is not None:
                yield from _runs(_from(_snapshot(tier, snap.url), start))
            start = snap.horizon
        yield from plog.read(start, end=None, follow=True, cancelled=cancelled)

    return read


def last_compacted(plog: PartitionLog, metadata: MetadataStore, tier: TierStorage
                   ) -> Position | None:
    """The last message a compacted read of the partition delivers (None: none): the log's
    last, unless the snapshot covers it, then the snapshot's last (the log's last may be a
    message compaction left out, which such a read never receives)."""
    last = plog.last_confirmed()[0]
    snap = compactions_of(metadata, plog.topic).get(plog.partition)
    if snap is None or (last is not None and last >= snap.horizon):
        return last
    if snap.url is None:
        return None
    rows = _snapshot(tier, snap.url)
    if rows.num_rows == 0:
        return None
    at = rows.num_rows - 1
    return Position(plog.partition, int(rows.column("segment_id")[at].as_py()),
                    int(rows.column("entry_id")[at].as_py()),
                    int(rows.column("batch_index")[at].as_py()))


@functools.lru_cache(maxsize=64)
def _snapshot(tier: TierStorage, url: str) -> pa.Table:
    """A snapshot's rows (in position order, as written). A file is never rewritten: a run
    writes a new one, so a cached copy is never stale."""
    rows = pq.read_table(tier.path(url), filesystem=tier.filesystem())
    return rows.select(MESSAGE_SCHEMA.names).cast(MESSAGE_SCHEMA)


def _from(rows: pa.Table, start: Position) -> pa.Table:
    seg = rows.column("segment_id").to_numpy()
    ent = rows.column("entry_id").to_numpy()
    idx = rows.column("batch_index").to_numpy()
    s, e, i = start.segment_id, start.entry_id, start.batch_index
    keep = (seg > s) | ((seg == s) & ((ent > e) | ((ent == e) & (idx >= i))))
    return rows.filter(pa.array(keep))


def _runs(rows: pa.Table) -> Iterator[pa.RecordBatch]:
    """``rows`` as one batch per entry, of consecutive batch indexes from the entry's first
    row kept to its last: the messages compaction left out between them are there as
    placeholders whose key hash is :data:`COMPACTED_OUT` (Pulsar's ``compacted_out``), which
    the read window takes as acknowledged. One chunk per entry is what a Pulsar client needs:
    it drops a second frame of an entry it has acknowledged a message of."""
    if rows.num_rows == 0:
        return
    seg = rows.column("segment_id").to_numpy()
    ent = rows.column("entry_id").to_numpy()
    idx = rows.column("batch_index").to_numpy()
    cuts = (np.flatnonzero((seg[1:] != seg[:-1]) | (ent[1:] != ent[:-1])) + 1).tolist()
    table = rows.combine_chunks()
    for a, b in zip([0, *cuts], [*cuts, rows.num_rows], strict=True):
        lo, hi = int(idx[a]), int(idx[b - 1])
        if hi - lo + 1 == b - a:
            yield from table.slice(a, b - a).to_batches()
            continue
        take = np.full(hi - lo + 1, a, dtype=np.int64)
        take[idx[a:b] - lo] = np.arange(a, b)
        kept = np.zeros(hi - lo + 1, dtype=bool)
        kept[idx[a:b] - lo] = True
        full = table.take(pa.array(take)).combine_chunks()
        full = full.set_column(full.schema.get_field_index("batch_index"),
                               full.schema.field("batch_index"),
                               pa.array(np.arange(lo, hi + 1), type=pa.int32()))
        hashes = np.where(kept, full.column("key_hash").to_numpy(), COMPACTED_OUT)
        full = full.set_column(full.schema.get_field_index("key_hash"),
                               full.schema.field("key_hash"),
                               pa.array(hashes, type=pa.int32()))
        yield from full.to_batches()
