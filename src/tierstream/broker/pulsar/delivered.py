"""What one Pulsar consumer was sent and has not acknowledged, and the frames that send it.

A message keeps the id its send receipt gave (``pulsar_protocol/message_ids.py``) when its
entry goes out as the batch it was stored as, and the client numbers the batch's messages
itself. That takes a batch the consumer can acknowledge as a whole, since a client without
batch-index acks (the default) acknowledges a batch only once every message of it is:

- the first messages of an entry (indexes 0..k-1: a whole entry, as the dispatcher hands a
  Pulsar consumer whole entries, or what is left of one at its start) go out as a batch of k,
  or alone as the receipt's ``(segment, entry, -1)`` for an entry of one message that was not
  sent in a batch;
- a reader also gets other parts of an entry as a batch, the messages it is not given masked
  out by the MESSAGE's ``ack_set`` (it acknowledges cumulatively, if at all);
- anything else (a Key_Shared entry whose keys belong to several consumers, what is left of an
  entry after part of it was acknowledged, an entry compaction thinned) goes out as a
  **pack**: the consumer's messages of the entry as a batch of their own, under an id of the
  broker's own that this consumer's record maps back (batch index j of the pack is the j-th
  message it was given) — for a consumer that may acknowledge cumulatively (Exclusive,
  Failover), under the entry's own id while it holds no other part of the entry; a message
  that cannot share a batch (its redelivery count differs, it is large, it is the only one)
  goes out alone, with an id of its own.

An acknowledgement of a batch or a pack (with or without an ``ack_set``) is then read against
what this consumer was sent of that entry, never more.
"""

from __future__ import annotations

import threading
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa

from tierstream.model.positions import Position
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import MAX_MESSAGE_SIZE, serialized_payload_frame
from tierstream.pulsar_protocol.message_ids import (
    ack_words,
    acked_indexes,
    cumulative_end,
    is_own,
    pack_entry_id,
    position_of,
    positions_of,
    wire_entry_ids,
)
from tierstream.pulsar_protocol.messages import (
    BATCH_PROPERTIES,
    BATCHED,
    batch_of,
    chunks_of,
    metadata_of,
    plain_batch,
)

__all__ = ["Delivered"]

_Cmd = api.BaseCommand
_Entry = tuple[int, int]  # segment, entry


