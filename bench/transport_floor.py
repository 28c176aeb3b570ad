"""The Flight transport's own cost per message: what a broker's instructions cannot go below.

A bare pyarrow Flight server in Python, which stores nothing and looks at nothing: a DoPut
reads each batch and answers it with a small ack, a DoGet streams batches built in memory once,
a DoAction answers at once. ``bench --instructions`` counts it under callgrind beside the broker
doing the same work (``produce``: batches of 1,000 in, an ack each; ``consume``: the batches
out, an ack action each), so the broker's figure can be read against the part of it that is
gRPC, Flight and the Python callbacks they make. Run: ``python -m bench.transport_floor``; it
prints ``listening on URL`` when ready.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from bench.flight_ceiling import serve_until_terminated
from tierstream.model.message_format import CONSUMER_SCHEMA, PRODUCE_SCHEMA
from tierstream.wire.flight import put_batches

__all__ = ["FloorProcess", "FloorServer", "floor_consume", "floor_produce"]

_ACK = json.dumps({"ok": 1}).encode()


def _consumer_batch(rows: int, value: bytes) -> pa.RecordBatch:
    """A batch as a consumer receives it: ``rows`` unkeyed messages of ``value``."""
    n = rows
    ints = {"key_hash": np.zeros(n, np.int32), "publish_time": np.full(n, 1, np.int64),
            "partition": np.zeros(n, np.int32), "segment_id": np.zeros(n, np.int64),
            "entry_id": np.zeros(n, np.int64), "batch_index": np.arange(n, dtype=np.int32),
            "redelivery_count": np.zeros(n, np.int32)}
    columns = []
    for field in CONSUMER_SCHEMA:
        if field.name in ints:
            columns.append(pa.array(ints[field.name], field.type))
        elif field.name == "value":
            columns.append(pa.array([value] * n, field.type))
        else:
            columns.append(pa.nulls(n, field.type))
    return pa.RecordBatch.from_arrays(columns, schema=CONSUMER_SCHEMA)


class FloorServer(flight.FlightServerBase):
    """Answers every produce batch and ack, serves ``batches`` on every DoGet."""

    def __init__(self, batches: list[pa.RecordBatch]) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.batches = batches

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader,
               writer: flight.FlightMetadataWriter) -> None:
        for _ in put_batches(reader):
            writer.write(pa.py_buffer(_ACK))

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        return flight.RecordBatchStream(
            pa.RecordBatchReader.from_batches(CONSUMER_SCHEMA, iter(self.batches)))

    def do_action(self, context: Any, action: flight.Action) -> list[bytes]:
        return [_ACK]


def floor_produce(url: str, batch: pa.RecordBatch, batches: int) -> None:
    """``batches`` times ``batch`` (PRODUCE_SCHEMA) through a DoPut, every ack read."""
    client = flight.FlightClient(url)
    try:
        writer, acks = client.do_put(flight.FlightDescriptor.for_command(b"produce"),
                                     PRODUCE_SCHEMA)
        for seq in range(batches):
            writer.write_with_metadata(batch, pa.py_buffer(str(seq).encode()))
        writer.done_writing()
        got = 0
        while acks.read() is not None:
            got += 1
        writer.close()
        if got != batches:
            raise RuntimeError(f"the floor server acknowledged {got} of {batches} batches")
    finally:
        client.close()


def floor_consume(url: str, messages: int) -> None:
    """The served batches through a DoGet, one ack action per batch."""
    client = flight.FlightClient(url)
    try:
        got = 0
        for chunk in client.do_get(flight.Ticket(b"consume")):
            got += chunk.data.num_rows
            list(client.do_action(flight.Action("ack", _ACK)))
        if got != messages:
            raise RuntimeError(f"the floor server sent {got} of {messages} messages")
    finally:
        client.close()


class FloorProcess:
    """This module's server in a process of its own (``prefix``: a command to run it under,
    such as valgrind's), serving ``messages`` rows on each DoGet; ``url`` once entered."""

    def __init__(self, messages: int, *, batch: int = 1000, value_bytes: int = 100,
                 prefix: Sequence[str] = ()) -> None:
        self._command = [*prefix, sys.executable, "-m", "bench.transport_floor",
                         "--messages", str(messages), "--batch", str(batch),
                         "--value-bytes", str(value_bytes)]
        self.url = ""

    def __enter__(self) -> FloorProcess:
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        self._proc = subprocess.Popen(self._command, stdout=subprocess.PIPE, text=True, env=env,
                                      cwd=Path(__file__).resolve().parents[1])
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # waits for the imports (and a prefix's start)
        if not line.startswith("listening on "):
            self._proc.kill()
            raise RuntimeError(f"the transport floor server did not start: {line!r}")
        self.url = line.split()[-1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    @property
    def pid(self) -> int:
        return self._proc.pid


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--value-bytes", type=int, default=100)
    args = parser.parse_args()
    one = _consumer_batch(args.batch, b"v" * args.value_bytes)
    serve_until_terminated(FloorServer([one] * (args.messages // args.batch)))


if __name__ == "__main__":
    main()
