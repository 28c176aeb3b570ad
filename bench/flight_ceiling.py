"""The Flight transport's own ceiling: a server that streams pre-built batches from memory.

It loads a topic's batches from a broker once, then serves them on every DoGet: the same bytes,
the same transport, none of the store's work. Run: ``python -m bench.flight_ceiling --broker URL
--topic T``; it prints ``listening on URL`` when ready.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.client import read
from tierstream.model.message_format import MESSAGE_SCHEMA
from tierstream.model.positions import Offset


class CeilingServer(flight.FlightServerBase):
    def __init__(self, batches: list[pa.RecordBatch]) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.batches = batches

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        return flight.RecordBatchStream(pa.Table.from_batches(self.batches, MESSAGE_SCHEMA))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--topic", required=True)
    args = parser.parse_args()
    batches = list(read(args.topic, broker=args.broker, end=Offset.latest()))
    serve_until_terminated(CeilingServer(batches))


def serve_until_terminated(server: flight.FlightServerBase) -> None:
    """Say ``listening on URL`` (what the benchmark that started this process waits for),
    then serve until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"listening on grpc://127.0.0.1:{server.port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()


if __name__ == "__main__":
    main()
