"""What a dispatcher has read of one partition and not yet seen acknowledged, message by message.

The window starts at the cursor's mark-delete position and grows as the dispatcher reads. Each
read batch (a contiguous slice of one entry) is a :class:`Chunk` with one state per message:
waiting to be sent, delivered to a consumer, delayed by a nack, acknowledged, or on its way to
the dead-letter topic. Leading chunks whose every message is acknowledged are dropped, which is
what moves the mark-delete position. Acknowledged ranges that lie beyond what was read (from the
stored cursor, or an ack that arrives after a broker restart for a message not read again yet)
wait in :attr:`ReadWindow.ahead` and mark messages acknowledged as they are read.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from tierstream.broker.subscriptions.cursor_state import MAX_ACKED_RANGES, AckedEntry
from tierstream.model.message_format import CONSUMER_SCHEMA
from tierstream.model.positions import Position, in_position_order

__all__ = ["ACKED", "COMPACTED_OUT", "DEAD", "DELAYED", "DELIVERED", "WAITING", "Chunk",
           "ReadWindow", "following", "span"]

WAITING, DELIVERED, DELAYED, ACKED, DEAD = 0, 1, 2, 3, 4
#: the key hash of a placeholder in a compacted read's chunk: a message compaction left out
#: between two it kept of one entry (``compacted_source.py``), held acknowledged
COMPACTED_OUT = -1
_NOTHING = np.zeros(0, dtype=np.int32)
_REDELIVERIES = CONSUMER_SCHEMA.field("redelivery_count")


def span(rows: np.ndarray) -> slice | np.ndarray:
    """``rows`` (ascending, each once) as a slice when they are one run, as a consumer's
    messages and acks mostly are: numpy indexes with a slice through a view, where an array
    of rows costs a gather or a scatter per use (a tenth of an exclusive receive + ack)."""
    n = len(rows)
    if n and int(rows[-1]) - int(rows[0]) + 1 == n:
        return slice(int(rows[0]), int(rows[0]) + n)
    return rows


def _with_counts(batch: pa.RecordBatch, counts: np.ndarray) -> pa.RecordBatch:
    """``batch`` with its messages' redelivery counts: the consumer's schema."""
    # one column added (from_arrays, which checks every column against the schema, took a
    # sixth of the Pulsar consume path's GIL time: bench --flame)
    out = batch.append_column(_REDELIVERIES, pa.array(counts, pa.int32()))
    return out if out.schema.equals(CONSUMER_SCHEMA, check_metadata=True) else \
        pa.RecordBatch.from_arrays(out.columns, schema=CONSUMER_SCHEMA)


def _consecutive(at: np.ndarray) -> bool:
    """Whether ``at`` counts up by one from its first value."""
    return len(at) > 0 and bool((np.diff(at) == 1).all())


class Chunk:
    """One read batch and the state of each of its messages."""

    __slots__ = ("batch", "bi0", "entry_id", "grouped", "grouped_at", "grouped_by", "groups",
                 "n", "open", "owner", "partition", "queued", "redeliveries", "resent",
                 "segment_id", "sent", "slots", "state", "until", "waiting")

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch: pa.RecordBatch | None = batch
        self.n = batch.num_rows
        self.partition = int(batch.column("partition")[0].as_py())
        self.segment_id = int(batch.column("segment_id")[0].as_py())
        self.entry_id = int(batch.column("entry_id")[0].as_py())
        self.bi0 = int(batch.column("batch_index")[0].as_py())
        self.slots = batch.column("key_hash").to_numpy()
        self.state = np.zeros(self.n, dtype=np.uint8)
        self.owner = np.full(self.n, -1, dtype=np.int32)
        self.redeliveries = np.zeros(self.n, dtype=np.int32)
        self.until = np.zeros(self.n, dtype=np.float64)  # delivered at / ready at (monotonic)
        self.waiting = self.n  # messages in state WAITING
        self.open = self.n     # messages not ACKED
        self.queued = False    # in its dispatcher's list of chunks with waiting messages
        #: the batch as a consumer receives it while none of it was sent again (a redelivery
        #: count of 0 on each message; made at the first hand-out), and whether one was
        self.sent: pa.RecordBatch | None = None
        self.resent = False
        #: the batch's rows ordered by a key (:meth:`group`; None: in that order already, or
        #: not grouped), where each row lies in it, the rows of each key value, and what the
        #: key was grouped for (None: not grouped)
        self.grouped: pa.RecordBatch | None = None
        self.grouped_at = _NOTHING
        self.groups: dict[int, np.ndarray] = {}
        self.grouped_by: object = None

    @property
    def entry(self) -> tuple[int, int]:
        return self.segment_id, self.entry_id

    def position(self, row: int) -> Position:
        return Position.known(self.partition, self.segment_id, self.entry_id, self.bi0 + row)

    def after(self) -> Position:
        """The position right after this chunk's last message."""
        return Position.known(self.partition, self.segment_id, self.entry_id, self.bi0 + self.n)

    def count_before(self, end: Position) -> int:
        """How many of this chunk's messages lie before ``end`` (a position at or after its
        first)."""
        return self.n if self.after() <= end else max(0, end.batch_index - self.bi0)

    def group(self, key: np.ndarray, by: object) -> None:
        """Keep the batch's rows also ordered by ``key`` (one value per row, the order within
        a value kept), noting ``by``: rows of one key value taken in log order are then a
        slice of it. A key_shared chunk's messages go to 4 consumers in 8 or more deliveries;
        each a gather of ~130 scattered rows cost as much as one gather of the whole batch
        (~100 µs: pyarrow's take per column), the most of a key_shared message's dispatch."""
        assert self.batch is not None
        self.grouped_by = by
        if bool((key[1:] >= key[:-1]).all()):  # in order already: its runs are slices
            order = np.arange(self.n)
            self.grouped, self.grouped_at = None, _NOTHING
        else:
            order = np.argsort(key, kind="stable")
            self.grouped = self._as_sent().take(pa.array(order))
            self.grouped_at = np.empty(self.n, dtype=np.intp)
            self.grouped_at[order] = np.arange(self.n)
        values, starts = np.unique(key[order], return_index=True)
        bounds = [*starts.tolist(), self.n]
        self.groups = {v: order[bounds[i]:bounds[i + 1]] for i, v in enumerate(values.tolist())}

    def handed_out(self) -> None:
        """No message waits any more: the grouped copy goes (a redelivery's rows, scattered
        anyway, are gathered), so a window of delivered, unacknowledged entries holds each
        once. Which rows each key value has is kept."""
        self.grouped, self.grouped_at = None, _NOTHING

    def rows_of(self, value: int) -> np.ndarray:
        """The rows (ascending) whose key was ``value`` when the chunk was grouped."""
        return self.groups.get(value, _NOTHING)

    def _as_sent(self) -> pa.RecordBatch:
        """The whole batch as a consumer receives it, with a redelivery count of 0 each."""
        if self.sent is None:
            assert self.batch is not None
            self.sent = _with_counts(self.batch, np.zeros(self.n, dtype=np.int32))
        return self.sent

    def take(self, rows: np.ndarray, sel: slice | np.ndarray | None = None) -> pa.RecordBatch:
        """``rows`` as a consumer receives them: with their redelivery counts (``sel``:
        ``span(rows)``, if the caller has it). Until a message of the chunk is sent again,
        a run of rows in log order or in the grouped copy is a slice of a batch made once:
        each pyarrow or numpy step of a hand-out costs tens of µs in a broker sharing two
        cores with its consumers, so a hand-out of a key_shared share is one step, not ten."""
        sel = span(rows) if sel is None else sel
        if isinstance(sel, slice):
            whole = self._as_sent()
            batch = whole if len(rows) == self.n else whole.slice(sel.start, len(rows))
        elif self.grouped is not None and _consecutive(at := self.grouped_at[rows]):
            batch = self.grouped.slice(int(at[0]), len(rows))
        else:
            batch = self._as_sent().take(pa.array(rows))
        if not self.resent:
            return batch
        return batch.set_column(batch.num_columns - 1, _REDELIVERIES,
                                pa.array(self.redeliveries[sel], pa.int32()))

    def count_redelivery(self, rows: np.ndarray) -> None:
        """``rows`` are sent again: one more redelivery each."""
        self.redeliveries[rows] += 1
        self.resent = True

    def hand_out(self, sel: slice | np.ndarray, n: int) -> None:
        """The ``n`` waiting messages at ``sel`` are delivered (:meth:`set_state` for rows
        known to wait, as every dispatch rule's are: one step, not six)."""
        self.state[sel] = DELIVERED
        self.waiting -= n

    def settle(self, sel: slice | np.ndarray, n: int) -> None:
        """The ``n`` delivered messages at ``sel`` are acknowledged (:meth:`set_state` for
        rows known to be delivered, as an ack's mostly are)."""
        self.state[sel] = ACKED
        self.open -= n
        if self.open == 0:
            self.release()

    def set_state(self, rows: np.ndarray, state: int) -> None:
        """Move ``rows`` (ascending, each once) to ``state`` and keep the counts."""
        sel = span(rows)
        old = self.state[sel]
        self.waiting += (len(rows) if state == WAITING else 0) - \
            int(np.count_nonzero(old == WAITING))
        self.open += int(np.count_nonzero(old == ACKED)) - (len(rows) if state == ACKED else 0)
        self.state[sel] = state
        if self.open == 0:
            self.release()

    def release(self) -> None:
        """Every message is acknowledged: keep only where the chunk lies (a window behind one
        slow message may hold many of these)."""
        self.batch = self.grouped = self.sent = None
        self.slots = self.state = self.owner = self.redeliveries = self.until = _NOTHING
        self.grouped_at, self.groups = _NOTHING, {}


