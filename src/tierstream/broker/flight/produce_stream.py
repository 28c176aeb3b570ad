"""A producer's stream on the broker: batches submitted as they arrive, acks sent in order.

A producer keeps up to ``max_in_flight`` batches on the wire. Appending each one and waiting
for its quorum before reading the next would make every batch pay a whole fsync of its own;
instead each batch is submitted to the bookies as it is read (``PartitionLog.submit``: entry
ids in arrival order) and a second thread sends the acks, in the same order, as each quorum
completes. Batches that arrive while the bookies sync share their next group commit.

Errors keep the old order: a refusal at submit (a stale routing, a deleted topic) is raised
after the acks of every batch before it were sent; a failed quorum ends the stream after the
acks before it (said in the ack stream at once: ``{"error": ...}``, since the producer may
wait for that ack before it sends or closes anything), and the later batches' outcomes are
still settled (confirmed or cut off with the segment) before the error goes back.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.errors import ProtocolError, TierstreamError
from tierstream.managed_ledger.open_segment import Ack, PendingAppend
from tierstream.managed_ledger.partition_log import PartitionLog
from tierstream.util.threads import Worker
from tierstream.wire.flight import PROTOCOL_VERSION, decode, encode, error_text

__all__ = ["MAX_PIPELINED", "ack_bytes", "produce_stream"]

#: batches of one stream submitted but not yet acknowledged, at most
MAX_PIPELINED = 64


def ack_bytes(ack: Ack) -> bytes:
    """``encode(ack.to_dict())``, the same JSON, formatted without the JSON encoder (its
    fields are ints, None and a bool): the encoder was a tenth of the ack thread's cost."""
    return (f'{{"v":{PROTOCOL_VERSION},"partition":{ack.partition},"segment_id":'
            f'{_json_int(ack.segment_id)},"entry_id":{_json_int(ack.entry_id)},"messages":'
            f'{ack.messages},"first_publish_time":{ack.first_publish_time},'
            f'"last_publish_time":{ack.last_publish_time},"sequence_id":'
            f'{_json_int(ack.sequence_id)},"duplicate":{"true" if ack.duplicate else "false"},'
            f'"restamped":{ack.restamped}}}').encode()


def _json_int(value: int | None) -> str:
    return "null" if value is None else str(int(value))


def produce_stream(plog: PartitionLog, reader: flight.MetadataRecordBatchReader,
                   writer: flight.FlightMetadataWriter, *, producer: str | None,
                   routed: int | None, check: Callable[[pa.RecordBatch], Any]) -> None:
    """Append every batch of ``reader`` to ``plog`` (``check`` refuses one first if it must)
    and write each one's ack to ``writer``, in order."""
    pending: queue.Queue[PendingAppend | None] = queue.Queue(maxsize=MAX_PIPELINED)
    failed: list[BaseException] = []

    def send_acks() -> None:
        while (entry := pending.get()) is not None:
            try:
                ack = entry.result()
            except BaseException as exc:
                if not failed:
                    failed.append(exc)
                    say_failed(exc)
                continue
            if not failed:
                try:
                    writer.write(pa.py_buffer(ack_bytes(ack)))
                except BaseException as exc:
                    failed.append(exc)

    def say_failed(exc: BaseException) -> None:
        """The stream's thread may be waiting for a batch the producer will not send before
        this ack: say the error in the ack stream; the producer then closes its side (and
        retries on a new stream), which ends the wait, and the error is raised as ever."""
        error = exc if isinstance(exc, TierstreamError) else ProtocolError(
            f"malformed produce request: {exc!r}")
        with contextlib.suppress(BaseException):
            writer.write(pa.py_buffer(encode({"error": error_text(error)})))

    acks = Worker("tierstream-acks", send_acks).start()
    try:
        while not failed:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            if chunk.data is None:
                continue
            meta = decode(chunk.app_metadata, "produce chunk metadata")
            check(chunk.data)
            seq = meta.get("seq")
            pending.put(plog.submit(chunk.data, producer=producer,
                                    sequence_id=None if seq is None else int(seq),
                                    routed=routed))
    finally:
        pending.put(None)
        acks.join()
    if failed:
        raise failed[0]
