"""A Pulsar producer's chunked message, put together before it is stored.

A client with chunking on sends a message over ``max_message_size`` as several SENDs of one
sequence id, each a chunk (``uuid``, ``chunk_id`` of ``num_chunks_from_msg``, the whole's
``total_chunk_msg_size``), compressed as a whole before it was cut. The broker keeps the
chunks of each producer's message in memory until the last one has come, then stores the
message as one entry of one row, so every tierstream reader (``read``, ``scan``, ``Consumer``,
Spark) sees one message, and de-duplication by sequence id covers it whole.

No chunk is answered before the whole message is stored: each chunk's receipt waits for it
(:class:`Whole`), and all of them name the message's entry. A message whose producer went
away mid-way is never stored, so no reader ever sees a part of one; its client, on a
connection of its own, sends every chunk again, since none was answered.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tierstream.errors import TierstreamError
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.replies import Refused

__all__ = ["MAX_CHUNKED_MESSAGE_SIZE", "Assembly", "Whole"]

#: the largest message a producer may send in chunks here: it is held in the broker's memory
#: until its last chunk has come, and stored as one value
MAX_CHUNKED_MESSAGE_SIZE = 512 * 1024 * 1024


class Whole:
    """A chunk's receipt: the stored message's, once its last chunk is stored (what the
    receipt thread waits on in place of a pending append)."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._pending: Any = None
        self._error: TierstreamError | None = None

    def settle(self, pending: Any) -> None:
        self._pending = pending
        self._set.set()

    def fail(self, error: TierstreamError) -> None:
        self._error = error
        self._set.set()

    def result(self) -> Any:
        self._set.wait()
        if self._error is not None:
            raise self._error
        return self._pending.result()


@dataclass
class _Message:
    uuid: str
    count: int
    size: int
    first: api.MessageMetadata
    parts: list[bytes] = field(default_factory=list)
    got: int = 0
    receipts: list[Whole] = field(default_factory=list)


class Assembly:
    """The chunked message one producer is sending (one at a time, in order)."""

    def __init__(self) -> None:
        self._message: _Message | None = None
        self._finished: list[Whole] = []  # the receipts of the message just put together

    def add(self, metadata: api.MessageMetadata, payload: bytes
            ) -> tuple[Whole, tuple[api.MessageMetadata, bytes] | None]:
        """Take one chunk: its receipt, and, with the last chunk, the whole message (its
        metadata without the chunk fields, and its payload). Refused (``Refused``, the
        message dropped) for a chunk out of order or a message over the size limit."""
        n, i, size = (metadata.num_chunks_from_msg, metadata.chunk_id,
                      metadata.total_chunk_msg_size)
        m = self._message
        if i == 0:
            if m is not None:  # sent again from its start, or another message began
                self.drop(Refused(f"chunked message {m.uuid!r} was not finished: its "
                                  "chunks were sent again or another message began"))
            if size > MAX_CHUNKED_MESSAGE_SIZE:
                raise Refused(f"a chunked message of {size:,} bytes is over the "
                              f"{MAX_CHUNKED_MESSAGE_SIZE:,} a message may have here; "
                              "nothing was stored")
            m = self._message = _Message(metadata.uuid, n, size, metadata)
        elif m is None or (metadata.uuid, n, i) != (m.uuid, m.count, len(m.parts)):
            expected = "its first chunk" if m is None else f"chunk {len(m.parts)} of {m.uuid!r}"
            self.drop(Refused(f"chunk {i} of {metadata.uuid!r} came where {expected} was "
                              "due; the message was dropped, nothing was stored"))
            raise Refused(f"chunk {i} of {metadata.uuid!r} out of order; nothing was stored")
        m.parts.append(payload)
        m.got += len(payload)
        if m.got > m.size:
            self.drop(Refused(f"chunked message {m.uuid!r} is longer than the "
                              f"{m.size:,} bytes it announced; nothing was stored"))
            raise Refused(f"chunked message {metadata.uuid!r} is longer than it announced")
        whole = Whole()
        m.receipts.append(whole)
        if len(m.parts) < m.count:
            return whole, None
        self._message = None
        meta = api.MessageMetadata()
        meta.CopyFrom(m.first)
        for name in ("uuid", "num_chunks_from_msg", "total_chunk_msg_size", "chunk_id"):
            meta.ClearField(name)
        self._finished = m.receipts
        return whole, (meta, b"".join(m.parts))

    def stored(self, pending: Any) -> None:
        """The whole message was submitted: every chunk's receipt is its."""
        for whole in self._finished:
            whole.settle(pending)
        self._finished = []

    def refused(self, error: TierstreamError) -> None:
        """The whole message was refused: every chunk's receipt says so."""
        for whole in self._finished:
            whole.fail(error)
        self._finished = []

    def drop(self, error: TierstreamError) -> None:
        """Give up the message being put together (its producer or connection went, or its
        chunks broke off): the receipts of its chunks so far say ``error``."""
        m, self._message = self._message, None
        for whole in m.receipts if m is not None else ():
            whole.fail(error)