class ReadWindow:
    """The chunks of one partition from the mark-delete position to the read position."""

    def __init__(self, partition: int, mark_delete: Position,
                 acked: list[tuple[Position, Position]], *, compacted: bool = False) -> None:
        self.partition = partition
        self.compacted = compacted  # chunks may hold COMPACTED_OUT placeholders
        self.chunks: deque[Chunk] = deque()
        #: the chunks of each entry: one as a rule, a compacted read's snapshot entry too (with
        #: placeholders for what compaction left out); a list, which assumes nothing
        self.by_entry: dict[tuple[int, int], list[Chunk]] = {}
        self.read_pos = mark_delete          # the next position to read
        self.ahead: list[tuple[Position, Position]] = sorted(acked)  # acked, not read yet

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self.chunks)

    def add(self, batch: pa.RecordBatch) -> Chunk | None:
        """Take a batch read at :attr:`read_pos`; the chunk, or None when every message of it
        was acknowledged already."""
        chunk = Chunk(batch)
        self.read_pos = chunk.after()
        acked = self._acked_ahead(chunk)
        if self.compacted:
            out = chunk.slots == COMPACTED_OUT
            if out.any():
                acked = out if acked is None else acked | out
        if acked is not None:
            chunk.set_state(np.flatnonzero(acked), ACKED)
            if chunk.open == 0 and not self.chunks:
                return None  # nothing before it is open: the mark-delete passes it
            # a released chunk behind open ones is kept: the acked ranges run through it
        self.chunks.append(chunk)
        self.by_entry.setdefault(chunk.entry, []).append(chunk)
        return chunk if chunk.open else None

    def _acked_ahead(self, chunk: Chunk) -> np.ndarray | None:
        """Which messages of ``chunk`` an ``ahead`` range covers (None: none), dropping the
        ranges it passes."""
        first, after = chunk.position(0), chunk.after()
        while self.ahead and self.ahead[0][1] <= first:
            self.ahead.pop(0)
        if not self.ahead or self.ahead[0][0] >= after:
            return None
        mask = np.zeros(chunk.n, dtype=bool)
        for lo, hi in self.ahead:
            if lo >= after:
                break
            a = 0 if lo <= first else lo.batch_index - chunk.bi0
            b = chunk.n if hi >= after else hi.batch_index - chunk.bi0
            mask[max(0, a):max(0, b)] = True
        return mask

    def ack_ahead(self, lo: Position, hi: Position) -> None:
        """Acknowledge ``[lo, hi)`` beyond the read position (merged into :attr:`ahead`)."""
        lo = max(lo, self.read_pos)
        if hi <= lo:
            return
        i = bisect.bisect_left(self.ahead, (lo, lo))
        self.ahead.insert(i, (lo, hi))
        merged: list[tuple[Position, Position]] = []
        for a, b in self.ahead:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.ahead = merged

    def locate(self, segment: np.ndarray, entry: np.ndarray, index: np.ndarray
               ) -> tuple[list[tuple[Chunk, np.ndarray]], list[Position]]:
        """The chunks and rows (ascending, each once) of the given message positions, and the
        positions not in the window (acknowledged before it, or not read yet)."""
        found: list[tuple[Chunk, np.ndarray]] = []
        missing: list[Position] = []
        if len(segment) == 0:
            return found, missing
        # by entry: a client's acks come in log order (then no sort at all); np.unique over
        # (segment, entry) pairs, and a pass over all positions per entry, were a third of
        # the broker's CPU on the consume path
        if not in_position_order(segment, entry, index):
            order = np.lexsort((index, entry, segment))
            segment, entry, index = segment[order], entry[order], index[order]
        new_entry = (np.diff(segment) != 0) | (np.diff(entry) != 0)
        repeated = ~new_entry & (np.diff(index) == 0)
        if repeated.any():  # a message named twice: once is enough
            keep = np.concatenate(([True], ~repeated))
            segment, entry, index, new_entry = (segment[keep], entry[keep], index[keep],
                                                new_entry[keep[1:]])
        cuts = (np.flatnonzero(new_entry) + 1).tolist()
        for a, z in zip([0, *cuts], [*cuts, len(segment)], strict=True):
            s, e, rows = int(segment[a]), int(entry[a]), index[a:z]
            for chunk in self.by_entry.get((s, e), ()):
                inside = (rows >= chunk.bi0) & (rows < chunk.bi0 + chunk.n)
                if chunk.open and inside.any():  # (one all acknowledged: nothing to do)
                    found.append((chunk, rows[inside] - chunk.bi0))
                rows = rows[~inside]
            missing.extend(Position(self.partition, s, e, int(b)) for b in rows.tolist())
        return found, missing

    def chunk_of(self, position: Position) -> tuple[Chunk, int] | None:
        """The chunk holding ``position`` and its row there (None: not in the window)."""
        for chunk in self.by_entry.get((position.segment_id, position.entry_id), ()):
            row = position.batch_index - chunk.bi0
            if 0 <= row < chunk.n:
                return chunk, row
        return None

    def trim(self) -> None:
        """Drop leading chunks whose every message is acknowledged."""
        while self.chunks and self.chunks[0].open == 0:
            chunk = self.chunks.popleft()
            of_entry = self.by_entry[chunk.entry]
            of_entry.remove(chunk)
            if not of_entry:
                del self.by_entry[chunk.entry]

    def mark_delete(self) -> Position:
        """Everything before this position is acknowledged."""
        for chunk in self.chunks:
            if chunk.open:
                return chunk.position(int(np.flatnonzero(chunk.state != ACKED)[0]))
        if self.ahead and self.ahead[0][0] <= self.read_pos:
            return self.ahead[0][1]
        return self.read_pos

    def acked_state(self) -> tuple[list[tuple[Position, Position]], list[AckedEntry]]:
        """What is acknowledged after :meth:`mark_delete`, compactly: ranges over runs of fully
        acknowledged chunks (and the ranges acknowledged ahead of the read position), and a
        bitmap per partly acknowledged chunk, together at most ``MAX_ACKED_RANGES + 1`` items.

        Key_Shared consumers acknowledge interleaved messages, which leaves a hole every few
        messages: as ranges, a snapshot would make thousands of positions per chunk, which is
        what made group commits the bottleneck; a chunk's bitmap is one item of ``n / 8`` bytes.
        """
        ranges: list[tuple[Position, Position]] = []
        entries: list[AckedEntry] = []
        start: Position | None = None  # the open run of fully acknowledged chunks
        seen_open = False
        for chunk in self.chunks:
            if chunk.open == 0:
                if seen_open and start is None:
                    start = chunk.position(0)
                continue
            if start is not None:
                ranges.append((start, chunk.position(0)))
                start = None
            seen_open = True
            if chunk.open < chunk.n:
                entries.append((chunk.segment_id, chunk.entry_id, chunk.bi0, chunk.n,
                                np.packbits(chunk.state == ACKED).tobytes()))
            if len(ranges) + len(entries) > MAX_ACKED_RANGES:
                return ranges, entries
        if start is not None:
            ranges.append((start, self.read_pos))
        if seen_open:
            for lo, hi in self.ahead:
                if ranges and ranges[-1][1] >= lo:
                    ranges[-1] = (ranges[-1][0], max(hi, ranges[-1][1]))
                else:
                    ranges.append((lo, hi))
        else:
            ranges = [r for r in self.ahead if r[0] > self.mark_delete()]
        return ranges, entries

    def unacknowledged(self) -> int:
        return sum(c.open for c in self.chunks)


def following(pos: Position) -> Position:
    """The position right after ``pos`` in its entry."""
    return Position.known(pos.partition, pos.segment_id, pos.entry_id, pos.batch_index + 1)
