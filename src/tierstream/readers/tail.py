"""The tail-consumer reader: a split through the broker (a Flight stream), key ranges
filtered in the broker; bounded, or following the open tail when the split has no end. It
reconnects across broker restarts from the position after the last batch it delivered."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from tierstream.client import BrokerClient, consume_stream
from tierstream.errors import ConfigError
from tierstream.model.message_format import with_topic
from tierstream.model.positions import Offset
from tierstream.readers.trim import trim
from tierstream.splits.split import Split
from tierstream.util.fanin import Cancel

__all__ = ["read_tail_split"]


def read_tail_split(split: Split, *, auth_token: str | None = None,
                    cancel: Cancel | None = None, reconnect_timeout_ms: int | None = None,
                    tls_ca: bytes | None = None) -> Iterator[pa.RecordBatch]:
    """The split's batches through the broker; a broker restart is ridden out (see
    :func:`~tierstream.client.consume_stream`)."""
    if split.broker is None:
        raise ConfigError(f"split {split.split_id} needs a broker address (option 'broker')")
    end: Offset | None
    if split.end is not None:
        end = Offset.at_position(split.end)
    elif split.end_time is not None:
        end = Offset.at_time(split.end_time)
    else:
        end = None
    ticket = {"op": "consume", "topic": split.topic, "partition": split.partition,
              "start": Offset.at_position(split.start).to_dict(),
              "end": None if end is None else end.to_dict(),
              "key_ranges": [] if split.key_range.is_full else [split.key_range.to_list()]}
    client = BrokerClient(split.broker, auth_token=auth_token, tls_ca=tls_ca)
    try:
        for batch in consume_stream(client, ticket, cancel=cancel,
                                    reconnect_timeout_ms=reconnect_timeout_ms):
            stop = split.end_time is not None and \
                pc.max(batch.column("publish_time")).as_py() >= split.end_time
            out = trim(batch, split, check_positions=False, check_keys=False)
            if out.num_rows:
                yield with_topic(out, split.topic)
            if stop:
                return
    finally:
        client.close()
