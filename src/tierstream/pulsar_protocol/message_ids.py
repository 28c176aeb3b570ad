"""Pulsar message ids for what the broker delivers, and back.

A message's id is the one its send receipt gave: ledgerId = segment id, entryId = entry id,
the partition (-1 for a topic of one partition) and its index in the entry's batch (-1 for a
message sent alone). The broker gets there by sending an entry as the batch it was stored as,
so that the client numbers its messages itself (``broker/pulsar/delivered.py`` decides when).
A client acknowledges such a batch as a whole — ``(ledger, entry)`` once every message of it
is acknowledged — or, with batch-index acks on, with an ``ack_set``: a bit per message, clear
for an acknowledged one.

Where an entry cannot go out as a batch whose every message the consumer may acknowledge (a
Key_Shared entry whose keys belong to several consumers, the rest of an entry after part of it
was acknowledged), its messages go out with ids of the broker's own: alone, entryId = 2^62 +
entry id * 2^20 + batch index, one message of the log; or packed, the consumer's messages of
the entry as a batch of their own, entryId = 2^62 + 2^61 + entry id * 2^20 + the first one's
batch index, whose batch indexes only the consumer that was sent it can map back to the log.
Bit 62 tells these ids from receipts, bit 61 a pack from a message alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tierstream.errors import ConfigError
from tierstream.model.positions import Position
from tierstream.pulsar_protocol import pulsar_api_pb2 as api

__all__ = ["LAST_INDEX", "NO_LEDGER", "ack_words", "acked_indexes", "cumulative_end", "id_before",
           "is_own", "last_message_id", "message_id", "no_message", "pack_entry_id",
           "position_of", "positions_of", "start_position", "wire_entry_ids"]

_OWN = 1 << 62
_PACK = 1 << 61
_SIGN = 1 << 63
_INDEX_BITS = 20
#: the largest batch index an id can name: "the end of the entry"
LAST_INDEX = (1 << _INDEX_BITS) - 1


def is_own(mid: api.MessageIdData) -> bool:
    """Whether ``mid`` is one of the broker's per-message ids (not a receipt's). Bit 62 alone
    tells: an entryId with bit 63 set is -1 as a client writes it (``(ledger, -1)``, the
    entry before a ledger's first), never one of ours."""
    return _is_own(int(mid.entryId))


def _is_own(entry: int) -> bool:
    return bool(entry & _OWN) and entry < _SIGN


def ack_words(indexes: list[int]) -> list[int]:
    """An ``ack_set`` with the bits of ``indexes`` set (int64 words, as the protocol has
    them): on a MESSAGE, the messages of its batch the consumer is given."""
    words = [0] * (max(indexes) // 64 + 1)
    for i in indexes:
        words[i // 64] |= 1 << (i % 64)
    return [w - (1 << 64) if w >= 1 << 63 else w for w in words]


def acked_indexes(mid: api.MessageIdData, size: int) -> list[int]:
    """The messages of a batch of ``size`` that an ACK's receipt-form id acknowledges: all of
    them, or with an ``ack_set`` those whose bit is clear."""
    if not mid.ack_set:
        return list(range(size))
    words = [w & ((1 << 64) - 1) for w in mid.ack_set]
    return [i for i in range(size)
            if i // 64 >= len(words) or not words[i // 64] >> (i % 64) & 1]


def cumulative_end(mid: api.MessageIdData, partition: int) -> Position | None:
    """The last message a cumulative ACK of ``mid`` acknowledges (None: none of this
    ledger). A receipt-form id without an ``ack_set`` is its whole entry; with one, the
    messages before its first set bit (a client acknowledges a batch's previous entry as
    ``(ledger, entry - 1)``, which is -1 before the ledger's first)."""
    entry = int(mid.entryId)
    if entry >= _SIGN:  # (ledger, -1): nothing of this ledger
        return None
    if _is_own(entry):
        return position_of(mid, partition)
    if mid.ack_set:
        clear = acked_indexes(mid, 64 * len(mid.ack_set))
        upto = next((i for i, j in enumerate(clear) if i != j), len(clear)) - 1
        if upto >= 0:
            return Position(partition, int(mid.ledgerId), entry, upto)
        if entry == 0:
            return None
        entry -= 1
    return Position(partition, int(mid.ledgerId), entry, LAST_INDEX)


def message_id(segment: int, entry: int, index: int, partition: int) -> api.MessageIdData:
    """The id a consumer sees for one message (see the module's docstring)."""
    if not 0 <= index < 1 << _INDEX_BITS or not 0 <= entry < 1 << (61 - _INDEX_BITS):
        raise ConfigError(f"message ({segment}, {entry}, {index}) has no Pulsar id")
    return api.MessageIdData(ledgerId=segment, entryId=_OWN | entry << _INDEX_BITS | index,
                             partition=partition)


def position_of(mid: api.MessageIdData, partition: int) -> Position:
    """The log position a consumer's message id names: its own message's (a pack's first:
    only the consumer it went to maps the rest), or for a receipt's id (a producer's) the
    entry's first message (a batch index, where given)."""
    entry = int(mid.entryId)
    if _is_own(entry):
        return Position(partition, int(mid.ledgerId), (entry & (_PACK - 1)) >> _INDEX_BITS,
                        entry & ((1 << _INDEX_BITS) - 1))
    return Position(partition, int(mid.ledgerId), entry, max(0, int(mid.batch_index)))


def positions_of(ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`position_of` of many message ids at once (an ACK's), as segment, entry and batch
    index arrays."""
    n = len(ids)
    segment = np.fromiter((m.ledgerId for m in ids), np.uint64, n).astype(np.int64)
    wire = np.fromiter((m.entryId for m in ids), np.uint64, n)
    given = np.fromiter((m.batch_index for m in ids), np.int64, n)
    own = ((wire & np.uint64(_OWN)) != 0) & (wire < np.uint64(_SIGN))
    low = np.uint64((1 << _INDEX_BITS) - 1)
    entry = np.where(own, (wire & np.uint64(_PACK - 1)) >> np.uint64(_INDEX_BITS), wire)
    index = np.where(own, (wire & low).astype(np.int64), np.maximum(given, 0))
    return segment, entry.astype(np.int64), index.astype(np.int64)


def wire_entry_ids(entries: np.ndarray, indexes: np.ndarray) -> np.ndarray:
    """:func:`message_id`'s entryId of many messages at once (uint64); ConfigError for a
    message beyond what an id can name."""
    entries, indexes = entries.astype(np.uint64), indexes.astype(np.uint64)
    if len(entries) and (int(indexes.max()) >= 1 << _INDEX_BITS
                         or int(entries.max()) >= 1 << (61 - _INDEX_BITS)):
        raise ConfigError(f"a message of entry {int(entries.max())} has no Pulsar id")
    ids: np.ndarray = np.uint64(_OWN) | entries << np.uint64(_INDEX_BITS) | indexes
    return ids


def pack_entry_id(entry: int, first: int) -> int:
    """The entryId of a pack: a consumer's messages of ``entry`` from batch index ``first``
    on, sent as a batch of their own (see the module's docstring)."""
    return int(wire_entry_ids(np.array([entry]), np.array([first]))[0]) | _PACK


#: -1 as Pulsar's clients write it in an unsigned field: "no ledger", "no entry"
_NONE = NO_LEDGER = 2**64 - 1
#: MessageId::latest(): INT64_MAX
_LATEST = 2**63 - 1


def no_message(partition: int) -> api.MessageIdData:
    """The id GET_LAST_MESSAGE_ID answers for a partition without messages."""
    return api.MessageIdData(ledgerId=_NONE, entryId=_NONE, partition=partition)


def start_position(mid: api.MessageIdData, plog: Any, *, reader: bool) -> Position:
    """Where a consumer that starts (``reader``) or seeks to ``mid`` is served from.

    A reader is served from that message: the client drops it unless its start is inclusive
    (it skips what is not after the start: a batch's messages by index, a message sent alone
    by entry). A subscription's seek is served from the message after it (the client keeps
    its start only where it compares: it would keep a message the seek named)."""
    if mid.ledgerId == _NONE:
        return plog.earliest()  # type: ignore[no-any-return]
    if mid.ledgerId == _LATEST:
        return plog.end()  # type: ignore[no-any-return]
    at = position_of(mid, plog.partition)
    if is_own(mid) or reader:
        return at
    if mid.batch_index < 0:  # a message sent alone: its entry is all of it
        return Position(at.partition, at.segment_id, at.entry_id + 1, 0)
    return Position(at.partition, at.segment_id, at.entry_id, at.batch_index + 1)


def last_message_id(last: Position, partition: int) -> api.MessageIdData:
    """GET_LAST_MESSAGE_ID's answer for a partition whose last message is at ``last``. The
    client compares it with the last id it received: a batch's last index, or -1 for an
    entry of one message, whether it went out alone (-1) or as a batch of one (0 > -1)."""
    return api.MessageIdData(ledgerId=last.segment_id, entryId=last.entry_id,
                             partition=partition,
                             batch_index=last.batch_index if last.batch_index else -1)


def id_before(position: Position, partition: int) -> api.MessageIdData:
    """The mark-delete position when everything before ``position`` is acknowledged: the last
    entry whose every message is (``(segment, -1)`` before a segment's first entry). The
    client compares it with the last message's id by ledger and entry only."""
    entry = position.entry_id - 1  # entry_id itself is acknowledged in part at most
    return api.MessageIdData(ledgerId=position.segment_id,
                             entryId=entry if entry >= 0 else _NONE, partition=partition)