class Delivered:
    """One consumer's messages on their way and unacknowledged, and how each entry went."""

    def __init__(self, consumer_id: int, partition: int, wire_partition: int, *,
                 reader: bool, cumulative: bool = False) -> None:
        self.consumer_id, self.partition, self.reader = consumer_id, partition, reader
        #: its client may acknowledge cumulatively (Exclusive, Failover): a pack goes out
        #: under its entry's own id where it can (see _pack_frames)
        self.cumulative = cumulative
        self.wire_partition = wire_partition  # -1 for a topic of one partition, as Pulsar's
        self.lock = threading.Lock()
        #: what it holds unacknowledged: per entry, the batch indexes as the set bits of an
        #: int (bit i: index i), so that a batch of a thousand messages is one number to
        #: record, look up and clear, not a thousand
        self.unacked: dict[_Entry, int] = {}
        #: entries that went out as a batch (or as a receipt's lone message): their size
        self.batches: dict[_Entry, int] = {}
        #: packs on their way: (segment, the pack's entryId) -> the entry, the batch index in
        #: the log of each of the pack's messages, in order, and those indexes as bits
        self.packs: dict[_Entry, tuple[int, list[int], int]] = {}
        self._packs_of: dict[_Entry, set[int]] = {}  # (segment, entry) -> pack ids

    # -- sending ------------------------------------------------------------------------------

    def frames(self, batch: pa.RecordBatch) -> list[bytes]:
        """The MESSAGE frames of a batch from the dispatcher, entry by entry in its order."""
        cols = _Columns(batch)
        segments = batch.column("segment_id").to_numpy(zero_copy_only=False)
        entries = batch.column("entry_id").to_numpy(zero_copy_only=False)
        indexes = batch.column("batch_index").to_numpy(zero_copy_only=False)
        cuts = np.flatnonzero((segments[1:] != segments[:-1]) | (entries[1:] != entries[:-1]))
        bounds = [0, *(cuts + 1).tolist(), len(entries)]
        plain = _Plain.of(batch)
        out: list[bytes] = []
        alone: list[int] = []  # rows that go out with ids of their own, in order
        with self.lock:
            for a, b in pairwise(bounds):
                frames = None if plain is None else self._plain_frames(
                    plain, int(segments[a]), int(entries[a]), indexes, a, b)
                if frames is None:
                    frames = self._batch_frames(cols, int(entries[a]),
                                                indexes[a:b].tolist(), a, b)
                if frames is None:
                    alone.extend(range(a, b))
                    continue
                if alone:
                    out += self._alone(cols, entries, indexes, alone)
                    alone = []
                out += frames
            if alone:
                out += self._alone(cols, entries, indexes, alone)
        return out

    def _message(self, segment: int, entry: int, redelivery_count: int) -> api.BaseCommand:
        """A MESSAGE to this consumer under the id (``segment``, ``entry``)."""
        return _Cmd(type=_Cmd.MESSAGE, message=api.CommandMessage(
            consumer_id=self.consumer_id, redelivery_count=redelivery_count,
            message_id=api.MessageIdData(ledgerId=segment, entryId=entry,
                                         partition=self.wire_partition)))

    def _plain_frames(self, plain: _Plain, segment: int, entry: int, indexes: np.ndarray,
                      a: int, b: int) -> list[bytes] | None:
        """:meth:`_batch_frames` of a whole entry of messages without keys, event times or
        properties, of one size and one redelivery count (most entries), made from the
        batch's columns with no step per message; None where it is not such an entry."""
        n = b - a
        if n < 2 or indexes[a] != 0 or indexes[b - 1] != n - 1 \
                or (segment, entry) in self._packs_of:
            return None
        counts = plain.redeliveries[a:b]
        if (counts != counts[0]).any() or \
                plain.offsets[b] - plain.offsets[a] > MAX_MESSAGE_SIZE // 2:
            return None
        made = plain_batch(plain.values.slice(a, n), int(plain.publish_times[a]))
        if made is None:
            return None
        command = self._message(segment, entry, int(counts[0]))
        self.batches[(segment, entry)] = n
        self._hold((segment, entry), (1 << n) - 1)
        return _message_frames(command, *made)

    def _batch_frames(self, cols: _Columns, entry: int, idx: list[int], a: int,
                      b: int) -> list[bytes] | None:
        """The frame of one entry's rows ``a:b`` as a batch, or a receipt's lone message's
        frame (its chunks' frames, if it is larger than a frame may be); None where they go
        out one by one."""
        segment, count = cols["segment_id"][a], cols["redelivery_count"][a]
        if cols["redelivery_count"][a:b].count(count) != b - a:
            return None  # one frame has one redelivery count
        first = idx[0] == 0 and idx[-1] == b - a - 1
        if not self.reader and (not first or (segment, entry) in self._packs_of):
            return self._pack_frames(cols, entry, idx, a, b)
        command = self._message(segment, entry, count)
        props = cols["properties"]
        if first and b - a == 1 and (BATCHED, "true") not in (props[a] or ()):
            meta = metadata_of(cols["key"][a], cols["publish_time"][a], cols["event_time"][a],
                               props[a])
            payload = cols["value"][a]
            size = 1
        else:
            size = idx[-1] + 1
            if sum(map(len, cols["value"][a:b])) > MAX_MESSAGE_SIZE // 2:
                return None  # large messages go one by one (in chunks where they must)
            if first:  # the whole entry in order: its rows as they are
                keys, values, events, properties = (cols["key"][a:b], cols["value"][a:b],
                                                    cols["event_time"][a:b], props[a:b])
            else:
                keys = [None] * size
                values = [b""] * size
                events = [None] * size
                shared = [p for p in props[a] or () if p[0] in BATCH_PROPERTIES]
                properties = [shared] * size  # what it is not given: empty messages
                for row, i in enumerate(idx, start=a):
                    keys[i], values[i], events[i] = (cols["key"][row], cols["value"][row],
                                                     cols["event_time"][row])
                    properties[i] = props[row]
            made = batch_of(keys, values, events, properties, cols["publish_time"][a])
            if made is None:
                return None
            meta, payload = made
            if not first:
                command.message.ack_set.extend(ack_words(idx))
        self.batches[(segment, entry)] = size
        self._hold((segment, entry), _mask_of(idx))
        return _message_frames(command, meta, payload)

    def _pack_frames(self, cols: _Columns, entry: int, idx: list[int], a: int,
                     b: int) -> list[bytes] | None:
        """Rows ``a:b`` of one entry as a pack (see the module's docstring); None where they
        go out alone."""
        segment = cols["segment_id"][a]
        # A client that acknowledges cumulatively drops every later frame whose id is at or
        # below the one it acknowledged: a pack id (beyond every entry id) would hide the
        # rest of its segment. So its packs take the entry's own id, unless this consumer
        # holds another part of the entry, which has it.
        original = self.cumulative and (segment, entry) not in self.batches \
            and (segment, entry) not in self._packs_of
        wire = entry if original else pack_entry_id(entry, idx[0])
        if (b - a < 2 and not original) or (segment, wire) in self.packs:
            return None  # one message; or a pack with its id still on its way
        if sum(map(len, cols["value"][a:b])) > MAX_MESSAGE_SIZE // 2:
            return None
        made = batch_of(cols["key"][a:b], cols["value"][a:b], cols["event_time"][a:b],
                        cols["properties"][a:b], cols["publish_time"][a])
        if made is None:
            return None
        command = self._message(segment, wire, cols["redelivery_count"][a])
        mask = _mask_of(idx)
        self.packs[(segment, wire)] = (entry, idx, mask)
        self._packs_of.setdefault((segment, entry), set()).add(wire)
        self._hold((segment, entry), mask)
        return _message_frames(command, *made)

    def _hold(self, at: _Entry, mask: int) -> None:
        _add(self.unacked, at, mask)

    def _of_pack(self, m: api.MessageIdData, *, whole: bool = False
                 ) -> tuple[_Entry, int] | None:
        """The entry and the unacknowledged messages of it (as bits) a pack's id names
        (None: ``m`` names no pack of this consumer's; lock held)."""
        segment = int(m.ledgerId)
        pack = self.packs.get((segment, int(m.entryId)))
        if pack is None:
            return None
        entry, idx, mask = pack
        if not whole and m.ack_set:
            mask = _mask_of([idx[j] for j in acked_indexes(m, len(idx))])
        return (segment, entry), mask & self.unacked.get((segment, entry), 0)

    def _alone(self, cols: _Columns, entries: np.ndarray, indexes: np.ndarray,
               rows: list[int]) -> list[bytes]:
        """A frame per row, each with an id of the broker's own. The per-message work is kept
        small: one command object refilled per message, and rows that share their metadata
        share its bytes."""
        at = np.array(rows)
        wire_ids = wire_entry_ids(entries[at], indexes[at]).tolist()
        command = _Cmd(type=_Cmd.MESSAGE)
        message = command.message
        message.consumer_id = self.consumer_id
        mid = message.message_id
        mid.partition = self.wire_partition
        metas: dict[Any, bytes] = {}
        keys, publish, event, props = (cols["key"], cols["publish_time"], cols["event_time"],
                                       cols["properties"])
        out = []
        for n, i in enumerate(rows):
            seg = cols["segment_id"][i]
            self._hold((seg, int(entries[i])), 1 << int(indexes[i]))
            shared = (keys[i], publish[i], event[i], tuple(props[i]) if props[i] else None)
            meta = metas.get(shared)
            if meta is None:
                meta = metas[shared] = metadata_of(keys[i], publish[i], event[i],
                                                 props[i]).SerializeToString()
            mid.ledgerId = seg
            mid.entryId = wire_ids[n]
            message.redelivery_count = cols["redelivery_count"][i]
            value = cols["value"][i]  # null: b""
            if len(value) > MAX_MESSAGE_SIZE // 2:
                out += _message_frames(command, metadata_of(keys[i], publish[i], event[i],
                                                            props[i]), value)
                continue
            out.append(serialized_payload_frame(command.SerializeToString(), meta, value))
        return out

    # -- what the client answers --------------------------------------------------------------

    def acked(self, ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The messages an individual ACK's ids acknowledge (segment, entry, index arrays),
        taken off what is unacknowledged. A batch's id counts for what this consumer was
        sent of that entry; one of an entry it holds nothing of counts for nothing (the
        client acknowledges what a connection before this one delivered, which the broker
        gave out again when that connection ended)."""
        with self.lock:
            took: dict[_Entry, int] = {}
            own = []
            for m in ids:
                of = self._of_pack(m) if self.packs else None
                if of is None and is_own(m):
                    own.append(m)
                    continue
                if of is None:
                    of = self._of_batch(m)
                if of is not None:
                    _add(took, *of)
            segment, entry, index = positions_of(own)
            for s, e, i in zip(segment.tolist(), entry.tolist(), index.tolist(), strict=True):
                _add(took, (s, e), 1 << i)
            self._forget(took)
        return _arrays(took)

    def acked_through(self, ids: Any) -> Position | None:
        """The last message a cumulative ACK's ids acknowledge (None: none), and everything
        up to it taken off what is unacknowledged."""
        with self.lock:
            ends = [end for end in (self._cumulative_end(m) for m in ids) if end is not None]
            if not ends:
                return None
            last = max(ends)
            at, upto = (last.segment_id, last.entry_id), (1 << (last.batch_index + 1)) - 1
            self._forget({e: mask if e < at else mask & upto
                          for e, mask in self.unacked.items() if e <= at})
        return last

    def _cumulative_end(self, m: api.MessageIdData) -> Position | None:
        pack = self.packs.get((int(m.ledgerId), int(m.entryId))) if self.packs else None
        if pack is None:
            return cumulative_end(m, self.partition)
        entry, idx, _ = pack
        acked = acked_indexes(m, len(idx))
        upto = next((n for n, j in enumerate(acked) if n != j), len(acked))
        return Position(self.partition, int(m.ledgerId), entry, idx[upto - 1]) if upto else None

    def taken_back(self, ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The messages a redelivery request names (all this consumer holds when it names
        none), taken off what it holds, as segment, entry and batch index arrays in log
        order: they go out again."""
        with self.lock:
            if not ids:
                took = dict(self.unacked)
            else:
                took = {}
                for m in ids:
                    of = self._of_pack(m, whole=True)
                    if of is None and is_own(m):
                        p = position_of(m, self.partition)
                        of = (p.segment_id, p.entry_id), 1 << p.batch_index
                    elif of is None:
                        of = self._of_batch(m, whole=True)
                    if of is not None:
                        _add(took, of[0], of[1] & self.unacked.get(of[0], 0))
            self._forget(took)
        return _arrays(dict(sorted(took.items())))

    def _of_batch(self, m: api.MessageIdData, *, whole: bool = False
                  ) -> tuple[_Entry, int] | None:
        """The entry and the unacknowledged messages of it (as bits) a batch's id names (None:
        ``m`` names no batch this consumer was sent; lock held)."""
        at = (int(m.ledgerId), int(m.entryId))
        size = self.batches.get(at)
        if size is None:
            return None
        mask = (1 << size) - 1 if whole or not m.ack_set else _mask_of(acked_indexes(m, size))
        return at, mask & self.unacked.get(at, 0)

    def _forget(self, took: dict[_Entry, int]) -> None:
        """Take the messages ``took`` names (per entry, as bits) off what it holds."""
        for at, mask in took.items():
            left = self.unacked.get(at, 0) & ~mask
            if left:
                self.unacked[at] = left
            else:
                self.unacked.pop(at, None)
            size = self.batches.get(at)
            if size is not None and not left & ((1 << size) - 1):
                del self.batches[at]
            wires = self._packs_of.get(at)
            for wire in list(wires or ()):
                if not left & self.packs[(at[0], wire)][2]:
                    del self.packs[(at[0], wire)]
                    wires.discard(wire)  # type: ignore[union-attr]
            if wires is not None and not wires:
                del self._packs_of[at]


def _message_frames(command: api.BaseCommand, meta: api.MessageMetadata, payload: bytes
                    ) -> list[bytes]:
    """One MESSAGE's frame, or its chunks' frames where it is larger than a frame may be
    (each chunk under the command's message id)."""
    data = command.SerializeToString()
    mid = command.message.message_id
    chunks = chunks_of(meta, payload, f"tierstream-{mid.ledgerId}-{mid.entryId}",
                       MAX_MESSAGE_SIZE)
    if chunks is None:
        return [serialized_payload_frame(data, meta.SerializeToString(), payload)]
    return [serialized_payload_frame(data, m, part) for m, part in chunks]


class _Columns:
    """A batch's columns as Python lists, each made when first asked for (an entry that
    goes out by :meth:`Delivered._plain_frames` needs none)."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self._batch = batch
        self._made: dict[str, list[Any]] = {}

    def __getitem__(self, name: str) -> list[Any]:
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = _pylist(self._batch.column(name))
        return made


class _Plain:
    """What :meth:`Delivered._plain_frames` reads of a batch whose messages have no keys,
    event times nor properties."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.values = batch.column("value")
        self.offsets = np.frombuffer(self.values.buffers()[1], np.int32,
                                     len(self.values) + 1, self.values.offset * 4)
        self.redeliveries = batch.column("redelivery_count").to_numpy(zero_copy_only=False)
        self.publish_times = batch.column("publish_time").to_numpy(zero_copy_only=False)

    @classmethod
    def of(cls, batch: pa.RecordBatch) -> _Plain | None:
        if any(batch.column(name).null_count != batch.num_rows
               for name in ("key", "event_time", "properties")) or \
                batch.column("value").null_count:
            return None
        return cls(batch)


def _add(held: dict[_Entry, int], at: _Entry, mask: int) -> None:
    """Add the messages ``mask`` names of entry ``at`` to ``held``."""
    held[at] = held.get(at, 0) | mask


def _pylist(column: pa.Array) -> list[Any]:
    """``column.to_pylist()``, without pyarrow's step per value where it can: all null (the
    properties and event times of most batches), or integers without nulls (by numpy)."""
    if column.null_count == len(column):
        return [None] * len(column)
    if column.null_count == 0 and pa.types.is_integer(column.type):
        return list(column.to_numpy().tolist())
    return list(column.to_pylist())


def _mask_of(indexes: list[int]) -> int:
    """Batch indexes (ascending, each once) as the set bits of an int."""
    if not indexes:
        return 0
    if indexes[-1] - indexes[0] + 1 == len(indexes):  # a run: one shift
        return ((1 << len(indexes)) - 1) << indexes[0]
    mask = 0
    for i in indexes:
        mask |= 1 << i
    return mask


def _bits(mask: int) -> np.ndarray:
    """The set bits of ``mask``, ascending."""
    if not mask & (mask + 1):  # 0..k-1, as a whole batch's
        return np.arange(mask.bit_length(), dtype=np.int64)
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).astype(np.int64)


def _arrays(took: dict[_Entry, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The messages ``took`` names as segment, entry and batch index arrays."""
    indexes = [_bits(mask) for mask in took.values()]
    counts = [len(i) for i in indexes]
    at = np.array(list(took) or np.empty((0, 2)), dtype=np.int64).reshape(-1, 2)
    return (np.repeat(at[:, 0], counts), np.repeat(at[:, 1], counts),
            np.concatenate(indexes) if indexes else np.empty(0, np.int64))
