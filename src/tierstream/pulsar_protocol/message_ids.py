"""Pulsar message ids for what the broker delivers, and back.

tierstream hands the rows of one entry to different consumers of a Shared or Key_Shared
subscription, and a Pulsar client acknowledges a batch only when every message of it is
acknowledged (and never clears the messages an ``ack_set`` masks out unless batch-index acks
are on). So every message goes out as a message of its own, and its id names exactly that
message: ledgerId = segment id, entryId = 2^62 + entry id * 2^20 + batch index, the partition
(-1 for a topic of one partition). An ack, a negative ack or a redelivery request of an id is
then one message of the log, whatever the subscription type; the high bit tells these ids
from a producer's receipts (whose entryId is the entry id).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tierstream.errors import ConfigError
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.splits.positions import Position

__all__ = ["id_before", "message_id", "no_message", "position_of", "positions_of", "start_position",
           "wire_entry_ids"]

_OWN = 1 << 62
_INDEX_BITS = 20


def message_id(segment: int, entry: int, index: int, partition: int) -> api.MessageIdData:
    """The id a consumer sees for one message (see the module's docstring)."""
    if not 0 <= index < 1 << _INDEX_BITS or not 0 <= entry < 1 << (62 - _INDEX_BITS):
        raise ConfigError(f"message ({segment}, {entry}, {index}) has no Pulsar id")
    return api.MessageIdData(ledgerId=segment, entryId=_OWN | entry << _INDEX_BITS | index,
                             partition=partition)


def position_of(mid: api.MessageIdData, partition: int) -> Position:
    """The log position a consumer's message id names: its own message's, or for a receipt's
    id (a producer's) the entry's first message (a batch index, where given)."""
    entry = int(mid.entryId)
    if entry & _OWN:
        return Position(partition, int(mid.ledgerId), (entry & (_OWN - 1)) >> _INDEX_BITS,
                        entry & ((1 << _INDEX_BITS) - 1))
    return Position(partition, int(mid.ledgerId), entry, max(0, int(mid.batch_index)))


def positions_of(ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`position_of` of many message ids at once (an ACK's), as segment, entry and batch
    index arrays."""
    n = len(ids)
    segment = np.fromiter((m.ledgerId for m in ids), np.uint64, n).astype(np.int64)
    wire = np.fromiter((m.entryId for m in ids), np.uint64, n)
    given = np.fromiter((m.batch_index for m in ids), np.int64, n)
    own = (wire & np.uint64(_OWN)) != 0
    low = np.uint64((1 << _INDEX_BITS) - 1)
    entry = np.where(own, (wire & np.uint64(_OWN - 1)) >> np.uint64(_INDEX_BITS), wire)
    index = np.where(own, (wire & low).astype(np.int64), np.maximum(given, 0))
    return segment, entry.astype(np.int64), index.astype(np.int64)


def wire_entry_ids(entries: np.ndarray, indexes: np.ndarray) -> np.ndarray:
    """:func:`message_id`'s entryId of many messages at once (uint64); ConfigError for a
    message beyond what an id can name."""
    entries, indexes = entries.astype(np.uint64), indexes.astype(np.uint64)
    if len(entries) and (int(indexes.max()) >= 1 << _INDEX_BITS
                         or int(entries.max()) >= 1 << (62 - _INDEX_BITS)):
        raise ConfigError(f"a message of entry {int(entries.max())} has no Pulsar id")
    ids: np.ndarray = np.uint64(_OWN) | entries << np.uint64(_INDEX_BITS) | indexes
    return ids


#: -1 as Pulsar's clients write it in an unsigned field: "no ledger", "no entry"
_NONE = 2**64 - 1
#: MessageId::latest(): INT64_MAX
_LATEST = 2**63 - 1


def no_message(partition: int) -> api.MessageIdData:
    """The id GET_LAST_MESSAGE_ID answers for a partition without messages."""
    return api.MessageIdData(ledgerId=_NONE, entryId=_NONE, partition=partition)


def start_position(mid: api.MessageIdData, plog: Any) -> Position:
    """Where a reader that starts at ``mid`` is served from. At one of this broker's own
    message ids: that message (the client drops it unless its start is inclusive: it skips a
    message whose entry id is not after the start's). At a producer's receipt id: the message
    after it (a receipt's entry id cannot be compared with delivered ids by the client)."""
    if mid.ledgerId == _NONE:
        return plog.earliest()  # type: ignore[no-any-return]
    if mid.ledgerId == _LATEST:
        return plog.last_confirmed()[1]  # type: ignore[no-any-return]
    at = position_of(mid, plog.partition)
    if int(mid.entryId) & _OWN:
        return at
    if mid.batch_index < 0:  # a message sent alone: its entry is all of it
        return Position(at.partition, at.segment_id, at.entry_id + 1, 0)
    return Position(at.partition, at.segment_id, at.entry_id, at.batch_index + 1)


def id_before(position: Position, partition: int) -> api.MessageIdData:
    """An id that sorts after every message before ``position`` and before every message at
    or after it (the mark-delete position: everything before ``position`` is acknowledged)."""
    if position.batch_index > 0:
        return message_id(position.segment_id, position.entry_id, position.batch_index - 1,
                          partition)
    if position.entry_id > 0:
        return message_id(position.segment_id, position.entry_id - 1, (1 << _INDEX_BITS) - 1,
                          partition)
    return api.MessageIdData(ledgerId=position.segment_id, entryId=_OWN - 1,
                             partition=partition)
